"""Segmentation metrics from per-class areas, the quantities ranks sum in distributed evaluation.

The areas are counted here (paddleseg's ``calculate_area`` fails on Paddle >= 2.6:
psanet.compat.PADDLESEG_CALCULATE_AREA) as paddleseg defines them, and the summary is
paddleseg's ``mean_iou``, ``class_measurement``, ``kappa`` and ``dice``, so the numbers
are PaddleSeg's.
"""
import numpy as np
import paddle
from paddleseg.utils import metrics as seg_metrics

__all__ = ['class_areas', 'confusion_matrix', 'summarize']


def _flat_int64(pred, label, caller):
    """``pred`` and ``label`` (Tensors or arrays) as flat int64 Tensors of as many pixels."""
    pred, label = ((a if isinstance(a, paddle.Tensor) else paddle.to_tensor(np.asarray(a)))
                   .astype('int64').flatten() for a in (pred, label))
    if pred.shape[0] != label.shape[0]:
        raise ValueError(f'{caller}: pred has {pred.shape[0]} pixels but label has '
                         f'{label.shape[0]}.')
    return pred, label


def _count(values, keep, length):
    """How often each of 0..length-1 occurs among ``values`` where ``keep`` holds: int64
    [length], counted where the tensors are (on the GPU in evaluation)."""
    kept = paddle.masked_select(values, keep & (values >= 0) & (values < length))
    if kept.shape[0] == 0:
        return np.zeros([length], dtype='int64')
    return paddle.bincount(kept, minlength=length).numpy().astype('int64')


def class_areas(pred, label, num_classes, ignore_index=255):
    """int64 [3, num_classes] intersection, prediction and label pixel counts per class, of the
    pixels whose label is not ``ignore_index``: class i's intersection counts label i
    predicted as i, its prediction area every prediction of i (a label outside the classes
    included), its label area label i."""
    pred, label = _flat_int64(pred, label, 'class_areas')
    scored = label != ignore_index
    return np.stack([_count(label, scored & (pred == label), num_classes),
                     _count(pred, scored, num_classes),
                     _count(label, scored, num_classes)])


def confusion_matrix(pred, label, num_classes, ignore_index=255):
    """int64 [C, C] pixel counts of each (ground truth row, prediction column) pair of classes;
    pixels whose label is ``ignore_index`` or whose label or prediction is not in 0..C-1 are
    left out. The areas of :func:`class_areas` are its diagonal, column and row sums wherever
    labels are ``ignore_index`` or a class id, as ``validate_dataset`` makes them."""
    pred, label = _flat_int64(pred, label, 'confusion_matrix')
    valid = ((label != ignore_index) & (label >= 0) & (label < num_classes) &
             (pred >= 0) & (pred < num_classes))
    return _count(label * num_classes + pred, valid, num_classes ** 2).reshape(
        num_classes, num_classes)


def summarize(areas):
    """PaddleSeg's metrics from summed [3, num_classes] areas: ``miou``, ``acc``, ``kappa``,
    ``mdice`` (floats) and ``class_iou``, ``class_precision``, ``class_recall``,
    ``class_dice`` (arrays)."""
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
