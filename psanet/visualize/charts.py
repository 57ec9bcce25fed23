"""An evaluation as pictures: the per-class IoU chart and the row-normalised confusion matrix.

val.py --save_dir writes them (:func:`write_evaluation_figures`), training
logs them to VisualDL (:func:`log_evaluation_figures`); :func:`class_names`
names the classes (the attention figures' legend too).
"""
import os

import cv2
import numpy as np

from psanet.contract import palette_for
from psanet.visualize.drawing import (BLACK, GREY, WHITE, put_text, text_width, vertical_text,
                                      write_png)

__all__ = ['class_names', 'normalized_confusion', 'iou_bar_chart', 'confusion_matrix_image',
           'write_evaluation_figures', 'log_evaluation_figures', 'EVALUATION_FIGURES']

# File names of write_evaluation_figures, also the VisualDL tags' last part.
EVALUATION_FIGURES = ('class_iou', 'confusion_matrix')


def class_names(num_classes, dataset=None):
    """Names of the classes: Cityscapes' 19 train ids, else ``'class 0'``, ``'class 1'``, ...

    Args:
        num_classes (int): number of classes.
        dataset (object, optional): the dataset or its class; None counts 19 classes as
            Cityscapes'. Default: None.
    """
    dataset_class = dataset if dataset is None or isinstance(dataset, type) else type(dataset)
    if num_classes == 19 and (dataset is None or palette_for(dataset_class) == 'cityscapes'):
        from cityscapesscripts.helpers.labels import labels
        names = {label.trainId: label.name for label in labels if 0 <= label.trainId < 255}
        return [names[i] for i in range(num_classes)]
    return [f'class {i}' for i in range(num_classes)]


def normalized_confusion(confusion):
    """Each row of a confusion matrix divided by its sum: float64, NaN rows for classes
    without ground-truth pixels."""
    confusion = np.asarray(confusion, np.float64)
    totals = confusion.sum(axis=1, keepdims=True)
    with np.errstate(invalid='ignore', divide='ignore'):
        return np.where(totals > 0, confusion / totals, np.nan)


