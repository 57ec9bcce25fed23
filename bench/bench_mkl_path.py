"""Paddle's MKL on this CPU: its own code path against the AVX2 path, side by side in one run.

Paddle's CPU wheels carry MKL 2019.0 (libmklml_intel.so), which on an AMD processor takes its
generic path; ``MKL_DEBUG_CPU_TYPE=5``, read at MKL's first call, selects the AVX2 one, and
importing psanet sets it on an AMD CPU with AVX2 unless it is set (psanet.compat.MKL_ON_AMD).
Each column runs in a process of its own, ``MKL_DEBUG_CPU_TYPE`` empty (MKL's own choice) and
``5``, timing the same work:

- the product of one PSA branch, ``matmul(features, map, transpose_y=True)`` at the map of a
  2048x1024 input (64x128, 512 channels), as a Paddle Inference or dygraph export runs it;
- a 3x3 convolution, 256 channels, forward and backward (dygraph: im2col and sgemm);
- a training step of ``--config`` at ``--crop`` (forward, backward of a stand-in loss, SGD);
- the model exported with the custom op and run in Paddle Inference (oneDNN on, psanet's
  predictor settings) at ``--infer-size``.

    python bench/bench_mkl_path.py [--threads 2] [--repeats 3] [--config ...] [--crop W H]
                                   [--infer-size W H] [--smoke]

``--smoke`` times tiny shapes on the mini config, one call each: the CI check that it runs.
Prints a markdown table of median ms and the ratio own / AVX2.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CONFIGS = os.path.join(ROOT, 'configs', 'psanet')
R50_CONFIG = os.path.join(CONFIGS, 'psanet_resnet50_os8_cityscapes_1024x512_80k.yml')
MINI_CONFIG = os.path.join(CONFIGS, 'psanet_resnet18_os8_mini_cityscapes_128x64_100.yml')
# (name, what): the rows, in the order printed.
ROWS = [('matmul', 'PSA product'), ('conv', 'conv 3x3 fwd+bwd'), ('train', 'training step'),
        ('inference', 'Paddle Inference')]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--threads', type=int, default=os.cpu_count(),
                        help="Paddle's CPU threads (MKL's and oneDNN's); default: all")
    parser.add_argument('--repeats', type=int, default=3,
                        help='timed calls per cell (median), after one; default 3')
    parser.add_argument('--config', default=R50_CONFIG,
                        help='the model of the training and inference rows; default: R50')
    parser.add_argument('--crop', type=int, nargs=2, default=(512, 256), metavar=('W', 'H'),
                        help='the training step\'s input (batch 1); default 512 256')
    parser.add_argument('--infer-size', type=int, nargs=2, default=(1024, 512),
                        metavar=('W', 'H'), help='the inference input; default 1024 512')
    parser.add_argument('--smoke', action='store_true',
                        help='tiny shapes, the mini config, one call per cell')
    parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.config = 1, MINI_CONFIG
        args.crop = args.infer_size = (64, 32)
    return args


def op_shapes(smoke):
    """{row: shape} of the matmul ([N, C, H*W] against an H*W x H*W map) and conv rows."""
    return {'matmul': (1, 64, 256) if smoke else (1, 512, 64 * 128),
            'conv': (1, 8, 16, 16) if smoke else (2, 256, 64, 128)}


def median_seconds(fn, repeats):
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _model(config):
    from psanet.core.config import ComponentBuilder, load_config
    cfg = load_config(config, opts=['model.backbone.pretrained=None'])
    return cfg, ComponentBuilder(cfg).model


def worker(args):
    """Times every row in this process (its MKL path set by the parent) and prints JSON."""
    import paddle
    paddle.base.core.set_num_threads(args.threads)
    paddle.seed(0)
    shapes = op_shapes(args.smoke)
    seconds = {}
    n, channels, positions = shapes['matmul']
    features, attention = paddle.randn([n, channels, positions]), \
        paddle.randn([n, positions, positions])
    seconds['matmul'] = median_seconds(
        lambda: paddle.matmul(features, attention, transpose_y=True).numpy(), args.repeats)
    conv = paddle.nn.Conv2D(shapes['conv'][1], shapes['conv'][1], 3, padding=1)
    image = paddle.randn(list(shapes['conv']))

    def conv_step():
        conv(image).mean().backward()
        conv.clear_gradients()
    seconds['conv'] = median_seconds(conv_step, args.repeats)

    cfg, model = _model(args.config)
    model.train()
    optimizer = paddle.optimizer.SGD(learning_rate=1e-6, parameters=model.parameters())
    width, height = args.crop
    crop = paddle.randn([1, 3, height, width])

    def train_step():
        loss = sum((logit ** 2).mean() for logit in model(crop))  # a stand-in loss
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
    seconds['train'] = median_seconds(train_step, args.repeats)

    from psanet.deploy.deploy_config import DeployConfig
    from psanet.deploy.predictor import PaddleRunner, PredictorOptions
    from psanet.export import ExportOptions, export_model
    model.eval()
    with tempfile.TemporaryDirectory(prefix='bench_mkl_path_') as folder:
        export_model(model, cfg.dic['val_dataset']['transforms'], folder,
                     ExportOptions(output_op='none', psa_impl='custom'))
        run = PaddleRunner(DeployConfig(folder), PredictorOptions(
            cpu_threads=args.threads, enable_mkldnn=True)).run
    width, height = args.infer_size
    batch = paddle.randn([1, 3, height, width]).numpy()
    seconds['inference'] = median_seconds(lambda: run(batch), args.repeats)
    print('SECONDS ' + json.dumps(seconds), flush=True)


def run_worker(argv, mkl_debug_cpu_type):
    env = dict(os.environ, MKL_DEBUG_CPU_TYPE=mkl_debug_cpu_type)
    result = subprocess.run([sys.executable, os.path.abspath(__file__), '--worker', *argv],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = next((line for line in result.stdout.splitlines() if line.startswith('SECONDS ')),
                None)
    if result.returncode != 0 or line is None:
        sys.exit(f'bench_mkl_path: the worker with MKL_DEBUG_CPU_TYPE={mkl_debug_cpu_type!r} '
                 f'failed (exit {result.returncode}):\n{result.stdout[-3000:]}')
    return json.loads(line[len('SECONDS '):])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    from psanet import amd_cpu_with_avx2
    amd = amd_cpu_with_avx2()
    own, avx2 = run_worker(argv, ''), run_worker(argv, '5')
    n, channels, positions = op_shapes(args.smoke)['matmul']
    shapes = {'matmul': f'{n}x{channels}x{positions}, map {positions}x{positions}',
              'conv': 'x'.join(str(d) for d in op_shapes(args.smoke)['conv']),
              'train': f'{os.path.basename(args.config)}, {args.crop[0]}x{args.crop[1]}',
              'inference': f'custom op, oneDNN on, {args.infer_size[0]}x{args.infer_size[1]}'}
    print(f'\nPaddle\'s MKL on this CPU ({"AMD with AVX2" if amd else "not AMD with AVX2"}; '
          f'psanet {"sets" if amd else "leaves"} MKL_DEBUG_CPU_TYPE), {args.threads} threads, '
          f'median ms of {args.repeats} calls after one, each column in a process of its own\n')
    print('| work | shape | MKL\'s own path | AVX2 path | own / AVX2 |\n|---|---|---|---|---|')
    for key, what in ROWS:
        print(f'| {what} | {shapes[key]} | {1e3 * own[key]:.1f} | {1e3 * avx2[key]:.1f} | '
              f'{own[key] / avx2[key]:.2f} |')


if __name__ == '__main__':
    main()
