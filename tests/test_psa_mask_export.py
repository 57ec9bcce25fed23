"""PSA mask op in exported models: jit.save/jit.load, the Paddle Inference predictor,
and the pure-Paddle op in onnxruntime and OpenVINO.

The expected values are the dygraph outputs of the same layer (whose op is
checked against a numpy loop in test_psa_mask.py), or for the op alone the numpy
loop itself, exactly.
"""
import contextlib
import json
import os
import sys
import textwrap

import numpy as np
import paddle
import pytest

from conftest import ROOT, assert_logits_agree, needs_onnx, reordered_sum_rtol, run_process
from predictor_helpers import cpu_config, create, predict, run_once
from psa_mask_reference import reference_forward
from psanet import compat
from psanet.models.psanet import PSABranch
from psanet.ops import load_library, psa_impl, psa_mask

CHANNELS = 4
# Two sizes, one smaller than the 7x7 window, to exercise the dynamic H and W.
INPUT_SHAPES = [(1, CHANNELS, 5, 6), (2, CHANNELS, 8, 3)]
# The op only copies; the convolutions and bmm around it are sums that a static
# program, oneDNN or another instruction set may add in another order. The longest
# is the 3x3 convolution over 4 channels (the bmm sums over H*W <= 30): see conftest.
RTOL = reordered_sum_rtol(3 * 3 * CHANNELS)  # 2.9e-6 of the largest output


class AttentionBlock(paddle.nn.Layer):
    """Convs predict collect (7x7) and distribute (4x5) masks that attend over x."""

    def __init__(self, impl=None):
        super().__init__()
        # 49 channels: oneDNN stores the conv output in a blocked layout.
        self.collect = paddle.nn.Conv2D(CHANNELS, 7 * 7, 1)
        self.distribute = paddle.nn.Conv2D(CHANNELS, 4 * 5, 3, padding=1)
        self.impl = impl

    def forward(self, x):
        feature = x.reshape([0, 0, -1])
        collect = psa_mask(self.collect(x), 'collect', 7, impl=self.impl)
        distribute = psa_mask(self.distribute(x), 'distribute', (4, 5), impl=self.impl)
        out = paddle.bmm(feature, collect.reshape([0, 0, -1])) + \
            paddle.bmm(feature, distribute.reshape([0, 0, -1]))
        return paddle.nn.functional.relu(paddle.reshape(out, paddle.shape(x))) + x


class RawPSAMask(paddle.nn.Layer):
    """psa_mask straight on the input, channels left dynamic: errors reach the kernel.
    Times a parameter of 1: Paddle 3.0.0's predictor needs a parameter file
    (psanet.compat.PARAMETERLESS_PROGRAM)."""

    def __init__(self):
        super().__init__()
        self.one = self.create_parameter(
            [1], default_initializer=paddle.nn.initializer.Constant(1.0))

    def forward(self, x):
        return psa_mask(x, 'distribute', 3, impl='custom') * self.one


def save(layer, path, channels=CHANNELS):
    spec = [paddle.static.InputSpec([None, channels, None, None], 'float32', 'x')]
    paddle.jit.save(paddle.jit.to_static(layer, input_spec=spec, full_graph=True), path)
    return path


def inputs():
    rng = np.random.default_rng(0)
    return [rng.standard_normal(shape).astype('float32') for shape in INPUT_SHAPES]


def run_predictor(path, x, onednn, placement=True):
    """Output of a CPU predictor; placement=False drops oneDNN's op placement pass
    (psanet.deploy does, for Paddle's bilinear_interp bug), leaving the fused
    convolutions in oneDNN."""
    return predict(cpu_config(path, onednn, placement=placement), x)


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
    """The layer (custom op) and its dygraph outputs, saved once with each impl."""
    load_library()
    folder = tmp_path_factory.mktemp('psa_mask_export')
    paddle.seed(0)
    layer = AttentionBlock()
    layer.eval()
    expected = [layer(paddle.to_tensor(x)).numpy() for x in inputs()]
    # A layer per export: to_static caches its traced program on the layer.
    twin = AttentionBlock()
    twin.set_state_dict(layer.state_dict())
    twin.eval()
    custom = save(layer, str(folder / 'custom' / 'model'))
    with psa_impl('paddle'):
        pure = save(twin, str(folder / 'paddle' / 'model'))
    raw = save(RawPSAMask(), str(folder / 'raw' / 'model'), channels=None)
    return {'folder': folder, 'custom': custom, 'paddle': pure, 'raw': raw,
            'expected': expected}


