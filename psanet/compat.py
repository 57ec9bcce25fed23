"""Fixes for paddleseg 2.8.0 components that break on Paddle >= 2.6 (measured on Paddle 3.3.1).

paddleseg 2.8.0 was written for Paddle 2.4/2.5. Paddle 2.6 made reductions
return 0-D tensors and Paddle 3 stopped promoting integer and float operands
of one op, so some of paddleseg's components fail. ``import psanet`` imports
this module, which patches the broken functions in place; each fix below says
what breaks, where, and how it is fixed, and has one test in
tests/test_compat.py that fails without it.

paddleseg.core (train / evaluate / predict) is not patched: the project has
its own engine in psanet.core that only reuses paddleseg's components.
"""
import paddle
import paddle.nn.functional as F
from paddleseg.models.losses import cross_entropy_loss
from paddleseg.utils import metrics

__all__ = ['FIXES', 'ORIGINALS', 'cross_entropy_post_process_loss', 'calculate_area']


def cross_entropy_post_process_loss(self, logit, label, semantic_weights, loss):
    """``CrossEntropyLoss._post_process_loss`` without integer/float mixing.

    Broken in 2.8.0 on Paddle 3: ``paddle.mean(mask * coef)`` multiplies the
    float32 mask by ``coef = ones_like(label)`` (int64), and with class
    weights ``F.one_hot(label * mask, ...)`` multiplies int64 by float32; both
    raise "Type promotion only support calculations between floating-point
    numbers". Fixed by making ``coef`` float32 and the masked label int64, the
    dtypes Paddle 2.5 promoted them to implicitly; the arithmetic is otherwise
    paddleseg's.
    """
    if self.avg_non_ignore:
        mask = paddle.cast(label != self.ignore_index, dtype='float32')
    else:
        mask = paddle.ones(label.shape, dtype='float32')
    mask.stop_gradient = True
    label.stop_gradient = True

    if loss.ndim > mask.ndim:
        loss = paddle.squeeze(loss, axis=-1)
    loss = loss * mask
    if semantic_weights is not None:
        loss = loss * semantic_weights

    if self.weight is not None:
        # Ignored pixels become class 0 here; their mask of 0 removes them again.
        masked_label = label * paddle.cast(label != self.ignore_index, 'int64')
        _one_hot = F.one_hot(masked_label, logit.shape[-1])
        coef = paddle.sum(_one_hot * self.weight, axis=-1)
    else:
        coef = paddle.ones(label.shape, dtype='float32')

    if self.top_k_percent_pixels == 1.0:
        return paddle.mean(loss) / (paddle.mean(mask * coef) + self.EPS)
    loss = loss.reshape((-1, ))
    top_k_pixels = int(self.top_k_percent_pixels * loss.numel())
    loss, indices = paddle.topk(loss, top_k_pixels)
    coef = paddle.gather(coef.reshape((-1, )), indices)
    coef.stop_gradient = True
    return loss.mean() / (paddle.mean(coef) + self.EPS)


def calculate_area(pred, label, num_classes, ignore_index=255):
    """``paddleseg.utils.metrics.calculate_area`` with per-class counts stacked, not concatenated.

    Broken in 2.8.0 on Paddle >= 2.6: ``paddle.sum`` returns 0-D tensors and
    ``paddle.concat`` of 0-D tensors raises "The axis is expected to be in
    range of [0, 0)", so ``paddleseg.core.evaluate`` fails on its first
    image. Fixed by ``paddle.stack``, which gives the [num_classes] int64
    tensors 2.8.0 returned on Paddle 2.5.

    Args:
        pred (Tensor): predicted class ids, [N, H, W] or [N, 1, H, W].
        label (Tensor): ground truth of the same shape.
        num_classes (int): number of classes.
        ignore_index (int, optional): label value left out of all three areas. Default: 255.

    Returns:
        tuple: intersect, prediction and label areas, int64 tensors of shape [num_classes].
    """
    if len(pred.shape) == 4:
        pred = paddle.squeeze(pred, axis=1)
    if len(label.shape) == 4:
        label = paddle.squeeze(label, axis=1)
    if not pred.shape == label.shape:
        raise ValueError('Shape of `pred` and `label should be equal, '
                         'but there are {} and {}.'.format(pred.shape, label.shape))
    pred_area = []
    label_area = []
    intersect_area = []
    mask = label != ignore_index
    for i in range(num_classes):
        pred_i = paddle.logical_and(pred == i, mask)
        label_i = label == i
        intersect_i = paddle.logical_and(pred_i, label_i)
        pred_area.append(paddle.sum(paddle.cast(pred_i, 'int64')))
        label_area.append(paddle.sum(paddle.cast(label_i, 'int64')))
        intersect_area.append(paddle.sum(paddle.cast(intersect_i, 'int64')))
    return paddle.stack(intersect_area), paddle.stack(pred_area), paddle.stack(label_area)


# (owner, attribute, replacement): applied once when psanet is imported.
FIXES = (
    (cross_entropy_loss.CrossEntropyLoss, '_post_process_loss', cross_entropy_post_process_loss),
    (metrics, 'calculate_area', calculate_area),
)


# The replaced functions, for tests that check the fixes are still needed.
ORIGINALS = {}


def _apply():
    for owner, name, fixed in FIXES:
        current = getattr(owner, name)
        if current is not fixed:
            ORIGINALS[(owner, name)] = current
            setattr(owner, name, fixed)


_apply()
