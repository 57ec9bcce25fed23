"""The point-wise spatial attention (PSA) mask op: functional, Layer, pure-Paddle form.

``psa_mask`` turns the attention predicted over a local ``mask_h x mask_w``
window at each position into a dense ``[N, H*W, H, W]`` map (Zhao et al.,
ECCV 2018). ``'custom'``: the C++/CUDA custom op (``ops/``), the default;
``'paddle'``: standard Paddle ops only, the form that exports to ONNX and runs
without the op library. The tests check both against the numpy reference
(tests/psa_mask_reference.py). CPU threads: docs/psa_mask.md.
"""
import contextlib
import numbers

import paddle
import paddle.nn as nn

from .library import load_library

__all__ = ['psa_mask', 'PSAMask', 'psa_mask_paddle', 'psa_impl', 'COLLECT', 'DISTRIBUTE',
           'BI_DIRECTIONAL', 'PSA_TYPE_NAMES', 'PSA_TYPES']

# psa_type, as the op and the model number it (ops/psa_mask_kernel.h mirrors the
# op's two). BI_DIRECTIONAL is the model's: both branches, each running the op
# once; the op itself takes COLLECT or DISTRIBUTE only.
COLLECT = 0
DISTRIBUTE = 1
BI_DIRECTIONAL = 2
PSA_TYPE_NAMES = {COLLECT: 'collect', DISTRIBUTE: 'distribute', BI_DIRECTIONAL: 'bi-directional'}
# The op's psa_type by name.
PSA_TYPES = {PSA_TYPE_NAMES[t]: t for t in (COLLECT, DISTRIBUTE)}
_IMPLS = ('custom', 'paddle')
_default_impl = 'custom'


@contextlib.contextmanager
def psa_impl(impl):
    """Within the block, ``psa_mask(..., impl=None)`` uses ``impl``.

    Used to trace a model with the pure-Paddle op for export:
    ``with psa_impl('paddle'): paddle.jit.save(...)``.
    """
    global _default_impl
    _check_impl(impl)
    previous, _default_impl = _default_impl, impl
    try:
        yield
    finally:
        _default_impl = previous


def _check_impl(impl):
    if impl not in _IMPLS:
        raise ValueError(f"psa_mask: impl must be one of {_IMPLS}, got {impl!r}.")


def _is_int(value):
    # numpy integers count; bools are ints to Python but never a size or a type here.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def normalize_psa_type(psa_type):
    """``'collect'``/``'distribute'`` or 0/1 -> ``COLLECT``/``DISTRIBUTE``."""
    if isinstance(psa_type, str) and psa_type.lower() in PSA_TYPES:
        return PSA_TYPES[psa_type.lower()]
    if _is_int(psa_type) and int(psa_type) in PSA_TYPES.values():
        return int(psa_type)
    choices = ' or '.join(f"'{name}' ({value})" for name, value in PSA_TYPES.items())
    raise ValueError(f'psa_mask: psa_type must be {choices}, got {psa_type!r}.')


def normalize_mask_size(mask_size):
    """An int or a pair ``(mask_h, mask_w)`` -> ``(mask_h, mask_w)``, each >= 1."""
    if _is_int(mask_size):
        size = (mask_size, mask_size)
    elif isinstance(mask_size, (tuple, list)):
        size = tuple(mask_size)
    else:
        size = None
    if size is None or len(size) != 2 or not all(_is_int(s) for s in size) \
            or min(size) < 1:
        raise ValueError(f'psa_mask: mask_size must be an int >= 1 or a pair of them '
                         f'(mask_h, mask_w), got {mask_size!r}.')
    return int(size[0]), int(size[1])


# What x may be: a tensor, or a variable of a static program (PIR or the legacy IR).
_TENSOR_TYPES = tuple(t for t in (paddle.Tensor, getattr(paddle.static, 'Variable', None),
                                  getattr(getattr(paddle, 'pir', None), 'Value', None)) if t)


