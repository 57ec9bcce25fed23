"""CPU inference speed of PSANet in every backend: dygraph, Paddle Inference (oneDNN off / on),
onnxruntime, OpenVINO, and the INT8 model in onnxruntime and OpenVINO.

    python bench/bench_deploy.py [--config CFG] [--model_path PDPARAMS] [--val]
        [--num_images 8] [--size 256 128] [--batch_size 1] [--rounds 3] [--warmup 2]
        [--cpu_threads 1] [--calib_num 32] [--opts KEY=VALUE ...]
    python bench/bench_deploy.py --smoke [--model_path PDPARAMS]     # CI: every backend runs

Protocol (docs/deploy.md, "Benchmark protocol"): one model, exported once with the
custom op and once with the pure-Paddle op (+ model.onnx, + model_int8.onnx
quantised on calibration images that are not the measured ones); the same
preprocessed batches go through every backend. Each backend first runs --warmup
untimed batches; then each round runs every backend over all batches, backends
interleaved, so that load from other processes falls on all of them alike. A
time is one batch through the model alone (input already preprocessed, output
copied to numpy); latency is per batch, images/s counts images. Each backend's
outputs of the first round are compared with the dygraph model's logits (class
agreement per pixel, largest difference); with --val the images are the config's
val set and each backend's mIoU against the labels is printed too. The last lines name the
backend ``psanet.Segmenter`` picks by default for the float and the INT8 model
(its own timing of the candidates at the bench's size, batch and threads, with a
fresh cache: psanet.deploy.backend_choice, whose log line shows its times), how
its time compares with the fastest row that runs the same model, and the same
for the fixed order that PSANET_TIME_BACKENDS=0 takes.
--smoke is the CI run (tests/test_deploy_bench.py): the mini config, 2 generated
images, 1 round, INT8 calibrated on 2 other images.
"""
import argparse
import glob
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# --smoke: the fewest images and runs that still run every backend once measured.
SMOKE = {'num_images': 2, 'size': (64, 32), 'rounds': 1, 'warmup': 1, 'calib_num': 2,
         'batch_size': 1, 'val': False, 'config': None, 'rows': None}
# The rows of the backends psanet.Segmenter picks from (the pure-Paddle export, its defaults:
# oneDNN on in Paddle Inference).
API_ROWS = {('paddle', False): 'Paddle Inference, paddle op, oneDNN on',
            ('onnxruntime', False): 'onnxruntime, ONNX, pure-Paddle op',
            ('openvino', False): 'openvino, ONNX, pure-Paddle op',
            ('onnxruntime', True): 'onnxruntime, INT8 ONNX',
            ('openvino', True): 'openvino, INT8 ONNX'}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default=None,
                        help='Default: configs/psanet/*mini*.yml.')
    parser.add_argument('--model_path', default=None,
                        help='Trained weights; default: the initial weights (speed is the same; '
                        'INT8 agreement needs trained weights to mean anything).')
    parser.add_argument('--val', action='store_true',
                        help="Measure on the config's val images (and print mIoU); calibrate "
                        "INT8 on its train images. Default: generated images at --size.")
    parser.add_argument('--num_images', type=int, default=8)
    parser.add_argument('--size', type=int, nargs=2, default=(256, 128), metavar=('W', 'H'))
    parser.add_argument('--batch_size', type=int, default=1)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--warmup', type=int, default=2, help='Untimed batches per backend.')
    parser.add_argument('--cpu_threads', type=int, default=1)
    parser.add_argument('--calib_num', type=int, default=32, help='INT8 calibration images.')
    parser.add_argument('--opts', nargs='+', default=None,
                        help='key=value config overrides, e.g. model.backbone.pretrained=null '
                        '(the R50 config names ImageNet weights to download).')
    parser.add_argument('--rows', nargs='+', default=None, metavar='WORD',
                        help='Only the rows whose name holds one of these words, e.g. '
                        '"oneDNN on" onnxruntime openvino (the dygraph model always runs: '
                        'the others are compared with it).')
    parser.add_argument('--smoke', action='store_true',
                        help='CI smoke run: ' + ', '.join(
                            f'--{k} {" ".join(map(str, v)) if isinstance(v, tuple) else v}'
                            for k, v in SMOKE.items() if v not in (None, False)) +
                        ' on the mini config, every row (overriding those flags).')
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


