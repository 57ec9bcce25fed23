"""PSA mask op CPU threads: as many as the process gives Paddle, and the same results on any number.

The op's thread count is read back from the library (``psa_mask_cpu_threads``:
what a call from this thread may use; ``psa_mask_last_cpu_threads``: what the
last call ran on), so nothing here depends on timing.
"""
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from conftest import ROOT, run_process
from psa_mask_reference import reference_forward
from predictor_helpers import cpu_config, create, run_once
from psanet.ops import psa_mask, psa_mask_cpu_threads, psa_mask_last_cpu_threads

# Work for 3 threads forward and backward (one per 65536 elements written at
# most): x has 15*17 * 23*37 = 217005 elements, the output 851**2 = 724201.
MASK, MAP = (15, 17), (23, 37)
# The Cityscapes training shape, whose 16 MiB output goes out with streaming stores.
CITYSCAPES_MASK, CITYSCAPES_MAP = (59, 59), (32, 64)


@pytest.fixture
def set_paddle_threads(monkeypatch):
    """``set_paddle_threads(n)`` gives Paddle n CPU threads for the test; restored after."""
    monkeypatch.delenv('PSA_MASK_NUM_THREADS', raising=False)
    original = psa_mask_cpu_threads()
    yield paddle.base.core.set_num_threads
    paddle.base.core.set_num_threads(original)


def random_input(mask, feature, dtype='float32', num=1, seed=0):
    shape = (num, mask[0] * mask[1]) + tuple(feature)
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def run(x, psa_type, mask):
    """(output, input gradient, threads of the forward, threads of the backward)."""
    x = paddle.to_tensor(x, stop_gradient=False)
    y = psa_mask(x, psa_type, mask, impl='custom')
    forward_threads = psa_mask_last_cpu_threads()
    grad_y = paddle.to_tensor(np.random.default_rng(1).standard_normal(y.shape)).astype(x.dtype)
    grad_x, = paddle.grad([y], [x], grad_outputs=[grad_y])
    return y.numpy(), grad_x.numpy(), forward_threads, psa_mask_last_cpu_threads()


def test_op_threads_follow_paddle_set_num_threads(set_paddle_threads):
    x = random_input(MASK, MAP)
    for threads in (1, 2, 3):
        set_paddle_threads(threads)
        assert psa_mask_cpu_threads() == threads
        _, _, forward, backward = run(x, 'collect', MASK)
        assert (forward, backward) == (threads, threads)


@pytest.mark.parametrize('psa_type', ['collect', 'distribute'])
@pytest.mark.parametrize('mask, feature, dtype', [
    (MASK, MAP, 'float32'), (MASK, MAP, 'float64'),
    (CITYSCAPES_MASK, CITYSCAPES_MAP, 'float32')])
def test_results_are_identical_on_one_two_and_three_threads(set_paddle_threads, psa_type,
                                                           mask, feature, dtype):
    x = random_input(mask, feature, dtype)
    set_paddle_threads(1)
    y_one, grad_one, _, _ = run(x, psa_type, mask)
    for threads in (2, 3):
        set_paddle_threads(threads)
        y, grad, forward, backward = run(x, psa_type, mask)
        assert (forward, backward) == (threads, threads)
        # The op only copies: any split of the work gives the same bits.
        np.testing.assert_array_equal(y, y_one)
        np.testing.assert_array_equal(grad, grad_one)


@pytest.mark.parametrize('value, expected', [('3', 3), ('1', 1), ('0', 2), ('many', 2)])
def test_psa_mask_num_threads_overrides_paddle_when_positive(set_paddle_threads, monkeypatch,
                                                             value, expected):
    set_paddle_threads(2)
    monkeypatch.setenv('PSA_MASK_NUM_THREADS', value)
    assert psa_mask_cpu_threads() == expected
    _, _, forward, backward = run(random_input(MASK, MAP), 'distribute', MASK)
    assert (forward, backward) == (expected, expected)


@pytest.mark.parametrize('omp_num_threads, expected', [(None, 1), ('2', 2)])
def test_a_new_process_takes_omp_num_threads_else_one(omp_num_threads, expected):
    """As a rank of paddle.distributed.launch starts: `import paddle` makes an unset
    OMP_NUM_THREADS 1."""
    env = {k: v for k, v in os.environ.items()
           if k not in ('OMP_NUM_THREADS', 'PSA_MASK_NUM_THREADS')}
    if omp_num_threads is not None:
        env['OMP_NUM_THREADS'] = omp_num_threads
    result = run_process(
        [sys.executable, '-c', 'from psanet.ops import psa_mask_cpu_threads; '
         'print(psa_mask_cpu_threads())'],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == str(expected)


class RawPSAMask(paddle.nn.Layer):
    """Times a parameter of 1: Paddle 3.0.0's predictor needs a parameter file
    (psanet.compat.PARAMETERLESS_PROGRAM)."""

    def __init__(self):
        super().__init__()
        self.one = self.create_parameter(
            [1], default_initializer=paddle.nn.initializer.Constant(1.0))

    def forward(self, x):
        return psa_mask(x, 'collect', MASK, impl='custom') * self.one


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
    path = str(tmp_path_factory.mktemp('psa_mask_threads') / 'model')
    spec = [paddle.static.InputSpec([None, MASK[0] * MASK[1], None, None], 'float32', 'x')]
    paddle.jit.save(paddle.jit.to_static(RawPSAMask(), input_spec=spec, full_graph=True), path)
    return path


@pytest.mark.parametrize('onednn', [False, True])
def test_predictor_runs_the_op_on_its_cpu_math_library_threads(set_paddle_threads, exported,
                                                             onednn):
    x = random_input(MASK, MAP)
    expected = reference_forward(x, 'collect', *MASK)
    set_paddle_threads(1)  # the predictor's count, not the caller's, decides
    for threads in (2, 3):
        predictor = create(cpu_config(exported, onednn, threads=threads))
        output = run_once(predictor, x)
        assert psa_mask_last_cpu_threads() == threads
        np.testing.assert_array_equal(output, expected)
