"""psanet.compat: each fixed paddleseg component against an independent numpy computation."""
import numpy as np
import paddle
import pytest
from paddleseg.models.losses import CrossEntropyLoss
from paddleseg.utils import metrics

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
