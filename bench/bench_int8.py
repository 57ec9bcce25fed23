"""INT8 recipes side by side: each one's pixel agreement with the float model, mIoU and
speed in onnxruntime and OpenVINO, and the float model's margins that explain the changes.

    python bench/bench_int8.py --model_path output/<run>/best_model --val
        [--config CFG] [--num_images 20] [--calib_num 32] [--rounds 3] [--warmup 2]
        [--cpu_threads 1] [--recipes minmax entropy ...] [--margin_models PDPARAMS ...]
        [--opts KEY=VALUE ...]

The model is exported once (pure-Paddle op, model.onnx, logits out); each row of
``RECIPES`` (an :class:`psanet.deploy.quantize.Int8Recipe`, and a calibration image count
where it names one) quantises that model.onnx with the first images of the same list
(the config's train images with --val, generated ones otherwise; never the measured ones).
Agreement: the share of pixels whose class is the float model's in the same backend; mIoU
against the val labels with --val. Speed: ms per image (the median), batch 1, the float
model and every recipe interleaved in each round as in bench_deploy.py, and the speed-up
over the float model in that backend. Margins: the share of pixels whose two best float
logits are within 0.25 / 0.5 of each other (the model's, and --margin_models' in dygraph),
and those of the pixels each recipe changes.
"""
import argparse
import os
import shutil
import time

import bench_deploy  # the bench's folder is sys.path[0]: its flags' checks, images, mIoU