def _check_input(x, mask_h, mask_w):
    if not isinstance(x, _TENSOR_TYPES):
        raise TypeError(f'psa_mask: x must be a Paddle tensor, got {type(x).__module__}.'
                        f'{type(x).__name__}; convert it with paddle.to_tensor(x).')
    if x.ndim != 4:
        raise ValueError(f'psa_mask: x must be 4-D [N, mask_h*mask_w, H, W], got shape '
                         f'{list(x.shape)}.')
    channels = x.shape[1]
    if channels is not None and channels >= 0 and channels != mask_h * mask_w:
        raise ValueError(f'psa_mask: x must have mask_h*mask_w = {mask_h}*{mask_w} = '
                         f'{mask_h * mask_w} channels, got {channels} '
                         f'(shape {list(x.shape)}).')
    if x.dtype not in (paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64):
        raise ValueError(f'psa_mask: x must be a floating-point tensor, got {x.dtype}; '
                         'cast it with x.astype("float32").')


def _check_custom_place(x):
    # The CPU kernels are float32/float64 only; say so before C++ does.
    if paddle.in_dynamic_mode() and x.place.is_cpu_place() \
            and x.dtype not in (paddle.float32, paddle.float64):
        raise ValueError(f'psa_mask: the CPU kernel takes float32 or float64, got '
                         f'{x.dtype}; cast it with x.astype("float32") or pass '
                         "impl='paddle'.")


@contextlib.contextmanager
def _explain_out_of_memory(x):
    """Turns Paddle's allocation failure for the op output into a MemoryError naming its size."""
    try:
        yield
    except MemoryError as error:
        if not paddle.in_dynamic_mode():
            raise
        n, _, h, w = (int(s) for s in x.shape)
        size = n * (h * w) ** 2 * x.element_size()
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise MemoryError(
            f'psa_mask: its output [N, H*W, H, W] = [{n}, {h * w}, {h}, {w}] '
            f'{str(x.dtype).replace("paddle.", "")} needs {size / 2 ** 30:.1f} GiB, which '
            f'could not be allocated ({lines[0] if lines else "out of memory"}). The map '
            f'grows with the 4th power of the input side: run the network on smaller inputs '
            f'(sliding windows) or shrink the feature map more.') from error


@paddle.jit.not_to_static
def psa_mask(x, psa_type, mask_size, impl=None):
    """Spreads local attention over a window into a dense point-wise attention map.

    Args:
        x (Tensor): ``[N, mask_h*mask_w, H, W]``, float32 or float64 (float16 on
            GPU); channel ``i*mask_w + j`` is window cell ``(i, j)``.
        psa_type (str|int): ``'collect'`` (0) or ``'distribute'`` (1).
        mask_size (int|tuple[int, int]): ``mask_h, mask_w``; an even size gives a
            window with ``(size-1)//2`` cells before the centre.
        impl (str, optional): ``'custom'`` (the C++/CUDA op) or ``'paddle'``
            (standard ops only). Default: ``'custom'``, or what ``psa_impl`` sets.

    Returns:
        Tensor: ``[N, H*W, H, W]``. Collect: ``Y[n, q, p] = x[n, k, h, w]``;
        distribute: ``Y[n, p, q] = x[n, k, h, w]``, where ``p = (h, w)`` and
        ``q = (h + i - (mask_h-1)//2, w + j - (mask_w-1)//2)``; cells whose ``q``
        falls off the map are dropped and every other entry is 0.

    Raises:
        MemoryError: when the output cannot be allocated; the message gives its
            shape and size (it grows with ``(H*W)**2``).
    """
    psa_type = normalize_psa_type(psa_type)
    mask_h, mask_w = normalize_mask_size(mask_size)
    impl = _default_impl if impl is None else impl
    _check_impl(impl)
    _check_input(x, mask_h, mask_w)
    if impl == 'paddle':
        with _explain_out_of_memory(x):
            return _psa_mask_gather(x, psa_type, mask_h, mask_w)
    _check_custom_place(x)
    load_library()
    if paddle.framework.in_dynamic_or_pir_mode():
        with _explain_out_of_memory(x):
            return paddle._C_ops._run_custom_op('psa_mask', x, psa_type, mask_h, mask_w)[0]
    from paddle.base.layer_helper import LayerHelper
    helper = LayerHelper('psa_mask', **locals())
    out = helper.create_variable(dtype=x.dtype)
    helper.append_op(type='psa_mask', inputs={'X': x}, outputs={'Out': out},
                     attrs={'psa_type': psa_type, 'mask_h': mask_h, 'mask_w': mask_w})
    return out


