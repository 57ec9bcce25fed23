"""INT8 recipes side by side: each one's pixel agreement with the float model, mIoU and
speed in onnxruntime and OpenVINO.

    python bench/bench_int8.py --model_path output/<run>/best_model --val
        [--config CFG] [--num_images 20] [--calib_num 32] [--rounds 3] [--warmup 2]
        [--cpu_threads 1] [--recipes minmax entropy ...] [--opts KEY=VALUE ...]

The model is exported once (pure-Paddle op, model.onnx, logits out); each recipe
(``RECIPES``, :class:`psanet.deploy.quantize.Int8Recipe`) quantises that model.onnx
with the same calibration images (the config's train images with --val, generated
ones otherwise; never the measured ones). Agreement: the share of pixels whose class
is the float model's in the same backend; mIoU against the val labels with --val.
Speed: ms per image, batch 1, the float model and every recipe interleaved in each
round as in bench_deploy.py, and the speed-up over the float model in that backend.
"""
import argparse
import os
import shutil
import time

import bench_deploy  # the bench's folder is sys.path[0]: its flags' checks, images, mIoU

# name -> Int8Recipe fields; the first is DEFAULT_RECIPE's.
RECIPES = {
    'minmax': {},
    'per-tensor weights': {'per_channel': False},
    'entropy': {'calibration': 'entropy'},
    'percentile': {'calibration': 'percentile'},
    '7-bit weights': {'reduce_range': True},
    'classifier float': {'float_classifier': True},
    'attention INT8': {'op_types': ('Conv', 'MatMul', 'Softmax')},
    'residual adds INT8': {'op_types': ('Conv', 'Add')},
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default=None, help='Default: configs/psanet/*mini*.yml.')
    parser.add_argument('--model_path', default=None, help='Trained weights.')
    parser.add_argument('--val', action='store_true',
                        help="The config's val images (and mIoU); calibration on its train "
                        'images. Default: generated images at --size.')
    parser.add_argument('--num_images', type=int, default=20)
    parser.add_argument('--size', type=int, nargs=2, default=(256, 128), metavar=('W', 'H'))
    parser.add_argument('--calib_num', type=int, default=32)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--cpu_threads', type=int, default=1)
    parser.add_argument('--recipes', nargs='+', default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument('--opts', nargs='+', default=None, help='key=value config overrides.')
    args = parser.parse_args(argv)
    args.batch_size = 1
    return args


def main(argv=None):
    bench_deploy.run_as_command(parse_args(argv), run, prefix='bench_int8_')


def run(args, config, cfg, weights, work):
    import cv2
    import numpy as np
    import paddle
    from psanet.core.config import ComponentBuilder
    from psanet.core.weights import load_model_weights
    from psanet.deploy.backends import create_runner, installed
    from psanet.deploy.deploy_config import DeployConfig
    from psanet.deploy.predictor import PredictorOptions
    from psanet.deploy.processing import preprocess
    from psanet.deploy.quantize import Int8Recipe, check_calib_images, quantize_export
    from psanet.export import ExportOptions, export_model
    from psanet.log import without_stderr_lines
    from psanet.compat import ORT_UNUSED_INITIALIZER

    paddle.set_device('cpu')
    model = ComponentBuilder(cfg).model
    if weights:
        load_model_weights(model, weights)
    model.eval()
    images, label_paths, calib = bench_deploy.bench_images(args, cfg, work)
    calib_paths = check_calib_images(calib, args.calib_num)
    float_dir = os.path.join(work, 'float')
    export_model(model, cfg.dic['val_dataset']['transforms'], float_dir,
                 ExportOptions(output_op='none', psa_impl='paddle', onnx=True))
    backends = [name for name in ('onnxruntime', 'openvino') if installed(name)]
    options = PredictorOptions(cpu_threads=args.cpu_threads)
    runners = {('float', b): create_runner(DeployConfig(float_dir), b, options).run
               for b in backends}
    for name in args.recipes:
        folder = os.path.join(work, name.replace(' ', '_'))
        shutil.copytree(float_dir, folder)
        with without_stderr_lines(ORT_UNUSED_INITIALIZER):
            quantize_export(DeployConfig(folder), calib, calib_paths,
                            recipe=Int8Recipe(**RECIPES[name]))
        for b in backends:
            runners[name, b] = create_runner(DeployConfig(folder), b, options, int8=True).run

    batches = [preprocess([path], DeployConfig(float_dir).build_transforms())[0]
               for path in images]
    truths = [cv2.imread(path, cv2.IMREAD_GRAYSCALE) for path in label_paths or []]
    labels = {key: np.concatenate([run_batch(x).argmax(1) for x in batches])
              for key, run_batch in runners.items()}
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
    print(f'INT8 recipes, PSANet {os.path.basename(config)}, weights {weights or "initial"}, '
          f'{len(images)} {"val images of the config" if args.val else "generated images"} '
          f'of {shape[3]}x{shape[2]}, calibrated on {len(calib_paths)} other images, batch 1, '
          f'{args.cpu_threads} CPU thread(s), {args.warmup} warm-up, {args.rounds} rounds, '
          f'load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs')
    head = ['recipe']
    for b in backends:
        head += [f'pixels as float, {b}'] + (['mIoU'] if truths else []) + \
            [f'ms/img, {b}', 'speed-up vs float']
    print('| ' + ' | '.join(head) + ' |')
    print('|' + '---|' * len(head))
    for name in ['float'] + list(args.recipes):
        what = 'float (FP32)' if name == 'float' else \
            f'{name}: {Int8Recipe(**RECIPES[name]).describe()}'
        cells = [what]
        for b in backends:
            agree = float(np.mean(labels[name, b] == labels['float', b]))
            ms = float(np.mean(times[name, b]))
            cells.append(f'{agree * 100:.2f}%')
            if truths:
                cells.append(f'{miou((name, b)) * 100:.2f}')
            cells += [f'{ms:.1f}', f'{np.mean(times["float", b]) / ms:.2f}x']
        print('| ' + ' | '.join(cells) + ' |')


if __name__ == '__main__':
    main()
