"""The memory of the attention maps: checked before a model runs, with a window or scale that fits.

A PSANet says what its attention maps take at one input size
(``PSANet.attention_memory``, an ``AttentionMemory``); other models pass
unchecked. A map of ``cells = h*w`` positions has ``N * cells**2`` elements and
``h = ceil(H / input_unit)``, so the largest window or scale that fits is
worked out from the number of cells the memory holds, not searched for.
"""
import math

import paddle

from psanet.compat import free_gpu_memory, generic_place
from psanet.deploy.memory import format_bytes, host_memory_available
from psanet.errors import InferenceMemoryError
from psanet.models import PSANet

__all__ = ['available_memory', 'check_attention_memory', 'out_of_memory', 'largest_crop',
           'largest_scale', 'scaled_size']

# A suggested window leaves this share of the available memory to the rest of
# the network (backbone activations, the logits of the whole image).
_SUGGESTION_SHARE = 0.5


def scaled_size(height, width, scale):
    """(h, w) of an input resized by ``scale``, as aug_inference resizes it."""
    return int(height * scale + 0.5), int(width * scale + 0.5)


def available_memory(place=None):
    """Bytes new tensors can still take on ``place``'s device, or None when unknown.

    CPU: ``MemAvailable`` of /proc/meminfo (Linux; None elsewhere). GPU: the
    device's free memory as CUDA reports it (``psanet.compat.free_gpu_memory``)
    plus what Paddle's allocator holds but does not use
    (``paddle.device.cuda.memory_reserved - memory_allocated``).

    Args:
        place (paddle.Place, optional): Default: the current device.
    """
    place = generic_place(place)
    if place.is_gpu_place():
        device = place.gpu_device_id()
        cached = paddle.device.cuda.memory_reserved(device) - \
            paddle.device.cuda.memory_allocated(device)
        return free_gpu_memory(device) + max(int(cached), 0)
    if not place.is_cpu_place():
        return None
    return host_memory_available()


def _first_line(error):
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _plan(model, image, height, width):
    """The model's AttentionMemory for a ``height x width`` input of ``image``'s batch, or None."""
    if not isinstance(model, PSANet):
        return None
    return model.attention_memory(height, width, int(image.shape[0]))