@paddle.jit.not_to_static
def psa_mask_paddle(x, psa_type, mask_h, mask_w):
    """``psa_mask`` written with standard Paddle ops (exportable, differentiable).

    Each output entry gathers its source from ``x`` through an index map built
    from the (possibly dynamic) H and W, as ``y_source`` in
    ``ops/psa_mask_kernel.h`` does per element for the CUDA kernels; entries
    outside the window gather a zero appended to ``x``. Memory: an int32 index
    of ``(H*W)**2`` entries, so ``mask_h * mask_w * H * W`` must stay below ``2**30``.
    """
    psa_type = normalize_psa_type(psa_type)
    mask_h, mask_w = normalize_mask_size((mask_h, mask_w))
    _check_input(x, mask_h, mask_w)
    return _psa_mask_gather(x, psa_type, mask_h, mask_w)


def _psa_mask_gather(x, psa_type, mask_h, mask_w):
    # The index math of y_source in ops/psa_mask_kernel.h (a Python file cannot
    # include the header): the window cell of an entry is window_row(qh - ph),
    # window_column(qw - pw), with half = (mask - 1) // 2 as make_geometry's.
    # The index of Y[n] is built as [H, W, H, W] (row position a = (a_h, a_w),
    # column b = (b_h, b_w)) from per-axis pieces of size H*H and W*W, so that
    # only two ops besides the gather run over all (H*W)**2 entries.
    shape = paddle.shape(x)
    h, w = shape[2], shape[3]
    positions = (h * w).astype('int32')
    along_h = paddle.arange(h, dtype='int32')
    along_w = paddle.arange(w, dtype='int32')
    a_h, a_w = along_h.reshape([-1, 1, 1, 1]), along_w.reshape([1, -1, 1, 1])
    b_h, b_w = along_h.reshape([1, 1, -1, 1]), along_w.reshape([1, 1, 1, -1])
    # collect: Y[q, p]; distribute: Y[p, q]; x sits at p, cell (i, j) at q - p.
    (qh, qw, ph, pw) = (a_h, a_w, b_h, b_w) if psa_type == COLLECT else (b_h, b_w, a_h, a_w)
    i = qh - ph + (mask_h - 1) // 2
    j = qw - pw + (mask_w - 1) // 2
    # Invalid entries gather the zero appended after x's mask_h*mask_w channels.
    # Each piece is that slot where its cell is off the window, so a sum of
    # pieces is at least the slot exactly where the entry is invalid (valid
    # sources stay below it); int32 holds 2 * mask_h * mask_w * H * W.
    zero_slot = positions * (mask_h * mask_w)
    valid_i = ((i >= 0) & (i < mask_h)).astype('int32')
    valid_j = ((j >= 0) & (j < mask_w)).astype('int32')
    source_i = zero_slot + valid_i * (i * mask_w * positions + ph * w.astype('int32')
                                      - zero_slot)
    source_j = zero_slot + valid_j * (j * positions + pw - zero_slot)
    source = paddle.minimum(source_i + source_j, zero_slot)
    flat = x.reshape([0, -1])
    flat = paddle.concat([flat, paddle.zeros([shape[0], 1], x.dtype)], axis=1)
    # Not paddle.gather(axis=1): its backward is wrong on Paddle 3.0.0
    # (psanet.compat.GATHER_AXIS_GRADIENT).
    y = paddle.index_select(flat, source.reshape([-1]), axis=1)
    return y.reshape([0, -1, h, w]) if not paddle.in_dynamic_mode() else \
        y.reshape([x.shape[0], -1, x.shape[2], x.shape[3]])


class PSAMask(nn.Layer):
    """Layer form of :func:`psa_mask`.

    Args:
        psa_type (str|int): ``'collect'`` (0) or ``'distribute'`` (1).
        mask_size (int|tuple[int, int]): window size ``(mask_h, mask_w)``.
        impl (str, optional): ``'custom'`` or ``'paddle'``; None follows ``psa_impl``.
    """

    def __init__(self, psa_type, mask_size, impl=None):
        super().__init__()
        self.psa_type = normalize_psa_type(psa_type)
        self.mask_size = normalize_mask_size(mask_size)
        if impl is not None:
            _check_impl(impl)
        self.impl = impl

    def forward(self, x):
        return psa_mask(x, self.psa_type, self.mask_size, impl=self.impl)

    def extra_repr(self):
        impl = self.impl if self.impl is not None else 'default'
        return (f"psa_type='{PSA_TYPE_NAMES[self.psa_type]}', mask_size={self.mask_size}, "
                f"impl='{impl}'")
