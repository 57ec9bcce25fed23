"""Where the CPU time goes, per operator: onnxruntime vs Paddle Inference with oneDNN.

    python bench/profile_cpu_backends.py --export DIR [--image IMAGE | --size 512 256]
        [--runs 3] [--cpu_threads 1]

DIR is an export with model.onnx (export.py --psa_impl paddle --onnx). Both backends
run the same preprocessed image (or a random input of --size): one untimed run each,
then --runs profiled runs of each, the two backends taking turns, so that load from
other processes falls on both alike. onnxruntime's profiler and Paddle's
(``paddle.profiler``, whose host tracer records each instruction of the inference
executor) time the operators of the profiled runs only: the first run (oneDNN
primitives, weight reorders) and the predictor's build (its constant folding) are not
in the tables. Printed: the wall time per run of each, the time per run of each group
of operators side by side (``GROUPS``), and each backend's time per operator type.
"""
import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (group, onnxruntime op types, Paddle op names): the same work under each backend's names.
GROUPS = [
    ('convolutions', {'Conv', 'FusedConv'},
     {'onednn_op.fused_conv2d', 'pd_op.conv2d', 'pd_op.depthwise_conv2d'}),
    ('pooling', {'MaxPool', 'AveragePool', 'GlobalAveragePool'}, {'pd_op.pool2d'}),
    ('resizes', {'Resize'}, {'pd_op.bilinear_interp'}),
    ('layout reorders', {'ReorderInput', 'ReorderOutput', 'Transpose'},
     {'pd_op.onednn_to_paddle_layout', 'pd_op.transpose'}),
    ('attention: gather, matmul, softmax', {'Gather', 'GatherElements', 'MatMul', 'Softmax'},
     {'pd_op.index_select', 'pd_op.gather', 'pd_op.take_along_axis', 'pd_op.bmm',
      'pd_op.matmul', 'pd_op.softmax'}),
    ('elementwise (add, relu, casts, ...)',
     {'Add', 'Mul', 'Sub', 'Div', 'Relu', 'Cast', 'Sum'},
     {'onednn_op.fused_elementwise_add', 'pd_op.add', 'pd_op.multiply', 'pd_op.subtract',
      'pd_op.divide', 'pd_op.relu', 'pd_op.cast', 'pd_op.scale', 'pd_op.scale_',
      'pd_op.multiply_', 'pd_op.dropout'}),
    ('copies (concat, slice, reshape, stack)',
     {'Concat', 'Slice', 'Reshape', 'Squeeze', 'Unsqueeze', 'Expand', 'Pad'},
     {'pd_op.concat', 'pd_op.slice', 'pd_op.reshape', 'pd_op.reshape_', 'pd_op.stack',
      'pd_op.pad'}),
]
OTHER = 'shapes and indices (the rest)'


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--export', required=True)
    parser.add_argument('--image', default=None,
                        help='An image, preprocessed by the export. Default: a random input '
                        'of --size.')
    parser.add_argument('--size', type=int, nargs=2, default=(256, 128), metavar=('W', 'H'))
    parser.add_argument('--runs', type=int, default=3, help='Profiled runs after one untimed.')
    parser.add_argument('--cpu_threads', type=int, default=1)
    return parser.parse_args()


def profile(deploy, batch, runs, threads):
    """{backend: ({op: ms per run}, wall ms per run)} over the runs after the first, for
    onnxruntime and Paddle Inference with oneDNN (as psanet.Segmenter creates it)."""
    import onnxruntime
    import paddle.profiler as profiler
    from psanet.deploy.predictor import PredictorOptions, create_predictor
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.enable_profiling = True
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(deploy.onnx, options,
                                           providers=['CPUExecutionProvider'])
    feed = {session.get_inputs()[0].name: batch}
    predictor = create_predictor(deploy, PredictorOptions(enable_mkldnn=True,
                                                          cpu_threads=threads))
    handle = predictor.get_input_handle(predictor.get_input_names()[0])
    handle.reshape(list(batch.shape))
    handle.copy_from_cpu(batch)
    session.run(None, feed)
    predictor.run()
    wall = collections.Counter()
    tracer = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU])
    tracer.start()
    for _ in range(runs):
        for backend, run in (('onnxruntime', lambda: session.run(None, feed)),
                             ('paddle', predictor.run)):
            start = time.perf_counter()
            run()
            wall[backend] += (time.perf_counter() - start) * 1000.0 / runs
        tracer.step()
    tracer.stop()
    tracer.export('paddle_profile.json', format='json')
    with open(session.end_profiling()) as f:
        events = json.load(f)
    first = min((e for e in events if e.get('name') == 'model_run'), key=lambda e: e['ts'])
    cut = first['ts'] + first['dur']
    ort = collections.Counter()
    for event in events:
        if event.get('cat') == 'Node' and event['name'].endswith('_kernel_time') and \
                event['ts'] >= cut:
            ort[event['args']['op_name']] += event['dur'] / 1000.0 / runs
    with open('paddle_profile.json') as f:
        events = json.load(f)
    events = events['traceEvents'] if isinstance(events, dict) else events
    pdi = collections.Counter()
    for event in events:
        if event.get('cat') == 'Operator' and 'dur' in event:
            # The exporter appends each event's duration to its name: "op[1.2 ms]".
            pdi[re.sub(r'\[.*\]$', '', event['name'])] += event['dur'] / 1000.0 / runs
    return {'onnxruntime': (ort, wall['onnxruntime']), 'paddle': (pdi, wall['paddle'])}


