"""PSA mask op: the custom op and the pure-Paddle form against the numpy reference.

The reference (tests/psa_mask_reference.py) follows the definition, one entry per
(window cell, position); neither implementation under test is used to compute an
expected value. The op only moves values (or writes zeros), so outputs and
gradients must equal the reference exactly, on any CPU; only finite differences
need a tolerance.
"""
import os
import re

import numpy as np
import paddle
import pytest

from conftest import ROOT
from psanet.ops import (BI_DIRECTIONAL, COLLECT, DISTRIBUTE, PSA_TYPE_NAMES, PSA_TYPES,
                        PSAMask, load_library, psa_impl, psa_mask,
                        psa_mask_cpu_backward_into, psa_mask_paddle)
from psa_mask_reference import OP_TEST_SHAPES, reference_backward, reference_forward

IMPLS = ('custom', 'paddle')
TYPE_NAMES = ('collect', 'distribute')


def run_op(impl, x, psa_type, mask_size, grad_y):
    """Forward output and the gradient of sum(Y * grad_y) w.r.t. x, as numpy."""
    x = paddle.to_tensor(x, stop_gradient=False)
    y = psa_mask(x, psa_type, mask_size, impl=impl)
    (grad_x,) = paddle.grad([y], [x], grad_outputs=[paddle.to_tensor(grad_y)])
    return y.numpy(), grad_x.numpy()


def random_case(rng, shape, mask_h, mask_w, dtype):
    num, height, width = shape
    x = rng.standard_normal((num, mask_h * mask_w, height, width)).astype(dtype)
    grad_y = rng.standard_normal((num, height * width, height, width)).astype(dtype)
    return x, grad_y


def check_against_reference(impl, x, grad_y, psa_type, mask_h, mask_w):
    y, grad_x = run_op(impl, x, psa_type, (mask_h, mask_w), grad_y)
    assert y.dtype == x.dtype and grad_x.dtype == x.dtype
    np.testing.assert_array_equal(y, reference_forward(x, psa_type, mask_h, mask_w))
    np.testing.assert_array_equal(grad_x,
                                  reference_backward(grad_y, psa_type, mask_h, mask_w))


@pytest.fixture(scope='module', autouse=True)
def op_library():
    load_library()


@pytest.mark.parametrize('dtype', ['float32', 'float64'])
@pytest.mark.parametrize('psa_type', TYPE_NAMES)
@pytest.mark.parametrize('impl', IMPLS)
@pytest.mark.parametrize('shape,mask', OP_TEST_SHAPES)
def test_forward_backward_match_reference(impl, psa_type, dtype, shape, mask):
    rng = np.random.default_rng(0)
    x, grad_y = random_case(rng, shape, *mask, dtype)
    check_against_reference(impl, x, grad_y, psa_type, *mask)


# Maps 16 to 48 wide, where the pure-Paddle form gathers 16 values per index: chunks
# that straddle a window's start or end and chunks that miss the window; windows of
# 33 columns, whose padded rows hold the fewest zeros before the window (16) and none
# after it (the next row's zeros follow), and a mask wider than the map.
WIDE_SHAPES = [((1, 3, 32), (3, 3)), ((2, 2, 48), (5, 4)), ((1, 3, 32), (2, 17)),
               ((1, 2, 48), (3, 33)), ((1, 2, 16), (3, 35))]


@pytest.mark.parametrize('psa_type', TYPE_NAMES)
@pytest.mark.parametrize('impl', IMPLS)
@pytest.mark.parametrize('shape,mask', WIDE_SHAPES)
def test_wide_maps_match_reference(impl, psa_type, shape, mask):
    rng = np.random.default_rng(16)
    x, grad_y = random_case(rng, shape, *mask, 'float32')
    check_against_reference(impl, x, grad_y, psa_type, *mask)


@pytest.mark.parametrize('impl', IMPLS)
def test_random_shapes_match_reference_exactly(impl):
    rng = np.random.default_rng(20180908)
    for _ in range(200):
        shape = (int(rng.integers(1, 3)), int(rng.integers(1, 7)), int(rng.integers(1, 7)))
        mask_h, mask_w = (int(m) for m in rng.integers(1, 8, size=2))
        psa_type = TYPE_NAMES[int(rng.integers(2))]
        dtype = ('float32', 'float64')[int(rng.integers(2))]
        x, grad_y = random_case(rng, shape, mask_h, mask_w, dtype)
        check_against_reference(impl, x, grad_y, psa_type, mask_h, mask_w)


