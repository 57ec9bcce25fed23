"""The standalone GPU harness (tests/gpu/) checked on a CPU-only machine.

The harness itself runs only where there is a GPU; here we check what it stands
on: its C ABI library compiles with nvcc, loads and refuses bad arguments, the
harness says why it cannot run, it compares with the reference the op's tests
use (tests/psa_mask_reference.py), and its checks pass a right kernel and fail
wrong ones (numpy stand-ins for the library).
"""
import ctypes
import importlib.util
import os
import shutil

import numpy as np
import pytest

import psa_mask_reference
from conftest import ROOT

_spec = importlib.util.spec_from_file_location(
    'run_gpu_checks', os.path.join(ROOT, 'tests', 'gpu', 'run_gpu_checks.py'))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)
Shape = harness.Shape

# Odd, even, mixed masks; mask larger than the map; H = 1; W = 1; N > 1.
SMALL_SHAPES = [Shape(2, 3, 3, 5, 6), Shape(1, 4, 4, 5, 6), Shape(1, 3, 4, 4, 5),
                Shape(1, 9, 9, 3, 4), Shape(2, 1, 5, 1, 7), Shape(2, 5, 1, 6, 1)]


# ---------------------------------------------------------------- nvcc build

@pytest.fixture(scope='module')
def capi_library(tmp_path_factory):
    nvcc = harness.find_nvcc()
    if nvcc is None:
        pytest.skip('nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): the C ABI '
                    'library of the GPU harness cannot be compiled here')
    # CUDA 13 dropped the architectures before Turing: build two it has.
    return harness.build_library(nvcc, '80,90', str(tmp_path_factory.mktemp('capi')))


def test_capi_library_compiles_and_exports_the_abi(capi_library):
    assert os.path.getsize(capi_library) > 0
    # Loading binds every psa_capi_* signature and checks the ABI version and dtype sizes.
    library = harness.Library(capi_library)
    assert [library._lib.psa_capi_dtype_size(code) for code in (0, 1, 2, 9)] == [4, 8, 2, 0]


@pytest.mark.parametrize('psa_type, mask, message', [
    (2, (3, 3), 'psa_type must be 0'),
    (0, (0, 3), 'mask_h and mask_w must be >= 1'),
])
def test_capi_rejects_bad_arguments_before_touching_cuda(capi_library, psa_type, mask,
                                                         message):
    x = np.zeros((1, max(1, mask[0] * mask[1]), 2, 2), np.float32)
    with pytest.raises(harness.CapiError, match=message):
        harness.Library(capi_library).run(0, x, psa_type, *mask, 0xFF)


def test_capi_binds_the_kernels_and_grid_arguments(capi_library):
    """The C ABI's kernel selector and grid cap reach its checks where ctypes puts them."""
    library = harness.Library(capi_library)
    x = np.zeros((1, 9, 2, 2), np.float32)
    with pytest.raises(harness.CapiError, match='kernels must be 0 .* got 3'):
        library.run(0, x, 0, 3, 3, 0xFF, kernels=3)
    with pytest.raises(harness.CapiError, match=r'max_grid_x must be .* got 0'):
        library.run(0, x, 0, 3, 3, 0xFF, max_grid_x=0)
    with pytest.raises(harness.CapiError, match='kernels must be 0 .* got -1'):
        library.time(1, 'float32', Shape(1, 3, 3, 2, 2), 0, 0, 1, kernels=-1)


def test_harness_exits_2_with_a_reason_without_a_gpu(capi_library, capsys):
    try:
        harness.Library(capi_library).device_info()
        pytest.skip('a CUDA device is present: the harness would run for real')
    except harness.CapiError:
        pass
    assert harness.main(['--library', capi_library]) == harness.EXIT_UNAVAILABLE
    assert 'no usable CUDA device' in capsys.readouterr().err


