"""Inference on one image: whole image, sliding windows, scales and flips, as InferenceOptions say.

Models follow paddleseg's convention: ``model(x)`` returns a list of logits,
the main one first, at the input size; results are mapped back to the label
size by undoing the transforms recorded in ``trans_info``. Before a model
runs, the memory its attention maps will take is checked against the memory
available (:func:`check_attention_memory`). Why this is not
``paddleseg.core.infer``: docs/design.md.
"""
import collections.abc
import math

import numpy as np
import paddle
import paddle.nn.functional as F

from psanet.compat import generic_place
from psanet.core.options import InferenceOptions
from psanet.errors import InferenceMemoryError

__all__ = ['reverse_transform', 'slide_windows', 'slide_inference', 'inference',
           'aug_inference', 'flip_combinations', 'available_memory', 'check_attention_memory']


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
    try:
        logits = model(x)
    except InferenceMemoryError:
        raise
    except MemoryError as error:
        height, width = int(x.shape[-2]), int(x.shape[-1])
        raise InferenceMemoryError(
            f'running the model on a {width}x{height} input ran out of memory '
            f'({_first_line(error)}); {_memory_advice(model, x, height, width)}') from error
    if not isinstance(logits, collections.abc.Sequence):
        raise TypeError(f'{type(model).__name__} returned {type(logits).__name__}: a segmentation '
                        'model must return a list of logits, the main one first.')
    return logits[0]


def slide_windows(height, width, crop_size, stride):
    """Window boxes covering an image, the last row/column flush with the border.

    Args:
        height (int): image height.
        width (int): image width.
        crop_size (tuple): (w, h) of a window, positive ints.
        stride (tuple): (w, h) step between windows, positive and at most crop_size
            (as :class:`InferenceOptions` checks them).

    Returns:
        list: ``(y1, y2, x1, x2)`` boxes, row by row.
    """
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


