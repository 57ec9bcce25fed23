"""Inference on one image: whole image, sliding window, and multi-scale / flip augmentation.

Models follow paddleseg's convention: ``model(x)`` returns a list of logits
whose first item is the main prediction at the input size. Results are
mapped back to the original label size by undoing the shape changes the
transforms recorded in ``trans_info`` (('resize', [h, w]) / ('padding', [h, w])
entries, most recent last).

Why not ``paddleseg.core.infer`` (2.8.0, which imports on Paddle 3.3.1):
the engine does not use ``paddleseg.core`` at all (its train/evaluate fail
on Paddle 3, see psanet/compat.py), and its inference differs where it
matters here:

* ``aug_inference`` there averages raw logits over scales and flips; here the
  softmax of each is averaged, after the flip is undone and before the
  resize back to the input size, so a scale with larger logits does not
  dominate (and ``evaluate`` scores probabilities);
* ``slide_inference`` there accumulates windows in float64 numpy and returns
  a float64 tensor (a host copy per window, and no fp16 path); here it stays
  a Paddle tensor of the model's dtype;
* ``inference`` there returns ``(pred, logit)`` or ``logit`` depending on
  ``trans_info``; here always the logits (or probabilities);
* bad ``trans_info`` entries or ``crop_size``/``stride`` raise errors that
  name the fix instead of a bare ``Exception`` or a ``RuntimeError`` after
  inference.

``reverse_transform`` (bilinear) and ``flip_combinations`` match paddleseg's
``reverse_transform(mode='bilinear')`` and ``flip_combination`` on float
logits; they stay here so that this module does not import
``paddleseg.core`` (about 9 s, and its training code) for 30 lines.
"""
import collections.abc
import math

import numpy as np
import paddle
import paddle.nn.functional as F

from psanet.core.errors import ConfigError

__all__ = ['reverse_transform', 'slide_windows', 'slide_inference', 'inference',
           'aug_inference', 'flip_combinations', 'check_slide_args']


def reverse_transform(logit, trans_info, mode='bilinear'):
    """Undoes the recorded resizes and paddings, last first.

    Args:
        logit (Tensor): [N, C, H, W] at the network input size.
        trans_info (list): one sample's ``[(op, [h, w]), ...]`` as the transforms recorded it,
            each size being the image size *before* that op.
        mode (str, optional): interpolation mode for 'resize'. Default: 'bilinear'.

    Returns:
        Tensor: [N, C, h0, w0], the size of the image as read (and of its label).
    """
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


def _main_logit(model, x):
    logits = model(x)
    if not isinstance(logits, collections.abc.Sequence):
        raise TypeError(f'{type(model).__name__} returned {type(logits).__name__}: a segmentation '
                        'model must return a list of logits, the main one first.')
    return logits[0]


def check_slide_args(crop_size, stride):
    """Validates ``(w, h)`` pairs for sliding-window inference and returns them as int tuples."""
    pairs = []
    for name, value in (('crop_size', crop_size), ('stride', stride)):
        if value is None or len(value) != 2 or any(int(v) <= 0 for v in value):
            raise ConfigError(f'sliding-window inference needs --{name} as two positive ints '
                              f'(width height), got {value!r}.')
        pairs.append((int(value[0]), int(value[1])))
    (crop_w, crop_h), (stride_w, stride_h) = pairs
    if stride_w > crop_w or stride_h > crop_h:
        raise ConfigError(f'--stride {stride_w} {stride_h} is larger than --crop_size {crop_w} '
                          f'{crop_h}: windows would leave pixels unpredicted; use a stride no '
                          'larger than the crop.')
    return pairs[0], pairs[1]


