"""Inference on one image: whole image, sliding window, and multi-scale / flip augmentation.

Models follow paddleseg's convention: ``model(x)`` returns a list of logits
whose first item is the main prediction at the input size. Results are
mapped back to the original label size by undoing the shape changes the
transforms recorded in ``trans_info`` (('resize', [h, w]) / ('padding', [h, w])
entries, most recent last).

``aug_inference`` combines scales and flips as paddleseg 2.8's
``paddleseg.core.infer.aug_inference`` does by default (``combine='logits'``:
the mean of the logits, each flipped back and resized to the input size, then
the recorded transforms undone); ``combine='softmax'`` averages their softmax
instead, so that a scale with larger logits does not dominate (the ranking
of classes the PaddleSeg 2.4 reproduction got by summing them).

Why not ``paddleseg.core.infer`` itself (2.8.0, which imports on Paddle 3.3.1):
the engine does not use ``paddleseg.core`` at all (its train/evaluate fail
on Paddle 3, see psanet/compat.py), and its inference differs where it
matters here:

* ``aug_inference`` there has no softmax combination;
* ``slide_inference`` there accumulates windows in float64 numpy and returns
  a float64 tensor (a host copy per window, and no fp16 path); here it stays
  a Paddle tensor of the model's dtype;
* ``inference`` there returns ``(pred, logit)`` or ``logit`` depending on
  ``trans_info``; here always the logits (or probabilities);
* bad ``trans_info`` entries or ``crop_size``/``stride`` raise errors that
  name the fix instead of a bare ``Exception`` or a ``RuntimeError`` after
  inference;
* before the model runs, the memory PSANet's attention maps will take at each
  network input size (whole image, each scale, each window) is compared with
  the memory available, and an input that cannot fit is refused with the
  crop (or scale) that does (:func:`check_attention_memory`), instead of an
  allocation failure after minutes of backbone.

``reverse_transform`` (bilinear) and ``flip_combinations`` match paddleseg's
``reverse_transform(mode='bilinear')`` and ``flip_combination`` on float
logits; they stay here so that this module does not import
``paddleseg.core`` (about 9 s, and its training code) for 30 lines.
"""
import collections.abc
import math
import weakref

import numpy as np
import paddle
import paddle.nn.functional as F

from psanet.errors import ConfigError, InferenceMemoryError
from psanet.models.psanet import PSABranch

