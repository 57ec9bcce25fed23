"""psanet.compat: each fix against an independent computation, and each record's gate against
what this Paddle does (tests/test_compat_records.py checks the records themselves)."""
import ast
import dataclasses
import os
import re
import subprocess
import sys

import numpy as np
import paddle
import pytest
from paddleseg.models.losses import CrossEntropyLoss
from paddleseg.utils import metrics

from conftest import ROOT, autocast_state, run_process
from predictor_helpers import cpu_config, predict
import psanet.models  # noqa: F401  (applies the paddleseg fixes, as a config build does)
from psanet import amd_cpu_with_avx2, compat, mkl_avx2_on_amd

IGNORE = 255
EPS = 1e-8  # CrossEntropyLoss.EPS, in the denominator


def _logits_and_labels(seed, num_classes=4, shape=(2, 5, 7)):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(shape[0], num_classes) + shape[1:]).astype('float32')
    labels = rng.integers(0, num_classes, size=shape).astype('int64')
    labels[rng.random(shape) < 0.2] = IGNORE
    return logits, labels


def _numpy_cross_entropy(logits, labels, weight=None, top_k=1.0, avg_non_ignore=True,
                         pixel_weight=None):
    """paddleseg's CrossEntropyLoss in float64 numpy: l = w[y] * -log softmax(x)[y] per
    pixel (0 where ignored), times the pixel's weight; with top_k < 1 the mean of the k
    largest l over the mean w[y] of their pixels; else the mean l over the mean w[y] of the
    counted pixels (the scored ones, or with avg_non_ignore False all, an ignored pixel
    counting with class 0's weight)."""
    num_classes = logits.shape[1]
    weight = np.ones(num_classes) if weight is None else np.asarray(weight, np.float64)
    x = np.moveaxis(logits.astype(np.float64), 1, -1).reshape(-1, num_classes)
    y = labels.reshape(-1)
    scored = y != IGNORE
    y = np.where(scored, y, 0)
    log_prob = x - x.max(1, keepdims=True)
    log_prob -= np.log(np.exp(log_prob).sum(1, keepdims=True))
    pixel_loss = np.where(scored, -weight[y] * log_prob[np.arange(len(y)), y], 0.0)
    if pixel_weight is not None:
        pixel_loss = pixel_loss * pixel_weight.reshape(-1)
    if top_k < 1.0:
        hardest = np.argsort(-pixel_loss, kind='stable')[:int(top_k * len(y))]
        return pixel_loss[hardest].mean() / (weight[y][hardest].mean() + EPS)
    counted = scored if avg_non_ignore else np.ones_like(scored)
    return pixel_loss.mean() / ((counted * weight[y]).mean() + EPS)


@pytest.mark.parametrize('weight', [None, [0.5, 1.0, 2.0, 1.5]])
@pytest.mark.parametrize('top_k', [1.0, 0.3])
@pytest.mark.parametrize('avg_non_ignore', [True, False])
def test_cross_entropy_matches_numpy(weight, top_k, avg_non_ignore):
    logits, labels = _logits_and_labels(seed=1)
    loss = CrossEntropyLoss(weight=weight, ignore_index=IGNORE, top_k_percent_pixels=top_k,
                            avg_non_ignore=avg_non_ignore)
    # 70 pixels, 21 of them the top 30%: fewer than the ~56 scored ones, so the top ones are
    # scored, their losses apart, and the ranking the same in float32 and float64.
    got = loss(paddle.to_tensor(logits), paddle.to_tensor(labels))
    # float32 log-softmax of 4 classes and a mean over ~56 pixels against float64: about
    # sqrt(56) eps32 = 1e-6 relative in any order of the sums; 1e-5 leaves a margin.
    np.testing.assert_allclose(float(got), _numpy_cross_entropy(
        logits, labels, weight, top_k, avg_non_ignore), rtol=1e-5)


def test_cross_entropy_with_pixel_weights_matches_numpy():
    logits, labels = _logits_and_labels(seed=5)
    pixel_weight = np.random.default_rng(6).uniform(0.5, 2, labels.shape).astype('float32')
    got = CrossEntropyLoss(weight=[0.5, 1.0, 2.0, 1.5])(
        paddle.to_tensor(logits), paddle.to_tensor(labels), paddle.to_tensor(pixel_weight))
    np.testing.assert_allclose(float(got), _numpy_cross_entropy(
        logits, labels, [0.5, 1.0, 2.0, 1.5], pixel_weight=pixel_weight), rtol=1e-5)