def test_harness_exits_2_when_nvcc_is_missing(capsys):
    assert harness.main(['--nvcc', '/nonexistent/nvcc']) == harness.EXIT_UNAVAILABLE
    assert 'nvcc not found' in capsys.readouterr().err


def test_the_build_cache_is_keyed_by_every_source(tmp_path):
    """The cache both tests/gpu builds use: reused while nothing changes, rebuilt when a
    file the source includes changes, and a failed build names its command and output."""
    import cached_build  # tests/gpu/, on the path since the harness was loaded
    compiler = shutil.which('c++') or shutil.which('g++')
    if compiler is None:
        pytest.skip('no C++ compiler')
    source, header = tmp_path / 'value.cc', tmp_path / 'value.h'
    source.write_text('#include "value.h"\nextern "C" int value() { return VALUE; }\n')
    flags, built, calls = ['-shared', '-fPIC', f'-I{tmp_path}'], [], []
    for value in (1, 1, 2):
        header.write_text(f'#define VALUE {value}\n')
        built.append(cached_build.cached_build(compiler, flags, [str(source), str(header)],
                                               str(tmp_path / 'cache'), 'value', RuntimeError,
                                               calls.append))
        assert ctypes.CDLL(built[-1]).value() == value
    assert built[0] == built[1] != built[2] and len(calls) == 2
    source.write_text('int broken(\n')
    with pytest.raises(RuntimeError, match=r'(?s)^\$ .*value\.cc\n.*error'):
        cached_build.cached_build(compiler, flags, [str(source)], str(tmp_path / 'cache'),
                                  'value', RuntimeError)
    assert sorted(os.listdir(tmp_path / 'cache')) == sorted(os.path.basename(p) for p in
                                                            set(built))


def test_arch_flags():
    assert harness.arch_flags('native') == ['-arch=native']
    assert harness.arch_flags('sm_80, 90') == [
        '-gencode', 'arch=compute_80,code=sm_80', '-gencode', 'arch=compute_90,code=sm_90',
        '-gencode', 'arch=compute_90,code=compute_90']
    with pytest.raises(ValueError, match='--arch'):
        harness.arch_flags('hopper')


def test_harness_compares_with_the_reference_of_the_op_tests():
    # tests/test_psa_mask.py checks that reference against both forms of the op.
    assert harness.reference_forward is psa_mask_reference.reference_forward
    assert harness.reference_backward is psa_mask_reference.reference_backward


# ---------------------------------------------------------------- the checks can fail

def test_compare_exact_sees_every_kind_of_difference():
    x = np.arange(1.0, 7.0, dtype=np.float32).reshape(1, 1, 2, 3)
    expected = psa_mask_reference.reference_forward(x, 0, 1, 1)
    _, written = psa_mask_reference.window_cells(0, 1, 1, 2, 3)
    assert harness.compare_exact(expected.copy(), expected, written).exact
    for name, change, outside in [('wrong value', (0, 0, 0, 0), 0),
                                  ('non-zero outside the window', (0, 0, 0, 1), 1),
                                  ('-0.0 for +0.0', (0, 0, 1, 2), 1)]:
        got = expected.copy()
        got[change] = -0.0 if name.startswith('-0.0') else got[change] + 0.5
        result = harness.compare_exact(got, expected, written)
        assert (result.mismatches, result.outside_window) == (1, outside), name
    got = expected.copy()
    got[0, 3, 1, 0] = np.nan  # a NaN left from the pre-fill
    result = harness.compare_exact(got, expected, written)
    assert result.mismatches == 1 and np.isnan(result.max_abs_error)


