"""Where the CPU time goes, per operator type: onnxruntime vs Paddle Inference with oneDNN.

    python bench/profile_cpu_backends.py --export DIR [--image IMAGE] [--runs 10] [--cpu_threads 1]

DIR is an export with model.onnx (export.py --psa_impl paddle --onnx). onnxruntime's
profiler and Paddle Inference's (``Config.enable_profile``, its table printed when the
predictor is destroyed) time the same graph on the same preprocessed image after one
untimed run; the table lists onnxruntime's share per operator type; Paddle's own
table follows it on stdout. The oneDNN passes Paddle applied are in its log
(``--print_detail``-style glog output is kept here).
"""
import argparse
import collections
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--export', required=True)
    parser.add_argument('--image', default=None, help='Default: random 256x128 input.')
    parser.add_argument('--runs', type=int, default=10)
    parser.add_argument('--cpu_threads', type=int, default=1)
    args = parser.parse_args()
    for name in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS'):
        os.environ[name] = str(args.cpu_threads)
    import numpy as np
    import onnxruntime
    from paddle import inference
    from psanet import compat
    from psanet.deploy.deploy_config import DeployConfig
    from psanet.deploy.processing import preprocess

    deploy = DeployConfig(args.export)
    if args.image:
        batch = preprocess([args.image], deploy.build_transforms())[0]
    else:
        batch = np.random.RandomState(0).uniform(-1, 1, (1, 3, 128, 256)).astype('float32')
    # Both profilers write files into the working folder: a temporary one.
    os.chdir(tempfile.mkdtemp(prefix='profile_cpu_backends_'))

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = args.cpu_threads
    options.enable_profiling = True
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(deploy.onnx, options,
                                           providers=['CPUExecutionProvider'])
    name = session.get_inputs()[0].name
    session.run(None, {name: batch})
    for _ in range(args.runs):
        session.run(None, {name: batch})
    with open(session.end_profiling()) as f:
        events = json.load(f)
    per_type = collections.Counter()
    for event in events:
        if event.get('cat') == 'Node' and event['name'].endswith('_kernel_time'):
            per_type[event['args']['op_name']] += event['dur']
    total = sum(per_type.values())
    print(f'onnxruntime, {args.runs} runs after one untimed, {args.cpu_threads} thread(s): '
          f'{total / args.runs / 1000:.1f} ms per run in kernels')
    print('| op type | ms per run | share |')
    print('|---|---|---|')
    for op, dur in per_type.most_common():
        print(f'| {op} | {dur / args.runs / 1000:.2f} | {dur / total * 100:.1f}% |')
    sys.stdout.flush()

    config = inference.Config(deploy.model, deploy.params)
    config.disable_gpu()
    config.set_cpu_math_library_num_threads(args.cpu_threads)
    config.enable_mkldnn()
    config.enable_profile()
    compat.configure_inference(config)
    predictor = inference.create_predictor(config)
    handle = predictor.get_input_handle(predictor.get_input_names()[0])
    handle.reshape(list(batch.shape))
    handle.copy_from_cpu(batch)
    for _ in range(args.runs + 1):
        predictor.run()
    print(f'\nPaddle Inference, oneDNN on, {args.runs + 1} runs (its profile table follows):',
          flush=True)
    del predictor


if __name__ == '__main__':
    main()
