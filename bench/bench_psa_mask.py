"""Speed of the PSA mask op at the Cityscapes shapes, side by side in one run, on CPU or GPU.

For each shape it times the custom op ('custom') and the pure-Paddle form
('paddle'), forward and backward, beside the memory-bound limit: on the CPU,
writing an output of the same size once with ``paddle.full``; on the GPU, a
device copy of the bytes the op must move (the window entries it reads plus all
of the output it writes: half of them read, half written). Prints a markdown
table of medians and ratios.

    python bench/bench_psa_mask.py [--device cpu|gpu] [--repeats 5] [--psa-type collect]
                                   [--budget-gib 20] [--threads N] [--impls custom paddle]
                                   [--backends] [--backends-only] [--smoke]

On the CPU, Paddle and the op run on ``--threads`` threads (default: all of
them), set as a training script would, with ``paddle.base.core.set_num_threads``.
On the GPU (paddlepaddle-gpu, the op library built with its CUDA kernels) each
call is timed between two ``paddle.device.synchronize()``. The GPU kernels alone,
without Paddle, against a copy and against the kernels they replace:
``tests/gpu/run_gpu_checks.py``.

A cell that would need more memory than the budget (or than the machine or GPU
has free), or whose single call would run past ``--max-seconds``, is skipped with
the reason printed under the table. ``--impls custom`` times the custom op
alone (a before/after comparison of the kernels needs no pure-Paddle cells).

On the CPU a second table times the backward kernel alone (float32, N=1, through
``psa_mask_cpu_backward_into``: no copy of grad_outputs, no fresh memory) against
its read+write limit: reading grad_out once (a Paddle sum) plus writing grad_x
once (a Paddle fill of a tensor as large), both on memory already touched.

``--backends`` adds a further table: the pure-Paddle form exported (N, H, W
dynamic) and run in Paddle Inference (oneDNN on, psanet's predictor settings),
onnxruntime and OpenVINO, beside the custom op in dygraph and the write limit, at
the R50 config's 59x59 mask on the maps of 512x256, 1024x512 and 2048x1024 inputs
(output stride 8, shrink factor 2). Each backend's output is checked against the
custom op's, exactly. The exported backends share their inputs and leave the
output where they wrote it (no copy in or out, as inside a model). A second
table, the floor, times in each backend one kernel writing the output: a map of
zeros of its shape, exported as the op is; no form of the op can beat it there.
``--backends-only`` prints those tables alone. ``--smoke`` runs them at the
smallest map only, one call per cell, and skips the first table: the CI check
that the bench runs.

``--branches`` (also part of ``--smoke``) prints the table alone of what an export runs of one
R50 PSA branch after its attention convolution (the op, the softmax over H*W, the product with
the 512-channel feature: ``PSABranch.attend``), exported twice and run side by side: ``before``,
the map as the op writes it (collect transposed over positions, the softmax over its second
axis), as exports ran it until 2026-12-05, and ``now``, the model's export form (the map never
transposed), with the custom op (Paddle Inference) and the pure-Paddle op (every backend), beside
the same work with the custom op in dygraph. Every output must agree with dygraph's.
``--model-size W H`` prints (after it, with ``--branches``) the whole model of ``--model-config``
(default: configs/psanet R50; random weights) at a WxH input, exported the same two ways
(``before``: its branches' ``attend`` replaced by the former form), in Paddle Inference (custom
op, oneDNN on), onnxruntime and OpenVINO; ``--smoke`` runs it on the mini config at 64x32.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# compat first: it filters Paddle's "No ccache found" warning before paddle is imported
# (psanet.compat.NO_CCACHE_NOTICE); psanet.ops does not import compat.
from psanet import compat  # noqa: E402,F401
from psanet.ops import (COLLECT, DISTRIBUTE, PSA_TYPES, load_library, psa_impl,  # noqa: E402
                        psa_mask, psa_mask_cpu_backward_into, psa_mask_cpu_threads)

import numpy as np  # noqa: E402
import paddle  # noqa: E402

# (mask size, feature H, feature W): the attention maps of a 1024x512 training
# crop (1/8, then shrunk by 2: 32x64, mask 59) and of a full 2048x1024 image
# at test time (64x128; 97 is the mask that covers most of it).
SHAPES = [(59, 32, 64), (97, 64, 128)]
BATCHES = [1, 8]
# (mask, feature H, feature W) of the backends table: configs/psanet R50's 59x59 mask on
# the maps of 512x256, 1024x512 and 2048x1024 inputs.
BACKEND_SHAPES = [(59, 16, 32), (59, 32, 64), (59, 64, 128)]
GIB = 1 << 30
_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs',
                        'psanet')
R50_CONFIG = os.path.join(_CONFIGS, 'psanet_resnet50_os8_cityscapes_1024x512_80k.yml')
MINI_CONFIG = os.path.join(_CONFIGS, 'psanet_resnet18_os8_mini_cityscapes_128x64_100.yml')


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--device', default='cpu', choices=['cpu', 'gpu'],
                        help='where the op runs; default cpu')
    parser.add_argument('--repeats', type=int, default=5,
                        help='timed calls per measurement (median); default 5')
    parser.add_argument('--psa-type', default='collect', choices=['collect', 'distribute'])
    parser.add_argument('--budget-gib', type=float, default=20.0,
                        help='skip cells whose estimated peak memory exceeds this')
    parser.add_argument('--max-seconds', type=float, default=60.0,
                        help='skip a measurement whose single call would take longer')
    parser.add_argument('--threads', type=int, default=os.cpu_count(),
                        help="Paddle's CPU threads, which the op follows; default: all")
    parser.add_argument('--impls', nargs='+', default=['custom', 'paddle'],
                        choices=['custom', 'paddle'], help='the forms timed; default: both')
    parser.add_argument('--backends', action='store_true',
                        help='also time the exported pure-Paddle form in every backend')
    parser.add_argument('--backends-only', action='store_true',
                        help='the backends table alone')
    parser.add_argument('--branches', action='store_true',
                        help="the branch table alone: a PSA branch's op, softmax and product "
                        'exported before and now, in every backend')
    parser.add_argument('--model-size', type=int, nargs=2, metavar=('W', 'H'), default=None,
                        help='the whole R50 model (random weights) at this input size, exported '
                        'before and now (after the branch table with --branches)')
    parser.add_argument('--model-config', default=R50_CONFIG,
                        help='the config of --model-size; default: the R50 config')
    parser.add_argument('--smoke', action='store_true',
                        help='the backends and branch tables and the CPU backward kernel at '
                        'the smallest map, one call per cell: the check CI runs')
    args = parser.parse_args()
    if args.smoke:
        args.backends, args.repeats = True, 1
        args.model_size, args.model_config = (64, 32), MINI_CONFIG
    return args


def available_bytes(device):
    if device == 'gpu':
        return paddle.device.cuda.get_device_properties().total_memory - \
            paddle.device.cuda.memory_allocated()
    try:
        with open('/proc/meminfo') as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def moved_elements(num, mask, height, width):
    """The window entries the forward reads plus the output it writes."""
    half = (mask - 1) // 2
    on_rows = sum(min(height, h + mask - half) - max(0, h - half) for h in range(height))
    on_columns = sum(min(width, w + mask - half) - max(0, w - half) for w in range(width))
    return num * on_rows * on_columns + num * (height * width) ** 2


def peak_bytes(impl, direction, num, mask, positions, width, moved):
    """Rough peak memory of one measurement (float32), from what it allocates."""
    x = 4 * num * mask * mask * positions
    y = 4 * num * positions * positions
    if impl == 'limit':
        return y
    if impl == 'copy':
        return 4 * moved
    # paddle.grad copies grad_outputs before running the grad op.
    backward = 2 * y + x if direction == 'backward' else 0
    if impl == 'custom':
        return x + y + backward
    # The pure-Paddle form: x transposed and padded (rows of mask values padded
    # to at most mask + 45), an int64 index of one entry per chunk of the output
    # (16 values, or 1 where W is odd), and for collect a transposed copy of y.
    chunk = max(c for c in (1, 2, 4, 8, 16) if width % c == 0)
    index = 8 * num * positions * positions // chunk
    return x + x * (mask + 45) // mask + 2 * y + index + backward


def time_calls(fn, repeats, max_seconds, sync=lambda: None):
    """Median seconds of fn() over repeats calls after one warm-up call, each
    between two sync() (the GPU's queue drained).

    A warm-up call slower than a tenth of max_seconds stands as the only sample.
    """
    def one_call():
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    first = one_call()
    if first > max_seconds / 10:
        return first, 1
    samples = [one_call() for _ in range(repeats)]
    return statistics.median(samples), repeats


def measure_cell(args, mask, height, width, num, notes, estimates):
    """Times of one table row, in seconds (None where skipped)."""
    positions = height * width
    moved = moved_elements(num, mask, height, width)
    budget = args.budget_gib * GIB
    free = available_bytes(args.device)
    if free is not None:
        budget = min(budget, 0.8 * free)
    label = f'{mask}x{mask} on {height}x{width}, N={num}'
    times = {}

    def run(key, impl, direction, fn):
        need = peak_bytes(impl, direction, num, mask, positions, width, moved)
        if need > budget:
            notes.append(f'{label}, {key}: skipped, needs about {need / GIB:.1f} GiB, '
                         f'budget {budget / GIB:.1f} GiB.')
            times[key] = None
            return
        guess = estimates.get((mask, key))
        if guess is not None and guess * num > args.max_seconds:
            notes.append(f'{label}, {key}: skipped, N=1 took {guess:.1f} s, so one call '
                         f'may take up to {guess * num:.0f} s > {args.max_seconds:.0f} s.')
            times[key] = None
            return
        seconds, repeats = time_calls(fn, args.repeats, args.max_seconds, sync)
        if repeats == 1:
            notes.append(f'{label}, {key}: one call of {seconds:.1f} s, not repeated.')
        if num == 1:
            estimates[(mask, key)] = seconds
        times[key] = seconds

    sync = paddle.device.synchronize if args.device == 'gpu' else (lambda: None)
    if args.device == 'gpu':
        source = paddle.zeros([max(1, moved // 2)], 'float32')
        run('limit', 'copy', 'forward', lambda: source.clone())
        del source
    else:
        shape = [num, positions, height, width]
        run('limit', 'limit', 'forward', lambda: paddle.full(shape, 0.0, 'float32'))
    x = paddle.randn([num, mask * mask, height, width], 'float32')
    x.stop_gradient = False
    for impl in ('custom', 'paddle'):
        if impl not in args.impls:
            times[f'{impl} fwd'] = times[f'{impl} bwd'] = None
            continue
        run(f'{impl} fwd', impl, 'forward',
            lambda: psa_mask(x, args.psa_type, mask, impl=impl))
        if times[f'{impl} fwd'] is None:
            notes.append(f'{label}, {impl} bwd: skipped with its forward.')
            times[f'{impl} bwd'] = None
            continue
        y = psa_mask(x, args.psa_type, mask, impl=impl)
        grad_y = paddle.randn(y.shape, 'float32')
        run(f'{impl} bwd', impl, 'backward',
            lambda: paddle.grad([y], [x], grad_outputs=[grad_y], retain_graph=True))
        y = grad_y = None  # freed before the next cell
    x = None
    return times


def fmt_ms(seconds):
    return '—' if seconds is None else f'{seconds * 1e3:.1f}'


def fmt_ratio(numerator, denominator):
    if numerator is None or denominator is None:
        return '—'
    return f'{numerator / denominator:.2f}'


def fmt_bytes(count):
    return f'{count / GIB:.2f} GiB' if count >= GIB else f'{count / (1 << 20):.0f} MiB'


def gpu_name():
    """The GPU Paddle runs on, or None (a CPU Paddle, no device)."""
    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() < 1:
        return None
    return paddle.device.cuda.get_device_name()


def backward_kernel_table(args):
    """The CPU backward kernel alone beside reading grad_out plus writing grad_x, N=1."""
    psa_type = COLLECT if args.psa_type == 'collect' else DISTRIBUTE
    print(f'\nThe CPU backward kernel alone ({args.psa_type}, float32, N=1, op threads '
          f'{psa_mask_cpu_threads()}), median ms of {args.repeats} calls after one\n')
    header = ['mask', 'map', 'grad_out + grad_x', 'read grad_out', 'write grad_x',
              'read+write limit', 'bwd kernel', 'bwd / limit']
    print('| ' + ' | '.join(header) + ' |')
    print('|' + '---|' * len(header))
    notes = []
    for mask, height, width in SHAPES[:1] if args.smoke else SHAPES:
        positions = height * width
        y_bytes, x_bytes = 4 * positions ** 2, 4 * mask * mask * positions
        free = available_bytes('cpu')
        budget = args.budget_gib * GIB if free is None else min(args.budget_gib * GIB, 0.8 * free)
        if 2 * (y_bytes + x_bytes) > budget:
            notes.append(f'{mask}x{mask} on {height}x{width}: skipped, needs about '
                         f'{2 * (y_bytes + x_bytes) / GIB:.1f} GiB, '
                         f'budget {budget / GIB:.1f} GiB.')
            continue
        grad_y = np.random.default_rng(0).standard_normal(
            (1, positions, height, width), dtype='float32')
        grad_x = np.empty((1, mask * mask, height, width), 'float32')
        grad_y_tensor = paddle.to_tensor(grad_y)
        fill = paddle.zeros(grad_x.shape, 'float32')
        read, _ = time_calls(lambda: grad_y_tensor.sum(), args.repeats, args.max_seconds)
        write, _ = time_calls(lambda: fill.fill_(0.0), args.repeats, args.max_seconds)
        kernel, _ = time_calls(
            lambda: psa_mask_cpu_backward_into(grad_y, grad_x, psa_type, mask, mask),
            args.repeats, args.max_seconds)
        row = [f'{mask}x{mask}', f'{height}x{width}', fmt_bytes(y_bytes + x_bytes),
               fmt_ms(read), fmt_ms(write), fmt_ms(read + write), fmt_ms(kernel),
               fmt_ratio(kernel, read + write)]
        print('| ' + ' | '.join(row) + ' |', flush=True)
        grad_y = grad_x = grad_y_tensor = fill = None  # freed before the next shape
    for note in notes:
        print('- ' + note)


class _PurePSAMask(paddle.nn.Layer):
    """The pure-Paddle op alone, for export. A parameter of 1 as a second output:
    Paddle 3.0.0's predictor needs a parameter file (psanet.compat.PARAMETERLESS_PROGRAM),
    and multiplying the map by it would add a pass over the output to every backend."""

    def __init__(self, psa_type, mask):
        super().__init__()
        self.psa_type, self.mask = psa_type, mask
        self.one = self.create_parameter(
            [1], default_initializer=paddle.nn.initializer.Constant(1.0))

    def forward(self, x):
        return psa_mask(x, self.psa_type, self.mask, impl='paddle'), self.one * 1.0


class _ZeroMap(paddle.nn.Layer):
    """A map of zeros of the op's output shape, for export: one kernel writing the output,
    the least any form of the op can cost in a backend (the floor table)."""

    def __init__(self):
        super().__init__()
        self.one = self.create_parameter(  # as _PurePSAMask's
            [1], default_initializer=paddle.nn.initializer.Constant(1.0))

    def forward(self, x):
        shape = paddle.shape(x)
        n, height, width = shape[0], shape[2], shape[3]
        return paddle.zeros(paddle.stack([n, height * width, height, width])), self.one * 1.0


def export_runners(args, layer, spec, folder, impl='paddle'):
    """{backend: bind} for ``layer`` exported into ``folder`` with the ``impl`` form of the op
    (the custom op: Paddle Inference alone). ``bind(*arrays)`` returns ``(call, output)``:
    ``call()`` runs the backend on the arrays, shared with it rather than copied in, and leaves
    the output where the backend wrote it, as a layer inside a model would (what is timed);
    ``output()`` copies the last call's first output out."""
    from paddle import inference

    from psanet.contract import PARAMS_FILE, PROGRAM_FILE
    from psanet.export import export_onnx
    prefix = os.path.join(folder, os.path.splitext(PROGRAM_FILE)[0])
    with psa_impl(impl):
        paddle.jit.save(paddle.jit.to_static(layer, input_spec=spec, full_graph=True), prefix)
    config = inference.Config(os.path.join(folder, PROGRAM_FILE),
                              os.path.join(folder, PARAMS_FILE))
    config.disable_gpu()
    config.disable_glog_info()
    config.set_cpu_math_library_num_threads(args.threads)
    config.enable_mkldnn()
    predictor = inference.create_predictor(compat.configure_inference(config))

    def paddle_inference(*arrays):
        tensors = [paddle.to_tensor(array) for array in arrays]
        handles = [predictor.get_input_handle(name) for name in predictor.get_input_names()]

        def call():
            for handle, tensor in zip(handles, tensors):
                handle.reshape(tensor.shape)
                handle.share_external_data(tensor)
            predictor.run()
        return call, predictor.get_output_handle(predictor.get_output_names()[0]).copy_to_cpu

    runners = {'Paddle Inference': paddle_inference}
    if impl != 'paddle':
        return runners
    try:
        import onnxruntime
        import openvino
    except ImportError as error:
        print(f'- {error.name} is not installed: its column is empty.')
        return runners
    onnx = export_onnx(folder)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = onnxruntime.InferenceSession(onnx, options, providers=['CPUExecutionProvider'])

    def onnx_runtime(*arrays):
        binding = session.io_binding()
        for node, array in zip(session.get_inputs(), arrays):
            binding.bind_cpu_input(node.name, np.ascontiguousarray(array))
        for node in session.get_outputs():
            binding.bind_output(node.name, 'cpu')
        return (lambda: session.run_with_iobinding(binding),
                lambda: binding.copy_outputs_to_cpu()[0])

    compiled = openvino.Core().compile_model(onnx, 'CPU', {
        'INFERENCE_NUM_THREADS': args.threads, 'PERFORMANCE_HINT': 'LATENCY',
        'INFERENCE_PRECISION_HINT': 'f32'})

    def open_vino(*arrays):
        request = compiled.create_infer_request()  # a fresh one takes any input shape
        arrays = [np.ascontiguousarray(array) for array in arrays]
        return (lambda: request.infer(arrays, share_inputs=True, share_outputs=True),
                lambda: np.array(request.get_output_tensor(0).data, copy=True))

    runners['onnxruntime'], runners['OpenVINO'] = onnx_runtime, open_vino
    return runners


def backends_table(args):
    """The pure-Paddle form in every backend beside the custom op (dygraph), one run; then the
    floor of each backend: a map of zeros of the output's shape."""
    import tempfile
    shapes = BACKEND_SHAPES[:1] if args.smoke else BACKEND_SHAPES
    names = ['dygraph', 'Paddle Inference', 'onnxruntime', 'OpenVINO']
    print(f'\nThe pure-Paddle form ({args.psa_type}, N=1, exported with N, H, W dynamic) by '
          f'backend, {args.threads} threads, median ms of {args.repeats} calls after one; '
          'ratio to the custom op in dygraph\n')
    header = ['mask', 'map', 'output', 'write limit', 'custom'] + \
        [f'{name} (ratio)' for name in names]
    print('| ' + ' | '.join(header) + ' |')
    print('|' + '---|' * len(header))
    runners, floors = {}, []
    for mask, height, width in shapes:
        if mask not in runners:
            spec = [paddle.static.InputSpec([None, mask * mask, None, None], 'float32', 'x')]
            runners[mask] = [export_runners(args, layer, spec,
                                            tempfile.mkdtemp(prefix='bench_psa_mask_'))
                             for layer in (_PurePSAMask(args.psa_type, mask), _ZeroMap())]
        rng = np.random.default_rng(0)
        x_np = rng.standard_normal((1, mask * mask, height, width)).astype('float32')
        x = paddle.to_tensor(x_np)
        positions = height * width
        limit, _ = time_calls(lambda: paddle.full([1, positions, height, width], 0.0, 'float32'),
                              args.repeats, args.max_seconds)
        custom, _ = time_calls(lambda: psa_mask(x, args.psa_type, mask), args.repeats,
                               args.max_seconds)
        expected = psa_mask(x, args.psa_type, mask).numpy()
        zeros = np.zeros_like(expected)
        op = {'dygraph': (lambda: psa_mask(x, args.psa_type, mask, impl='paddle'), None)}
        floor = {'dygraph': (lambda: paddle.zeros([1, positions, height, width]), None)}
        for name, bind in runners[mask][0].items():
            op[name] = bind(x_np)
        for name, bind in runners[mask][1].items():
            floor[name] = bind(x_np)
        output = fmt_bytes(4 * positions ** 2)
        row = [f'{mask}x{mask}', f'{height}x{width}', output, fmt_ms(limit), fmt_ms(custom)]
        floor_row = [f'{mask}x{mask}', f'{height}x{width}', output, fmt_ms(custom)]
        for name in names:
            for calls, want, cells, what in ((op, expected, row, 'the op'),
                                             (floor, zeros, floor_row, 'the zero map')):
                if name not in calls:
                    cells.append('—')
                    continue
                call, output_of = calls[name]
                got = call()
                got = got.numpy() if output_of is None else output_of()
                if not np.array_equal(got, want):
                    raise SystemExit(f'bench_psa_mask: {what} in {name} differs from the custom '
                                     f'op\'s at {height}x{width}, mask {mask}.')
                seconds, _ = time_calls(call, args.repeats, args.max_seconds)
                cells.append(f'{fmt_ms(seconds)} ({fmt_ratio(seconds, custom)})')
        print('| ' + ' | '.join(row) + ' |', flush=True)
        floors.append(floor_row)
    print('\nEvery backend\'s output equals the custom op\'s exactly. The exported backends '
          'share their inputs (no copy in) and leave the output where they wrote it (no copy '
          'out), as a layer inside a model does.')
    print('\nThe floor of each backend: one kernel writing the output, a map of zeros of its '
          'shape (exported as the op is), ms (ratio to the custom op in dygraph): no form of '
          'the op can be faster there\n')
    header = ['mask', 'map', 'output', 'custom'] + [f'{name} zeros (ratio)' for name in names]
    print('| ' + ' | '.join(header) + ' |')
    print('|' + '---|' * len(header))
    for floor_row in floors:
        print('| ' + ' | '.join(floor_row) + ' |')


BRANCH_CHANNELS = 512  # configs/psanet R50's psa_channels


class _BranchTail(paddle.nn.Layer):
    """A PSA branch after its attention convolution: (attention, feature) -> aggregated
    (:meth:`PSABranch.attend`); ``before``: :func:`_attend_before`, the form exports ran
    until 2026-12-05."""

    def __init__(self, psa_type, mask, before):
        super().__init__()
        from psanet.models.psanet import PSABranch
        self.branch = PSABranch(1, 1, psa_type, mask, mask, 1, 1.0, True, False)
        self.before = before
        self.one = self.create_parameter(  # as _PurePSAMask's
            [1], default_initializer=paddle.nn.initializer.Constant(1.0))

    def forward(self, attention, feature):
        attend = _attend_before(self.branch) if self.before else self.branch.attend
        return attend(feature, attention) * self.one


def branches_table(args):
    """One branch's op, softmax and product exported before and now, in every backend."""
    import tempfile
    shapes = BACKEND_SHAPES[:1] if args.smoke else BACKEND_SHAPES
    # (column, op form, backend): each exported before and now.
    groups = [('Paddle Inference, custom op', 'custom', 'Paddle Inference'),
              ('Paddle Inference, pure op', 'paddle', 'Paddle Inference'),
              ('onnxruntime', 'paddle', 'onnxruntime'), ('OpenVINO', 'paddle', 'OpenVINO')]
    print(f'\nA PSA branch after its attention convolution ({args.psa_type}, softmax, '
          f'{BRANCH_CHANNELS} channels, N=1, exported with N, H, W dynamic), {args.threads} '
          f'threads, median ms of {args.repeats} calls after one: the export before and now\n')
    header = ['mask', 'map', 'custom op: dygraph'] + [
        f'{column} {when}' for column, _, _ in groups for when in ('before', 'now', 'before / now')]
    print('| ' + ' | '.join(header) + ' |')
    print('|' + '---|' * len(header))
    psa_type = PSA_TYPES[args.psa_type]
    runners = {}
    for mask, height, width in shapes:
        if mask not in runners:
            spec = [paddle.static.InputSpec([None, mask * mask, None, None], 'float32', 'a'),
                    paddle.static.InputSpec([None, BRANCH_CHANNELS, None, None], 'float32',
                                            'x')]
            runners[mask] = {
                (impl, before): export_runners(args, _BranchTail(psa_type, mask, before), spec,
                                               tempfile.mkdtemp(prefix='bench_psa_branch_'), impl)
                for impl in ('custom', 'paddle') for before in (True, False)}
        rng = np.random.default_rng(0)
        arrays = (rng.standard_normal((1, mask * mask, height, width)).astype('float32'),
                  rng.standard_normal((1, BRANCH_CHANNELS, height, width)).astype('float32'))
        tensors = [paddle.to_tensor(a) for a in arrays]
        dygraph = _BranchTail(psa_type, mask, False)
        expected = dygraph(*tensors).numpy()
        # Each output is a mean of features (softmax weights): sums of H*W terms in any order.
        atol = 4 * np.finfo(np.float32).eps * np.sqrt(height * width) * np.abs(arrays[1]).max()

        def checked(column, bind):
            call, output = bind(*arrays)
            call()
            got = output()
            if not np.allclose(got, expected, rtol=0, atol=atol):
                raise SystemExit(f'bench_psa_mask: the branch exported for {column} differs '
                                 f'from dygraph by {np.abs(got - expected).max():.3g} (more than '
                                 f'{atol:.3g}) at {height}x{width}, mask {mask}.')
            return call

        row = [f'{mask}x{mask}', f'{height}x{width}',
               fmt_ms(time_calls(lambda: dygraph(*tensors), args.repeats, args.max_seconds)[0])]
        for column, impl, name in groups:
            if name not in runners[mask][impl, False]:
                row += ['—'] * 3
                continue
            seconds = [time_calls(checked(column, runners[mask][impl, before][name]),
                                  args.repeats, args.max_seconds)[0] for before in (True, False)]
            row += [fmt_ms(seconds[0]), fmt_ms(seconds[1]), fmt_ratio(*seconds)]
        print('| ' + ' | '.join(row) + ' |', flush=True)
    print('\nEvery output agrees with dygraph\'s within 4 eps sqrt(H*W) of the largest feature.')


def _attend_before(branch):
    """``branch.attend`` as exports ran it until 2026-12-05 (see _BranchTail)."""
    from psanet.models.psanet import aggregate

    def attend(x, attention):
        return aggregate(x, branch.normalize(branch.psa_mask(attention)))
    return attend


def model_table(args):
    """The whole model of --model-config at --model-size, exported before and now."""
    import tempfile

    from psanet.core.config import ComponentBuilder, load_config
    from psanet.deploy.backends import create_runner, installed
    from psanet.deploy.deploy_config import DeployConfig
    from psanet.deploy.predictor import PaddleRunner, PredictorOptions
    from psanet.export import ExportOptions, export_model
    from psanet.models.psanet import PSABranch
    cfg = load_config(args.model_config, opts=['model.backbone.pretrained=None'])
    width, height = args.model_size
    x = np.random.default_rng(0).standard_normal((1, 3, height, width)).astype('float32')
    options = PredictorOptions(cpu_threads=args.threads, enable_mkldnn=True)
    onnx = all(installed(b) for b in ('onnxruntime', 'openvino'))
    runs = {}
    for form in ('before', 'now'):
        paddle.seed(0)
        model = ComponentBuilder(cfg).model
        model.eval()
        if form == 'before':
            for layer in model.sublayers():
                if isinstance(layer, PSABranch):
                    layer.attend = _attend_before(layer)
        folders = {impl: tempfile.mkdtemp(prefix=f'bench_psa_model_{form}_{impl}_')
                   for impl in ('custom', 'paddle')}
        for impl, folder in folders.items():
            export_model(model, cfg.dic['val_dataset']['transforms'], folder, ExportOptions(
                output_op='none', psa_impl=impl, onnx=onnx and impl == 'paddle'))
        runs['Paddle Inference, custom op, oneDNN on', form] = PaddleRunner(
            DeployConfig(folders['custom']), options).run
        for backend in ('onnxruntime', 'openvino') if onnx else ():
            runs[backend, form] = create_runner(DeployConfig(folders['paddle']), backend,
                                                options).run
        if form == 'now':
            with paddle.no_grad():
                expected = model(paddle.to_tensor(x))[0].numpy()
    print(f'\nPSANet of {os.path.basename(args.model_config)} (random weights), one {width}x'
          f'{height} image, {args.threads} threads, median ms of {args.repeats} calls after one: '
          'exported before and now\n')
    print('| backend | before | now | before / now |\n|---|---|---|---|')
    scale = np.abs(expected).max()
    for name in dict.fromkeys(key[0] for key in runs):
        seconds = []
        for form in ('before', 'now'):
            got = runs[name, form](x)
            if np.abs(got - expected).max() > 1e-3 * scale:
                raise SystemExit(f'bench_psa_mask: the model exported {form} differs in {name} '
                                 f'from dygraph by {np.abs(got - expected).max():.3g}.')
            seconds.append(time_calls(lambda run=runs[name, form]: run(x), args.repeats,
                                      args.max_seconds * 10)[0])
        print(f'| {name} | {fmt_ms(seconds[0])} | {fmt_ms(seconds[1])} | '
              f'{fmt_ratio(*seconds)} |', flush=True)
    print('\nEvery output within 1e-3 of the largest logit of dygraph\'s.')


def main():
    args = parse_args()
    if args.device == 'gpu' and gpu_name() is None:
        build = 'sees none' if paddle.is_compiled_with_cuda() else 'is a CPU build'
        sys.exit(f'bench_psa_mask.py: --device gpu needs paddlepaddle-gpu and a CUDA device; '
                 f'this Paddle {build} (the kernels alone, without Paddle: python '
                 'tests/gpu/run_gpu_checks.py).')
    library = load_library()
    paddle.set_device(args.device)
    if args.device == 'gpu':
        where, limit = gpu_name(), 'copy limit'
    else:
        paddle.base.core.set_num_threads(args.threads)
        where = f'CPU, {os.cpu_count()} CPUs, op threads {psa_mask_cpu_threads()}'
        limit = 'write limit'
    if (args.branches or args.model_size) and not args.smoke:
        if args.branches:
            branches_table(args)
        if args.model_size:
            model_table(args)
        return
    if args.smoke or args.backends_only:
        backends_table(args)
        if args.smoke and args.device == 'cpu':
            branches_table(args)
            model_table(args)
            backward_kernel_table(args)
        return
    print(f'psa_mask on {where}, {args.psa_type}, float32: paddle {paddle.__version__}, median '
          f'of {args.repeats} calls after one warm-up (ms); op library {library}\n')
    header = ['mask', 'map', 'N', 'output', limit, 'custom fwd', 'fwd / limit',
              'paddle fwd', 'paddle / custom fwd', 'custom bwd', 'paddle bwd',
              'paddle / custom bwd']
    print('| ' + ' | '.join(header) + ' |')
    print('|' + '---|' * len(header))
    notes, estimates = [], {}
    for mask, height, width in SHAPES:
        for num in BATCHES:
            t = measure_cell(args, mask, height, width, num, notes, estimates)
            output = 4 * num * (height * width) ** 2
            row = [f'{mask}x{mask}', f'{height}x{width}', str(num), fmt_bytes(output),
                   fmt_ms(t['limit']), fmt_ms(t['custom fwd']),
                   fmt_ratio(t['custom fwd'], t['limit']), fmt_ms(t['paddle fwd']),
                   fmt_ratio(t['paddle fwd'], t['custom fwd']), fmt_ms(t['custom bwd']),
                   fmt_ms(t['paddle bwd']), fmt_ratio(t['paddle bwd'], t['custom bwd'])]
            print('| ' + ' | '.join(row) + ' |', flush=True)
    if args.device == 'gpu':
        print('\ncopy limit: a device copy of half the elements the op moves (the window '
              'entries read plus the output written), fresh memory each call as for the op.')
    else:
        print('\nwrite limit: paddle.full of the output, fresh memory each call as for the op.')
    print('bwd: paddle.grad of the output w.r.t. x (includes its copy of grad_outputs).')
    for note in notes:
        print('- ' + note)
    if args.device == 'cpu':
        backward_kernel_table(args)
    if args.backends:
        backends_table(args)


if __name__ == '__main__':
    main()