def test_cross_entropy_gradient_matches_finite_differences():
    logits, labels = _logits_and_labels(seed=2, shape=(1, 3, 3))
    weight = [0.5, 1.0, 2.0, 1.5]
    x = paddle.to_tensor(logits, stop_gradient=False)
    CrossEntropyLoss(weight=weight)(x, paddle.to_tensor(labels)).backward()
    step = 1e-3
    numeric = np.zeros_like(logits, dtype=np.float64)
    for index in np.ndindex(*logits.shape):
        plus, minus = logits.astype(np.float64), logits.astype(np.float64)
        plus[index] += step
        minus[index] -= step
        numeric[index] = (_numpy_cross_entropy(plus, labels, weight) -
                          _numpy_cross_entropy(minus, labels, weight)) / (2 * step)
    # Central differences with step 1e-3 are off by step**2 / 6 * |f'''| < 1e-7 here,
    # the float32 gradient (up to 0.17) by ~1e-8: 1e-4 is far above both, and far below
    # a wrong gradient (the unweighted one is off by 0.08).
    np.testing.assert_allclose(x.grad.numpy(), numeric, atol=1e-4)


def _raises(call):
    try:
        call()
    except (TypeError, ValueError):
        return True
    return False


def test_paddleseg_cross_entropy_is_still_broken_on_this_paddle():
    """If paddleseg or Paddle fixes it, this fails: set the record's ``fixed`` release."""
    key = (CrossEntropyLoss, '_post_process_loss')
    original = compat.ORIGINALS.get(key, CrossEntropyLoss._post_process_loss)
    logits, labels = _logits_and_labels(seed=4)
    x = paddle.transpose(paddle.to_tensor(logits), [0, 2, 3, 1])
    label = paddle.to_tensor(labels)
    for weight in (None, [1.0, 2.0, 1.0, 1.0]):
        loss = CrossEntropyLoss(weight=weight)
        pixel_losses = paddle.nn.functional.cross_entropy(
            x, label, ignore_index=IGNORE, reduction='none', weight=loss.weight)
        broken = _raises(lambda: original(loss, x, label, None, pixel_losses))
        assert broken == compat.PADDLESEG_CROSS_ENTROPY.needed(), weight
    assert bool(compat.FIXES) == compat.PADDLESEG_CROSS_ENTROPY.needed()


def test_paddleseg_calculate_area_is_still_broken_where_its_record_says():
    """psanet.core.metrics counts the areas itself: when this fails, paddleseg's works again
    and the record can go."""
    labels = _logits_and_labels(seed=4)[1][:, None]
    broken = _raises(lambda: metrics.calculate_area(paddle.to_tensor(labels % 4),
                                                    paddle.to_tensor(labels), 4))
    assert broken == compat.PADDLESEG_CALCULATE_AREA.needed()


# ---------------------------------------------------------------------------
# The Paddle workarounds: version checks, configure_inference, the op build names
# ---------------------------------------------------------------------------

def _gate(**gate):
    return dataclasses.replace(compat.MEMORY_OPTIM, **gate)


def test_version_checks_cover_first_to_fixed():
    workaround = _gate(first=(3, 0), fixed=(3, 4))
    assert [workaround.needed(v) for v in [(2, 6, 2), (3, 0, 0), (3, 3, 1), (3, 4, 0)]] == \
        [False, True, True, False]
    assert _gate(first=(3, 0)).needed((9, 9))
    paddleseg_fix = _gate(first=(2, 6), paddleseg=(2, 8, 0))
    assert paddleseg_fix.needed((3, 3, 1), (2, 8, 0))
    assert not paddleseg_fix.needed((3, 3, 1), (2, 9, 0))
    assert not paddleseg_fix.needed((2, 5, 2), (2, 8, 0))
    # The release a record names as fixed no longer needs it, however it is written.
    for fixed in ((3, 4), (3, 4, 0)):
        record = _gate(first=(3, 0), fixed=fixed)
        assert not record.needed((3, 4)) and not record.needed((3, 4, 0))
        assert record.needed((3, 3, 9))
    # A record without a gate is done on every release.
    assert _gate(first=None).needed((2, 0)) and _gate(first=None).needed((9, 9))
    # A develop build reports 0.0.0 and is newer than any release.
    assert compat.parse_version('0.0.0') > compat.parse_version('3.3.1') == (3, 3, 1)
    assert compat.parse_version('3.0.0rc1') == (3, 0, 0)