@pytest.mark.parametrize('psa_type', TYPE_NAMES)
@pytest.mark.parametrize('impl', IMPLS)
@pytest.mark.parametrize('shape,mask', [((1, 3, 4), (2, 3)), ((2, 2, 3), (3, 3))])
def test_gradient_matches_finite_differences(impl, psa_type, shape, mask):
    rng = np.random.default_rng(1)
    x, weights = random_case(rng, shape, *mask, 'float64')
    w = paddle.to_tensor(weights)

    def objective(values):
        return float((psa_mask(paddle.to_tensor(values), psa_type, mask, impl=impl) * w).sum())

    _, grad_x = run_op(impl, x, psa_type, mask, weights)
    eps = 1e-6
    numeric = np.zeros_like(x)
    for index in np.ndindex(*x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += eps
        minus[index] -= eps
        numeric[index] = (objective(plus) - objective(minus)) / (2 * eps)
    # The op is linear: central differences have no truncation error, only rounding.
    # Each float64 objective, a sum of n products in whatever order Paddle adds them,
    # is off by at most n * eps64/2 * sum|y * w|; x +- eps by eps64/2 * |x|.
    eps64 = np.finfo(np.float64).eps
    y = reference_forward(x, psa_type, *mask)
    np.testing.assert_allclose(grad_x, numeric, rtol=eps64 * np.abs(x).max() / eps,
                               atol=y.size * eps64 * np.abs(y * weights).sum() / eps)


@pytest.mark.parametrize('psa_type', TYPE_NAMES)
@pytest.mark.parametrize('impl', IMPLS)
def test_outputs_are_zeroed_on_every_call(impl, psa_type):
    # Calls whose outputs are all NaN or huge come first, so that freed blocks
    # the allocator hands back hold garbage: zeros must be written, not assumed.
    mask, shape = (3, 4), (2, 6, 5)
    rng = np.random.default_rng(2)
    for fill in (np.nan, 1e30, -1e30):
        poison = np.full((2, 12, 6, 5), fill, 'float32')
        poison_grad = np.full((2, 30, 6, 5), fill, 'float32')
        run_op(impl, poison, psa_type, mask, poison_grad)
        x, grad_y = random_case(rng, shape, *mask, 'float32')
        y, grad_x = run_op(impl, x, psa_type, mask, grad_y)
        assert not np.isnan(y).any() and not np.isnan(grad_x).any()
        np.testing.assert_array_equal(y, reference_forward(x, psa_type, *mask))
        np.testing.assert_array_equal(grad_x, reference_backward(grad_y, psa_type, *mask))


@pytest.mark.parametrize('psa_type', [COLLECT, DISTRIBUTE])
@pytest.mark.parametrize('shape,mask', [((2, 5, 37), (7, 9)), ((1, 3, 33), (5, 41)),
                                        ((1, 4, 16), (3, 3))])
def test_cpu_backward_kernel_alone_matches_reference_over_nan(psa_type, shape, mask):
    # The bench's hook into the float32 kernel; the map rows (37, 33: a partial
    # cache line last; 16: exactly one) take several lines of columns, and grad_x
    # starts as NaN, so every element must be written.
    num, height, width = shape
    grad_y = np.random.default_rng(5).standard_normal(
        (num, height * width, height, width)).astype('float32')
    grad_x = np.full((num, mask[0] * mask[1], height, width), np.nan, 'float32')
    psa_mask_cpu_backward_into(grad_y, grad_x, psa_type, *mask)
    np.testing.assert_array_equal(grad_x, reference_backward(grad_y, psa_type, *mask))


def test_cpu_backward_kernel_alone_refuses_a_wrong_array():
    grad_y = np.zeros((1, 20, 4, 5), 'float64')
    with pytest.raises(ValueError, match='C-contiguous float32'):
        psa_mask_cpu_backward_into(grad_y, np.zeros((1, 9, 4, 5), 'float32'), COLLECT, 3, 3)


@pytest.mark.parametrize('impl', IMPLS)
def test_cells_off_the_map_get_zero_gradient_even_from_nan(impl):
    # Entries of grad_y that no cell maps to are NaN here; they must not leak.
    rng = np.random.default_rng(3)
    x, grad_y = random_case(rng, (1, 4, 5), 3, 3, 'float64')
    used = reference_forward(np.ones_like(x), 'distribute', 3, 3) != 0
    grad_y[~used] = np.nan
    _, grad_x = run_op(impl, x, 'distribute', 3, grad_y)
    np.testing.assert_array_equal(grad_x, reference_backward(
        np.where(used, grad_y, 0.0), 'distribute', 3, 3))


@pytest.mark.parametrize('impl', IMPLS)
def test_non_contiguous_input(impl):
    rng = np.random.default_rng(4)
    x, grad_y = random_case(rng, (2, 5, 4), 3, 3, 'float32')
    # Stored as [N, C, W, H] and transposed: a strided view with the right shape.
    base = paddle.to_tensor(np.ascontiguousarray(x.transpose(0, 1, 3, 2)))
    strided = paddle.transpose(base, [0, 1, 3, 2])
    assert not strided.is_contiguous()
    strided.stop_gradient = False
    y = psa_mask(strided, 'collect', 3, impl=impl)
    (grad_x,) = paddle.grad([y], [strided], grad_outputs=[paddle.to_tensor(grad_y)])
    np.testing.assert_array_equal(y.numpy(), reference_forward(x, 'collect', 3, 3))
    np.testing.assert_array_equal(grad_x.numpy(),
                                  reference_backward(grad_y, 'collect', 3, 3))


def test_layer_and_psa_impl_match_functional():
    rng = np.random.default_rng(5)
    x = paddle.to_tensor(rng.standard_normal((1, 15, 4, 6)).astype('float32'))
    expected = reference_forward(x.numpy(), 'distribute', 3, 5)
    np.testing.assert_array_equal(PSAMask('distribute', (3, 5))(x).numpy(), expected)
    np.testing.assert_array_equal(psa_mask_paddle(x, 1, 3, 5).numpy(), expected)
    with psa_impl('paddle'):
        np.testing.assert_array_equal(psa_mask(x, 1, (3, 5)).numpy(), expected)
    np.testing.assert_array_equal(psa_mask(x, np.int64(1), (np.int32(3), 5)).numpy(),
                                  expected)


def test_layer_repr_names_type_and_size():
    text = repr(PSAMask('distribute', (3, 5), impl='paddle'))
    assert 'PSAMask' in text and "'distribute'" in text and '(3, 5)' in text
    assert "'collect'" in repr(PSAMask(0, 7)) and '(7, 7)' in repr(PSAMask(0, 7))


def test_psa_type_constants_are_the_values_of_the_op_and_its_kernels():
    assert PSA_TYPES == {'collect': COLLECT, 'distribute': DISTRIBUTE} \
        == {'collect': 0, 'distribute': 1}
    # The model's two-branch value has a name but is no op value (BAD_CALLS: 2).
    assert PSA_TYPE_NAMES[BI_DIRECTIONAL] == 'bi-directional'
    assert BI_DIRECTIONAL not in PSA_TYPES.values()
    with open(os.path.join(ROOT, 'ops', 'psa_mask_kernel.h')) as f:
        constants = re.findall(r'constexpr int (kCollect|kDistribute) = (\d+);', f.read())
    assert constants == [('kCollect', str(COLLECT)), ('kDistribute', str(DISTRIBUTE))]


def _tensor(shape, dtype='float32'):
    return paddle.zeros(shape, dtype=dtype)


BAD_CALLS = [
    ((_tensor([9, 4, 4]), 'collect', 3), '4-D'),
    ((_tensor([1, 1, 9, 4, 4]), 'collect', 3), '4-D'),
    ((_tensor([1, 8, 4, 4]), 'collect', 3), '9 channels'),
    ((_tensor([1, 12, 4, 4]), 'distribute', (4, 4)), '16 channels'),
    ((_tensor([1, 9, 4, 4]), 'collect', 0), 'mask_size'),
    ((_tensor([1, 9, 4, 4]), 'collect', -3), 'mask_size'),
    ((_tensor([1, 9, 4, 4]), 'collect', 3.0), 'mask_size'),
    ((_tensor([1, 9, 4, 4]), 'collect', '3'), 'mask_size'),
    ((_tensor([1, 9, 4, 4]), 'collect', True), 'mask_size'),
    ((_tensor([1, 9, 4, 4]), 'collect', (3,)), 'mask_size'),
    ((_tensor([1, 9, 4, 4]), 'collect', (3, 3, 1)), 'mask_size'),
    ((_tensor([1, 9, 4, 4]), 'collect', (3, 0)), 'mask_size'),
    ((_tensor([1, 9, 4, 4]), 'foo', 3), 'psa_type'),
    ((_tensor([1, 9, 4, 4]), 2, 3), 'psa_type'),
    ((_tensor([1, 9, 4, 4]), True, 3), 'psa_type'),
    ((_tensor([1, 9, 4, 4]), None, 3), 'psa_type'),
    ((_tensor([1, 9, 4, 4], 'int32'), 'collect', 3), 'floating-point'),
    ((_tensor([1, 9, 4, 4], 'int64'), 'collect', 3), 'floating-point'),
    ((_tensor([1, 9, 4, 4], 'bool'), 'collect', 3), 'floating-point'),
]


@pytest.mark.parametrize('impl', IMPLS)
@pytest.mark.parametrize('args,message', BAD_CALLS)
def test_bad_input_raises_value_error(impl, args, message):
    with pytest.raises(ValueError, match=message):
        psa_mask(*args, impl=impl)


@pytest.mark.parametrize('impl', IMPLS)
def test_a_numpy_array_is_told_to_become_a_tensor(impl):
    with pytest.raises(TypeError, match=r'x must be a Paddle tensor, got numpy.ndarray; convert '
                       r'it with paddle.to_tensor\(x\)'):
        psa_mask(np.zeros((1, 9, 4, 4), 'float32'), 'collect', 3, impl=impl)


def test_bad_impl_and_cpu_float16_raise_value_error():
    x = _tensor([1, 9, 4, 4])
    with pytest.raises(ValueError, match='impl'):
        psa_mask(x, 'collect', 3, impl='cuda')
    with pytest.raises(ValueError, match='impl'):
        PSAMask('collect', 3, impl='fast')
    with pytest.raises(ValueError, match='float32 or float64'):
        psa_mask(x.astype('float16'), 'collect', 3, impl='custom')
    with pytest.raises(ValueError, match='mask_size'):
        psa_mask_paddle(x, 'collect', 3, 0)


@pytest.mark.parametrize('args,message', [
    ((_tensor([1, 8, 4, 4]), 0, 3, 3), '9 channels'),
    ((_tensor([9, 4, 4]), 0, 3, 3), '4-D'),
    ((_tensor([1, 9, 4, 4]), 2, 3, 3), 'psa_type'),
    ((_tensor([1, 9, 4, 4]), -1, 3, 3), 'psa_type'),
    ((_tensor([1, 9, 4, 4]), 0, 0, 9), 'mask_h and mask_w'),
    ((_tensor([1, 9, 4, 4]), 0, 9, -1), 'mask_h and mask_w'),
    ((_tensor([1, 9, 4, 4], 'float16'), 0, 3, 3), 'float32 or float64'),
])
def test_kernel_checks_its_inputs_again(args, message):
    # Straight to the C++ op, past the Python checks: an exception, not a crash.
    with pytest.raises(Exception, match=message):
        paddle._C_ops._run_custom_op('psa_mask', *args)


@pytest.mark.parametrize('psa_type', TYPE_NAMES)
def test_gradient_under_to_static_matches_reference(psa_type):
    # Training through dy2static runs the grad op from the static graph, whose
    # shape comes from the grad op's own shape inference.
    rng = np.random.default_rng(6)
    x, grad_y = random_case(rng, (2, 4, 5), 3, 4, 'float32')

    def weighted_sum(values, weights):
        return (psa_mask(values, psa_type, (3, 4), impl='custom') * weights).sum()

    static = paddle.jit.to_static(weighted_sum, full_graph=True, input_spec=[
        paddle.static.InputSpec([None, 12, None, None], 'float32'),
        paddle.static.InputSpec([None, 20, None, None], 'float32')])
    values = paddle.to_tensor(x, stop_gradient=False)
    static(values, paddle.to_tensor(grad_y)).backward()
    np.testing.assert_array_equal(values.grad.numpy(),
                                  reference_backward(grad_y, psa_type, 3, 4))
