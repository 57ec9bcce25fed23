"""CPU inference speed of PSANet: dygraph vs Paddle Inference (oneDNN off / on) vs onnxruntime.

    python bench/bench_deploy.py [--config CFG] [--model_path PDPARAMS] [--num_images 8]
        [--size 256 128] [--rounds 3] [--cpu_threads 1]

The same images (generated mini Cityscapes at --size) go through every backend;
each round runs every backend over all images, backends interleaved, so that
load from other processes falls on all of them alike. Times are of the model
alone (batch of one, input already preprocessed, output copied to numpy);
preprocessing is the same for every backend. Every backend's logits are checked
against the dygraph model's (argmax agreement, largest difference).
"""
import argparse
import glob
import os
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
                        help='Trained weights; default: the initial weights (speed is the same).')
    parser.add_argument('--num_images', type=int, default=8)
    parser.add_argument('--size', type=int, nargs=2, default=(256, 128), metavar=('W', 'H'))
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--warmup', type=int, default=2, help='Untimed runs per backend.')
    parser.add_argument('--cpu_threads', type=int, default=1)
    return parser.parse_args()


def main():
    args = parse_args()
    # Before Paddle loads its math libraries: every backend gets the same threads.
    for name in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OPENBLAS_NUM_THREADS'):
        os.environ[name] = str(args.cpu_threads)
    import numpy as np
    import paddle
    import psanet.compat  # noqa: F401  (filters Paddle's ccache notice)
    from psanet.core.checkpoint import load_model_weights
    from psanet.core.config import ComponentBuilder, load_config
    from psanet.contract import get_image_list
    from psanet.data import generate_mini_cityscapes
    from psanet.deploy.config import DeployConfig
    from psanet.deploy.predictor import OnnxRunner, PaddleRunner, PredictorOptions
    from psanet.deploy.processing import preprocess
    from psanet.export import ExportOptions, export_model

    paddle.set_device('cpu')
    config = args.config or sorted(glob.glob(os.path.join(ROOT, 'configs/psanet/*mini*.yml')))[0]
    cfg = load_config(config)
    model = ComponentBuilder(cfg).model
    if args.model_path:
        load_model_weights(model, args.model_path)
    model.eval()
    work = tempfile.mkdtemp(prefix='bench_deploy_')
    generate_mini_cityscapes(os.path.join(work, 'data'), num_train=0,
                             num_val=args.num_images, size=tuple(args.size), seed=0)
    images = [path for path, _ in get_image_list(os.path.join(work, 'data', 'leftImg8bit',
                                                               'val'))]
    transforms = cfg.dic['val_dataset']['transforms']
    exports = {}
    for impl in ('custom', 'paddle'):
        exports[impl] = os.path.join(work, impl)
        export_model(model, transforms, exports[impl],
                     ExportOptions(output_op='none', psa_impl=impl, onnx=impl == 'paddle'))
    compose = DeployConfig(exports['custom']).build_transforms()
    inputs = [preprocess([path], compose)[0] for path in images]

    def dygraph(x):
        with paddle.no_grad():
            return model(paddle.to_tensor(x))[0].numpy()

    backends = [('dygraph, custom op', dygraph)]
    for impl in ('custom', 'paddle'):
        for mkldnn in (False, True):
            runner = PaddleRunner(exports[impl], PredictorOptions(
                enable_mkldnn=mkldnn, cpu_threads=args.cpu_threads))
            backends.append((f'Paddle Inference, {impl} op, oneDNN {"on" if mkldnn else "off"}',
                             runner.run))
    backends.append(('onnxruntime, pure-Paddle op', OnnxRunner(
        exports['paddle'], PredictorOptions(cpu_threads=args.cpu_threads)).run))

    reference = [dygraph(x) for x in inputs]
    times = {name: [] for name, _ in backends}
    agreement = {}
    for name, run in backends:
        for _ in range(args.warmup):
            run(inputs[0])
        outputs = [run(x) for x in inputs]
        agreement[name] = (
            float(np.mean([(o.argmax(1) == r.argmax(1)).mean()
                           for o, r in zip(outputs, reference)])),
            float(max(np.abs(o - r).max() for o, r in zip(outputs, reference))))
    for _ in range(args.rounds):
        for name, run in backends:
            for x in inputs:
                start = time.perf_counter()
                run(x)
                times[name].append((time.perf_counter() - start) * 1000.0)

    base = np.mean(times[backends[0][0]])
    print(f'PSANet {os.path.basename(config)}, {args.size[0]}x{args.size[1]} images, '
          f'batch 1, {args.cpu_threads} CPU thread(s), {args.num_images} images x '
          f'{args.rounds} rounds, paddle {paddle.__version__}')
    print('| backend | mean ms/img | p50 | p90 | speed-up vs dygraph | argmax agreement '
          '| max abs logit diff |')
    print('|---|---|---|---|---|---|---|')
    for name, _ in backends:
        values = np.asarray(times[name])
        agree, diff = agreement[name]
        print(f'| {name} | {values.mean():.1f} | {np.percentile(values, 50):.1f} | '
              f'{np.percentile(values, 90):.1f} | {base / values.mean():.2f}x | '
              f'{agree * 100:.3f}% | {diff:.1e} |')


if __name__ == '__main__':
    main()