def slide_windows(height, width, crop_size, stride):
    """Window boxes covering an image, the last row/column flush with the border.

    Args:
        height (int): image height.
        width (int): image width.
        crop_size (tuple): (w, h) of a window.
        stride (tuple): (w, h) step between windows.

    Returns:
        list: ``(y1, y2, x1, x2)`` boxes, row by row.
    """
    (crop_w, crop_h), (stride_w, stride_h) = check_slide_args(crop_size, stride)
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
    """Logits from overlapping windows, each pixel the mean over the windows covering it.

    Args:
        model (paddle.nn.Layer): segmentation model.
        image (Tensor): [N, C, H, W].
        crop_size (tuple): (w, h) of a window; a window larger than the image is clipped to it.
        stride (tuple): (w, h) between windows, at most crop_size.

    Returns:
        Tensor: [N, num_classes, H, W].
    """
    height, width = int(image.shape[-2]), int(image.shape[-1])
    total = None
    count = np.zeros([1, 1, height, width], dtype='float32')
    for y1, y2, x1, x2 in slide_windows(height, width, crop_size, stride):
        logit = _main_logit(model, image[:, :, y1:y2, x1:x2])
        padded = F.pad(logit, [x1, width - x2, y1, height - y2], mode='constant', value=0.0)
        total = padded if total is None else total + padded
        count[:, :, y1:y2, x1:x2] += 1
    return total / paddle.to_tensor(count, dtype=total.dtype)


def inference(model, image, trans_info=None, is_slide=False, crop_size=None, stride=None):
    """Logits of the whole image or of sliding windows, at the original size given ``trans_info``.

    Args:
        model (paddle.nn.Layer): segmentation model in eval mode.
        image (Tensor): [N, C, H, W] normalised input.
        trans_info (list, optional): one sample's recorded transforms. Default: None.
        is_slide (bool, optional): sliding-window inference. Default: False.
        crop_size (tuple, optional): (w, h), needed when is_slide. Default: None.
        stride (tuple, optional): (w, h), needed when is_slide. Default: None.

    Returns:
        Tensor: [N, num_classes, h, w] logits.
    """
    if is_slide:
        logit = slide_inference(model, image, crop_size, stride)
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


def aug_inference(model, image, trans_info=None, scales=1.0, flip_horizontal=False,
                  flip_vertical=False, is_slide=False, crop_size=None, stride=None):
    """Softmax probabilities averaged over scales and flips.

    Each scale resizes the input by ``scale`` (bilinear), each flip is undone
    on the output, and every probability map is resized back to the input
    size before averaging.

    Args:
        model (paddle.nn.Layer): segmentation model in eval mode.
        image (Tensor): [N, C, H, W] normalised input.
        trans_info (list, optional): one sample's recorded transforms. Default: None.
        scales (float | list, optional): input scales. Default: 1.0.
        flip_horizontal (bool, optional): add horizontally flipped inputs. Default: False.
        flip_vertical (bool, optional): add vertically flipped inputs. Default: False.
        is_slide (bool, optional): sliding windows at each scale. Default: False.
        crop_size (tuple, optional): (w, h) when is_slide. Default: None.
        stride (tuple, optional): (w, h) when is_slide. Default: None.

    Returns:
        Tensor: [N, num_classes, h, w] probabilities.
    """
    if isinstance(scales, (int, float)):
        scales = [scales]
    scales = [float(s) for s in scales]
    if not scales or any(s <= 0 for s in scales):
        raise ConfigError(f'--scales must be positive numbers, got {scales}.')
    height, width = int(image.shape[-2]), int(image.shape[-1])
    combos = flip_combinations(flip_horizontal, flip_vertical)
    total = None
    for scale in scales:
        size = [int(height * scale + 0.5), int(width * scale + 0.5)]
        scaled = image if size == [height, width] else F.interpolate(
            image, size, mode='bilinear', align_corners=False)
        for horizontal, vertical in combos:
            logit = inference(model, _flip(scaled, horizontal, vertical), is_slide=is_slide,
                              crop_size=crop_size, stride=stride)
            prob = _flip(F.softmax(logit, axis=1), horizontal, vertical)
            if list(prob.shape[-2:]) != [height, width]:
                prob = F.interpolate(prob, [height, width], mode='bilinear', align_corners=False)
            total = prob if total is None else total + prob
    prob = total / float(len(scales) * len(combos))
    if trans_info is not None:
        prob = reverse_transform(prob, trans_info)
    return prob