def iou_bar_chart(class_iou, class_names, miou):
    """A horizontal bar per class (its name, its IoU) and a vertical line at the mIoU.

    Args:
        class_iou (np.ndarray): [C] IoU per class.
        class_names (list): C names.
        miou (float): the mean IoU.

    Returns:
        np.ndarray: BGR uint8 image.
    """
    class_iou = np.asarray(class_iou, np.float64)
    scale, row_height, bar_width = 0.5, 24, 500
    left = max(text_width(name, scale) for name in class_names) + 16
    top, bottom = 56, 36
    height = top + row_height * len(class_iou) + bottom
    width = left + bar_width + 70
    image = np.full((height, width, 3), 255, np.uint8)
    put_text(image, f'Per-class IoU ({len(class_iou)} classes)', (8, 22), 0.6)
    for tick in np.linspace(0, 1, 6):
        x = left + int(round(tick * bar_width))
        cv2.line(image, (x, top - 4), (x, height - bottom), (225, 225, 225), 1)
        put_text(image, f'{tick:.1f}', (x - 10, height - bottom + 18), 0.45)
    put_text(image, 'IoU', (left + bar_width // 2 - 12, height - 4), 0.45)
    values = []
    for i, (name, iou) in enumerate(zip(class_names, class_iou)):
        y = top + i * row_height
        put_text(image, name, (left - 8 - text_width(name, scale), y + 16), scale)
        if np.isnan(iou):
            values.append(('n/a', left + 4, y))
            continue
        end = left + int(round(np.clip(iou, 0, 1) * bar_width))
        cv2.rectangle(image, (left, y + 3), (max(end, left + 1), y + row_height - 3),
                      (180, 119, 31), -1)
        values.append((f'{iou:.3f}', end + 4, y))
    x = left + int(round(np.clip(miou, 0, 1) * bar_width))
    cv2.line(image, (x, top - 6), (x, height - bottom), (40, 40, 220), 2)
    label = f'mIoU {miou:.4f}'
    label_x = min(max(x - text_width(label, 0.5) // 2, left), width - text_width(label, 0.5) - 4)
    put_text(image, label, (label_x, top - 12), 0.5, (40, 40, 220))
    for text, x, y in values:  # over the mIoU line, on white
        cv2.rectangle(image, (x - 1, y + 4), (x + text_width(text, 0.45) + 1, y + 20), WHITE, -1)
        put_text(image, text, (x, y + 16), 0.45)
    return image


def _blues(values):
    """[...] values in 0..1 -> BGR from white to dark blue."""
    low, high = np.array(WHITE, np.float64), np.array((107, 48, 8), np.float64)
    values = np.clip(np.asarray(values, np.float64), 0, 1)[..., None]
    return (low + (high - low) * values).round().astype(np.uint8)


def confusion_matrix_image(confusion, class_names):
    """The row-normalised confusion matrix (rows ground truth, columns prediction).

    Each cell is the share of the row class's ground-truth pixels predicted as
    the column class (:func:`normalized_confusion`), in percent, white (0) to
    dark blue (100); a class without ground-truth pixels is a grey row.

    Args:
        confusion (np.ndarray): [C, C] pixel counts, rows ground truth.
        class_names (list): C names.

    Returns:
        np.ndarray: BGR uint8 image.
    """
    shares = normalized_confusion(confusion)
    count = len(shares)
    cell = 30 if count <= 30 else max(8, 900 // count)
    scale = 0.45 if cell >= 20 else 0.35
    name_width = max(text_width(name, scale) for name in class_names) + 12
    left, top = 28 + name_width, 64 + name_width
    matrix_size = cell * count
    title = 'Confusion matrix, % of each ground-truth class'
    height = top + matrix_size + 20
    width = max(left + matrix_size + 90, text_width(title, 0.6) + 16)
    image = np.full((height, width, 3), 255, np.uint8)
    put_text(image, title, (8, 22), 0.6)
    put_text(image, 'prediction', (left + matrix_size // 2 - 40, 48), 0.5)
    axis = vertical_text('ground truth', 0.5)
    y = top + max(0, (matrix_size - axis.shape[0]) // 2)
    image[y:y + axis.shape[0], 4:4 + axis.shape[1]] = axis[:height - y]
    for i, name in enumerate(class_names):
        y = top + i * cell
        put_text(image, name, (left - 6 - text_width(name, scale), y + cell // 2 + 5), scale)
        label = vertical_text(name, scale)
        x = left + i * cell + (cell - label.shape[1]) // 2
        image[top - 6 - label.shape[0]:top - 6, x:x + label.shape[1]] = label
    empty = np.isnan(shares).all(axis=1)
    for i in range(count):
        y = top + i * cell
        if empty[i]:
            image[y:y + cell, left:left + matrix_size] = (235, 235, 235)
            continue
        image[y:y + cell, left:left + matrix_size] = np.repeat(
            np.repeat(_blues(shares[i])[None], cell, axis=0), cell, axis=1)
        if cell < 20:
            continue
        for j, share in enumerate(shares[i]):
            if share >= 0.005:
                text = f'{100 * share:.0f}'
                x = left + j * cell + (cell - text_width(text, 0.4)) // 2
                put_text(image, text, (x, y + cell // 2 + 5), 0.4,
                         WHITE if share > 0.5 else BLACK)
    for k in range(count + 1):
        cv2.line(image, (left, top + k * cell), (left + matrix_size, top + k * cell),
                 (210, 210, 210), 1)
        cv2.line(image, (left + k * cell, top), (left + k * cell, top + matrix_size),
                 (210, 210, 210), 1)
    for k in np.flatnonzero(~empty):  # the diagonal, the correct predictions, outlined
        corner = left + k * cell, top + k * cell
        cv2.rectangle(image, corner, (corner[0] + cell, corner[1] + cell), (60, 60, 60), 1)
    for k in np.flatnonzero(empty):
        put_text(image, 'no ground-truth pixels', (left + 6, top + k * cell + cell // 2 + 5),
                 scale, GREY)
    bar_x = left + matrix_size + 16
    ramp = _blues(np.linspace(1, 0, matrix_size))[:, None]
    image[top:top + matrix_size, bar_x:bar_x + 16] = np.repeat(ramp, 16, axis=1)
    cv2.rectangle(image, (bar_x, top), (bar_x + 15, top + matrix_size - 1), GREY, 1)
    for share, y in ((1, top + 10), (0.5, top + matrix_size // 2 + 5), (0, top + matrix_size)):
        put_text(image, f'{100 * share:.0f}%', (bar_x + 20, y), 0.45)
    return image


def _evaluation_images(result, class_names):
    chart, matrix = EVALUATION_FIGURES
    return {chart: iou_bar_chart(result['class_iou'], class_names, result['miou']),
            matrix: confusion_matrix_image(result['confusion_matrix'], class_names)}


def write_evaluation_figures(result, class_names, save_dir):
    """Writes ``class_iou.png`` and ``confusion_matrix.png`` of an evaluation into ``save_dir``.

    Args:
        result (dict): from ``psanet.core.val.evaluate``: ``class_iou``, ``miou`` and
            ``confusion_matrix`` ([C, C], rows ground truth).
        class_names (list): C names (:func:`class_names`).
        save_dir (str): folder, made when missing; each file is written whole.

    Returns:
        list: the two paths.
    """
    return [write_png(os.path.join(save_dir, f'{name}.png'), image)
            for name, image in _evaluation_images(result, class_names).items()]


def log_evaluation_figures(writer, result, class_names, step):
    """Logs the two figures of :func:`write_evaluation_figures` to a VisualDL ``LogWriter``
    as ``Evaluate/class_iou`` and ``Evaluate/confusion_matrix`` (RGB, HWC) at ``step``."""
    for name, image in _evaluation_images(result, class_names).items():
        writer.add_image(f'Evaluate/{name}', cv2.cvtColor(image, cv2.COLOR_BGR2RGB), step)