@pytest.mark.parametrize('record', [r for r in compat.WORKAROUNDS if r.measured],
                         ids=lambda record: record.name)
def test_each_gate_says_what_was_measured_on_the_releases_it_names(record):
    """Read on the measured releases, not only on the installed one: a gate set a release
    early or late (fixed=(3, 2) for FREE_GPU_MEMORY) passes the test of this Paddle, not
    this one."""
    assert {release: record.needed(release) for release, _ in record.measured} == \
        dict(record.measured), record


def test_the_elastic_launcher_still_ends_on_its_own_failure_where_its_record_says():
    """ELASTIC_OWN_FAILURE: Paddle's launcher marks its own pod's failure FAILED (a done
    state), and its wait for peers stops in a done state, so only an etcd event makes it
    restart: once Paddle changes either, the record needs its ``fixed`` release."""
    import inspect
    from paddle.distributed.launch.controllers.controller import ControllerBase
    from paddle.distributed.launch.controllers.master import ETCDMaster
    from paddle.distributed.launch.context.status import Status
    marks_failed = 'self.ctx.status.fail()' in inspect.getsource(ControllerBase.watch)
    stops_when_done = 'is_done()' in inspect.getsource(ETCDMaster.wait_peer_ready)
    status = Status()
    status.fail()
    assert (marks_failed and stops_when_done and status.is_done()) == \
        compat.ELASTIC_OWN_FAILURE.needed()