def test_saved_graphs_hold_the_op_only_with_custom_impl(exported):
    with open(exported['custom'] + '.json') as f:
        assert 'psa_mask' in f.read()
    with open(exported['paddle'] + '.json') as f:
        assert 'psa_mask' not in f.read()


@pytest.mark.parametrize('impl', ['custom', 'paddle'])
def test_jit_load_matches_dygraph_at_two_sizes(exported, impl):
    loaded = paddle.jit.load(exported[impl])
    for x, expected in zip(inputs(), exported['expected']):
        assert_logits_agree(loaded(paddle.to_tensor(x)).numpy(), expected, RTOL,
                            f'jit.load {impl} {x.shape}')


def test_predictor_without_onednn_matches_dygraph(exported):
    for x, expected in zip(inputs(), exported['expected']):
        assert_logits_agree(run_predictor(exported['custom'], x, onednn=False), expected,
                            RTOL, f'predictor {x.shape}')


@pytest.mark.parametrize('placement', [True, False])
def test_predictor_with_onednn_matches_dygraph(exported, placement):
    # The predictor hands the op its input in oneDNN's blocked layout; the op
    # reorders it. Read as plain NCHW it would give a wrong answer, not an error.
    for x, expected in zip(inputs(), exported['expected']):
        output = run_predictor(exported['custom'], x, onednn=True, placement=placement)
        assert_logits_agree(output, expected, RTOL, f'oneDNN predictor {x.shape}')


@pytest.mark.parametrize('onednn', [False, True])
def test_predictor_reports_kernel_errors_with_their_message(exported, onednn):
    bad = np.zeros((1, 8, 4, 4), 'float32')
    with pytest.raises(Exception, match='9 channels, got 8'):
        run_predictor(exported['raw'], bad, onednn=onednn)


def test_pure_paddle_export_needs_no_op_library(exported):
    # A fresh process that never imports psanet: the pure-Paddle graph runs and
    # gives the dygraph result; the custom graph fails loudly, not silently.
    folder = exported['folder']
    for k, x in enumerate(inputs()):
        np.save(folder / f'x{k}.npy', x)
    script = textwrap.dedent(f'''
        import json, sys
        import numpy as np
        sys.path.insert(0, r'{os.path.join(ROOT, 'tests')}')
        from predictor_helpers import cpu_config, create, predict, run_once

        def run(path, x):
            return predict(cpu_config(path, onednn=False), x)

        for k in range({len(INPUT_SHAPES)}):
            np.save(r'{folder}/pure{{}}.npy'.format(k), run(r'{exported['paddle']}',
                    np.load(r'{folder}/x{{}}.npy'.format(k))))
        try:
            run(r'{exported['custom']}', np.load(r'{folder}/x0.npy'))
            custom = 'ran'
        except Exception as error:
            custom = type(error).__name__
        assert 'psanet' not in sys.modules
        print(json.dumps({{'custom': custom}}))
    ''')
    result = run_process([sys.executable, '-c', script], capture_output=True, text=True,
                         env=dict(os.environ, GLOG_minloglevel='2'), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])['custom'] != 'ran'
    for k, expected in enumerate(exported['expected']):
        assert_logits_agree(np.load(folder / f'pure{k}.npy'), expected, RTOL,
                            f'pure-Paddle predictor {INPUT_SHAPES[k]}')


# The pure-Paddle op alone, exported with N, H and W dynamic: a 4x5 mask (even height)
# on maps smaller and larger than it, widths that move 16, 4 and 1 values per gather
# index (the chunk is the largest power of two up to 16 dividing W), and a batch of 2.
PURE_MASK = (4, 5)
PURE_SHAPES = [(1, 3, 4), (2, 6, 16), (1, 5, 12), (1, 7, 7), (1, 2, 32)]


class PurePSAMasks(paddle.nn.Layer):
    """Collect and distribute of the input with the pure-Paddle op, side by side
    along the channels; times a parameter of 1 (Paddle 3.0.0's predictor needs a
    parameter file, psanet.compat.PARAMETERLESS_PROGRAM)."""

    def __init__(self):
        super().__init__()
        self.one = self.create_parameter(
            [1], default_initializer=paddle.nn.initializer.Constant(1.0))

    def forward(self, x):
        return paddle.concat([psa_mask(x, psa_type, PURE_MASK, impl='paddle')
                              for psa_type in ('collect', 'distribute')], axis=1) * self.one


def pure_expected(x):
    return np.concatenate([reference_forward(x, psa_type, *PURE_MASK)
                           for psa_type in ('collect', 'distribute')], axis=1)


def pure_inputs():
    rng = np.random.default_rng(1)
    cells = PURE_MASK[0] * PURE_MASK[1]
    return [rng.standard_normal((n, cells, h, w)).astype('float32') for n, h, w in PURE_SHAPES]


