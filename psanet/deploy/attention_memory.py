"""The memory of PSANet's attention maps: what an input takes, the window or scale that fits,
and the check against the memory available before a model runs.

An N x 3 x H x W input's maps have ``N * cells**2`` elements, ``cells = ceil(H / input_unit)
* ceil(W / input_unit)``, each taking ``bytes_per_element`` at the peak (the map and its
softmax): an :class:`AttentionCost`. The model says both numbers
(``PSANet.attention_memory``); export.py records them in deploy.yaml (``attention_memory``)
for the deploy package. The largest window or scale that fits is worked out from the number of
cells the memory holds, not searched for. The engine's inference
(:func:`check_attention_memory`, :func:`out_of_memory`) and the deploy package's
:class:`~psanet.deploy.pipeline.Pipeline` (:func:`check_batch_memory`) check here.
"""
import math
from typing import NamedTuple

from psanet.compat import free_gpu_memory, generic_place
from psanet.errors import DeployError, InferenceMemoryError

__all__ = ['ATTENTION_MEMORY', 'AttentionCost', 'host_memory_available', 'available_memory',
           'format_bytes', 'scaled_size', 'largest_crop', 'largest_scale',
           'check_attention_memory', 'out_of_memory', 'check_batch_memory']

# The deploy.yaml entry export.py writes: {'input_unit': ..., 'bytes_per_element': ...}.
ATTENTION_MEMORY = 'attention_memory'
# Where Linux says how much memory new allocations can take (MemAvailable, in KiB).
MEMINFO = '/proc/meminfo'
# A suggested window leaves this share of the available memory to the rest of
# the network (backbone activations, the logits of the whole image).
_SUGGESTION_SHARE = 0.5