__all__ = ['reverse_transform', 'slide_windows', 'slide_inference', 'inference',
           'aug_inference', 'AUG_COMBINES', 'flip_combinations', 'check_slide_args',
           'available_memory',
           'attention_map_shapes', 'attention_memory', 'check_attention_memory']


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

    Raises:
        InferenceMemoryError: before the model runs, when the attention maps of
            the network input cannot fit in the memory available.
    """
    if is_slide:
        crop_size, stride = check_slide_args(crop_size, stride)
    check_attention_memory(model, image, is_slide=is_slide, crop_size=crop_size)
    return _inference(model, image, trans_info, is_slide, crop_size, stride)


def _inference(model, image, trans_info, is_slide, crop_size, stride):
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


# How aug_inference combines scales and flips: the mean of the logits (paddleseg 2.8's
# aug_inference), or the mean of their softmax.
AUG_COMBINES = ('logits', 'softmax')


def aug_inference(model, image, trans_info=None, scales=1.0, flip_horizontal=False,
                  flip_vertical=False, is_slide=False, crop_size=None, stride=None,
                  combine='logits'):
    """Logits (or probabilities) averaged over scales and flips.

    Each scale resizes the input by ``scale`` (bilinear), each flip is undone
    on the output, and every output is resized back to the input size before
    averaging; then the recorded transforms are undone. With
    ``combine='logits'`` this is paddleseg 2.8's ``aug_inference``.

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
        combine (str, optional): 'logits' averages the logits (paddleseg 2.8);
            'softmax' averages their softmax. Default: 'logits'.

    Returns:
        Tensor: [N, num_classes, h, w] mean logits, or mean probabilities with
        ``combine='softmax'``.

    Raises:
        InferenceMemoryError: before the model runs, when the attention maps of
            the largest network input (scale, or window) cannot fit in the
            memory available.
    """
    if combine not in AUG_COMBINES:
        raise ConfigError(f'--aug_combine must be one of {AUG_COMBINES}, got {combine!r}.')
    if isinstance(scales, (int, float)):
        scales = [scales]
    scales = [float(s) for s in scales]
    if not scales or any(s <= 0 for s in scales):
        raise ConfigError(f'--scales must be positive numbers, got {scales}.')
    if is_slide:
        crop_size, stride = check_slide_args(crop_size, stride)
    check_attention_memory(model, image, scales=scales, is_slide=is_slide, crop_size=crop_size)
    height, width = int(image.shape[-2]), int(image.shape[-1])
    combos = flip_combinations(flip_horizontal, flip_vertical)
    total = None
    for scale in scales:
        size = list(_scaled_size(height, width, scale))
        # A bilinear resize to the same size is the identity, bit for bit: skipped.
        scaled = image if size == [height, width] else F.interpolate(
            image, size, mode='bilinear', align_corners=False)
        for horizontal, vertical in combos:
            score = _inference(model, _flip(scaled, horizontal, vertical), None, is_slide,
                               crop_size, stride)
            if combine == 'softmax':
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


# --- Memory of PSANet's attention maps -------------------------------------------------------
#
# Each PSA branch builds a dense [N, h*w, h, w] attention map over the shrunk
# feature map (h, w), so its size grows with the 4th power of the input side:
# 15.6 GB for one 4000x4000 image at output stride 8 and shrink factor 2.
# Branches run one after another; while a branch softmaxes its map, the map
# and its softmax are both alive, which is the peak checked here.

# A suggested window leaves this share of the available memory to the rest of
# the network (backbone activations, the logits of the whole image).
_SUGGESTION_SHARE = 0.5
# Probe sizes that tell the backbone's output stride and its rounding (ceil).
_PROBES = ((64, 96), (65, 97))
_feature_strides = weakref.WeakKeyDictionary()


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
    place = place if place is not None else paddle.framework._current_expected_place()
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


def _psa_branches(model):
    return [layer for layer in model.sublayers() if isinstance(layer, PSABranch)]


def _feature_stride(model, channels, dtype):
    """The stride of the backbone output the PSA head takes, or None when not a plain one.

    Told from two small probe inputs rather than from the config, so that any
    backbone works; a backbone whose output size is not ``ceil(size / stride)``
    gets None (and no memory check).
    """
    backbone, indices = getattr(model, 'backbone', None), getattr(model, 'backbone_indices', None)
    if backbone is None or indices is None:
        return None
    if backbone in _feature_strides:
        return _feature_strides[backbone]
    was_training = backbone.training
    backbone.eval()  # no batch-norm statistics change from the probes
    try:
        with paddle.no_grad():
            sizes = [tuple(int(s) for s in backbone(paddle.zeros([1, channels, h, w], dtype))
                           [indices[1]].shape[-2:]) for h, w in _PROBES]
    finally:
        if was_training:
            backbone.train()
    probe_h, stride = _PROBES[0][0], None
    if sizes[0][0] > 0 and probe_h % sizes[0][0] == 0:
        candidate = probe_h // sizes[0][0]
        if all(size == (math.ceil(h / candidate), math.ceil(w / candidate))
               for size, (h, w) in zip(sizes, _PROBES)):
            stride = candidate
    _feature_strides[backbone] = stride
    return stride


def attention_map_shapes(model, height, width, batch=1, channels=3, dtype='float32'):
    """The ``[N, h*w, h, w]`` attention map each PSA branch builds for a network input.

    Args:
        model (paddle.nn.Layer): the model (PSANet; any other model has no branches).
        height (int): network input height.
        width (int): network input width.
        batch (int, optional): N. Default: 1.
        channels (int, optional): input channels, for the backbone probe. Default: 3.
        dtype (str, optional): input dtype, for the backbone probe. Default: 'float32'.

    Returns:
        list | None: one shape per branch ([] for a model without PSA branches),
        or None when the backbone's output size cannot be told.
    """
    branches = _psa_branches(model)
    if not branches:
        return []
    stride = _feature_stride(model, channels, dtype)
    if stride is None:
        return None
    feature_h, feature_w = math.ceil(height / stride), math.ceil(width / stride)
    shapes = []
    for branch in branches:
        # PSABranch.shrink: ((H - 1) // s + 1, (W - 1) // s + 1).
        h = (feature_h - 1) // branch.shrink_factor + 1
        w = (feature_w - 1) // branch.shrink_factor + 1
        shapes.append([int(batch), h * w, h, w])
    return shapes


_ELEMENT_BYTES = {paddle.float16: 2, paddle.bfloat16: 2, paddle.float32: 4, paddle.float64: 8}


def _attention_dtype(branch):
    if paddle.amp.is_autocast_enabled():
        return paddle.amp.get_autocast_dtype()
    return branch.attention[-1].weight.dtype


def attention_memory(model, height, width, batch=1, channels=3, dtype='float32'):
    """Memory of the PSA attention maps for a ``height x width`` network input.

    Args: as :func:`attention_map_shapes`.

    Returns:
        dict | None: ``shape`` (of the largest map), ``dtype``, ``map_bytes``
        (that map), ``peak_bytes`` (the map and its softmax, alive together; under
        fp16 autocast also the float32 copy softmax takes), and
        ``branches``; None for a model without PSA branches or whose backbone
        output size cannot be told.
    """
    shapes = attention_map_shapes(model, height, width, batch, channels, dtype)
    if not shapes:
        return None
    best = None
    for branch, shape in zip(_psa_branches(model), shapes):
        map_dtype = _attention_dtype(branch)
        if isinstance(map_dtype, str):
            map_dtype = getattr(paddle, map_dtype)
        elements = math.prod(shape)
        map_bytes = elements * _ELEMENT_BYTES.get(map_dtype, 4)
        peak = map_bytes
        if branch.psa_softmax:
            # softmax is on Paddle's fp16 black list: under autocast a half map is cast
            # to a float32 copy and softmaxed into another float32 tensor, all alive at once.
            softmax_bytes = elements * max(_ELEMENT_BYTES.get(map_dtype, 4), 4)
            copy_bytes = softmax_bytes if softmax_bytes > map_bytes else 0
            peak = map_bytes + copy_bytes + softmax_bytes
        if best is None or peak > best['peak_bytes']:
            best = {'shape': shape, 'dtype': str(map_dtype).replace('paddle.', ''),
                    'map_bytes': map_bytes, 'peak_bytes': peak}
    best['branches'] = len(shapes)
    return best


def _fits(model, image, height, width, budget):
    need = attention_memory(model, height, width, int(image.shape[0]), int(image.shape[1]),
                            image.dtype)
    return need is None or need['peak_bytes'] <= budget


def _suggest_crop(model, image, height, width, budget):
    """The largest window of about the input's aspect whose attention fits ``budget``."""
    stride = _feature_stride(model, int(image.shape[1]), image.dtype) or 1
    unit = stride * max(branch.shrink_factor for branch in _psa_branches(model))
    need = attention_memory(model, height, width, int(image.shape[0]), int(image.shape[1]),
                            image.dtype)
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
    if not _psa_branches(model) or available is None:
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
    if not _psa_branches(model):
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
        need = attention_memory(model, h, w, int(image.shape[0]), int(image.shape[1]),
                                image.dtype)
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
        f'PSANet\'s attention (each branch\'s map {need["shape"]} {need["dtype"]} is '
        f'{_format_bytes(need["map_bytes"])}{softmax}), but only '
        f'{_format_bytes(available)} of {where} memory is available; '
        f'{_memory_advice(model, image, height, width, scales, available)}')
