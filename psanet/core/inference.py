"""Inference on one image: whole image, sliding windows, scales and flips, as InferenceOptions say.

Models return a list of logits, the main one first, at the input size; results are mapped
back to the label size by undoing the transforms recorded in ``trans_info``. The attention
maps' memory is checked before a model runs. Why this is not ``paddleseg.core.infer``:
docs/design.md.
"""
import collections.abc
import math

import numpy as np
import paddle
import paddle.nn.functional as F

from psanet.core.options import InferenceOptions
from psanet.deploy.attention_memory import check_attention_memory, out_of_memory
from psanet.deploy.attention_memory import scaled_size as _scaled_size
from psanet.errors import InferenceMemoryError
from psanet.models import PSANet

__all__ = ['reverse_transform', 'slide_windows', 'slide_inference', 'inference',
           'aug_inference', 'flip_combinations']


def reverse_transform(logit, trans_info, mode='bilinear'):
    """Undoes the recorded resizes and paddings, last first: [N, C, H, W] at the network input
    size -> the size of the image as read. ``trans_info``: one sample's ``[(op, [h, w]), ...]``,
    each size the image's *before* that op."""
    for op, size in reversed(list(trans_info)):
        h, w = int(size[0]), int(size[1])
        if op == 'resize':
            logit = F.interpolate(logit, [h, w], mode=mode, align_corners=False)
        elif op == 'padding':
            logit = logit[:, :, 0:h, 0:w]
        else:
            raise ValueError(f'unknown trans_info entry {op!r}: only resize and padding can be '
                             'undone')
    return logit


def _attention_memory(model):
    """The model's plan of its attention memory (``PSANet.attention_memory``); None for a
    model without one."""
    return model.attention_memory if isinstance(model, PSANet) else None


def _main_logit(model, x):
    try:
        logits = model(x)
    except InferenceMemoryError:
        raise
    except MemoryError as error:
        raise out_of_memory(_attention_memory(model), x, error) from error
    if not isinstance(logits, collections.abc.Sequence):
        raise TypeError(f'{type(model).__name__} returned {type(logits).__name__}: a segmentation '
                        'model must return a list of logits, the main one first.')
    return logits[0]


def slide_windows(height, width, crop_size, stride):
    """``(y1, y2, x1, x2)`` window boxes covering an image, row by row, the last row and column
    flush with the border; crop_size and stride are (w, h), as InferenceOptions checks them."""
    (crop_w, crop_h), (stride_w, stride_h) = crop_size, stride
    rows = max(math.ceil((height - crop_h) / stride_h), 0) + 1
    cols = max(math.ceil((width - crop_w) / stride_w), 0) + 1
    boxes = []
    for r in range(rows):
        for c in range(cols):
            y2 = min(r * stride_h + crop_h, height)
            x2 = min(c * stride_w + crop_w, width)
            boxes.append((max(y2 - crop_h, 0), y2, max(x2 - crop_w, 0), x2))
    return boxes


def slide_inference(model, image, crop_size, stride):
    """Logits from overlapping windows, each pixel the mean over the windows covering it; a
    window larger than the image is clipped to it."""
    height, width = int(image.shape[-2]), int(image.shape[-1])
    total = None
    count = np.zeros([1, 1, height, width], dtype='float32')
    for y1, y2, x1, x2 in slide_windows(height, width, crop_size, stride):
        logit = _main_logit(model, image[:, :, y1:y2, x1:x2])
        padded = F.pad(logit, [x1, width - x2, y1, height - y2], mode='constant', value=0.0)
        total = padded if total is None else total + padded
        count[:, :, y1:y2, x1:x2] += 1
    return total / paddle.to_tensor(count, dtype=total.dtype)


def inference(model, image, trans_info=None, options=None):
    """Logits of ``image`` at its original size given ``trans_info``, as ``options`` say
    (default: the whole image, once); mean probabilities with aug_eval and
    ``aug_combine='softmax'``.

    Raises:
        InferenceMemoryError: before the model runs, when the attention maps of the largest
            network input cannot fit in the memory available.
    """
    options = options or InferenceOptions()
    if options.aug_eval:
        return aug_inference(model, image, trans_info, options)
    check_attention_memory(_attention_memory(model), image, is_slide=options.is_slide,
                           crop_size=options.crop_size)
    return _inference(model, image, trans_info, options)


def _inference(model, image, trans_info, options):
    if options.is_slide:
        logit = slide_inference(model, image, options.crop_size, options.stride)
    else:
        logit = _main_logit(model, image)
    if trans_info is not None:
        logit = reverse_transform(logit, trans_info)
    return logit


def flip_combinations(flip_horizontal=False, flip_vertical=False):
    """(horizontal, vertical) flips to average over, starting with no flip."""
    combos = [(False, False)]
    if flip_horizontal:
        combos.append((True, False))
    if flip_vertical:
        combos.append((False, True))
        if flip_horizontal:
            combos.append((True, True))
    return combos


def _flip(x, horizontal, vertical):
    axes = ([3] if horizontal else []) + ([2] if vertical else [])
    return paddle.flip(x, axis=axes) if axes else x


def aug_inference(model, image, trans_info=None, options=None):
    """Logits (or probabilities) averaged over ``options``' scales and flips.

    Each scale resizes the input (bilinear), each flip is undone on the output, and every
    output is resized back to the input size before averaging; then the recorded transforms
    are undone. With ``aug_combine='logits'`` this is paddleseg 2.8's ``aug_inference``;
    ``options.aug_eval`` itself is not read. Raises InferenceMemoryError as :func:`inference`.
    """
    options = options or InferenceOptions()
    scales = list(options.scales)
    check_attention_memory(_attention_memory(model), image, scales=scales,
                           is_slide=options.is_slide, crop_size=options.crop_size)
    height, width = int(image.shape[-2]), int(image.shape[-1])
    combos = flip_combinations(options.flip_horizontal, options.flip_vertical)
    total = None
    for scale in scales:
        size = list(_scaled_size(height, width, scale))
        # A bilinear resize to the same size is the identity, bit for bit: skipped.
        scaled = image if size == [height, width] else F.interpolate(
            image, size, mode='bilinear', align_corners=False)
        for horizontal, vertical in combos:
            score = _inference(model, _flip(scaled, horizontal, vertical), None, options)
            if options.aug_combine == 'softmax':
                score = F.softmax(score, axis=1)
            score = _flip(score, horizontal, vertical)
            if list(score.shape[-2:]) != [height, width]:
                score = F.interpolate(score, [height, width], mode='bilinear',
                                      align_corners=False)
            total = score if total is None else total + score
    score = total / float(len(scales) * len(combos))
    if trans_info is not None:
        score = reverse_transform(score, trans_info)
    return score