def fake_kernel(direction, array, psa_type, mask_h, mask_w, fill_byte, half=None, zero=True,
                kernels=harness.OP_KERNELS, max_grid_x=harness.MAX_GRID_X):
    """The kernels in numpy, one gather per output element, with switchable bugs:
    another window centre, no zero outside the window."""
    num, _, height, width = array.shape
    positions = height * width
    half_h, half_w = half(mask_h, mask_w) if half else ((mask_h - 1) // 2, (mask_w - 1) // 2)
    if direction == 0:
        n, a, b = np.indices((num, positions, positions))
        p, q = (b, a) if psa_type == 0 else (a, b)
        i, j = q // width - p // width + half_h, q % width - p % width + half_w
        inside = (i >= 0) & (i < mask_h) & (j >= 0) & (j < mask_w)
        index = (n, i * mask_w + j, p)
    else:
        n, k, p = np.indices((num, mask_h * mask_w, positions))
        qh, qw = p // width + k // mask_w - half_h, p % width + k % mask_w - half_w
        inside = (qh >= 0) & (qh < height) & (qw >= 0) & (qw < width)
        q = qh * width + qw
        index = (n, q, p) if psa_type == 0 else (n, p, q)
    out = np.full(inside.size * array.itemsize, fill_byte, np.uint8).view(array.dtype)
    out = out.reshape(inside.shape)
    out[inside] = array.reshape(num, -1, positions)[tuple(v[inside] for v in index)]
    if zero:
        out[~inside] = 0
    return out.reshape(num, -1, height, width)


class FakeLibrary:
    """Stands in for the CUDA library: the numpy kernels above and made-up timings
    (the op's kernels 2 ms forward, 1 ms backward; the landed ones 5 times slower,
    the per-position ones 3 times); records each run's kernels and grid cap."""
    bugs = {}
    runs = []

    def __init__(self, path):
        pass

    def device_info(self):
        return {'name': 'fake GPU', 'capability': (9, 0), 'memory_bytes': 2**30,
                'runtime': 13000, 'driver': 13000}

    def run(self, *args, **kwargs):
        self.runs.append((kwargs.get('kernels', harness.OP_KERNELS),
                          kwargs.get('max_grid_x', harness.MAX_GRID_X)))
        return fake_kernel(*args, **kwargs, **self.bugs)

    def time(self, direction, dtype, shape, psa_type, warmup, repeats,
             kernels=harness.OP_KERNELS):
        return (2.0 if direction == 0 else 1.0) * {harness.OP_KERNELS: 1, harness.LANDED: 5,
                                                    harness.PER_POSITION: 3}[kernels]

    def time_copy(self, nbytes, warmup, repeats):
        return 1.0


@pytest.mark.parametrize('bugs, shape', [
    ({}, None),
    ({'zero': False}, Shape(1, 3, 3, 4, 5)),                              # no zero fill
    ({'half': lambda mh, mw: (mh // 2, mw // 2)}, Shape(1, 4, 4, 4, 5)),  # even mask centre
])
def test_check_case_fails_a_wrong_kernel(monkeypatch, bugs, shape):
    monkeypatch.setattr(FakeLibrary, 'bugs', bugs)
    for s in [shape] if shape else SMALL_SHAPES:
        for dtype in ('float32', 'float16'):
            for psa_type in (0, 1):
                results = harness.check_case(FakeLibrary(None), s, dtype, psa_type, 0xFF, 1)
                assert [r.exact for r in results] == [not bugs] * 2, (s, results)
                if bugs.get('zero') is False:
                    assert all(r.outside_window > 0 for r in results)


def test_check_case_fails_swapped_collect_and_distribute():
    class Swapped(FakeLibrary):
        def run(self, direction, array, psa_type, *args, **kwargs):
            return fake_kernel(direction, array, 1 - psa_type, *args, **kwargs)

    results = harness.check_case(Swapped(None), Shape(1, 3, 3, 4, 5), 'float64', 0, 0x5A, 1)
    assert not any(r.exact for r in results)


def _run_main_on_fake(monkeypatch, tmp_path, bugs, *args):
    monkeypatch.setattr(harness, 'Library', FakeLibrary)
    monkeypatch.setattr(FakeLibrary, 'bugs', bugs)
    monkeypatch.setattr(FakeLibrary, 'runs', [])
    monkeypatch.setattr(harness, 'CPU_TEST_SHAPES', SMALL_SHAPES[:3])
    monkeypatch.setattr(harness, 'SANITIZE_SHAPES', SMALL_SHAPES[:2])
    monkeypatch.setattr(harness, 'CITYSCAPES_SHAPES', [Shape(1, 5, 5, 4, 6),
                                                       Shape(2, 5, 5, 4, 6)])
    monkeypatch.setattr(harness, 'GOAL_SHAPE', Shape(2, 5, 5, 4, 6))
    out = tmp_path / 'results.md'
    code = harness.main(['--library', 'fake.so', '--random-shapes', '3', '--out', str(out),
                         *args])
    return code, out.read_text() if out.exists() else None


def test_main_reports_a_passing_run(monkeypatch, tmp_path):
    code, report = _run_main_on_fake(monkeypatch, tmp_path, {})
    assert code == 0, report
    assert '**PASSED**' in report and '## Failures' not in report
    checks, timing = report.split('## Timing')
    rows = [line for line in checks.splitlines() if line.startswith('| N=2 mask 5x5')]
    assert len(rows) == 6  # 3 dtypes x collect/distribute
    # float32 forward: 2 ms for (the values moved + all of Y) * 4 bytes; 1 ms for a copy
    # of half of them; the landed kernels take 10 ms.
    moved = int(psa_mask_reference.reference_forward(np.ones((2, 25, 4, 6)), 0, 5, 5).sum())
    cells = [cell.strip() for cell in rows[0].split('|')]
    assert cells[6] == '2.000' and cells[8] == f'{(moved + 2 * 24 * 24) * 4 / 2e-3 / 1e9:.0f}'
    assert (cells[9], cells[10]) == ('50%', '5.00')
    rows = [line for line in timing.splitlines() if line.startswith('| N=2 mask 5x5')]
    assert len(rows) == 12  # and both directions
    assert [cell.strip() for cell in rows[1].split('|')][4:12] == [
        'backward', '1.000', '1.000', '5.000', '3.000', '100%', '5.00', '3.00']
    goal = [line for line in timing.splitlines() if line.startswith('- ')]
    assert goal[:2] == ['- collect forward: 50% of the copy, 5.00x the landed kernels: NOT met',
                        '- collect backward: 100% of the copy, 5.00x the landed kernels: met']
    assert len(goal) == 4
    # The baselines are checked before they are timed, and the op's kernels on a small grid.
    assert {(harness.LANDED, harness.MAX_GRID_X), (harness.PER_POSITION, harness.MAX_GRID_X),
            (harness.OP_KERNELS, harness.SMALL_GRID_X)} < set(FakeLibrary.runs)


def test_main_reports_a_failing_run(monkeypatch, tmp_path):
    code, report = _run_main_on_fake(monkeypatch, tmp_path, {'zero': False})
    assert code == harness.EXIT_FAILED
    assert '**FAILED**' in report and '## Failures' in report
    assert 'outside the window' in report


@pytest.mark.parametrize('bugs, expected', [({}, 0), ({'zero': False}, 1)])
def test_sanitize_child_exit_status(monkeypatch, tmp_path, bugs, expected):
    assert _run_main_on_fake(monkeypatch, tmp_path, bugs, '--sanitize-child')[0] == expected


def test_parse_sanitizer_output():
    clean = '========= ERROR SUMMARY: 0 errors\n'
    assert harness.parse_sanitizer_output(clean, 0, 60) == ('ok', 'ERROR SUMMARY: 0 errors')
    races = '========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n'
    assert harness.parse_sanitizer_output(races, 86, 60)[0] == 'FAIL'
    assert harness.parse_sanitizer_output(clean, 1, 60)[0] == 'FAIL'  # a check failed
    assert harness.parse_sanitizer_output('Device not supported', 1, 60)[0] == 'unavailable'
    assert harness.parse_sanitizer_output('', None, 60) == ('FAIL', 'timed out after 60 s')