class AttentionCost(NamedTuple):
    """What the attention maps of any input size take.

    Attributes:
        input_unit (int): input pixels per map position along a side (the feature
            stride times the shrink factor).
        bytes_per_element (int): peak bytes per map element.
    """
    input_unit: int
    bytes_per_element: int

    @classmethod
    def of(cls, plan):
        """The cost of a model's ``AttentionMemory`` (:meth:`PSANet.attention_memory`)."""
        return cls(plan.input_unit, plan.peak_bytes_per_element)

    def peak_bytes(self, batch, height, width):
        """Peak bytes of the maps of a ``[batch, 3, height, width]`` input."""
        unit = self.input_unit
        cells = math.ceil(height / unit) * math.ceil(width / unit)
        return batch * cells ** 2 * self.bytes_per_element

    def cells(self, batch, budget):
        """The most map positions (h*w) whose attention fits ``budget`` bytes."""
        return math.isqrt(int(budget) // (batch * self.bytes_per_element))


def host_memory_available():
    """Bytes new allocations on the host can still take (``MemAvailable`` of /proc/meminfo),
    or None where unknown (not Linux)."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory(place=None):
    """Bytes new tensors can still take on ``place``'s device, or None when unknown.

    CPU: :func:`host_memory_available`. GPU: the device's free memory as CUDA
    reports it (``psanet.compat.free_gpu_memory``) plus what Paddle's allocator
    holds but does not use (``paddle.device.cuda.memory_reserved - memory_allocated``).

    Args:
        place (paddle.Place, optional): Default: the current device.
    """
    place = generic_place(place)
    if place.is_gpu_place():
        import paddle
        device = place.gpu_device_id()
        cached = paddle.device.cuda.memory_reserved(device) - \
            paddle.device.cuda.memory_allocated(device)
        return free_gpu_memory(device) + max(int(cached), 0)
    if not place.is_cpu_place():
        return None
    return host_memory_available()


def format_bytes(size):
    """'1.5 GiB', '12.0 MiB', '300 B'."""
    for unit, scale in (('GiB', 2 ** 30), ('MiB', 2 ** 20), ('KiB', 2 ** 10)):
        if size >= scale:
            return f'{size / scale:.1f} {unit}'
    return f'{int(size)} B'


def scaled_size(height, width, scale):
    """(h, w) of an input resized by ``scale``, as aug_inference resizes it."""
    return int(height * scale + 0.5), int(width * scale + 0.5)


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


def largest_crop(cost, batch, height, width, budget):
    """The largest window of about a ``height x width`` input's aspect whose attention fits.

    The window is the input scaled by the 4th root of ``budget / peak_bytes``,
    each side rounded down to whole map positions (``input_unit`` pixels), at
    least one. Since the map's positions grow with the product of the sides
    and its elements with their square, that fits, except where a side was
    raised to one position or the root rounded up: then the longer side is
    shortened (:func:`_shorten`).

    Args:
        cost (AttentionCost): the model's.
        batch (int): images per run.
        height (int): the input's height.
        width (int): the input's width.
        budget (float): bytes the attention may take.

    Returns:
        tuple | None: ``(crop_w, crop_h)``, multiples of ``input_unit``; None when not
        even one position fits.
    """
    unit = cost.input_unit
    factor = min(1.0, (budget / cost.peak_bytes(batch, height, width)) ** 0.25)
    rows = max(1, int(height * factor) // unit)
    cols = max(1, int(width * factor) // unit)
    cut = _shorten(rows, cols, cost.cells(batch, budget))
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


def largest_scale(cost, batch, height, width, budget):
    """The largest scale (2 decimals, at most 1) at which a whole input's attention fits.

    At a scale the map is ``ceil(h'/unit) x ceil(w'/unit)`` positions for the
    scaled size (h', w'); for each number of rows r that fits, the columns
    ``cells // r`` bound the width; the scale is the largest that keeps both.

    Args:
        cost (AttentionCost): the model's.
        batch (int): images per run.
        height (int): the input's height at scale 1.
        width (int): the input's width at scale 1.
        budget (float): bytes the attention may take.

    Returns:
        float | None: e.g. 0.73; None when not even scale 0.01 fits.
    """
    unit, cells = cost.input_unit, cost.cells(batch, budget)
    best = 0
    for rows in range(1, min(cells, math.ceil(height / unit)) + 1):
        best = max(best, min(_largest_step(height, rows * unit),
                             _largest_step(width, cells // rows * unit)))
    return best / 100 if best else None


def _windows(cost, batch, height, width, available):
    """``((crop_w, crop_h), (stride_w, stride_h))`` of the windows to suggest, which leave
    the rest of the network its share of ``available`` bytes; None when none fits."""
    crop = largest_crop(cost, batch, height, width, available * _SUGGESTION_SHARE)
    return None if crop is None else (crop, tuple(max(1, side * 3 // 4) for side in crop))


def _first_line(error):
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _memory_advice(attention_memory, image, height, width, scales=None, available=None):
    """How to run a ``height x width`` input in the memory there is: a window, or smaller scales."""
    available = available_memory(image.place) if available is None else available
    batch = int(image.shape[0])
    plan = None if attention_memory is None else attention_memory(height, width, batch)
    if plan is None or available is None:
        return ('use sliding windows (--is_slide --crop_size W H --stride W H) with a smaller '
                'crop, or smaller --scales.')
    cost = AttentionCost.of(plan)
    windows = _windows(cost, batch, height, width, available)
    if windows is None:
        return (f'not even the smallest window fits in {format_bytes(available)}: free memory '
                f'or run on a machine with more.')
    (crop_w, crop_h), (stride_w, stride_h) = windows
    advice = (f'use sliding windows that fit, e.g. --is_slide --crop_size {crop_w} {crop_h} '
              f'--stride {stride_w} {stride_h}')
    if scales is not None:
        scale = largest_scale(cost, batch, int(image.shape[-2]), int(image.shape[-1]),
                              available * _SUGGESTION_SHARE)
        if scale is not None and max(scales) > scale:
            advice += f', or --scales no larger than {scale:g}'
    return advice + '.'


def out_of_memory(attention_memory, x, error):
    """The InferenceMemoryError for a model run on ``x`` that raised MemoryError ``error``.

    Args:
        attention_memory (callable | None): the model's ``attention_memory`` method
            (``PSANet.attention_memory``), None for a model without attention.
    """
    height, width = int(x.shape[-2]), int(x.shape[-1])
    return InferenceMemoryError(
        f'running the model on a {width}x{height} input ran out of memory '
        f'({_first_line(error)}); {_memory_advice(attention_memory, x, height, width)}')


def check_attention_memory(attention_memory, image, scales=None, is_slide=False,
                           crop_size=None):
    """Raises InferenceMemoryError when an attention map of this inference cannot fit.

    Every network input the inference will run (the image at each scale, or
    its windows) is sized before any runs; the largest is compared with the
    memory available on the image's device. Models without PSA branches, and
    devices whose free memory is unknown, pass unchecked.

    Args:
        attention_memory (callable | None): the model's ``attention_memory`` method
            (``PSANet.attention_memory``), None for a model without attention.
        image (Tensor): [N, C, H, W] input, on the device the model runs on.
        scales (list, optional): aug_inference's scales; None: the image as is.
        is_slide (bool, optional): windows of ``crop_size`` at each scale. Default: False.
        crop_size (tuple, optional): (w, h) of a window. Default: None.

    Raises:
        InferenceMemoryError: naming the memory needed and available, and a
            window (``--is_slide --crop_size``) or scale that fits.
    """
    if attention_memory is None:
        return
    height, width = int(image.shape[-2]), int(image.shape[-1])
    worst = None
    for scale in scales or [1.0]:
        h, w = scaled_size(height, width, scale)
        if is_slide:
            h, w = min(h, int(crop_size[1])), min(w, int(crop_size[0]))
        need = attention_memory(h, w, int(image.shape[0]))
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
        f'{_memory_advice(attention_memory, image, height, width, scales, available)}')


def check_batch_memory(cost, shape):
    """Raises DeployError when the attention maps of a batch of ``shape`` (N, 3, H, W)
    cannot fit in the host's available memory (the backend would abort or swap), naming a
    window that fits half of it.

    Args:
        cost (AttentionCost): the export's (``DeployConfig.attention_cost``).
        shape (tuple): the batch's shape.
    """
    count, _, height, width = shape
    need = cost.peak_bytes(count, height, width)
    available = host_memory_available()
    if available is None or need <= available:
        return
    fit = _windows(cost, count, height, width, available)
    windows = '' if fit is None else (
        ', or run it in windows: Segmenter.from_config(config, weights, backend="dygraph", '
        f'inference={{"is_slide": True, "crop_size": [{fit[0][0]}, {fit[0][1]}], "stride": '
        f'[{fit[1][0]}, {fit[1][1]}]}})')
    raise DeployError(f'a {width}x{height} network input{"s" * (count > 1)} (after the '
                      f'transforms{f", batch of {count}" if count > 1 else ""}) needs '
                      f'{format_bytes(need)} for the model\'s attention maps, but only '
                      f'{format_bytes(available)} of host memory is available: use smaller '
                      f'images (or a Resize in deploy.yaml\'s transforms){windows}.')