def _group(name, backend):
    for group, ort_types, paddle_ops in GROUPS:
        if name in (ort_types if backend == 'onnxruntime' else paddle_ops):
            return group
    return OTHER


def _print_ops(title, per_op):
    total = sum(per_op.values())
    print(f'\n{title}: {total:.1f} ms per run in operators')
    print('| op | ms per run | share |')
    print('|---|---|---|')
    for op, ms in per_op.most_common():
        if ms >= 0.005:
            print(f'| {op} | {ms:.2f} | {ms / total * 100:.1f}% |')


def main():
    args = parse_args()
    for name in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS'):
        os.environ[name] = str(args.cpu_threads)
    import numpy as np
    import paddle
    import onnxruntime
    from psanet.deploy.deploy_config import DeployConfig
    from psanet.deploy.processing import preprocess

    deploy = DeployConfig(args.export)
    if deploy.onnx is None:
        sys.exit(f'error: {args.export} has no model.onnx: export with --psa_impl paddle --onnx.')
    if args.image:
        batch = preprocess([args.image], deploy.build_transforms())[0]
    else:
        width, height = args.size
        batch = np.random.RandomState(0).uniform(-1, 1, (1, 3, height, width)).astype('float32')
    # Both profilers write files into the working folder: a temporary one.
    os.chdir(tempfile.mkdtemp(prefix='profile_cpu_backends_'))
    result = profile(deploy, batch, args.runs, args.cpu_threads)
    (ort, ort_wall), (pdi, pdi_wall) = result['onnxruntime'], result['paddle']

    print(f'{os.path.abspath(args.export)}, input {batch.shape[3]}x{batch.shape[2]}, '
          f'{args.cpu_threads} thread(s), {args.runs} profiled runs after one untimed; '
          f'onnxruntime {onnxruntime.__version__}, paddle {paddle.__version__}; load average '
          f'{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs')
    print(f'wall time per run: onnxruntime {ort_wall:.1f} ms, Paddle Inference oneDNN on '
          f'{pdi_wall:.1f} ms ({pdi_wall / ort_wall:.2f}x)')
    groups = [group for group, _, _ in GROUPS] + [OTHER]
    sums = {backend: collections.Counter() for backend in ('onnxruntime', 'paddle')}
    names = {backend: collections.defaultdict(list) for backend in sums}
    for backend, per_op in (('onnxruntime', ort), ('paddle', pdi)):
        for op, ms in per_op.most_common():
            group = _group(op, backend)
            sums[backend][group] += ms
            names[backend][group].append(op)
    print('\n| operators | onnxruntime ms | Paddle Inference ms | Paddle / onnxruntime | '
          'Paddle ops |')
    print('|---|---|---|---|---|')
    for group in groups + ['all']:
        a = sum(sums['onnxruntime'].values()) if group == 'all' else sums['onnxruntime'][group]
        b = sum(sums['paddle'].values()) if group == 'all' else sums['paddle'][group]
        ratio = f'{b / a:.2f}x' if a > 0 else '-'
        ops = ', '.join(op.split('.', 1)[-1] for op in names['paddle'][group][:4])
        print(f'| {group} | {a:.1f} | {b:.1f} | {ratio} | {ops} |')
    _print_ops('onnxruntime', ort)
    _print_ops('Paddle Inference, oneDNN on', pdi)


if __name__ == '__main__':
    main()