@pytest.fixture(scope='module')
def pure_export(tmp_path_factory):
    folder = tmp_path_factory.mktemp('pure_psa_mask')
    save(PurePSAMasks(), str(folder / 'model'), channels=PURE_MASK[0] * PURE_MASK[1])
    return folder


@pytest.mark.parametrize('onednn', [False, True])
def test_pure_op_in_paddle_inference_is_exact(pure_export, onednn):
    # psanet's own predictor settings (compat.configure_inference): with oneDNN its
    # integer index math and its pad must survive the oneDNN passes (compat 3, 25).
    predictor = create(compat.configure_inference(cpu_config(str(pure_export / 'model'),
                                                             onednn=onednn)))
    for x in pure_inputs():
        np.testing.assert_array_equal(run_once(predictor, x), pure_expected(x),
                                      err_msg=str(x.shape))


@needs_onnx
def test_pure_op_in_onnxruntime_and_openvino_is_exact(pure_export):
    import onnxruntime

    from psanet.export import export_onnx
    path = export_onnx(str(pure_export))
    session = onnxruntime.InferenceSession(path, providers=['CPUExecutionProvider'])
    runs = {'onnxruntime': lambda x: session.run(None, {session.get_inputs()[0].name: x})[0]}
    try:
        import openvino
    except ImportError:
        openvino = None
    if openvino is not None:
        core = openvino.Core()
        compiled = core.compile_model(core.read_model(path), 'CPU',
                                      {'INFERENCE_PRECISION_HINT': 'f32'})
        runs['openvino'] = lambda x: np.array(compiled.create_infer_request().infer([x])[0])
    for name, run in runs.items():
        for x in pure_inputs():
            np.testing.assert_array_equal(run(x), pure_expected(x),
                                          err_msg=f'{name} {x.shape}')


class TwoBranches(paddle.nn.Layer):
    """PSANet's collect and distribute branches (softmax on, 5x3 windows) side by side."""

    def __init__(self):
        super().__init__()
        self.branches = paddle.nn.LayerList(
            [PSABranch(CHANNELS, 6, psa_type, 5, 3, 1, normalization_factor=1.0,
                       psa_softmax=True, compact=False) for psa_type in (0, 1)])

    def forward(self, x):
        return paddle.concat([branch(x) for branch in self.branches], axis=1)


@pytest.fixture(scope='module')
def branch_export(tmp_path_factory):
    """Exported with the pure op, the branches never transpose their maps
    (PSABranch._aggregate_exported); dygraph runs the op and softmax as written, which
    tests/test_psanet_model.py holds against numpy."""
    paddle.seed(2)
    layer = TwoBranches()
    layer.eval()
    expected = [layer(paddle.to_tensor(x)).numpy() for x in inputs()]
    twin = TwoBranches()
    twin.set_state_dict(layer.state_dict())
    twin.eval()
    folder = tmp_path_factory.mktemp('psa_branches')
    with psa_impl('paddle'):
        save(twin, str(folder / 'model'))
    return folder, expected


def assert_branches_agree(got, expected, what):
    # The sums: a 1x1 convolution over CHANNELS, BN, the aggregation over H*W <= 30.
    atol = reordered_sum_rtol(30) * np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=atol, err_msg=what)


@pytest.mark.parametrize('onednn', [False, True])
def test_exported_branches_in_paddle_inference_match_dygraph(branch_export, onednn):
    folder, expected = branch_export
    predictor = create(compat.configure_inference(cpu_config(str(folder / 'model'), onednn)))
    for x, want in zip(inputs(), expected):
        assert_branches_agree(run_once(predictor, x), want, f'oneDNN {onednn} {x.shape}')


@needs_onnx
def test_exported_branches_in_onnxruntime_and_openvino_match_dygraph(branch_export):
    import onnxruntime

    from psanet.export import export_onnx
    folder, expected = branch_export
    path = export_onnx(str(folder))
    session = onnxruntime.InferenceSession(path, providers=['CPUExecutionProvider'])
    runs = {'onnxruntime': lambda x: session.run(None, {session.get_inputs()[0].name: x})[0]}
    with contextlib.suppress(ImportError):
        import openvino
        compiled = openvino.Core().compile_model(path, 'CPU', {'INFERENCE_PRECISION_HINT': 'f32'})
        runs['openvino'] = lambda x: np.array(compiled.create_infer_request().infer([x])[0])
    for name, run in runs.items():
        for x, want in zip(inputs(), expected):
            assert_branches_agree(run(x), want, f'{name} {x.shape}')
