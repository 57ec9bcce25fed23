"""The PSA mask op written from its definition in numpy: the one reference its tests use.

The definition (docs/psa_mask.md, "Definition"): window cell (i, j), channel k = i*mask_w + j,
predicted at p = (h, w) points at q = (h + i - (mask_h-1)//2, w + j - (mask_w-1)//2);
cells whose q is off the map are dropped. collect: Y[n, q, p] = x[n, k, h, w];
distribute: Y[n, p, q] = x[n, k, h, w]; every other entry of Y is 0. The backward
is the matching gather: grad_x[n, k, h, w] = grad_Y at the same entry, 0 for a
cell off the map.

The loop over (i, j, h, w) is written once, as numpy index arrays (one entry per
iteration), so the same lines serve 1x1 maps and Cityscapes' 97x97 windows on
64x128. Nothing here comes from the op (ops/psa_mask_kernel.h gathers per output
element, psanet/ops/psa_mask.py builds one index map for all of them);
tests/test_psa_mask.py (both forms of the op), tests/test_psanet_model.py and the
GPU harness tests/gpu/run_gpu_checks.py (which runs without Paddle) all import it.
``branch_reference`` is a PSA branch's softmax and aggregation over such a map, in float64.
"""
import functools

import numpy as np

PSA_TYPES = {'collect': 0, 'distribute': 1}

# (N, H, W), (mask_h, mask_w) of the op's CPU tests, which the GPU harness runs too:
# odd, even and mixed masks; masks larger and smaller than the map; single-row
# and single-column maps; batches.
OP_TEST_SHAPES = [
    ((1, 5, 6), (3, 3)), ((2, 5, 6), (4, 4)), ((1, 4, 7), (3, 4)), ((1, 6, 4), (4, 3)),
    ((3, 3, 3), (1, 1)), ((1, 4, 6), (1, 5)), ((1, 6, 2), (5, 1)), ((1, 3, 2), (7, 9)),
    ((2, 1, 7), (3, 5)), ((1, 6, 1), (6, 2)), ((1, 1, 1), (3, 3)), ((2, 9, 11), (2, 2)),
]


# Cached, read-only: the GPU harness asks for each Cityscapes shape a dozen times,
# and one at 97x97 on 64x128 takes a few seconds and about 600 MB.
@functools.lru_cache(maxsize=4)
def window_cells(psa_type, mask_h, mask_w, height, width):
    """Every (cell, position) whose q is on the map, as flat indices of one sample.

    Returns:
        tuple: ``(x_index, y_index)``, int arrays of equal length: ``x[k, h, w]`` at
        ``x_index[m]`` goes to ``Y[row, col]`` at ``y_index[m]``; their length is how
        many values the op moves.
    """
    collect = PSA_TYPES.get(psa_type, psa_type) == 0
    # One entry per iteration of `for i, j, h, w`: window cell (i, j) predicted at (h, w).
    i, j, h, w = np.meshgrid(np.arange(mask_h), np.arange(mask_w), np.arange(height),
                             np.arange(width), indexing='ij', sparse=True)
    k, p = i * mask_w + j, h * width + w
    qh, qw = h + i - (mask_h - 1) // 2, w + j - (mask_w - 1) // 2
    q = qh * width + qw
    row, col = (q, p) if collect else (p, q)
    on_map = (qh >= 0) & (qh < height) & (qw >= 0) & (qw < width)  # the others are dropped
    positions = height * width
    x_index = np.broadcast_to(k * positions + p, on_map.shape)[on_map]
    y_index = np.broadcast_to(row * positions + col, on_map.shape)[on_map]
    x_index.flags.writeable = y_index.flags.writeable = False
    return x_index, y_index


def reference_forward(x, psa_type, mask_h, mask_w):
    """Y [N, H*W, H, W] from x [N, mask_h*mask_w, H, W] ('collect'/0 or 'distribute'/1)."""
    num, cells, height, width = x.shape
    assert cells == mask_h * mask_w, (x.shape, mask_h, mask_w)
    x_index, y_index = window_cells(psa_type, mask_h, mask_w, height, width)
    y = np.zeros((num, (height * width) ** 2), x.dtype)
    y[:, y_index] = x.reshape(num, -1)[:, x_index]
    return y.reshape(num, height * width, height, width)


def reference_backward(grad_y, psa_type, mask_h, mask_w):
    """grad_x [N, mask_h*mask_w, H, W] from grad_Y [N, H*W, H, W]."""
    num, positions, height, width = grad_y.shape
    assert positions == height * width, grad_y.shape
    x_index, y_index = window_cells(psa_type, mask_h, mask_w, height, width)
    grad_x = np.zeros((num, mask_h * mask_w * positions), grad_y.dtype)
    grad_x[:, x_index] = grad_y.reshape(num, -1)[:, y_index]
    return grad_x.reshape(num, mask_h * mask_w, height, width)


_FLOAT32_EPS = float(np.finfo(np.float32).eps)


def branch_reference(x_reduced, dense, scale, softmax):
    """Softmax over the H*W axis, then out[c, p] = sum_a x[c, a] * A[a, p], in float64.

    Returns:
        tuple: the output, and the largest error float32 may make computing it, in
        any order of the sums: with K = H*W, the softmax's sum and the product's
        each round at most K times (unit roundoff eps/2); exp(z) is off by |z| eps/2
        more, z = A - max A being rounded; exp, the division and the scale round a
        few times more. So (K + max|z| + 8) * eps32 of sum_a |x[c, a] * A[a, p]|: a
        first-order worst case, which no instruction set or thread count exceeds.
    """
    n, c, h, w = x_reduced.shape
    a = dense.reshape(n, h * w, h * w).astype(np.float64)
    spread = 0.0
    if softmax:
        z = a - a.max(axis=1, keepdims=True)
        spread = float(np.abs(z).max())
        a = np.exp(z)
        a = a / a.sum(axis=1, keepdims=True)
    x = x_reduced.reshape(n, c, h * w).astype(np.float64)
    out = np.einsum('nca,nap->ncp', x, a) * scale
    magnitude = np.einsum('nca,nap->ncp', np.abs(x), np.abs(a)) * abs(scale)
    bound = (h * w + spread + 8) * _FLOAT32_EPS * magnitude
    return out.reshape(n, c, h, w), bound.reshape(n, c, h, w)


def assert_within(out, expected, bound):
    error = np.abs(out - expected)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert (error <= bound).all(), (f'{int((error > bound).sum())} outputs off; at {worst}: '
                                    f'{error[worst]:.3g} > {bound[worst]:.3g}')
