"""Segmentation metrics from per-class areas, the quantities ranks sum in distributed evaluation.

The areas come from paddleseg's ``calculate_area`` (fixed in psanet.compat)
and the summary from paddleseg's ``mean_iou``, ``class_measurement``,
``kappa`` and ``dice``, so the numbers are PaddleSeg's.
"""
import numpy as np
import paddle
from paddleseg.utils import metrics as seg_metrics

from psanet import compat

# paddleseg's calculate_area, or its fixed copy where this paddleseg needs it (compat, 9),
# whether or not the fixes were applied to paddleseg itself.
_calculate_area = (compat.calculate_area if compat.PADDLESEG_CALCULATE_AREA.needed()
                   else seg_metrics.calculate_area)

__all__ = ['class_areas', 'confusion_matrix', 'summarize']


def class_areas(pred, label, num_classes, ignore_index=255):
    """Intersection, prediction and label pixel counts per class.

    Args:
        pred (Tensor): predicted class ids, [N, 1, H, W] or [N, H, W].
        label (Tensor): ground truth of the same shape; ``ignore_index`` pixels count nowhere.
        num_classes (int): number of classes.
        ignore_index (int, optional): Default: 255.

    Returns:
        np.ndarray: int64 [3, num_classes]: intersection, prediction, label areas.
    """
    areas = _calculate_area(pred, label, num_classes, ignore_index=ignore_index)
    return np.stack([a.numpy() for a in areas]).astype('int64')


def confusion_matrix(pred, label, num_classes, ignore_index=255):
    """Pixel counts of each (ground truth, prediction) pair of classes.

    The areas of :func:`class_areas` are its diagonal (intersection), column
    sums (prediction) and row sums (label) wherever labels are ``ignore_index``
    or a class id, as ``validate_dataset`` makes them before evaluation.

    Args:
        pred (Tensor | np.ndarray): predicted class ids, any shape.
        label (Tensor | np.ndarray): ground truth with as many pixels.
        num_classes (int): number of classes C.
        ignore_index (int, optional): label value counted nowhere. Default: 255.

    Returns:
        np.ndarray: int64 [C, C], rows = ground truth, columns = prediction; pixels
        whose label is ``ignore_index`` or whose label or prediction is not in
        0..C-1 are left out.
    """
    # Counted where the tensors are (on the GPU in evaluation): one [C, C] copy to the host.
    pred, label = ((a if isinstance(a, paddle.Tensor) else paddle.to_tensor(np.asarray(a)))
                   .astype('int64').flatten() for a in (pred, label))
    if pred.shape[0] != label.shape[0]:
        raise ValueError(f'confusion_matrix: pred has {pred.shape[0]} pixels but label has '
                         f'{label.shape[0]}.')
    valid = ((label != ignore_index) & (label >= 0) & (label < num_classes) &
             (pred >= 0) & (pred < num_classes))
    pairs = paddle.masked_select(label * num_classes + pred, valid)
    if pairs.shape[0] == 0:
        return np.zeros([num_classes, num_classes], dtype='int64')
    counts = paddle.bincount(pairs, minlength=num_classes ** 2).numpy()
    return counts.reshape(num_classes, num_classes).astype('int64')


def summarize(areas):
    """PaddleSeg's metrics from summed areas.

    Args:
        areas (np.ndarray): [3, num_classes] intersection, prediction and label areas.

    Returns:
        dict: ``miou``, ``acc``, ``kappa``, ``mdice`` (floats) and ``class_iou``,
        ``class_precision``, ``class_recall``, ``class_dice`` (arrays).
    """
    intersect, pred, label = (paddle.to_tensor(np.asarray(a, dtype='int64')) for a in areas)
    class_iou, miou = seg_metrics.mean_iou(intersect, pred, label)
    acc, class_precision, class_recall = seg_metrics.class_measurement(intersect, pred, label)
    kappa = seg_metrics.kappa(intersect, pred, label)
    class_dice, mdice = seg_metrics.dice(intersect, pred, label)
    return {'miou': float(miou), 'acc': float(acc), 'kappa': float(kappa), 'mdice': float(mdice),
            'class_iou': np.asarray(class_iou, dtype='float64'),
            'class_precision': np.asarray(class_precision, dtype='float64'),
            'class_recall': np.asarray(class_recall, dtype='float64'),
            'class_dice': np.asarray(class_dice, dtype='float64')}
