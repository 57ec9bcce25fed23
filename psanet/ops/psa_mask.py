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
import paddle.nn.functional as F

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


@paddle.jit.not_to_static  # read live under to_static (psanet.compat.TO_STATIC_GLOBALS)
def current_psa_impl(impl=None):
    """The form ``psa_mask(..., impl=impl)`` runs: ``impl``, or else what ``psa_impl`` set."""
    return _default_impl if impl is None else impl


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
    impl = current_psa_impl(impl)
    _check_impl(impl)
    _check_input(x, mask_h, mask_w)
    if impl == 'paddle':
        with _explain_out_of_memory(x):
            return _psa_mask_shear(x, psa_type, mask_h, mask_w)
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

    The window rows of every position are padded with zeros and read back as
    chunks of up to ``CHUNK`` values, each chunk from the row shifted by its
    position: the shear that turns window cells into map positions, done by
    one pad and one gather (docs/psa_mask.md, "The pure-Paddle form"). Memory
    beyond the output: the padded rows, ``(mask_w + CHUNK)`` to
    ``(mask_w + 3*CHUNK - 2)`` values for every ``mask_w`` of ``x``, an int64 index
    of one entry per chunk of the output, and for collect a transposed copy of
    the output.
    """
    psa_type = normalize_psa_type(psa_type)
    mask_h, mask_w = normalize_mask_size((mask_h, mask_w))
    _check_input(x, mask_h, mask_w)
    return _psa_mask_shear(x, psa_type, mask_h, mask_w)


# The longest chunk the pure-Paddle form gathers: a map width divisible by 16
# moves 16 values per index; other widths their largest power-of-two divisor.
CHUNK = 16


def _padded_row(mask_w):
    """(left zeros, row length) of a window row padded for the shear.

    Chunk ``c`` of output row ``pw`` starts at ``pw*(length-1) + left + half_w +
    c*chunk`` in its block: a multiple of any chunk that divides CHUNK when
    ``length`` is 1 modulo CHUNK and ``left + half_w`` is 0 modulo CHUNK. At
    least CHUNK zeros before each window make a zero chunk at the start of every
    block (read by chunks off the window) and keep a chunk that overlaps the
    window inside zeros and window values: one that runs past the window's end
    reads the zeros that start the next row (after the last row, the zero block).
    """
    half_w = (mask_w - 1) // 2
    left = CHUNK + (-(CHUNK + half_w)) % CHUNK
    length = left + mask_w
    length += (1 - length) % CHUNK
    return left, length


def _int64(value):
    # Integer index math multiplies tensors by tensors, never by Python numbers:
    # Paddle Inference's oneDNN pass fuses such a scale into the elementwise op
    # before it and drops it (psanet.compat.ONEDNN_INT_SCALE).
    return paddle.full([], value, 'int64')


def _psa_mask_shear(x, psa_type, mask_h, mask_w):
    # Distribute: Y[n, p, q] with p = (ph, pw), q = (qh, qw), read as rows
    # (ph, pw, qh) of W values over qw. Row (ph, pw, qh) is window row
    # i = qh - ph + half_h of position p, shifted right by pw - half_w. Collect
    # is its transpose over positions.
    shape = paddle.shape(x)
    n, h, w = shape[0], shape[2], shape[3]
    half_h, half_w = (mask_h - 1) // 2, (mask_w - 1) // 2
    left, length = _padded_row(mask_w)
    h64, w64 = h.astype('int64'), w.astype('int64')
    # Window rows of every position, as runs of mask_w values: [N, mask_h, H*W, mask_w],
    # blocks (i, ph) of W rows; one block row of zeros (i = mask_h) for windows off the map.
    runs = x.reshape([0, mask_h, mask_w, -1]).transpose([0, 1, 3, 2])
    padded = F.pad(runs, [0, 0, 0, 1, 0, 0, left, length - left - mask_w])
    chunk = paddle.full([], 1, 'int64')
    for divisor in (2, 4, 8, CHUNK):
        chunk = paddle.where(w64 % _int64(divisor) == 0, _int64(divisor), chunk)
    chunks = padded.reshape(paddle.stack([n, paddle.full_like(n, -1), chunk.astype(n.dtype)]))
    # Index of output chunk (ph, pw, qh, c): block (i, ph) at row pw, shifted.
    # Collect transposes that map over positions. Paddle's CPU transpose does best
    # on the whole [H*W, H*W] map; onnxruntime's and OpenVINO's on the blocks of
    # one target row qh at a time, so an exported collect reads the chunks in the
    # order (qh, ph, pw, c) (docs/psa_mask.md, "Speed").
    by_target_row = psa_type == COLLECT and not paddle.in_dynamic_mode()
    rows, cols = paddle.arange(h, dtype='int64'), paddle.arange(w, dtype='int64')
    axes = (1, 2, 0) if by_target_row else (0, 1, 2)    # of ph, pw, qh
    ph, pw, qh = (v.reshape([-1 if k == axis else 1 for k in range(4)])
                  for v, axis in zip((rows, cols, rows), axes))
    i = qh - ph + _int64(half_h)
    i = paddle.where((i >= 0) & (i < mask_h), i, _int64(mask_h))
    block = (i * h64 + ph) * (w64 * _int64(length) // chunk)
    start = paddle.arange(w64 // chunk, dtype='int64') * chunk
    first = start - pw + _int64(half_w)                 # window column at the chunk's start
    offset = (pw * _int64(length - 1) + _int64(left + half_w) + start) // chunk
    # Chunks off the window read the zero chunk that starts their block. Decided
    # on the [W, W/chunk] offsets, so that only the add below spans the index
    # (a where over it exports as several index-sized broadcasts).
    offset = paddle.where((first < mask_w) & (first + chunk > 0), offset, _int64(0))
    y = paddle.index_select(chunks, (block + offset).reshape([-1]), axis=1)
    positions = h * w
    if by_target_row:      # [N*qh, ph, pw, qw] -> [N*qh, qw, ph, pw]
        y = y.reshape(paddle.stack([n * h, h, w, w])).transpose([0, 3, 1, 2])
    elif psa_type == COLLECT:
        y = y.reshape(paddle.stack([n, positions, positions])).transpose([0, 2, 1])
    return y.reshape(paddle.stack([n, positions, h, w]))


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
