"""The standalone GPU harness (tests/gpu/) checked on a CPU-only machine.

The harness itself runs only where there is a GPU; here we check what it
stands on: its C ABI library compiles and links with nvcc, its numpy
reference agrees with the Paddle op (both implementations) and with the
definition written as loops, and its checks fail on kernels that are wrong.
"""
import importlib.util
import os

import numpy as np
import pytest

from conftest import ROOT

HARNESS_PATH = os.path.join(ROOT, 'tests', 'gpu', 'run_gpu_checks.py')


def _load_harness():
    spec = importlib.util.spec_from_file_location('run_gpu_checks', HARNESS_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


harness = _load_harness()
Shape = harness.Shape

# Odd, even, mixed masks; mask larger than the map; H = 1; W = 1; N > 1.
SMALL_SHAPES = [Shape(2, 3, 3, 5, 6), Shape(1, 4, 4, 5, 6), Shape(1, 3, 4, 4, 5),
                Shape(1, 9, 9, 3, 4), Shape(2, 1, 5, 1, 7), Shape(2, 5, 1, 6, 1)]


def _x_shape(shape):
    return (shape.num, shape.mask_h * shape.mask_w, shape.feature_h, shape.feature_w)


def _y_shape(shape):
    positions = shape.feature_h * shape.feature_w
    return (shape.num, positions, shape.feature_h, shape.feature_w)


# ---------------------------------------------------------------- nvcc build

@pytest.fixture(scope='module')
def capi_library(tmp_path_factory):
    nvcc = harness.find_nvcc_quiet()
    if nvcc is None:
        pytest.skip('nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): the C ABI '
                    'library of the GPU harness cannot be compiled here')
    # CUDA 13 dropped the architectures before Turing: build two it has.
    return harness.build_library(nvcc, '80,90', str(tmp_path_factory.mktemp('capi')))


def test_capi_library_compiles_and_exports_the_abi(capi_library):
    assert os.path.getsize(capi_library) > 0
    # Loading binds every psa_capi_* signature and checks the ABI version.
    library = harness.Library(capi_library)
    assert library._lib.psa_capi_dtype_size(0) == 4
    assert library._lib.psa_capi_dtype_size(1) == 8
    assert library._lib.psa_capi_dtype_size(2) == 2
    assert library._lib.psa_capi_dtype_size(9) == 0


@pytest.mark.parametrize('psa_type, mask, message', [
    (2, (3, 3), 'psa_type must be 0'),
    (0, (0, 3), 'mask_h and mask_w must be >= 1'),
])
def test_capi_rejects_bad_arguments_before_touching_cuda(capi_library, psa_type, mask,
                                                         message):
    library = harness.Library(capi_library)
    x = np.zeros((1, max(1, mask[0] * mask[1]), 2, 2), np.float32)
    with pytest.raises(harness.CapiError, match=message):
        library.forward_host(x, psa_type, mask[0], mask[1], 0xFF)


def test_harness_exits_2_with_a_reason_without_a_gpu(capi_library, capsys):
    library = harness.Library(capi_library)
    try:
        if library.device_count() > 0:
            pytest.skip('a CUDA device is present: the harness would run for real')
    except harness.CapiError:
        pass
    assert harness.main(['--library', capi_library]) == harness.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert 'no usable CUDA device' in err or 'no CUDA device found' in err


def test_harness_exits_2_when_nvcc_is_missing(capsys):
    assert harness.main(['--nvcc', '/nonexistent/nvcc']) == harness.EXIT_UNAVAILABLE
    assert 'nvcc not found' in capsys.readouterr().err


def test_arch_flags():
    assert harness.arch_flags('native') == ['-arch=native']
    assert harness.arch_flags('sm_80, 90') == [
        '-gencode', 'arch=compute_80,code=sm_80', '-gencode', 'arch=compute_90,code=sm_90',
        '-gencode', 'arch=compute_90,code=compute_90']
    with pytest.raises(ValueError, match='--arch'):
        harness.arch_flags('hopper')


# ----------------------------------------------- the reference is the op

@pytest.mark.parametrize('impl', ['custom', 'paddle'])
@pytest.mark.parametrize('psa_type', [0, 1])
def test_reference_matches_the_paddle_op(impl, psa_type):
    paddle = pytest.importorskip('paddle')
    from psanet.ops import psa_mask
    rng = np.random.default_rng(3)
    for shape in SMALL_SHAPES:
        x_np = rng.standard_normal(_x_shape(shape))
        grad_y = rng.standard_normal(_y_shape(shape))
        x = paddle.to_tensor(x_np, stop_gradient=False)
        y = psa_mask(x, psa_type, (shape.mask_h, shape.mask_w), impl=impl)
        (y * paddle.to_tensor(grad_y)).sum().backward()
        # The op only moves values: float64 equality, not closeness.
        np.testing.assert_array_equal(
            y.numpy(), harness.psa_mask_reference(x_np, psa_type, shape.mask_h, shape.mask_w),
            err_msg=f'forward {shape}')
        np.testing.assert_array_equal(
            x.grad.numpy(),
            harness.psa_mask_backward_reference(grad_y, psa_type, shape.mask_h, shape.mask_w),
            err_msg=f'backward {shape}')


@pytest.mark.parametrize('psa_type', [0, 1])
def test_reference_matches_the_definition_as_loops(psa_type):
    rng = np.random.default_rng(5)
    for shape in SMALL_SHAPES + harness.random_shapes(40, seed=11):
        x = rng.standard_normal(_x_shape(shape)).astype(np.float32)
        grad_y = rng.standard_normal(_y_shape(shape)).astype(np.float32)
        args = (psa_type, shape.mask_h, shape.mask_w)
        np.testing.assert_array_equal(harness.psa_mask_reference(x, *args),
                                      harness.psa_mask_reference_loop(x, *args),
                                      err_msg=str(shape))
        np.testing.assert_array_equal(harness.psa_mask_backward_reference(grad_y, *args),
                                      harness.psa_mask_backward_reference_loop(grad_y, *args),
                                      err_msg=str(shape))


def test_window_entries_counts_the_values_the_forward_reads():
    for shape in SMALL_SHAPES + harness.random_shapes(20, seed=13):
        for psa_type in (0, 1):
            ones = harness.psa_mask_reference_loop(np.ones(_x_shape(shape)), psa_type,
                                                   shape.mask_h, shape.mask_w)
            assert harness.window_entries(shape) == int(ones.sum()), shape


def test_reference_chunks_cover_every_sample():
    assert harness._chunks(0, 10) == [(0, 0)]
    assert harness._chunks(8, 1 << 26) == [(n, n + 1) for n in range(8)]
    assert harness._chunks(5, 1 << 24) == [(0, 4), (4, 5)]
    assert harness._chunks(8, 100, parts=3) == [(0, 3), (3, 6), (6, 8)]


# --------------------------------------------- the checks can fail

def test_compare_exact_sees_every_kind_of_difference():
    x = np.arange(1.0, 7.0, dtype=np.float32).reshape(1, 1, 2, 3)
    expected = harness.psa_mask_reference(x, 0, 1, 1)

    def window():
        return expected != 0   # x holds no zeros

    assert harness.compare_exact(expected.copy(), expected, window).exact
    for name, change, outside in [('wrong value', (0, 0, 0, 0), 0),
                                  ('non-zero outside the window', (0, 0, 0, 1), 1),
                                  ('-0.0 for +0.0', (0, 0, 1, 2), 1)]:
        got = expected.copy()
        got[change] = -0.0 if name.startswith('-0.0') else got[change] + 0.5
        result = harness.compare_exact(got, expected, window)
        assert (result.mismatches, result.outside_window) == (1, outside), name
    got = expected.copy()
    got[0, 3, 1, 0] = np.nan   # a NaN left from the pre-fill
    result = harness.compare_exact(got, expected, window)
    assert result.mismatches == 1 and np.isnan(result.max_abs_error)


def _fake_forward(x, psa_type, mask_h, mask_w, fill_byte, half=None, zero=True):
    """A kernel in numpy, flat indices like CUDA's, with switchable bugs."""
    num, _, feature_h, feature_w = x.shape
    positions = feature_h * feature_w
    y = np.empty((num, positions, feature_h, feature_w), x.dtype)
    y.view(np.uint8)[...] = fill_byte
    flat = y.reshape(-1)
    if zero:
        flat[...] = 0
    half_h, half_w = half(mask_h, mask_w) if half else ((mask_h - 1) // 2, (mask_w - 1) // 2)
    for index in range(x.size):
        n, rest = divmod(index, x.size // max(num, 1))
        k, p = divmod(rest, positions)
        i, j = divmod(k, mask_w)
        h, w = divmod(p, feature_w)
        qh, qw = h + i - half_h, w + j - half_w
        if 0 <= qh < feature_h and 0 <= qw < feature_w:
            q = qh * feature_w + qw
            row, col = (q, p) if psa_type == 0 else (p, q)
            flat[(n * positions + row) * positions + col] = x.reshape(-1)[index]
    return y


class _FakeLibrary:
    """Stands in for the CUDA library: numpy kernels and made-up timings."""
    bugs = {}

    def __init__(self, path):
        self.path = path

    def device_count(self):
        return 1

    def device_info(self):
        return {'name': 'fake GPU', 'capability': (9, 0), 'memory_bytes': 2**30,
                'runtime': 13000, 'driver': 13000}

    def forward_host(self, x, psa_type, mask_h, mask_w, fill_byte):
        return _fake_forward(x, psa_type, mask_h, mask_w, fill_byte, **self.bugs)

    def backward_host(self, grad_y, psa_type, mask_h, mask_w, fill_byte):
        # Exact by construction: only the forward carries the planted bugs.
        return harness.psa_mask_backward_reference_loop(grad_y, psa_type, mask_h, mask_w)

    def time_forward(self, dtype, shape, psa_type, warmup, repeats):
        return 2.0

    def time_backward(self, dtype, shape, psa_type, warmup, repeats):
        return 1.0

    def time_copy(self, nbytes, warmup, repeats):
        return 1.0


@pytest.mark.parametrize('bugs, shape', [
    ({}, None),
    ({'zero': False}, Shape(1, 3, 3, 4, 5)),                         # no zero fill
    ({'half': lambda mh, mw: (mh // 2, mw // 2)}, Shape(1, 4, 4, 4, 5)),  # even mask centre
])
def test_check_case_fails_a_wrong_kernel(bugs, shape):
    runner = harness.HostRunner(_FakeLibrary(None))
    runner.library.bugs = bugs
    shapes = [shape] if shape else SMALL_SHAPES
    for s in shapes:
        for dtype in (np.float32, np.float16):
            forward, backward = harness.check_case(runner, s, dtype, 0, 0xFF, seed=1)
            assert backward.exact
            assert forward.exact == (not bugs), (s, forward.describe())
    if bugs.get('zero') is False:
        assert forward.outside_window > 0


def test_check_case_fails_swapped_collect_and_distribute():
    class Swapped(_FakeLibrary):
        def forward_host(self, x, psa_type, mask_h, mask_w, fill_byte):
            return _fake_forward(x, 1 - psa_type, mask_h, mask_w, fill_byte)

    runner = harness.HostRunner(Swapped(None))
    forward, _ = harness.check_case(runner, Shape(1, 3, 3, 4, 5), np.float64, 0, 0x5A, 1)
    assert not forward.exact


def _run_main_on_fake(monkeypatch, tmp_path, bugs):
    monkeypatch.setattr(harness, 'Library', _FakeLibrary)
    monkeypatch.setattr(_FakeLibrary, 'bugs', bugs)
    monkeypatch.setattr(harness, 'CPU_TEST_SHAPES', SMALL_SHAPES[:3])
    monkeypatch.setattr(harness, 'CITYSCAPES_SHAPES', [Shape(1, 5, 5, 4, 6),
                                                       Shape(2, 5, 5, 4, 6)])
    out = tmp_path / 'results.md'
    code = harness.main(['--library', 'fake.so', '--backend', 'numpy', '--random-shapes',
                         '3', '--out', str(out)])
    return code, out.read_text()


def test_main_reports_a_passing_run(monkeypatch, tmp_path):
    code, report = _run_main_on_fake(monkeypatch, tmp_path, {})
    assert code == 0, report
    assert '**PASSED**' in report and '## Failures' not in report
    rows = [line for line in report.splitlines() if line.startswith('| N=2 mask 5x5')]
    assert len(rows) == 6   # 3 dtypes x collect/distribute
    # float32 forward: 2 ms for (window entries + all of Y) * 4 bytes.
    shape = Shape(2, 5, 5, 4, 6)
    forward_bytes = (harness.window_entries(shape) + 2 * 24 * 24) * 4
    cells = rows[0].split('|')
    assert cells[6].strip() == '2.000'
    assert cells[8].strip() == f'{forward_bytes / 2e-3 / 1e9:.0f}'


def test_main_reports_a_failing_run(monkeypatch, tmp_path):
    code, report = _run_main_on_fake(monkeypatch, tmp_path, {'zero': False})
    assert code == harness.EXIT_FAILED
    assert '**FAILED**' in report and '## Failures' in report
    assert 'outside the window' in report


@pytest.mark.parametrize('bugs, expected', [({}, 0), ({'zero': False}, 1)])
def test_sanitize_child_exit_status(monkeypatch, bugs, expected):
    monkeypatch.setattr(harness, 'Library', _FakeLibrary)
    monkeypatch.setattr(_FakeLibrary, 'bugs', bugs)
    monkeypatch.setattr(harness, 'SANITIZE_SHAPES', SMALL_SHAPES[:2])
    assert harness.sanitize_child('fake.so') == expected


def test_parse_sanitizer_output():
    clean = '========= ERROR SUMMARY: 0 errors\n'
    assert harness.parse_sanitizer_output(clean, 0, 60) == ('ok', 'ERROR SUMMARY: 0 errors')
    races = '========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n'
    assert harness.parse_sanitizer_output(races, 86, 60)[0] == 'FAIL'
    assert harness.parse_sanitizer_output(clean, 1, 60)[0] == 'FAIL'   # a check failed
    assert harness.parse_sanitizer_output('Device not supported', 1, 60)[0] == 'unavailable'
    assert harness.parse_sanitizer_output('', None, 60) == ('FAIL', 'timed out after 60 s')
