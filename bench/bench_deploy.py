"""CPU inference speed of PSANet in every backend: dygraph, Paddle Inference (oneDNN off / on),
onnxruntime, OpenVINO, and the INT8 model in onnxruntime and OpenVINO.

    python bench/bench_deploy.py [--config CFG] [--model_path PDPARAMS] [--val]
        [--num_images 8] [--size 256 128] [--batch_size 1] [--rounds 3] [--warmup 2]
        [--cpu_threads 1] [--calib_num 32]

Protocol (docs/deploy.md, "Benchmark protocol"): one model, exported once with the
custom op and once with the pure-Paddle op (+ model.onnx, + model_int8.onnx
quantised on calibration images that are not the measured ones); the same
preprocessed batches go through every backend. Each backend first runs --warmup
untimed batches; then each round runs every backend over all batches, backends
interleaved, so that load from other processes falls on all of them alike. A
time is one batch through the model alone (input already preprocessed, output
copied to numpy); latency is per batch, images/s counts images. Each backend's
output is compared with the dygraph model's logits (class agreement per pixel,
largest difference); with --val the images are the config's val set and each
backend's mIoU against the labels is printed too.
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


def parse_args():
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
    return parser.parse_args()


def _images(args, cfg, work):
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


def _miou(labels, truths, num_classes, ignore=255):
    import numpy as np
    confusion = np.zeros((num_classes, num_classes), np.int64)
    for label, truth in zip(labels, truths):
        keep = truth != ignore
        confusion += np.bincount(truth[keep].astype(np.int64) * num_classes + label[keep],
                                 minlength=num_classes ** 2).reshape(num_classes, num_classes)
    union = confusion.sum(0) + confusion.sum(1) - np.diag(confusion)
    present = union > 0
    return float((np.diag(confusion)[present] / union[present]).mean())


def main():
    args = parse_args()
    work = tempfile.mkdtemp(prefix='bench_deploy_')
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, work):
    # Before Paddle loads its math libraries: every backend gets the same threads.
    for name in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OPENBLAS_NUM_THREADS'):
        os.environ[name] = str(args.cpu_threads)
    import cv2
    import numpy as np
    import paddle
    import psanet.compat  # noqa: F401  (filters Paddle's ccache notice)
    from psanet.core.weights import load_model_weights
    from psanet.core.config import ComponentBuilder, load_config
    from psanet.deploy.deploy_config import DeployConfig
    from psanet.deploy.predictor import PaddleRunner, PredictorOptions
    from psanet.deploy.processing import preprocess
    from psanet.deploy.backends import PACKAGES, OpenVinoRunner, create_runner, installed
    from psanet.deploy.quantize import check_quantize_tools
    from psanet.errors import ConfigError
    from psanet.export import ONNX_INSTALL, ExportOptions, export_model, onnx_tools_installed

    paddle.set_device('cpu')
    config = args.config or sorted(glob.glob(os.path.join(ROOT, 'configs/psanet/*mini*.yml')))[0]
    cfg = load_config(config)
    model = ComponentBuilder(cfg).model
    if args.model_path:
        load_model_weights(model, args.model_path)
    model.eval()
    images, label_paths, calib = _images(args, cfg, work)
    transforms = cfg.dic['val_dataset']['transforms']
    skipped = []
    onnx = onnx_tools_installed()
    quantize = onnx
    if not onnx:
        skipped.append(f'the ONNX rows and INT8 (the ONNX export needs them: {ONNX_INSTALL})')
    else:
        try:
            check_quantize_tools()
        except ConfigError as error:
            quantize = False
            skipped.append(f'INT8 ({error})')
    exports = {}
    for impl in ('custom', 'paddle'):
        exports[impl] = os.path.join(work, impl)
        export_model(model, transforms, exports[impl], ExportOptions(
            output_op='none', psa_impl=impl, onnx=onnx and impl == 'paddle',
            quantize='int8' if quantize and impl == 'paddle' else None, calib_images=calib,
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
        backends.append((f'{backend}, ONNX, pure-Paddle op',
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
            backends.append((f'{backend}, INT8 ONNX (convolutions)',
                             create_runner(paddle_export, backend, options, int8=True).run))

    reference = [dygraph(x) for x in batches]
    truths = None
    if label_paths:
        truths = [cv2.imread(path, cv2.IMREAD_GRAYSCALE) for path in label_paths]
    times = {name: [] for name, _ in backends}
    quality = {}
    for name, run in backends:
        for _ in range(args.warmup):
            run(batches[0])
        outputs = [run(x) for x in batches]
        labels = np.concatenate([o.argmax(1) for o in outputs])
        quality[name] = (
            float(np.mean(labels == np.concatenate([r.argmax(1) for r in reference]))),
            float(max(np.abs(o - r).max() for o, r in zip(outputs, reference))),
            _miou(labels, truths, outputs[0].shape[1]) if truths else None)
    for _ in range(args.rounds):
        for name, run in backends:
            for x in batches:
                start = time.perf_counter()
                run(x)
                times[name].append((time.perf_counter() - start) * 1000.0)

    base = np.sum(times[backends[0][0]])
    source = 'val images of the config' if args.val else 'generated images'
    print(f'PSANet {os.path.basename(config)}, weights {args.model_path or "initial"}, '
          f'{len(images)} {source} of {singles[0].shape[3]}x{singles[0].shape[2]}, batch '
          f'{args.batch_size}, {args.cpu_threads} CPU thread(s), {args.warmup} warm-up '
          f'batches, {args.rounds} rounds, '
          + (f'INT8 calibrated on {args.calib_num} other images, ' if quantize else '') +
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
    for line in skipped:
        print(f'not run: {line}')


if __name__ == '__main__':
    main()