def test_psanet_launch_makes_its_own_failure_a_restart(tmp_path):
    # In a fresh interpreter: the change is to Paddle's class, for the launcher's process.
    code = ('from psanet.launch import restart_own_failure\n'
            'from paddle.distributed.launch.context.status import Status\n'
            'restart_own_failure()\n'
            'status = Status()\n'
            'status.fail()\n'
            'assert status.is_restarting() and not status.is_done(), status._current_status')
    result = run_process([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


class _ConvInterp(paddle.nn.Layer):
    """A convolution and a bilinear upsampling with align_corners, as PaddleSeg's heads:
    what trips both inference bugs."""

    def __init__(self):
        super().__init__()
        self.conv = paddle.nn.Conv2D(3, 4, 3, padding=1)

    def forward(self, x):
        return paddle.nn.functional.interpolate(
            self.conv(x), size=[x.shape[2] * 2, x.shape[3] * 2], mode='bilinear',
            align_corners=True)


@pytest.fixture(scope='module')
def conv_interp(tmp_path_factory):
    """(path prefix, input, dygraph output) of _ConvInterp saved for inference."""
    paddle.seed(0)
    layer = _ConvInterp()
    layer.eval()
    x = np.random.default_rng(5).standard_normal((1, 3, 8, 8)).astype('float32')
    expected = layer(paddle.to_tensor(x)).numpy()
    path = str(tmp_path_factory.mktemp('conv_interp') / 'model')
    spec = [paddle.static.InputSpec([None, 3, None, None], 'float32', 'x')]
    paddle.jit.save(paddle.jit.to_static(layer, input_spec=spec, full_graph=True), path)
    return path, x, expected


@pytest.mark.parametrize('onednn', [False, True])
def test_configure_inference_makes_the_predictor_run(conv_interp, onednn):
    path, x, expected = conv_interp
    config = cpu_config(path, onednn)
    assert compat.configure_inference(config) is config
    # A 3x3 convolution over 3 channels, then a 4-tap interpolation: sums of 27 and 4
    # terms that oneDNN may add in another order, a few eps32 of the largest output.
    np.testing.assert_allclose(predict(config, x), expected, rtol=0,
                               atol=1e-5 * np.abs(expected).max())


def test_onednn_placement_workaround_is_needed_where_its_record_says(conv_interp):
    """If Paddle fixes issue 79749, this fails: set ONEDNN_PLACEMENT.fixed in psanet.compat.
    Paddle 3.3 refuses the saved bilinear_interp; 3.0 to 3.2 run it in oneDNN, which
    ignores align_corners: an output off by far more than any rounding."""
    path, x, expected = conv_interp
    try:
        got = predict(cpu_config(path, onednn=True), x)
    except Exception as error:  # noqa: BLE001  (Paddle raises its own error types)
        assert 'ConvertPirAttribute2RuntimeAttribute' in str(error), error
        broken = True
    else:
        broken = not np.allclose(got, expected, rtol=0, atol=1e-3 * np.abs(expected).max())
    assert broken == compat.ONEDNN_PLACEMENT.needed()


class _IntegerScale(paddle.nn.Layer):
    """arange(W) * W * 33 as float: a scale after an integer elementwise multiply (ONEDNN_INT_SCALE)."""

    def forward(self, x):
        w = paddle.shape(x)[3].astype('int64')
        return (paddle.arange(w, dtype='int64') * w * 33).astype('float32').reshape([1, -1])


def test_onednn_drops_an_integer_scale_where_its_record_says(tmp_path):
    """If Paddle's operator_scale_onednn_fuse_pass keeps integer scales, this fails: set
    ONEDNN_INT_SCALE.fixed in psanet.compat."""
    path = str(tmp_path / 'model')
    spec = [paddle.static.InputSpec([None, 1, None, None], 'float32', 'x')]
    paddle.jit.save(paddle.jit.to_static(_IntegerScale(), input_spec=spec, full_graph=True), path)
    x = np.zeros((1, 1, 2, 5), 'float32')
    want = (np.arange(5) * 5 * 33).astype('float32').reshape(1, -1)
    for onednn in (False, True):
        got = predict(compat.configure_inference(cpu_config(path, onednn)), x)
        broken = not np.array_equal(got, want)
        assert broken == (onednn and compat.ONEDNN_INT_SCALE.needed()), (onednn, got)


@pytest.mark.skipif(not compat.MEMORY_OPTIM.needed(), reason='not needed on this Paddle')
def test_memory_optim_workaround_is_still_needed_on_this_paddle(conv_interp):
    """If Paddle fixes issue 75496, this fails: set MEMORY_OPTIM.fixed in psanet.compat."""
    path, x, _ = conv_interp
    config = cpu_config(path, onednn=False)
    config.enable_memory_optim()
    with pytest.raises(Exception, match='memory_optimize_pass'):
        predict(config, x)


def test_paddle_core_library_is_the_core_module_file():
    """The private name and its fallback agree, so the fallback links the same library."""

    from psanet.ops.build import paddle_core_library
    assert paddle_core_library() == os.path.basename(paddle.base.libpaddle.__file__)


def test_importing_compat_imports_no_paddleseg():
    """The runtime may import psanet.compat without the training stack."""
    code = ('import sys; import psanet.compat; '
            'print(sorted(m for m in sys.modules if m.startswith(("paddleseg", "psanet"))))')
    result = run_process([sys.executable, '-c', code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    loaded = ast.literal_eval(result.stdout.split('\n')[-2])
    assert loaded[:2] == ['psanet', 'psanet.compat'], result.stdout
    assert all(m.startswith('psanet.compat.') for m in loaded[2:]), result.stdout
    assert 'ccache' not in result.stderr.lower(), result.stderr


_BATCHNORM_FORWARD = ('import paddle\n'
                      'norm = paddle.nn.BatchNorm2D(2)\n'
                      'norm.train()\n'
                      'norm(paddle.ones([1, 2, 3, 3]))\n')


def _stderr_of(code):
    result = run_process([sys.executable, '-c', code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_batchnorm_notice_is_still_printed_by_this_paddle():
    """BATCHNORM_TRACKING_NOTICE: when this fails, Paddle no longer prints the notice:
    delete BATCHNORM_NOTICE and its record."""
    assert compat.BATCHNORM_NOTICE in _stderr_of(_BATCHNORM_FORWARD)


@pytest.mark.parametrize('first', ['psanet.compat', 'psanet.cli', 'psanet.core'])
def test_importing_compat_first_filters_the_batchnorm_notice(first):
    """What train.py, val.py, predict.py and the engine import first keeps it off stderr."""
    stderr = _stderr_of(f'import {first}\n' + _BATCHNORM_FORWARD)
    assert 'we now always track' not in stderr, stderr
    assert 'ccache' not in stderr.lower(), stderr


def test_importing_compat_or_the_engine_package_loads_no_paddle():
    """psanet.core's docstring: importing it loads none of the engine, nor paddle."""
    code = ('import sys; import psanet.core; '
            'print(sorted(m for m in sys.modules if m.split(".")[0] in ("paddle", "psanet")))')
    result = run_process([sys.executable, '-c', code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    loaded = [m for m in ast.literal_eval(result.stdout.split('\n')[-2])
              if not m.startswith('psanet.compat.')]
    assert loaded == ['psanet', 'psanet.compat', 'psanet.core'], result.stdout


@pytest.mark.parametrize('module', ['psanet.models', 'psanet.core.config'])
@pytest.mark.parametrize('missing, said', [
    ('paddleseg', 'psanet needs paddleseg 2.8.0'),
    ('six', 'paddleseg needs six, which is not installed'),
])
def test_the_training_stack_without_paddleseg_says_what_to_install(module, missing, said):
    code = (f"import sys; sys.modules[{missing!r}] = None\n"
            f"try:\n    import {module}\nexcept ImportError as error:\n    print(error)\n")
    result = run_process([sys.executable, '-c', code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line, = result.stdout.strip().splitlines()
    assert line.startswith(f'{said}: pip install -r requirements.txt && pip install --no-deps '
                           '-r requirements-paddleseg.txt'), line


# ---------------------------------------------------------------------------
# Paddle 3.0 to 3.2: each record against what this Paddle does
# ---------------------------------------------------------------------------

def test_const_contiguous_record_matches_this_paddles_header():
    """CONST_CONTIGUOUS: the op calls contiguous() on a copy while some supported Paddle declares it
    non-const; this fails when the record disagrees with the installed header."""
    header = os.path.join(os.path.dirname(paddle.__file__), 'include', 'paddle', 'phi', 'api',
                          'include', 'tensor.h')
    with open(header) as f:
        declarations = re.findall(r'Tensor contiguous\(\)\s*(const)?\s*;', f.read())
    assert len(declarations) == 1, declarations
    assert (declarations[0] != 'const') == compat.CONST_CONTIGUOUS.needed()


def _gradient_of_weighted_sum(select, x, index, weight):
    tensor = paddle.to_tensor(x, stop_gradient=False)
    (select(tensor, paddle.to_tensor(index), axis=1) * paddle.to_tensor(weight)).sum().backward()
    return tensor.grad.numpy()


def test_gather_gradient_is_wrong_where_its_record_says():
    """GATHER_AXIS_GRADIENT: d/dx of sum(w * x[:, index]) is w scattered back to index, row by row
    (numpy's add.at); paddle.gather(axis=1) gets it wrong on 3.0.0, index_select nowhere."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((3, 5))
    index = np.array([4, 0, 0, 2, 4, 4])
    weight = rng.standard_normal((3, len(index)))
    expected = np.zeros_like(x)
    for row in range(3):
        np.add.at(expected[row], index, weight[row])
    np.testing.assert_allclose(_gradient_of_weighted_sum(paddle.index_select, x, index, weight),
                               expected, rtol=1e-12)
    gather = _gradient_of_weighted_sum(paddle.gather, x, index, weight)
    assert (not np.allclose(gather, expected, rtol=1e-12)) == \
        compat.GATHER_AXIS_GRADIENT.needed(), gather


def test_amp_state_api_record_matches_this_paddle():
    """AMP_STATE_API: fails once paddle.amp has is_autocast_enabled where the record says
    it has not."""
    has_api = all(hasattr(paddle.amp, name)
                  for name in ('is_autocast_enabled', 'get_autocast_dtype'))
    assert has_api == (not compat.AMP_STATE_API.needed())


@pytest.mark.parametrize('on, name', [(False, 'float16'), (True, 'float16'),
                                      (True, 'bfloat16')])
def test_autocast_dtype_reads_the_state_autocast_set(monkeypatch, on, name):
    """Both ways (the API where it exists, the tracer's state) give the state just set."""
    expected = name if on else None
    with autocast_state(on, name):
        assert compat.autocast_dtype() == expected
        monkeypatch.setattr(compat.fixes, 'AMP_STATE_API', _gate(first=(0,)))
        assert compat.autocast_dtype() == expected
        if hasattr(paddle.amp, 'is_autocast_enabled'):
            assert paddle.amp.is_autocast_enabled() == on


def test_place_kind_record_matches_this_paddle():
    """PLACE_KIND: fails once the place classes have is_gpu_place where the record says not."""
    assert hasattr(paddle.CPUPlace(), 'is_gpu_place') == (not compat.PLACE_KIND.needed())


def test_generic_place_says_what_a_place_is(monkeypatch):
    paddle.set_device('cpu')
    for record in (compat.PLACE_KIND, _gate(first=(0,))):
        monkeypatch.setattr(compat.fixes, 'PLACE_KIND', record)
        for place in (compat.generic_place(), compat.generic_place(paddle.CPUPlace()),
                      compat.generic_place(paddle.zeros([1]).place)):
            assert place.is_cpu_place() and not place.is_gpu_place()


class _Logits(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.conv = paddle.nn.Conv2D(3, 2, 1)

    def forward(self, x):
        return [self.conv(x)]


class _Argmax(paddle.nn.Layer):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return paddle.argmax(self.model(x)[0], axis=1)


def _save_wrapped(model, path):
    spec = [paddle.static.InputSpec([None, 3, None, None], 'float32', 'x')]
    paddle.jit.save(_Argmax(model), path, input_spec=spec)


def test_jit_save_replaces_the_inner_forward_where_its_record_says(tmp_path):
    """JIT_SAVE_FORWARD: fails once paddle.jit.save leaves the wrapped Layer's forward
    alone where the record says it does not (or replaces it where it says it does not)."""
    model = _Logits()
    model.eval()
    _save_wrapped(model, str(tmp_path / 'model'))
    assert ('forward' in model.__dict__) == compat.JIT_SAVE_FORWARD.needed()


def test_to_static_freezes_a_global_read_where_its_record_says(tmp_path, monkeypatch):
    """TO_STATIC_GLOBALS: a module setting read through a function that a traced forward
    calls keeps the value of the first trace (fails once to_static reads the live one)."""
    (tmp_path / 'frozen_setting.py').write_text(
        "SETTING = 'first'\n\n\ndef read_setting():\n    return SETTING\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import frozen_setting
    seen = []

    class Reads(paddle.nn.Layer):
        def forward(self, x):
            seen.append(frozen_setting.read_setting())
            return x * 2

    traced = []  # each Layer kept alive while it is traced
    for value in ('first', 'second'):
        monkeypatch.setattr(frozen_setting, 'SETTING', value)
        traced.append(Reads())
        paddle.jit.to_static(traced[-1].forward, full_graph=True)(paddle.ones([2]))
    assert seen == (['first', 'first'] if compat.TO_STATIC_GLOBALS.needed()
                    else ['first', 'second'])


def test_keep_forward_leaves_the_model_as_it_was(tmp_path):
    """After a wrapped save, the model runs as before and saves on its own (which fails on
    3.0.0 with "'WeakMethod' object has no attribute '__name__'" without keep_forward)."""
    model = _Logits()
    model.eval()
    x = paddle.rand([1, 3, 4, 4])
    expected = model(x)[0].numpy()
    spec = [paddle.static.InputSpec([None, 3, None, None], 'float32', 'x')]
    for n in range(2):
        with compat.keep_forward(model):
            _save_wrapped(model, str(tmp_path / f'wrapped{n}'))
        assert 'forward' not in model.__dict__
        np.testing.assert_array_equal(model(x)[0].numpy(), expected)
        with compat.keep_forward(model):
            paddle.jit.save(model, str(tmp_path / f'alone{n}'), input_spec=spec)


class _Double(paddle.nn.Layer):
    def forward(self, x):
        return x * 2


def test_parameterless_program_fails_in_the_predictor_where_its_record_says(tmp_path):
    """PARAMETERLESS_PROGRAM: fails once the predictor runs a program without parameters
    where the record says it cannot (the tests then need no parameter of 1)."""
    path = str(tmp_path / 'double')
    spec = [paddle.static.InputSpec([None, 3], 'float32', 'x')]
    paddle.jit.save(paddle.jit.to_static(_Double(), input_spec=spec, full_graph=True), path)
    x = np.arange(3, dtype='float32').reshape(1, 3)
    if compat.PARAMETERLESS_PROGRAM.needed():
        with pytest.raises(Exception, match='pdiparams'):
            predict(cpu_config(path, onednn=False), x)
    else:
        np.testing.assert_array_equal(predict(cpu_config(path, onednn=False), x), 2 * x)


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason='a record of the CPU builds')
def test_cpu_paddle_exports_tensor_stream_where_its_record_says():
    """CPU_TENSOR_STREAM: fails once this CPU Paddle exports paddle::Tensor::stream() where
    the record says it does not (tests/test_psa_mask_build.py then loads the CUDA library)."""
    import ctypes
    core = ctypes.CDLL(paddle.base.libpaddle.__file__)
    assert hasattr(core, '_ZNK6paddle6Tensor6streamEv') == (not compat.CPU_TENSOR_STREAM.needed())


# ---------------------------------------------------------------------------
# Below the supported range, ``import psanet`` stops with one line
# ---------------------------------------------------------------------------

def _fake_paddle(folder, name, version):
    """A site folder whose package metadata says ``name`` ``version`` is installed, with a
    ``paddle`` that kills the interpreter as Paddle 2.6 can (importing it must not happen)."""
    info = folder / f'{name.replace("-", "_")}-{version}.dist-info'
    info.mkdir(parents=True)
    (info / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n')
    (folder / 'paddle').mkdir()
    (folder / 'paddle' / '__init__.py').write_text('import os\nos.abort()\n')
    return str(folder)


def _run_with(site, code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, ROOT]))
    return run_process([sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)


@pytest.mark.parametrize('name, version', [('paddlepaddle', '2.6.2'),
                                           ('paddlepaddle-gpu', '2.6.2.post118')])
@pytest.mark.parametrize('code', ['import psanet', 'import psanet.models',
                                  'import runpy; runpy.run_path("train.py")'])
def test_a_paddle_below_3_gets_one_line(tmp_path, name, version, code):
    result = _run_with(_fake_paddle(tmp_path, name, version), code)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    line, = result.stderr.strip().splitlines()
    assert f'found {name} {version}' in line and 'paddlepaddle>=3.0' in line, line
    assert 'pip install paddlepaddle==3' in line, line
    assert 'pip install paddlepaddle-gpu==3' in line and 'paddlepaddle.org.cn' in line, line
    assert result.stdout == ''


@pytest.mark.parametrize('version', ['3.0.0', '0.0.0'])
def test_paddle_3_and_develop_builds_pass_the_range_check(tmp_path, version):
    """Only the metadata is read: the fake paddle, which aborts, is never imported."""
    result = _run_with(_fake_paddle(tmp_path, 'paddlepaddle', version),
                       'import sys, psanet; print(sorted(m for m in sys.modules '
                       'if m.split(".")[0] in ("paddle", "psanet")))')
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "['psanet']"


def _python(code, *args):
    """``python -c code args`` (``python code args`` when ``code`` is a file), which must
    succeed: its CompletedProcess."""
    command = [code] if os.path.isfile(code) else ['-c', code]
    result = run_process([sys.executable, *command, *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def _stderr_of_args(code, *args):
    return _python(code, *args).stderr


def test_paddleseg_builder_still_prints_each_config_as_yaml():
    """BUILDER_YAML: when this fails, paddleseg no longer prints it: delete
    quiet_builder_messages and its record."""
    out = _python('from paddleseg.cvlibs.builder import Builder\n'
                  "Builder.show_msg('model', {'type': 'PSANet'})\n").stdout
    assert compat.BUILDER_MESSAGE + ' model' in out, out


def test_a_config_build_prints_no_yaml(capsys):
    from paddleseg.cvlibs.builder import Builder
    Builder.show_msg('model', {'type': 'PSANet'})
    assert compat.BUILDER_MESSAGE not in capsys.readouterr().out


_PIR_ADD = ('import os, sys, tempfile\n'
            'sys.path.insert(0, os.getcwd())\n'
            'from psanet import compat, log\n'
            'import paddle\n'
            'class Add(paddle.nn.Layer):\n'
            '    def forward(self, x):\n'
            '        return paddle.add(x, x)\n'
            'spec = [paddle.static.InputSpec([None, 2], "float32", "x")]\n'
            'with log.without_stderr_lines(*sys.argv[1:]):\n'
            '    print("a line of ours", file=sys.stderr, flush=True)\n'
            '    os.write(2, b"a C line of ours\\n")\n'
            '    paddle.jit.save(Add(), os.path.join(tempfile.mkdtemp(), "m"), input_spec=spec)\n')


def test_paddle_still_logs_pir_out_tensor_and_the_filter_drops_only_it(tmp_path):
    """PIR_OUT_TENSOR_LINE: when the first assertion fails, Paddle no longer logs it:
    delete PIR_OUT_TENSOR and its record."""
    script = tmp_path / 'pir_add.py'  # a file: paddle.jit.save reads the forward's source
    script.write_text(_PIR_ADD)
    unfiltered = _stderr_of_args(str(script))
    assert compat.PIR_OUT_TENSOR in unfiltered, unfiltered
    filtered = _stderr_of_args(str(script), compat.PIR_OUT_TENSOR)
    assert compat.PIR_OUT_TENSOR not in filtered, filtered
    assert 'a line of ours\n' in filtered and 'a C line of ours\n' in filtered, filtered


def test_onnxruntime_still_logs_removing_initializer_on_the_int8_preprocessing(tmp_path):
    """ORT_INITIALIZER_LINES: when this fails, onnxruntime no longer logs it for our
    export: delete ORT_UNUSED_INITIALIZER, its filter in psanet/export.py and its record."""
    from psanet.export import ExportOptions, export_model, onnx_tools_installed
    if not onnx_tools_installed():
        pytest.skip('paddle2onnx / onnxruntime not installed')
    from engine_helpers import mini_psanet_for_eval
    export_model(mini_psanet_for_eval(seed=1), [{'type': 'Normalize'}], str(tmp_path / 'e'),
                 ExportOptions(psa_impl='paddle', onnx=True), num_classes=19)
    code = ('import sys\n'
            'from onnxruntime.quantization.shape_inference import quant_pre_process\n'
            'quant_pre_process(sys.argv[1], sys.argv[2], skip_symbolic_shape=True)\n')
    stderr = _stderr_of_args(code, str(tmp_path / 'e' / 'model.onnx'),
                             str(tmp_path / 'folded.onnx'))
    assert compat.ORT_UNUSED_INITIALIZER in stderr, stderr


_MATMUL_DIGEST = ('import hashlib, numpy as np, paddle\n'
                  'rng = np.random.default_rng(0)\n'
                  'a, b = (paddle.to_tensor(rng.standard_normal(s, dtype=np.float32))\n'
                  '        for s in ((64, 1024), (1024, 64)))\n'
                  'print(hashlib.sha1(paddle.matmul(a, b).numpy().tobytes()).hexdigest())\n')


def _matmul_digest(mkl_debug_cpu_type):
    """The digest of one Paddle matmul in a process that does not import psanet."""
    env = dict(os.environ, MKL_DEBUG_CPU_TYPE=mkl_debug_cpu_type)
    result = run_process([sys.executable, '-c', _MATMUL_DIGEST], env=env, capture_output=True,
                         text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()[-1]


@pytest.mark.skipif(not amd_cpu_with_avx2(), reason='MKL_ON_AMD acts on AMD CPUs only')
def test_mkl_takes_another_path_on_amd_where_its_record_says():
    """MKL_ON_AMD: on this AMD CPU the variable changes MKL's code path, seen in the bits of
    a matmul (sums in another order); when this fails, Paddle's MKL ignores it: delete the
    record and psanet.mkl_avx2_on_amd. How much faster: bench/bench_mkl_path.py."""
    if not os.path.exists(os.path.join(os.path.dirname(paddle.__file__), 'libs',
                                       'libmklml_intel.so')):
        pytest.skip('this Paddle has no MKL')
    own, avx2 = _matmul_digest(''), _matmul_digest('5')
    assert own != avx2
    assert _matmul_digest('') == own  # the same path gives the same bits


_CPUINFO = ('processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 25\n'
            'flags\t\t: fpu vme sse sse2 {flags} aes\nbogomips\t: 4890.85\n\n')


@pytest.mark.parametrize('vendor, flags, preset, sets', [
    ('AuthenticAMD', 'avx avx2 fma', None, True),
    ('AuthenticAMD', 'avx fma', None, False),        # no AVX2: the path would not run
    ('AuthenticAMD', 'avx avx2', None, False),       # no FMA
    ('GenuineIntel', 'avx avx2 fma', None, False),   # MKL picks Intel's own path
    ('AuthenticAMD', 'avx avx2 fma', '', False),     # the user's value, even empty, stays
    ('AuthenticAMD', 'avx avx2 fma', '4', False)])
def test_psanet_points_mkl_at_avx2_on_amd_cpus_only(tmp_path, vendor, flags, preset, sets):
    cpuinfo = tmp_path / 'cpuinfo'
    cpuinfo.write_text(_CPUINFO.format(vendor=vendor, flags=flags) * 2)
    environ = {} if preset is None else {'MKL_DEBUG_CPU_TYPE': preset}
    assert mkl_avx2_on_amd(environ, str(cpuinfo)) is sets
    assert environ.get('MKL_DEBUG_CPU_TYPE') == ('5' if sets else preset)
    assert mkl_avx2_on_amd({}, str(tmp_path / 'none')) is False  # not Linux


def test_importing_psanet_sets_the_variable_where_this_cpu_needs_it():
    env = {k: v for k, v in os.environ.items() if k != 'MKL_DEBUG_CPU_TYPE'}
    code = 'import os, psanet; print(repr(os.environ.get("MKL_DEBUG_CPU_TYPE")))'
    for preset, want in ((None, '5' if amd_cpu_with_avx2() else None), ('', '')):
        run_env = env if preset is None else dict(env, MKL_DEBUG_CPU_TYPE=preset)
        result = run_process([sys.executable, '-c', code], env=run_env, cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.split()[-1] == repr(want), (preset, result.stdout)