def check_args(args):
    """Each flag's mistake as one ConfigError line, before any work."""
    from psanet.core.config import load_config
    from psanet.core.weights import resolve_weights_path
    from psanet.errors import ConfigError
    for name in ('num_images', 'batch_size', 'rounds', 'cpu_threads', 'calib_num'):
        if getattr(args, name) < 1:
            raise ConfigError(f'--{name} must be >= 1, got {getattr(args, name)}.')
    if args.warmup < 0:
        raise ConfigError(f'--warmup must be >= 0, got {args.warmup}.')
    if min(args.size) < 32:
        raise ConfigError(f'--size must be at least 32 32 (W H), got {args.size[0]} '
                          f'{args.size[1]}.')
    config = args.config or sorted(glob.glob(os.path.join(ROOT, 'configs/psanet/*mini*.yml')))[0]
    cfg = load_config(config, opts=args.opts)
    weights = resolve_weights_path(args.model_path) if args.model_path else None
    return config, cfg, weights


def main(argv=None):
    run_as_command(parse_args(argv), run)


def run_as_command(args, work, prefix='bench_deploy_'):
    """Runs ``work(args, config, cfg, weights, folder)`` with --cpu_threads set for every
    math library, after :func:`check_args`, in a temporary folder removed afterwards; a
    wrong flag or input is one ``error:`` line and exit code 2 (psanet.cli.run_cli)."""
    # Before Paddle loads its math libraries: every backend gets the same threads.
    for name in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OPENBLAS_NUM_THREADS'):
        os.environ[name] = str(args.cpu_threads)
    from psanet.cli import exit_with, run_cli

    def checked_then_run():
        checked = check_args(args)
        folder = tempfile.mkdtemp(prefix=prefix)
        try:
            work(args, *checked, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    exit_with(run_cli(checked_then_run))


def bench_images(args, cfg, work):
    """(measured image paths, their label paths or None, calibration image folder)."""
    from psanet.contract import get_image_list
    from psanet.data import generate_mini_cityscapes
    if args.val:
        from psanet.core.config import ComponentBuilder
        builder = ComponentBuilder(cfg)
        val = builder.dataset('val', check_labels='none').file_list[:args.num_images]
        calib = os.path.join(work, 'calib.txt')
        with open(calib, 'w') as f:
            f.writelines(os.path.abspath(image) + '\n' for image, _ in
                         builder.dataset('train', check_labels='none').file_list[:args.calib_num])
        return [image for image, _ in val], [label for _, label in val], calib
    generate_mini_cityscapes(os.path.join(work, 'data'), num_train=args.calib_num,
                             num_val=args.num_images, size=tuple(args.size), seed=0)
    images = [path for path, _ in get_image_list(os.path.join(work, 'data', 'leftImg8bit',
                                                               'val'))]
    return images, None, os.path.join(work, 'data', 'leftImg8bit', 'train')


def mean_iou(labels, truths, num_classes, ignore=255):
    import numpy as np
    confusion = np.zeros((num_classes, num_classes), np.int64)
    for label, truth in zip(labels, truths):
        keep = truth != ignore
        confusion += np.bincount(truth[keep].astype(np.int64) * num_classes + label[keep],
                                 minlength=num_classes ** 2).reshape(num_classes, num_classes)
    union = confusion.sum(0) + confusion.sum(1) - np.diag(confusion)
    present = union > 0
    return float((np.diag(confusion)[present] / union[present]).mean())


def _tools(skipped):
    """(ONNX export possible, INT8 possible), naming in ``skipped`` what is not installed."""
    from psanet.deploy.quantize import check_quantize_tools
    from psanet.errors import ConfigError
    from psanet.export import ONNX_INSTALL, onnx_tools_installed
    if not onnx_tools_installed():
        skipped.append(f'the ONNX rows and INT8 (the ONNX export needs them: {ONNX_INSTALL})')
        return False, False
    try:
        check_quantize_tools()
    except ConfigError as error:
        skipped.append(f'INT8 ({error})')
        return True, False
    return True, True


def run(args, config, cfg, weights, work):
    import cv2
    import numpy as np
    import paddle
    from psanet.core.config import ComponentBuilder
    from psanet.core.weights import load_model_weights
    from psanet.deploy.backend_choice import CACHE_ENV, TIMING_ENV, default_runner
    from psanet.deploy.backends import (PACKAGES, OpenVinoRunner, create_runner,
                                        default_backend, installed)
    from psanet.deploy.deploy_config import DeployConfig
    from psanet.deploy.predictor import API_ENABLE_MKLDNN, PaddleRunner, PredictorOptions
    from psanet.deploy.processing import preprocess
    from psanet.deploy.quantize import DEFAULT_RECIPE
    from psanet.export import ExportOptions, export_model

    paddle.set_device('cpu')
    model = ComponentBuilder(cfg).model
    if weights:
        load_model_weights(model, weights)
    model.eval()
    images, label_paths, calib = bench_images(args, cfg, work)
    transforms = cfg.dic['val_dataset']['transforms']
    skipped = []
    onnx, quantize = _tools(skipped)
    exports = {}
    for impl in ('custom', 'paddle'):
        int8 = quantize and impl == 'paddle'
        exports[impl] = os.path.join(work, impl)
        export_model(model, transforms, exports[impl], ExportOptions(
            output_op='none', psa_impl=impl, onnx=onnx and impl == 'paddle',
            quantize='int8' if int8 else None, calib_images=calib if int8 else None,
            calib_num=args.calib_num))
    compose = DeployConfig(exports['custom']).build_transforms()
    singles = [preprocess([path], compose)[0] for path in images]
    batches = [np.concatenate(singles[i:i + args.batch_size])
               for i in range(0, len(singles), args.batch_size)]

    def dygraph(x):
        with paddle.no_grad():
            return model(paddle.to_tensor(x))[0].numpy()

    options = PredictorOptions(cpu_threads=args.cpu_threads)
    backends = [('dygraph, custom op', dygraph)]
    for impl in ('custom', 'paddle'):
        for mkldnn in (False, True):
            runner = PaddleRunner(DeployConfig(exports[impl]), PredictorOptions(
                enable_mkldnn=mkldnn, cpu_threads=args.cpu_threads))
            backends.append((f'Paddle Inference, {impl} op, oneDNN {"on" if mkldnn else "off"}',
                             runner.run))
    paddle_export = DeployConfig(exports['paddle'])
    for backend in ('onnxruntime', 'openvino') if onnx else ():
        if not installed(backend):
            skipped.append(f'{backend} (pip install {PACKAGES[backend]})')
            continue
        backends.append((API_ROWS[backend, False],
                         create_runner(paddle_export, backend, options).run))
        if backend == 'openvino':
            import openvino
            from openvino.frontend import FrontEndManager
            if FrontEndManager().load_by_framework('paddle').supported(paddle_export.model):
                runner = OpenVinoRunner(paddle_export.model, paddle_export.input_shape, options)
                backends.append(('openvino, model.json, pure-Paddle op', runner.run))
            else:
                version = openvino.__version__.split('-')[0]
                skipped.append(f"openvino on model.json (OpenVINO {version}'s "
                               "Paddle frontend does not read Paddle 3's model.json)")
        if paddle_export.onnx_int8:
            backends.append((API_ROWS[backend, True],
                             create_runner(paddle_export, backend, options, int8=True).run))

    if args.rows:
        backends = [(name, run_batch) for name, run_batch in backends
                    if name == backends[0][0] or any(word in name for word in args.rows)]
    truths = None
    if label_paths:
        truths = [cv2.imread(path, cv2.IMREAD_GRAYSCALE) for path in label_paths]
    for _, run_batch in backends:
        for _ in range(args.warmup):
            run_batch(batches[0])
    times = {name: [] for name, _ in backends}
    outputs = {name: [] for name, _ in backends}
    for round_ in range(args.rounds):
        for name, run_batch in backends:
            for x in batches:
                start = time.perf_counter()
                output = run_batch(x)
                times[name].append((time.perf_counter() - start) * 1000.0)
                if round_ == 0:
                    outputs[name].append(output)
    reference = outputs[backends[0][0]]
    quality = {}
    for name, _ in backends:
        labels = np.concatenate([o.argmax(1) for o in outputs[name]])
        quality[name] = (
            float(np.mean(labels == np.concatenate([r.argmax(1) for r in reference]))),
            float(max(np.abs(o - r).max() for o, r in zip(outputs[name], reference))),
            mean_iou(labels, truths, reference[0].shape[1]) if truths else None)

    base = np.sum(times[backends[0][0]])
    source = 'val images of the config' if args.val else 'generated images'
    print(f'PSANet {os.path.basename(config)}, weights {weights or "initial"}, '
          f'{len(images)} {source} of {singles[0].shape[3]}x{singles[0].shape[2]}, batch '
          f'{args.batch_size}, {args.cpu_threads} CPU thread(s), {args.warmup} warm-up '
          f'batches, {args.rounds} rounds, '
          + (f'INT8 ({DEFAULT_RECIPE.describe()}) calibrated on {args.calib_num} other '
             'images, ' if quantize else '') +
          f'paddle {paddle.__version__}, load average {os.getloadavg()[0]:.1f} on '
          f'{os.cpu_count()} CPUs')
    miou = ' mIoU |' if truths else ''
    print(f'| backend | images/s | p50 ms/batch | p90 ms/batch | speed-up vs dygraph '
          f'| pixels as dygraph | max abs logit diff |{miou}')
    print('|---|---|---|---|---|---|---|' + ('---|' if truths else ''))
    for name, _ in backends:
        values = np.asarray(times[name])
        agree, diff, score = quality[name]
        images_per_s = args.rounds * len(images) / (values.sum() / 1000.0)
        cell = f' {score * 100:.2f} |' if truths else ''
        print(f'| {name} | {images_per_s:.2f} | {np.percentile(values, 50):.1f} | '
              f'{np.percentile(values, 90):.1f} | {base / values.sum():.2f}x | '
              f'{agree * 100:.3f}% | {diff:.1e} |{cell}')
    # The API's choice, timed as a first load times it: a cache of its own, so that an
    # earlier choice for these files is not read back.
    os.environ[CACHE_ENV] = os.path.join(work, 'cache')
    os.environ.pop(TIMING_ENV, None)
    api_options = PredictorOptions(enable_mkldnn=API_ENABLE_MKLDNN, cpu_threads=args.cpu_threads)
    for int8 in (False, True) if onnx else (False,):
        if int8 and not paddle_export.onnx_int8:
            continue
        chosen, _ = default_runner(paddle_export, api_options, int8, args.batch_size,
                                   shape=batches[0].shape)
        print(_default_line(chosen, default_backend(paddle_export, int8=int8), int8, times))
    for line in skipped:
        print(f'not run: {line}')


def _default_line(chosen, fixed, int8, times):
    """The API's default for the export (``chosen``: timed; ``fixed``: the fixed order's)
    against the rows that run the same model: its time over the fastest one's (1.00x: it is
    the fastest measured here)."""
    rows = {backend: API_ROWS[backend, int8] for backend, precision in API_ROWS
            if precision == int8 and API_ROWS[backend, precision] in times}
    total = {backend: sum(times[row]) for backend, row in rows.items()}
    fastest = min(total, key=total.get) if total else None

    def ratio(backend):
        if backend not in total:
            return 'not measured here (--rows)'
        return f'{total[backend] / total[fastest]:.2f}x'

    measured = (f' the time of the fastest measured ({fastest}) of {", ".join(sorted(total))}'
                if chosen in total else '')
    return (f'default {"INT8" if int8 else "float"} backend (psanet.Segmenter, CPU, timed): '
            f'{chosen}, {ratio(chosen)}{measured}; without the timing '
            f'(PSANET_TIME_BACKENDS=0): {fixed}, {ratio(fixed)}')


if __name__ == '__main__':
    main()
