"""The point-wise spatial attention (PSA) mask op: functional, Layer, pure-Paddle form.

``psa_mask`` turns the per-position attention predicted over a local
``mask_h x mask_w`` window into a dense ``[N, H*W, H, W]`` attention map
(Zhao et al., "PSANet: Point-wise Spatial Attention Network for Scene
Parsing", ECCV 2018). Two implementations compute the same thing:

* ``'custom'``: the C++/CUDA custom op (``ops/``), fast, the default;
* ``'paddle'``: standard Paddle ops only (an index gather); the reference the
  kernels are tested against, and the form that exports to ONNX or runs where
  the op library is not available.
"""
import contextlib

import paddle
import paddle.nn as nn

__all__ = ['psa_mask', 'PSAMask', 'psa_mask_paddle', 'psa_impl', 'PSA_TYPES']

PSA_TYPES = {'collect': 0, 'distribute': 1}
_TYPE_NAMES = {v: k for k, v in PSA_TYPES.items()}
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


def normalize_psa_type(psa_type):
    """``'collect'``/``'distribute'`` or 0/1 -> 0/1."""
    if isinstance(psa_type, str) and psa_type.lower() in PSA_TYPES:
        return PSA_TYPES[psa_type.lower()]
    if isinstance(psa_type, int) and not isinstance(psa_type, bool) \
            and psa_type in _TYPE_NAMES:
        return psa_type
    raise ValueError(f"psa_mask: psa_type must be 'collect' (0) or 'distribute' (1), "
                     f"got {psa_type!r}.")


def normalize_mask_size(mask_size):
    """An int or a pair ``(mask_h, mask_w)`` -> ``(mask_h, mask_w)``, each >= 1."""
    size = (mask_size, mask_size) if isinstance(mask_size, int) else tuple(mask_size)
    if len(size) != 2 or not all(isinstance(s, int) and not isinstance(s, bool)
                                 for s in size) or min(size) < 1:
        raise ValueError(f'psa_mask: mask_size must be an int >= 1 or a pair of them '
                         f'(mask_h, mask_w), got {mask_size!r}.')
    return size


def _check_input(x, mask_h, mask_w):
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
    """
    psa_type = normalize_psa_type(psa_type)
    mask_h, mask_w = normalize_mask_size(mask_size)
    impl = _default_impl if impl is None else impl
    _check_input(x, mask_h, mask_w)
    _check_impl(impl)
    if impl == 'paddle':
        return psa_mask_paddle(x, psa_type, mask_h, mask_w)
    from .loader import load_library
    load_library()
    if paddle.framework.in_dynamic_or_pir_mode():
        return paddle._C_ops._run_custom_op('psa_mask', x, psa_type, mask_h, mask_w)[0]
    from paddle.base.layer_helper import LayerHelper
    helper = LayerHelper('psa_mask', **locals())
    out = helper.create_variable(dtype=x.dtype)
    helper.append_op(type='psa_mask', inputs={'X': x}, outputs={'Out': out},
                     attrs={'psa_type': psa_type, 'mask_h': mask_h, 'mask_w': mask_w})
    return out


def psa_mask_paddle(x, psa_type, mask_h, mask_w):
    """``psa_mask`` written with standard Paddle ops (exportable, differentiable).

    Each output entry gathers its source from ``x`` through an index map built
    from the (possibly dynamic) H and W; entries outside the window gather a
    zero appended to ``x``. Memory: an int32 index of ``(H*W)**2`` entries.
    """
    psa_type = normalize_psa_type(psa_type)
    shape = paddle.shape(x)
    h, w = shape[2], shape[3]
    positions = h * w
    index = paddle.arange(positions, dtype='int32')
    rows = index.unsqueeze(1)   # a in Y[n, a, b]
    cols = index.unsqueeze(0)   # b
    p, q = (cols, rows) if psa_type == 0 else (rows, cols)
    w32 = w.astype('int32')
    i = q // w32 - p // w32 + (mask_h - 1) // 2
    j = q % w32 - p % w32 + (mask_w - 1) // 2
    valid = (i >= 0) & (i < mask_h) & (j >= 0) & (j < mask_w)
    positions32 = positions.astype('int32')
    source = (i * mask_w + j) * positions32 + p
    zero_slot = paddle.full_like(source, mask_h * mask_w) * positions32
    source = paddle.where(valid, source, zero_slot).reshape([-1])
    flat = x.reshape([0, -1])
    flat = paddle.concat([flat, paddle.zeros_like(flat[:, :1])], axis=1)
    y = paddle.gather(flat, source, axis=1)
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
        return (f"psa_type='{_TYPE_NAMES[self.psa_type]}', mask_size={self.mask_size}, "
                f"impl='{impl}'")