def inference(model, image, trans_info=None, options=None):
    """Logits of ``image`` at its original size given ``trans_info``, as ``options`` say.

    The whole image or sliding windows; with ``options.aug_eval``, averaged over
    scales and flips (:func:`aug_inference`).

    Args:
        model (paddle.nn.Layer): segmentation model in eval mode.
        image (Tensor): [N, C, H, W] normalised input.
        trans_info (list, optional): one sample's recorded transforms. Default: None.
        options (InferenceOptions, optional): Default: the whole image, once.

    Returns:
        Tensor: [N, num_classes, h, w] logits (mean probabilities with aug_eval and
        ``aug_combine='softmax'``).

    Raises:
        InferenceMemoryError: before the model runs, when the attention maps of
            the largest network input cannot fit in the memory available.
    """
    options = options or InferenceOptions()
    if options.aug_eval:
        return aug_inference(model, image, trans_info, options)
    check_attention_memory(model, image, is_slide=options.is_slide, crop_size=options.crop_size)
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

    Each scale resizes the input by ``scale`` (bilinear), each flip is undone
    on the output, and every output is resized back to the input size before
    averaging; then the recorded transforms are undone. With
    ``aug_combine='logits'`` this is paddleseg 2.8's ``aug_inference``.

    Args:
        model (paddle.nn.Layer): segmentation model in eval mode.
        image (Tensor): [N, C, H, W] normalised input.
        trans_info (list, optional): one sample's recorded transforms. Default: None.
        options (InferenceOptions, optional): scales, flips, windows and
            ``aug_combine`` ('logits' averages the logits, 'softmax' their softmax);
            ``aug_eval`` itself is not read. Default: scale 1.0, no flip.

    Returns:
        Tensor: [N, num_classes, h, w] mean logits, or mean probabilities with
        ``aug_combine='softmax'``.

    Raises:
        InferenceMemoryError: before the model runs, when the attention maps of
            the largest network input (scale, or window) cannot fit in the
            memory available.
    """
    options = options or InferenceOptions()
    scales = list(options.scales)
    check_attention_memory(model, image, scales=scales, is_slide=options.is_slide,
                           crop_size=options.crop_size)
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


def _scaled_size(height, width, scale):
    """(h, w) of an input resized by ``scale``, as aug_inference resizes it."""
    return int(height * scale + 0.5), int(width * scale + 0.5)


# --- Memory of attention maps ----------------------------------------------------------------
#
# A model that offers ``attention_memory(height, width, batch, channels, dtype)``
# (PSANet does) is asked, before it runs, what its attention maps will take at
# each network input size; other models pass unchecked.

# A suggested window leaves this share of the available memory to the rest of
# the network (backbone activations, the logits of the whole image).
_SUGGESTION_SHARE = 0.5


def _format_bytes(size):
    for unit, scale in (('GiB', 2 ** 30), ('MiB', 2 ** 20), ('KiB', 2 ** 10)):
        if size >= scale:
            return f'{size / scale:.1f} {unit}'
    return f'{int(size)} B'


def _first_line(error):
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def available_memory(place=None):
    """Bytes new tensors can still take on ``place``'s device, or None when unknown.

    CPU: ``MemAvailable`` of /proc/meminfo (Linux; None elsewhere). GPU: the
    device's free memory plus what Paddle's allocator holds but does not use.

    Args:
        place (paddle.Place, optional): Default: the current device.
    """
    place = generic_place(place)
    if place.is_gpu_place():
        core = paddle.base.core
        if not hasattr(core, 'gpu_memory_available'):
            return None
        device = place.gpu_device_id()
        cached = paddle.device.cuda.memory_reserved(device) - \
            paddle.device.cuda.memory_allocated(device)
        return int(core.gpu_memory_available()) + max(int(cached), 0)
    if not place.is_cpu_place():
        return None
    try:
        with open('/proc/meminfo') as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _attention_memory(model, image, height, width):
    """The model's attention plan for a ``height x width`` input of ``image``'s batch, or None."""
    plan = getattr(model, 'attention_memory', None)
    if not callable(plan):
        return None
    return plan(height, width, int(image.shape[0]), int(image.shape[1]), image.dtype)


def _fits(model, image, height, width, budget):
    need = _attention_memory(model, image, height, width)
    return need is None or need['peak_bytes'] <= budget


def _suggest_crop(model, image, height, width, budget):
    """The largest window of about the input's aspect whose attention fits ``budget``."""
    need = _attention_memory(model, image, height, width)
    unit = need['input_unit'] if need else 1
    # The map grows with the square of the area, so with the 4th power of the side.
    factor = min(1.0, (budget / need['peak_bytes']) ** 0.25) if need else 1.0
    crop_h = max(unit, int(height * factor) // unit * unit)
    crop_w = max(unit, int(width * factor) // unit * unit)
    while not _fits(model, image, crop_h, crop_w, budget):
        if crop_h == unit and crop_w == unit:
            return None
        if crop_h >= crop_w and crop_h > unit or crop_w == unit:
            crop_h -= unit
        else:
            crop_w -= unit
    return crop_w, crop_h


def _suggest_scale(model, image, height, width, budget):
    """The largest scale (2 decimals) at which the whole input's attention fits ``budget``."""
    scale = 1.0
    while scale >= 0.01:
        if _fits(model, image, *_scaled_size(height, width, scale), budget):
            return scale
        scale = round(scale - 0.01, 2)
    return None


def _memory_advice(model, image, height, width, scales=None, available=None):
    """How to run a ``height x width`` input in the memory there is: a window, or smaller scales."""
    available = available_memory(image.place) if available is None else available
    if _attention_memory(model, image, height, width) is None or available is None:
        return ('use sliding windows (--is_slide --crop_size W H --stride W H) with a smaller '
                'crop, or smaller --scales.')
    budget = available * _SUGGESTION_SHARE
    crop = _suggest_crop(model, image, height, width, budget)
    if crop is None:
        return (f'not even the smallest window fits in {_format_bytes(available)}: free memory '
                f'or run on a machine with more.')
    crop_w, crop_h = crop
    advice = (f'use sliding windows that fit, e.g. --is_slide --crop_size {crop_w} {crop_h} '
              f'--stride {max(1, crop_w * 3 // 4)} {max(1, crop_h * 3 // 4)}')
    if scales is not None:
        base_h, base_w = int(image.shape[-2]), int(image.shape[-1])
        scale = _suggest_scale(model, image, base_h, base_w, budget)
        if scale is not None and max(scales) > scale:
            advice += f', or --scales no larger than {scale:g}'
    return advice + '.'


def check_attention_memory(model, image, scales=None, is_slide=False, crop_size=None):
    """Raises InferenceMemoryError when an attention map of this inference cannot fit.

    Every network input the inference will run (the image at each scale, or
    its windows) is sized before any runs; the largest is compared with the
    memory available on the image's device. Models without PSA branches, and
    devices whose free memory is unknown, pass unchecked.

    Args:
        model (paddle.nn.Layer): the model.
        image (Tensor): [N, C, H, W] input, on the device the model runs on.
        scales (list, optional): aug_inference's scales; None: the image as is.
        is_slide (bool, optional): windows of ``crop_size`` at each scale. Default: False.
        crop_size (tuple, optional): (w, h) of a window. Default: None.

    Raises:
        InferenceMemoryError: naming the memory needed and available, and a
            window (``--is_slide --crop_size``) or scale that fits.
    """
    if not callable(getattr(model, 'attention_memory', None)):
        return
    available = available_memory(image.place)
    if available is None:
        return
    height, width = int(image.shape[-2]), int(image.shape[-1])
    worst = None
    for scale in scales or [1.0]:
        h, w = _scaled_size(height, width, scale)
        if is_slide:
            h, w = min(h, int(crop_size[1])), min(w, int(crop_size[0]))
        need = _attention_memory(model, image, h, w)
        if need is None:
            return
        if worst is None or need['peak_bytes'] > worst[0]['peak_bytes']:
            worst = (need, h, w)
    need, h, w = worst
    if need['peak_bytes'] <= available:
        return
    where = 'GPU' if image.place.is_gpu_place() else 'host'
    softmax = ', more while its softmax runs' if need['peak_bytes'] > need['map_bytes'] else ''
    what = f'{w}x{h} windows' if is_slide else f'a {w}x{h} network input'
    raise InferenceMemoryError(
        f'{what} need{"" if is_slide else "s"} {_format_bytes(need["peak_bytes"])} for '
        f'the model\'s attention (each branch\'s map {need["shape"]} {need["dtype"]} is '
        f'{_format_bytes(need["map_bytes"])}{softmax}), but only '
        f'{_format_bytes(available)} of {where} memory is available; '
        f'{_memory_advice(model, image, height, width, scales, available)}')
