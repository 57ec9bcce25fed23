"""psanet.compat: each fixed paddleseg component against an independent numpy computation."""
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest
from paddleseg.models.losses import CrossEntropyLoss
from paddleseg.utils import metrics

from conftest import ROOT, run_process
from predictor_helpers import cpu_config, predict
import psanet.models  # noqa: F401  (applies the paddleseg fixes, as a config build does)
from psanet import compat

IGNORE = 255


def _logits_and_labels(seed, num_classes=4, shape=(2, 5, 7)):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(shape[0], num_classes) + shape[1:]).astype('float32')
    labels = rng.integers(0, num_classes, size=shape).astype('int64')
    labels[rng.random(shape) < 0.2] = IGNORE
    return logits, labels


def _numpy_cross_entropy(logits, labels, weight=None):
    """Mean of w[y] * -log softmax(x)[y] over non-ignored pixels, divided by the mean weight."""
    num_classes = logits.shape[1]
    weight = np.ones(num_classes) if weight is None else np.asarray(weight, np.float64)
    x = np.moveaxis(logits.astype(np.float64), 1, -1).reshape(-1, num_classes)
    y = labels.reshape(-1)
    keep = y != IGNORE
    x, y = x[keep], y[keep]
    log_prob = x - x.max(1, keepdims=True)
    log_prob -= np.log(np.exp(log_prob).sum(1, keepdims=True))
    nll = -log_prob[np.arange(len(y)), y]
    return (weight[y] * nll).sum() / weight[y].sum()


@pytest.mark.parametrize('weight', [None, [0.5, 1.0, 2.0, 1.5]])
def test_cross_entropy_matches_numpy(weight):
    logits, labels = _logits_and_labels(seed=1)
    loss = CrossEntropyLoss(weight=weight, ignore_index=IGNORE)(
        paddle.to_tensor(logits), paddle.to_tensor(labels))
    # float32 log-softmax of 4 classes and a mean over ~56 pixels against float64: about
    # sqrt(56) eps32 = 1e-6 relative in any order of the sums; 1e-5 leaves a margin.
    np.testing.assert_allclose(float(loss), _numpy_cross_entropy(logits, labels, weight),
                               rtol=1e-5)


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


def _numpy_areas(pred, label, num_classes):
    keep = label != IGNORE
    confusion = np.bincount(label[keep] * num_classes + pred[keep],
                            minlength=num_classes**2).reshape(num_classes, num_classes)
    return np.diag(confusion), confusion.sum(0), confusion.sum(1)


def test_calculate_area_matches_numpy_confusion():
    rng = np.random.default_rng(3)
    num_classes = 5
    label = rng.integers(0, num_classes, size=(2, 1, 9, 11))
    label[rng.random(label.shape) < 0.25] = IGNORE
    pred = rng.integers(0, num_classes, size=label.shape)
    areas = metrics.calculate_area(paddle.to_tensor(pred, dtype='int32'),
                                   paddle.to_tensor(label, dtype='int64'), num_classes, IGNORE)
    for got, expected in zip(areas, _numpy_areas(pred, label, num_classes)):  # counts: exact
        assert got.shape == [num_classes]
        np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize('owner, name', [(o, n) for o, n, _ in compat.FIXES])
def test_original_is_still_broken_on_this_paddle(owner, name):
    """If paddleseg or Paddle fixes the bug, the patch in psanet.compat can go."""
    original = compat.ORIGINALS[(owner, name)]
    logits, labels = _logits_and_labels(seed=4)
    with pytest.raises((TypeError, ValueError)):
        if name == 'calculate_area':
            original(paddle.to_tensor(labels[:, None] % 4), paddle.to_tensor(labels[:, None]), 4)
        else:
            loss = CrossEntropyLoss(weight=[1.0, 2.0, 1.0, 1.0])
            x = paddle.transpose(paddle.to_tensor(logits), [0, 2, 3, 1])
            label = paddle.to_tensor(labels)
            original(loss, x, label, None, paddle.nn.functional.cross_entropy(
                x, label, ignore_index=IGNORE, reduction='none'))


# ---------------------------------------------------------------------------
# The Paddle workarounds: version checks, configure_inference, the op build names
# ---------------------------------------------------------------------------

def test_version_checks_cover_first_to_fixed():
    workaround = compat.Workaround('issue', first=(3, 0), fixed=(3, 4))
    assert [workaround.needed(v) for v in [(2, 6, 2), (3, 0, 0), (3, 3, 1), (3, 4, 0)]] == \
        [False, True, True, False]
    assert compat.Workaround('open issue', first=(3, 0)).needed((9, 9))
    paddleseg_fix = compat.Workaround('issue', first=(2, 6), paddleseg=(2, 8, 0))
    assert paddleseg_fix.needed((3, 3, 1), (2, 8, 0))
    assert not paddleseg_fix.needed((3, 3, 1), (2, 9, 0))
    assert not paddleseg_fix.needed((2, 5, 2), (2, 8, 0))
    # A develop build reports 0.0.0 and is newer than any release.
    assert compat.parse_version('0.0.0') > compat.parse_version('3.3.1') == (3, 3, 1)
    assert compat.parse_version('3.0.0rc1') == (3, 0, 0)


class _ConvInterp(paddle.nn.Layer):
    """A convolution and a bilinear upsampling: what trips both inference bugs."""

    def __init__(self):
        super().__init__()
        self.conv = paddle.nn.Conv2D(3, 4, 3, padding=1)

    def forward(self, x):
        return paddle.nn.functional.interpolate(self.conv(x), scale_factor=2, mode='bilinear')


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


@pytest.mark.skipif(not compat.ONEDNN_PLACEMENT.needed(), reason='not needed on this Paddle')
def test_onednn_placement_workaround_is_still_needed_on_this_paddle(conv_interp):
    """If Paddle fixes issue 79749, this fails: set ONEDNN_PLACEMENT.fixed in psanet.compat."""
    path, x, _ = conv_interp
    with pytest.raises(Exception, match='ConvertPirAttribute2RuntimeAttribute'):
        predict(cpu_config(path, onednn=True), x)


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
    assert result.stdout.split('\n')[-2] == "['psanet', 'psanet.compat']", result.stdout
    assert 'ccache' not in result.stderr.lower(), result.stderr


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