# name -> Int8Recipe fields, and 'calib_num' where a row calibrates on another image count than
# --calib_num; the first is DEFAULT_RECIPE's.
RECIPES = {
    'first conv, classifier float': {'float_stem': True, 'float_classifier': True},
    'minmax': {},
    'minmax, per-tensor': {'per_channel': False},
    'entropy': {'calibration': 'entropy'},
    'entropy, per-tensor': {'calibration': 'entropy', 'per_channel': False},
    'percentile': {'calibration': 'percentile'},
    'percentile, per-tensor': {'calibration': 'percentile', 'per_channel': False},
    '7-bit weights': {'reduce_range': True},
    'classifier float': {'float_classifier': True},
    'first conv float': {'float_stem': True},
    '7-bit, first conv, classifier float': {'reduce_range': True, 'float_stem': True,
                                            'float_classifier': True},
    'per-tensor, first conv, classifier float': {'per_channel': False, 'float_stem': True,
                                                 'float_classifier': True},
    'entropy, first conv, classifier float': {'calibration': 'entropy', 'float_stem': True,
                                              'float_classifier': True},
    'attention INT8': {'op_types': ('Conv', 'MatMul', 'Softmax')},
    'residual adds INT8': {'op_types': ('Conv', 'Add')},
    'minmax, 8 images': {'calib_num': 8},
    'entropy, 8 images': {'calibration': 'entropy', 'calib_num': 8},
}
TIES = (0.25, 0.5)  # margins (top-1 minus top-2 logit) counted as near a tie


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default=None, help='Default: configs/psanet/*mini*.yml.')
    parser.add_argument('--model_path', default=None, help='Trained weights.')
    parser.add_argument('--margin_models', nargs='+', default=[], metavar='PDPARAMS',
                        help='Other weights of the same config whose float margins are '
                        'printed beside the measured model\'s (e.g. a shorter training).')
    parser.add_argument('--val', action='store_true',
                        help="The config's val images (and mIoU); calibration on its train "
                        'images. Default: generated images at --size.')
    parser.add_argument('--num_images', type=int, default=20)
    parser.add_argument('--size', type=int, nargs=2, default=(256, 128), metavar=('W', 'H'))
    parser.add_argument('--calib_num', type=int, default=32,
                        help='Calibration images of the rows that name no other count.')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--cpu_threads', type=int, default=1)
    parser.add_argument('--recipes', nargs='+', default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument('--opts', nargs='+', default=None, help='key=value config overrides.')
    args = parser.parse_args(argv)
    args.batch_size = 1
    args.recipe_calib_num = args.calib_num
    # bench_images lists as many calibration images as the largest row needs.
    args.calib_num = max([args.calib_num] + [RECIPES[name].get('calib_num', 0)
                                             for name in args.recipes])
    return args


def main(argv=None):
    bench_deploy.run_as_command(parse_args(argv), run, prefix='bench_int8_')


def near_ties(logits, margins=TIES):
    """The share of pixels whose two largest logits (axis 1 of N x C x H x W) differ by
    less than each of ``margins``."""
    import numpy as np
    top = np.sort(logits, axis=1)
    gap = top[:, -1] - top[:, -2]
    return [float(np.mean(gap < margin)) for margin in margins]


def margin_line(what, logits):
    shares = near_ties(logits)
    return f'{what}: ' + ', '.join(f'{share * 100:.1f}% within {margin}'
                                   for share, margin in zip(shares, TIES))


def _split(name):
    """(Int8Recipe, calibration image count or None) of a RECIPES row."""
    from psanet.deploy.quantize import Int8Recipe
    fields = dict(RECIPES[name])
    return Int8Recipe(**{k: v for k, v in fields.items() if k != 'calib_num'}), \
        fields.get('calib_num')


def run(args, config, cfg, weights, work):
    import cv2
    import numpy as np
    import paddle
    from psanet.core.config import ComponentBuilder
    from psanet.core.weights import load_model_weights, resolve_weights_path
    from psanet.deploy.backends import create_runner, installed
    from psanet.deploy.deploy_config import DeployConfig
    from psanet.deploy.predictor import PredictorOptions
    from psanet.deploy.processing import preprocess
    from psanet.deploy.quantize import check_calib_images, quantize_export
    from psanet.export import ExportOptions, export_model
    from psanet.log import without_stderr_lines
    from psanet.compat import ORT_UNUSED_INITIALIZER

    paddle.set_device('cpu')
    model = ComponentBuilder(cfg).model
    others = [resolve_weights_path(path) for path in args.margin_models]
    if weights:
        load_model_weights(model, weights)
    model.eval()
    images, label_paths, calib = bench_deploy.bench_images(args, cfg, work)
    float_dir = os.path.join(work, 'float')
    export_model(model, cfg.dic['val_dataset']['transforms'], float_dir,
                 ExportOptions(output_op='none', psa_impl='paddle', onnx=True))
    backends = [name for name in ('onnxruntime', 'openvino') if installed(name)]
    options = PredictorOptions(cpu_threads=args.cpu_threads)
    runners = {('float', b): create_runner(DeployConfig(float_dir), b, options).run
               for b in backends}
    calib_counts = {}
    for name in args.recipes:
        recipe, count = _split(name)
        calib_paths = check_calib_images(calib, count or args.recipe_calib_num)
        calib_counts[name] = len(calib_paths)
        folder = os.path.join(work, name.replace(' ', '_').replace(',', ''))
        shutil.copytree(float_dir, folder)
        with without_stderr_lines(ORT_UNUSED_INITIALIZER):
            quantize_export(DeployConfig(folder), calib, calib_paths, recipe=recipe)
        for b in backends:
            runners[name, b] = create_runner(DeployConfig(folder), b, options, int8=True).run

    batches = [preprocess([path], DeployConfig(float_dir).build_transforms())[0]
               for path in images]
    truths = [cv2.imread(path, cv2.IMREAD_GRAYSCALE) for path in label_paths or []]
    logits = {key: np.concatenate([run_batch(x) for x in batches])
              for key, run_batch in runners.items()}
    labels = {key: value.argmax(1) for key, value in logits.items()}
    times = {key: [] for key in runners}
    for key, run_batch in runners.items():
        for _ in range(args.warmup):
            run_batch(batches[0])
    for _ in range(args.rounds):
        for key, run_batch in runners.items():
            for x in batches:
                start = time.perf_counter()
                run_batch(x)
                times[key].append((time.perf_counter() - start) * 1000.0)

    def miou(key):
        return bench_deploy.mean_iou(labels[key], truths, model.num_classes)

    shape = batches[0].shape
    counts = sorted(set(calib_counts.values()))
    print(f'INT8 recipes, PSANet {os.path.basename(config)}, weights {weights or "initial"}, '
          f'{len(images)} {"val images of the config" if args.val else "generated images"} '
          f'of {shape[3]}x{shape[2]}, calibrated on {"/".join(map(str, counts))} other '
          f'images, batch 1, {args.cpu_threads} CPU thread(s), {args.warmup} warm-up, '
          f'{args.rounds} rounds (ms/img: the median), load average '
          f'{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs')
    head = ['recipe']
    for b in backends:
        head += [f'pixels as float, {b}'] + (['mIoU'] if truths else []) + \
            [f'ms/img, {b}', 'speed-up vs float']
    print('| ' + ' | '.join(head) + ' |')
    print('|' + '---|' * len(head))
    for name in ['float'] + list(args.recipes):
        what = 'float (FP32)' if name == 'float' else \
            f'{name}: {_split(name)[0].describe()}, {calib_counts[name]} images'
        cells = [what]
        for b in backends:
            agree = float(np.mean(labels[name, b] == labels['float', b]))
            ms = float(np.median(times[name, b]))
            cells.append(f'{agree * 100:.2f}%')
            if truths:
                cells.append(f'{miou((name, b)) * 100:.2f}')
            cells += [f'{ms:.1f}', f'{np.median(times["float", b]) / ms:.2f}x']
        print('| ' + ' | '.join(cells) + ' |')

    # Why pixels change: INT8 moves each logit a little, which flips only near-ties.
    reference = logits['float', backends[0]]
    print('Float margins (top-1 minus top-2 logit, share of the pixels; '
          f'{backends[0]} FP32 for the measured model, dygraph for the others):')
    print('- ' + margin_line(weights or 'initial', reference))
    for path in others:
        load_model_weights(model, path)
        with paddle.no_grad():
            other = np.concatenate([model(paddle.to_tensor(x))[0].numpy() for x in batches])
        print('- ' + margin_line(path, other))
    gap = np.diff(np.sort(reference, axis=1)[:, -2:], axis=1)[:, 0]
    for name in args.recipes:
        changed = labels[name, backends[0]] != labels['float', backends[0]]
        if changed.any():
            print(f'- pixels {name} changes ({backends[0]}, {changed.mean() * 100:.2f}%): '
                  + ', '.join(f'{np.mean(gap[changed] < m) * 100:.1f}% of them within {m}'
                              for m in TIES) + f', the largest margin {gap[changed].max():.2f}')


if __name__ == '__main__':
    main()