def _cells(plan, budget):
    """The most map positions (h*w) whose attention fits ``budget`` bytes."""
    per_cell_pair = plan.shape[0] * plan.peak_bytes_per_element  # bytes per cells**2
    return math.isqrt(int(budget) // per_cell_pair)


def _shorten(rows, cols, cells):
    """(rows, cols) shortened to at most ``cells`` positions as one-position steps on the
    longer side (rows on a tie) would: the longer side cut to what the shorter allows,
    else the m x m or m x (m + 1) (m rows) that fits; None when ``cells`` is 0."""
    if cells < 1:
        return None
    if rows * cols <= cells:
        return rows, cols
    short = min(rows, cols)
    if short * short <= cells:
        return (cells // short, short) if rows >= cols else (short, cells // short)
    side = math.isqrt(cells)
    return side, side + 1 if side * (side + 1) <= cells else side


def largest_crop(plan, height, width, budget):
    """The largest window of about a ``height x width`` input's aspect whose attention fits.

    The window is the input scaled by the 4th root of ``budget / peak_bytes``,
    each side rounded down to whole map positions (``input_unit`` pixels), at
    least one. Since the map's positions grow with the product of the sides
    and its elements with their square, that fits, except where a side was
    raised to one position or the root rounded up: then the longer side is
    shortened (:func:`_shorten`).

    Args:
        plan (AttentionMemory): the model's plan for the whole input.
        height (int): the input's height.
        width (int): the input's width.
        budget (float): bytes the attention may take.

    Returns:
        tuple | None: ``(crop_w, crop_h)``, multiples of ``input_unit``; None when not
        even one position fits.
    """
    unit = plan.input_unit
    factor = min(1.0, (budget / plan.peak_bytes) ** 0.25)
    rows = max(1, int(height * factor) // unit)
    cols = max(1, int(width * factor) // unit)
    cut = _shorten(rows, cols, _cells(plan, budget))
    return None if cut is None else (cut[1] * unit, cut[0] * unit)


def _largest_step(size, limit):
    """The largest k (0..100) for which ``scaled_size`` of ``size`` at k/100 is at most
    ``limit`` pixels: int(size * k/100 + 0.5) <= limit, in exact arithmetic, then checked
    in the floats scaled_size computes with."""
    k = min(100, (100 * (2 * limit + 1) - 1) // (2 * size))
    while k > 0 and int(size * (k / 100) + 0.5) > limit:
        k -= 1
    while k < 100 and int(size * ((k + 1) / 100) + 0.5) <= limit:
        k += 1
    return k


def largest_scale(plan, height, width, budget):
    """The largest scale (2 decimals, at most 1) at which a whole input's attention fits.

    At a scale the map is ``ceil(h'/unit) x ceil(w'/unit)`` positions for the
    scaled size (h', w'); for each number of rows r that fits, the columns
    ``cells // r`` bound the width; the scale is the largest that keeps both.

    Args:
        plan (AttentionMemory): the model's plan (any input size: only its unit and
            bytes per element are read).
        height (int): the input's height at scale 1.
        width (int): the input's width at scale 1.
        budget (float): bytes the attention may take.

    Returns:
        float | None: e.g. 0.73; None when not even scale 0.01 fits.
    """
    unit, cells = plan.input_unit, _cells(plan, budget)
    best = 0
    for rows in range(1, min(cells, math.ceil(height / unit)) + 1):
        best = max(best, min(_largest_step(height, rows * unit),
                             _largest_step(width, cells // rows * unit)))
    return best / 100 if best else None


def _memory_advice(model, image, height, width, scales=None, available=None):
    """How to run a ``height x width`` input in the memory there is: a window, or smaller scales."""
    available = available_memory(image.place) if available is None else available
    plan = _plan(model, image, height, width)
    if plan is None or available is None:
        return ('use sliding windows (--is_slide --crop_size W H --stride W H) with a smaller '
                'crop, or smaller --scales.')
    budget = available * _SUGGESTION_SHARE
    crop = largest_crop(plan, height, width, budget)
    if crop is None:
        return (f'not even the smallest window fits in {format_bytes(available)}: free memory '
                f'or run on a machine with more.')
    crop_w, crop_h = crop
    advice = (f'use sliding windows that fit, e.g. --is_slide --crop_size {crop_w} {crop_h} '
              f'--stride {max(1, crop_w * 3 // 4)} {max(1, crop_h * 3 // 4)}')
    if scales is not None:
        scale = largest_scale(plan, int(image.shape[-2]), int(image.shape[-1]), budget)
        if scale is not None and max(scales) > scale:
            advice += f', or --scales no larger than {scale:g}'
    return advice + '.'


def out_of_memory(model, x, error):
    """The InferenceMemoryError for a model run on ``x`` that raised MemoryError ``error``."""
    height, width = int(x.shape[-2]), int(x.shape[-1])
    return InferenceMemoryError(
        f'running the model on a {width}x{height} input ran out of memory '
        f'({_first_line(error)}); {_memory_advice(model, x, height, width)}')


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
    height, width = int(image.shape[-2]), int(image.shape[-1])
    worst = None
    for scale in scales or [1.0]:
        h, w = scaled_size(height, width, scale)
        if is_slide:
            h, w = min(h, int(crop_size[1])), min(w, int(crop_size[0]))
        need = _plan(model, image, h, w)
        if need is None:  # no attention to plan for
            return
        if worst is None or need.peak_bytes > worst[0].peak_bytes:
            worst = (need, h, w)
    available = available_memory(image.place)
    if available is None:
        return
    need, h, w = worst
    if need.peak_bytes <= available:
        return
    where = 'GPU' if image.place.is_gpu_place() else 'host'
    softmax = ', more while its softmax runs' if need.peak_bytes > need.map_bytes else ''
    what = f'{w}x{h} windows' if is_slide else f'a {w}x{h} network input'
    raise InferenceMemoryError(
        f'{what} need{"" if is_slide else "s"} {format_bytes(need.peak_bytes)} for '
        f'the model\'s attention (each branch\'s map {need.shape} {need.dtype} is '
        f'{format_bytes(need.map_bytes)}{softmax}), but only '
        f'{format_bytes(available)} of {where} memory is available; '
        f'{_memory_advice(model, image, height, width, scales, available)}')
