"""Segmentation metrics from per-class areas, the quantities ranks sum in distributed evaluation.

The areas come from paddleseg's ``calculate_area`` (fixed in psanet.compat)
and the summary from paddleseg's ``mean_iou``, ``class_measurement``,
``kappa`` and ``dice``, so the numbers are PaddleSeg's.
"""
import numpy as np
import paddle
from paddleseg.utils import metrics as seg_metrics

import psanet.compat  # noqa: F401  (calculate_area needs its fix)

__all__ = ['class_areas', 'summarize']


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
    areas = seg_metrics.calculate_area(pred, label, num_classes, ignore_index=ignore_index)
    return np.stack([a.numpy() for a in areas]).astype('int64')


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
