"""Standalone GPU check of the PSA mask CUDA kernels, for GPU machines without Paddle.

Builds ``psa_mask_capi.cu`` (a C ABI over the launchers of ``ops/psa_mask_kernel.h``
and two baseline layouts) with nvcc, calls it through ctypes, and compares its outputs,
pre-filled with NaN or garbage, bit for bit with ``tests/psa_mask_reference.py``; times
the kernels against a device-to-device copy and the baselines; runs a subset under
compute-sanitizer. What it checks, its options and its report: tests/gpu/README.md.

    python tests/gpu/run_gpu_checks.py [--quick] [--sanitize] [--out results.md]

Exit status: 0 all checks pass, 1 a check failed, 2 the machine cannot run the
checks (no nvcc, no CUDA device, the build failed).
"""
import argparse
import concurrent.futures
import ctypes
import dataclasses
import functools
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections import namedtuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for the reference shared with the op tests
sys.path.insert(0, HERE)  # tests/gpu/, for the build cache shared with emulator.py
from cached_build import cached_build  # noqa: E402
from psa_mask_reference import (  # noqa: E402
    OP_TEST_SHAPES, reference_backward, reference_forward, window_cells)

CAPI_SOURCE = os.path.join(HERE, 'psa_mask_capi.cu')
BASELINES_SOURCE = os.path.join(HERE, 'psa_mask_baselines.cuh')
KERNEL_HEADER = os.path.normpath(os.path.join(HERE, '..', '..', 'ops', 'psa_mask_kernel.h'))
DEFAULT_BUILD_DIR = os.path.join(HERE, 'build')
ABI_VERSION = 3
DTYPES = {'float32': 0, 'float64': 1, 'float16': 2}  # the C ABI's dtype codes
# The C ABI's kernel codes: the op's tiled kernels, then the baselines they are timed against.
OP_KERNELS, LANDED, PER_POSITION = 0, 1, 2
BASELINES = {LANDED: 'landed', PER_POSITION: 'per position'}
MAX_GRID_X = 2**31 - 1  # the op's launch; a lower cap runs the grid's second dimension
SMALL_GRID_X = 3
TYPE_NAMES = ('collect', 'distribute')
DIRECTIONS = ('forward', 'backward')  # the C ABI's direction codes 0 and 1
EXIT_FAILED, EXIT_UNAVAILABLE = 1, 2
THREADS = min(8, os.cpu_count() or 1)


class Shape(namedtuple('Shape', 'num mask_h mask_w feature_h feature_w')):
    def __str__(self):
        return (f'N={self.num} mask {self.mask_h}x{self.mask_w} '
                f'map {self.feature_h}x{self.feature_w}')


# The shapes of the op's CPU tests (tests/test_psa_mask.py), then an empty batch, a
# bigger batch and a PSANet-like 13x13.
CPU_TEST_SHAPES = [Shape(n, mh, mw, h, w) for (n, h, w), (mh, mw) in OP_TEST_SHAPES] + [
    Shape(0, 3, 3, 4, 4), Shape(3, 5, 5, 6, 6), Shape(2, 13, 13, 8, 16)]
# Small enough for compute-sanitizer; the last three take several tiles across the
# map (W > 32 source columns, W > 128 target columns) or the mask (> 128 window columns).
SANITIZE_SHAPES = [Shape(2, 3, 3, 5, 6), Shape(2, 4, 4, 5, 6), Shape(1, 3, 4, 4, 5),
                   Shape(1, 9, 9, 3, 4), Shape(2, 3, 3, 7, 1), Shape(1, 9, 9, 32, 40),
                   Shape(1, 3, 5, 2, 130), Shape(1, 1, 131, 1, 40)]
# Mask 59x59 on a 32x64 map and 97x97 on 64x128, batch 1 and 8: the largest Y
# is 8 * 8192^2 elements (2 GiB in float32).
CITYSCAPES_SHAPES = [Shape(1, 59, 59, 32, 64), Shape(8, 59, 59, 32, 64),
                     Shape(1, 97, 97, 64, 128), Shape(8, 97, 97, 64, 128)]
# The goal of the op's kernels at the training shape (float32), printed, not enforced:
# a share of a copy of the same bytes, and a speed-up over the landed kernels.
GOAL_SHAPE, GOAL_COPY_SHARE, GOAL_SPEEDUP = Shape(8, 97, 97, 64, 128), 0.60, 4.0
RANDOM_SEED = 2018
FILL_BYTES = (0xFF, 0x5A)  # output pre-fills: 0xFF is NaN in every dtype, 0x5A finite garbage
# Past this many elements, inputs repeat a random block of this prime length:
# drawing billions of normals would dominate the run, and an index bug would have
# to be off by an exact multiple of it to go unseen.
RANDOM_PERIOD = 1_048_573


def random_shapes(count, seed=RANDOM_SEED):
    rng = np.random.default_rng(seed)
    return [Shape(*(int(rng.integers(1, top)) for top in (4, 13, 13, 11, 11)))
            for _ in range(count)]


def random_array(shape, dtype, seed):
    size = int(np.prod(shape))
    values = np.random.default_rng(seed).standard_normal(min(size, RANDOM_PERIOD))
    return np.resize(values.astype(dtype), size).reshape(shape)


# ---------------------------------------------------------------- build and load

class HarnessUnavailable(RuntimeError):
    """The machine cannot run the checks (no nvcc, no device, the build failed)."""


class CapiError(RuntimeError):
    """A psa_capi_* call returned an error code."""


def _first_executable(candidates):
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)),
                None)


def find_nvcc(explicit=None):
    """``explicit``, else $NVCC, PATH, $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin."""
    if explicit:
        return _first_executable([explicit])
    homes = [os.environ.get(v) for v in ('CUDA_HOME', 'CUDA_PATH')]
    return _first_executable([os.environ.get('NVCC'), shutil.which('nvcc')] + [
        os.path.join(h, 'bin', 'nvcc') for h in homes if h] + ['/usr/local/cuda/bin/nvcc'])


def find_sanitizer(nvcc):
    candidates = [shutil.which('compute-sanitizer')]
    if nvcc:
        cuda = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        candidates += [os.path.join(os.path.dirname(nvcc), 'compute-sanitizer'),
                       os.path.join(cuda, 'bin', 'compute-sanitizer'),
                       os.path.join(cuda, 'compute-sanitizer', 'compute-sanitizer')]
    return _first_executable(candidates)


def arch_flags(arch):
    """'native' -> -arch=native; '80,90' (or 'sm_80,sm_90') -> SASS for each plus
    PTX of the newest, so that a newer GPU can still JIT it."""
    if arch == 'native':
        return ['-arch=native']
    numbers = [a.strip().replace('sm_', '').replace('compute_', '')
               for a in arch.split(',') if a.strip()]
    if not numbers or not all(re.fullmatch(r'\d+a?', n) for n in numbers):
        raise ValueError(f"--arch must be 'native' or a list like '80,90', got {arch!r}.")
    newest = max(numbers, key=lambda n: int(n.rstrip('a')))
    flags = [f for n in numbers for f in ('-gencode', f'arch=compute_{n},code=sm_{n}')]
    return flags + ['-gencode', f'arch=compute_{newest},code=compute_{newest}']


def build_library(nvcc, arch='native', build_dir=DEFAULT_BUILD_DIR, log=print):
    """Compiles psa_mask_capi.cu into ``build_dir``, named by a hash of the sources,
    nvcc and flags, so a build of the same is reused; returns the library's path."""
    flags = ['-O3', '-std=c++17', '-lineinfo', *arch_flags(arch), '-Xcompiler', '-fPIC,-Wall',
             '-shared']
    for path in (CAPI_SOURCE, BASELINES_SOURCE, KERNEL_HEADER):
        if not os.path.isfile(path):
            raise HarnessUnavailable(f'{path} not found: copy ops/ and tests/ keeping their '
                                     'relative places.')
    hint = ' (-arch=native needs a visible GPU; pass --arch, e.g. --arch 90)' \
        if arch == 'native' else ''
    return cached_build(nvcc, flags, [CAPI_SOURCE, BASELINES_SOURCE, KERNEL_HEADER], build_dir,
                        'psa_mask_capi',
                        lambda output: HarnessUnavailable(f'nvcc failed{hint}:\n{output}'), log)


_INT, _I64, _OUT_INT = ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_int)
_CASE = [_INT, _INT, _INT] + [_I64] * 5  # dtype, direction, psa_type, N, H, W, mask_h, mask_w
_OUT_MS = ctypes.POINTER(ctypes.c_double)
_SIGNATURES = {
    'psa_capi_abi_version': (_INT, []),
    'psa_capi_last_error': (ctypes.c_char_p, []),
    'psa_capi_dtype_size': (_INT, [_INT]),
    'psa_capi_device_info': (_INT, [ctypes.c_char_p, _INT, _OUT_INT, _OUT_INT,
                                    ctypes.POINTER(ctypes.c_longlong), _OUT_INT, _OUT_INT]),
    # kernels, max_grid_x, the case, input, output, fill byte
    'psa_capi_run': (_INT, [_INT, _I64] + _CASE + [ctypes.c_void_p, ctypes.c_void_p, _INT]),
    'psa_capi_time': (_INT, [_INT] + _CASE + [_INT, _INT, _OUT_MS]),  # kernels, the case, ...
    'psa_capi_time_copy': (_INT, [_I64, _INT, _INT, _OUT_MS]),
}


class Library:
    """ctypes bindings of psa_mask_capi.cu; a failing call raises CapiError with its reason."""

    def __init__(self, path):
        self._lib = ctypes.CDLL(path)
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(self._lib, name)
            function.restype, function.argtypes = restype, argtypes
        version = self._lib.psa_capi_abi_version()
        sizes = [self._lib.psa_capi_dtype_size(code) for code in DTYPES.values()]
        if version != ABI_VERSION or sizes != [np.dtype(d).itemsize for d in DTYPES]:
            raise HarnessUnavailable(f'{path} has C ABI version {version} (dtype sizes '
                                     f'{sizes}), this script expects {ABI_VERSION}: rebuild it.')

    def _call(self, name, *args):
        if getattr(self._lib, name)(*args) != 0:
            raise CapiError(f'{name}: {self._lib.psa_capi_last_error().decode(errors="replace")}')

    def device_info(self):
        name, memory = ctypes.create_string_buffer(256), ctypes.c_longlong()
        major, minor, runtime, driver = (ctypes.c_int() for _ in range(4))
        self._call('psa_capi_device_info', name, 256, ctypes.byref(major), ctypes.byref(minor),
                   ctypes.byref(memory), ctypes.byref(runtime), ctypes.byref(driver))
        return {'name': name.value.decode(), 'capability': (major.value, minor.value),
                'memory_bytes': memory.value, 'runtime': runtime.value, 'driver': driver.value}

    def run(self, direction, array, psa_type, mask_h, mask_w, fill_byte, kernels=OP_KERNELS,
            max_grid_x=MAX_GRID_X):
        """Forward (direction 0: x -> Y) or backward (1: grad_Y -> grad_x) on the GPU, the
        output's device buffer first filled with ``fill_byte``: the output, as numpy."""
        array = np.ascontiguousarray(array)
        num, _, feature_h, feature_w = array.shape
        channels = feature_h * feature_w if direction == 0 else mask_h * mask_w
        out = np.empty((num, channels, feature_h, feature_w), array.dtype)
        self._call('psa_capi_run', kernels, max_grid_x, DTYPES[array.dtype.name], direction,
                   psa_type, num, feature_h, feature_w, mask_h, mask_w, array.ctypes.data,
                   out.ctypes.data, fill_byte)
        return out

    def time(self, direction, dtype, shape, psa_type, warmup, repeats, kernels=OP_KERNELS):
        ms = ctypes.c_double()
        self._call('psa_capi_time', kernels, DTYPES[dtype], direction, psa_type, shape.num,
                   shape.feature_h, shape.feature_w, shape.mask_h, shape.mask_w, warmup,
                   repeats, ctypes.byref(ms))
        return ms.value

    def time_copy(self, nbytes, warmup, repeats):
        ms = ctypes.c_double()
        self._call('psa_capi_time_copy', nbytes, warmup, repeats, ctypes.byref(ms))
        return ms.value


# ---------------------------------------------------------------- checks

@dataclasses.dataclass
class Mismatch:
    """Entries of an output that differ bit for bit from the reference; of those,
    ``outside_window`` where the reference holds the op's 0 (Y outside the window,
    grad_x of a cell off the map)."""
    total: int = 0
    mismatches: int = 0
    outside_window: int = 0
    max_abs_error: float = 0.0

    @property
    def exact(self):
        return self.mismatches == 0

    def merge(self, other):
        return Mismatch(self.total + other.total, self.mismatches + other.mismatches,
                        self.outside_window + other.outside_window,
                        float(np.maximum(self.max_abs_error, other.max_abs_error)))  # NaN wins

    def describe(self):
        if self.exact:
            return 'exact'
        return (f'{self.mismatches}/{self.total} differ, {self.outside_window} of them outside '
                f'the window, max abs err {self.max_abs_error:.3g}')


def compare_exact(got, expected, written):
    """Bit-for-bit comparison: NaN, -0.0 and +0.0 are values like any other.
    ``written``: the flat indices where the op writes input values (0 elsewhere)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got, expected)
    bits = np.dtype(f'u{got.itemsize}')
    bad = (got.view(bits) != expected.view(bits)).ravel()
    mismatches = int(np.count_nonzero(bad))
    if mismatches == 0:
        return Mismatch(got.size)
    inside = np.zeros(bad.size, bool)
    inside[written] = True
    with np.errstate(invalid='ignore', over='ignore'):
        error = np.abs(got.ravel()[bad].astype(np.float64) - expected.ravel()[bad])
    return Mismatch(got.size, mismatches, int(np.count_nonzero(bad & ~inside)),
                    float(error.max()))


def check_case(library, shape, dtype, psa_type, fill_byte, seed, kernels=OP_KERNELS,
               max_grid_x=MAX_GRID_X):
    """Forward and backward of one case against the reference, each sample on a
    thread of its own: two Mismatch."""
    mask = (psa_type, shape.mask_h, shape.mask_w)
    x_index, y_index = window_cells(*mask, shape.feature_h, shape.feature_w)
    steps = ((shape.mask_h * shape.mask_w, reference_forward, y_index),
             (shape.feature_h * shape.feature_w, reference_backward, x_index))
    results = []
    for direction, (channels, reference, written) in enumerate(steps):
        source = random_array((shape.num, channels, shape.feature_h, shape.feature_w), dtype,
                              seed + direction)
        got = library.run(direction, source, *mask, fill_byte, kernels=kernels,
                          max_grid_x=max_grid_x)

        def sample(n):
            return compare_exact(got[n:n + 1], reference(source[n:n + 1], *mask), written)

        with concurrent.futures.ThreadPoolExecutor(max(1, min(shape.num, THREADS))) as pool:
            results.append(functools.reduce(Mismatch.merge, pool.map(sample, range(shape.num)),
                                            Mismatch()))
    return results


@dataclasses.dataclass
class Group:
    """One row of the report: cases (shape, fill byte, forward and backward
    Mismatch) of one dtype and psa_type, and their timing where measured."""
    label: str
    dtype: str
    psa_type: int
    cases: list = dataclasses.field(default_factory=list)
    timing: dict = None  # direction -> Timing

    @property
    def failures(self):
        return [case for case in self.cases if not (case[2].exact and case[3].exact)]

    def cell(self, direction):
        mismatches = [case[2 + direction] for case in self.cases]
        merged = functools.reduce(Mismatch.merge, mismatches, Mismatch())
        exact = sum(m.exact for m in mismatches)
        if len(mismatches) == 1:
            return merged.describe()
        if exact == len(mismatches):
            return f'exact ({exact}/{exact})'
        return f'FAIL {len(mismatches) - exact}/{len(mismatches)}: {merged.describe()}'

    def describe_failure(self, case):
        shape, fill, forward, backward = case
        return (f'{shape} {self.dtype} {TYPE_NAMES[self.psa_type]} (output pre-filled with '
                f'0x{fill:02X}): forward {forward.describe()}; backward {backward.describe()}')


def run_group(library, label, cases, log, kernels=OP_KERNELS, max_grid_x=MAX_GRID_X):
    """Checks ``cases`` (shape, fill byte) for every dtype and psa_type: a Group each."""
    groups, start = [], time.time()
    for dtype in DTYPES:
        for psa_type in (0, 1):
            group = Group(label, dtype, psa_type)
            for index, (shape, fill) in enumerate(cases):
                seed = RANDOM_SEED + 1000 * index + 10 * psa_type
                case = (shape, fill, *check_case(library, shape, dtype, psa_type, fill, seed,
                                                 kernels, max_grid_x))
                group.cases.append(case)
                if not (case[2].exact and case[3].exact) and len(group.failures) <= 10:
                    log('  FAIL ' + group.describe_failure(case))
            groups.append(group)
    log(f'{label}: {len(cases)} cases x {len(DTYPES)} dtypes x 2 types checked in '
        f'{time.time() - start:.1f} s')
    return groups


# ms: of the op's kernels; rate: GB/s of the bytes a call must move; copy_share: that
# rate over a copy's; copy_ms: the copy of as many bytes; baseline_ms: {kernels: ms}.
Timing = namedtuple('Timing', 'ms rate copy_share copy_ms baseline_ms')


def time_group(library, group, shape, warmup, repeats, copy_ms):
    """Milliseconds per call of the op's kernels and of the baselines; GB/s of the
    bytes a call must read and write (the window entries of its input, all of its
    output); and that rate over the rate of a device-to-device copy moving as many
    bytes (cached in ``copy_ms``)."""
    itemsize = np.dtype(group.dtype).itemsize
    x_index, _ = window_cells(0, shape.mask_h, shape.mask_w, shape.feature_h, shape.feature_w)
    read = shape.num * len(x_index)
    positions = shape.feature_h * shape.feature_w
    written = (shape.num * positions * positions, shape.num * shape.mask_h * shape.mask_w
               * positions)
    group.timing = {}
    for direction, name in enumerate(DIRECTIONS):
        moved = (read + written[direction]) * itemsize
        ms, *baseline_ms = [library.time(direction, group.dtype, shape, group.psa_type, warmup,
                                         repeats, kernels)
                            for kernels in (OP_KERNELS, *BASELINES)]
        copied = max(1, moved // 2)  # a copy of b bytes reads b and writes b
        if copied not in copy_ms:
            copy_ms[copied] = library.time_copy(copied, warmup, repeats)
        rate = moved / max(ms, 1e-9) / 1e6
        group.timing[name] = Timing(
            ms, rate, rate / (2 * copied / max(copy_ms[copied], 1e-9) / 1e6), copy_ms[copied],
            dict(zip(BASELINES, baseline_ms)))


# ---------------------------------------------------------------- compute-sanitizer

SANITIZER_TOOLS = ('memcheck', 'racecheck', 'initcheck')


def parse_sanitizer_output(output, code, timeout):
    """('ok' | 'FAIL' | 'unavailable', a one-line summary) of a compute-sanitizer run
    that exited with ``code`` (None: killed after ``timeout`` s). 'ok' needs exit 0
    and a summary of 0 errors or 0 hazards; no summary at all means the tool never
    got to check anything (an unsupported device, say)."""
    if code is None:
        return 'FAIL', f'timed out after {timeout} s'
    summaries = re.findall(r'(?:ERROR|RACECHECK) SUMMARY:[^\n]*', output)
    if not summaries:
        tail = ' / '.join(output.strip().splitlines()[-5:]).replace('|', '/')
        return 'unavailable', f'no summary (exit {code}): {tail}'
    summary = summaries[-1].strip()
    clean = re.search(r'SUMMARY: 0 (errors|hazards)', summary) is not None
    if code != 0:
        summary += f' (exit {code})'
    return ('ok' if clean and code == 0 else 'FAIL'), summary


def run_sanitizer(sanitizer, library_path, log, timeout=300):
    """Re-runs SANITIZE_SHAPES under each tool, in fresh processes: (tool, verdict, summary)."""
    rows = []
    for tool in SANITIZER_TOOLS:
        command = [sanitizer, '--tool', tool, '--error-exitcode', '86', sys.executable,
                   os.path.abspath(__file__), '--sanitize-child', '--library', library_path]
        log(f'sanitizer: {" ".join(command)}')
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
            output, code = result.stdout + result.stderr, result.returncode
        except subprocess.TimeoutExpired as error:
            output, code = str(error.stdout or '') + str(error.stderr or ''), None
        rows.append((tool,) + parse_sanitizer_output(output, code, timeout))
        log(f'sanitizer {tool}: {rows[-1][1]}: {rows[-1][2]}')
    return rows


def sanitize_child(library_path, log):
    """The subset run under compute-sanitizer, the second time on a grid of at most
    SMALL_GRID_X blocks across; exit status 0 if every case is exact."""
    cases = [(shape, 0xFF) for shape in SANITIZE_SHAPES]
    try:
        library = Library(library_path)
        groups = run_group(library, 'sanitize subset', cases, log)
        groups += run_group(library, 'sanitize subset, small grid', cases, log,
                            max_grid_x=SMALL_GRID_X)
    except CapiError as error:
        log(f'sanitize subset stopped: {error}')
        return EXIT_FAILED
    return EXIT_FAILED if any(group.failures for group in groups) else 0


# ---------------------------------------------------------------- report and main

def format_header(device, library_path, nvcc, arch, warmup, repeats):
    def version(code):
        return f'{code // 1000}.{code % 1000 // 10}'

    release = nvcc and re.search(r'release [^\n]*', subprocess.run(
        [nvcc, '--version'], capture_output=True, text=True).stdout)
    return [
        f"- device: {device['name']} (sm_{device['capability'][0]}{device['capability'][1]}, "
        f"{device['memory_bytes'] / 2**30:.0f} GiB), CUDA runtime {version(device['runtime'])}, "
        f"driver {version(device['driver'])}",
        f'- library: {os.path.basename(library_path)}'
        + (f' (nvcc {release.group(0) if release else "unknown"}, --arch {arch})' if nvcc else ''),
        f'- python {platform.python_version()}, numpy {np.__version__}; numpy arrays through '
        "the C ABI's host-pointer entry point",
        '- forward/backward: bit for bit against tests/psa_mask_reference.py, every output '
        'pre-filled with 0xFF (NaN) or 0x5A (garbage) bytes, so "exact" includes each entry '
        'outside the window being +0.0',
        f'- timing: CUDA events, {warmup} warm-up + {repeats} timed calls; GB/s counts bytes '
        'read + written (the window entries of the input, all of the output); "/ copy" is '
        'that rate over a device-to-device cudaMemcpy moving the same bytes, timed in this run; '
        '"x landed": how many times faster than the landed kernels (one thread per output '
        'element, tests/gpu/psa_mask_baselines.cuh), timed in this run']


def speedup(timing):
    return timing.baseline_ms[LANDED] / max(timing.ms, 1e-9)


def format_timing(groups):
    """The table of every timing, the baselines' beside the op's kernels, and a line
    per direction on the goal at GOAL_SHAPE in float32."""
    timed = [g for g in groups if g.timing is not None]
    if not timed:
        return []
    lines = ['', '## Timing against a copy and the baselines', '',
             '| shapes | dtype | type | direction | op ms | copy ms | '
             + ' | '.join(f'{name} ms' for name in BASELINES.values()) + ' | op / copy | '
             + ' | '.join(f'x {name}' for name in BASELINES.values()) + ' |',
             '|' + '---|' * (7 + 2 * len(BASELINES))]
    for g in timed:
        for direction in DIRECTIONS:
            t = g.timing[direction]
            lines.append('| ' + ' | '.join(
                [g.label, g.dtype, TYPE_NAMES[g.psa_type], direction, f'{t.ms:.3f}',
                 f'{t.copy_ms:.3f}'] + [f'{t.baseline_ms[k]:.3f}' for k in BASELINES]
                + [f'{100 * t.copy_share:.0f}%']
                + [f'{t.baseline_ms[k] / max(t.ms, 1e-9):.2f}' for k in BASELINES]) + ' |')
    goal = [g for g in timed if g.label == str(GOAL_SHAPE) and g.dtype == 'float32']
    if goal:
        lines += ['', f'Goal at {GOAL_SHAPE}, float32: >= {100 * GOAL_COPY_SHARE:.0f}% of the '
                  f'copy and >= {GOAL_SPEEDUP:g}x the landed kernels, both directions:', '']
        for g in goal:
            for direction in DIRECTIONS:
                t = g.timing[direction]
                met = t.copy_share >= GOAL_COPY_SHARE and speedup(t) >= GOAL_SPEEDUP
                lines.append(f'- {TYPE_NAMES[g.psa_type]} {direction}: '
                             f'{100 * t.copy_share:.0f}% of the copy, {speedup(t):.2f}x the '
                             f'landed kernels: {"met" if met else "NOT met"}')
    return lines


def format_report(header, groups, copy_ms, problems, sanitizer_rows):
    table = ['| shapes | dtype | type | forward | backward | fwd ms | bwd ms | fwd GB/s | '
             'fwd / copy | fwd x landed | bwd GB/s | bwd / copy | bwd x landed |',
             '|' + '---|' * 13]
    for g in groups:
        timing = ['-'] * 8 if g.timing is None else [
            f'{g.timing[d].ms:.3f}' for d in DIRECTIONS] + [
            cell for d in DIRECTIONS
            for cell in (f'{g.timing[d].rate:.0f}', f'{100 * g.timing[d].copy_share:.0f}%',
                         f'{speedup(g.timing[d]):.2f}')]
        table.append('| ' + ' | '.join([g.label, g.dtype, TYPE_NAMES[g.psa_type], g.cell(0),
                                        g.cell(1)] + timing) + ' |')
    report = ['# PSA mask CUDA kernels: standalone check', '', *header, '', *table]
    report += format_timing(groups)
    if copy_ms:
        size = max(copy_ms)
        report += ['', f'Largest reference copy: {size / 1e9:.2f} GB device to device in '
                   f'{copy_ms[size]:.3f} ms = {2 * size / copy_ms[size] / 1e6:.0f} GB/s '
                   '(read + write).']
    failures = [g.describe_failure(case) for g in groups for case in g.failures]
    if len(failures) > 40:
        failures = failures[:40] + [f'... and {len(failures) - 40} more failing cases']
    if failures or problems:
        report += ['', '## Failures', ''] + [f'- {line}' for line in failures + problems]
    if sanitizer_rows:
        report += ['', '## compute-sanitizer', '',
                   f'Subset: {len(SANITIZE_SHAPES)} shapes x {len(DTYPES)} dtypes x 2 types, '
                   f'on the full grid and on one of {SMALL_GRID_X} blocks across; '
                   '"unavailable" (the tool reported nothing) does not fail the run.', '',
                   '| tool | result | summary |', '|---|---|---|']
        report += [f'| {tool} | {verdict} | {summary} |'
                   for tool, verdict, summary in sanitizer_rows]
    return report


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Check and time the PSA mask CUDA kernels without Paddle.')
    add = parser.add_argument
    add('--quick', action='store_true',
        help='50 random shapes, batch-1 Cityscapes shapes only, fewer repeats')
    add('--sanitize', action='store_true', help='also run a small subset under '
        'compute-sanitizer (memcheck, racecheck, initcheck)')
    add('--out', help='also write the markdown report to this file')
    add('--arch', default='native',
        help="'native' or a list like '80,90' (default: %(default)s)")
    add('--nvcc', help='path of nvcc (default: found on PATH or CUDA_HOME)')
    add('--build-dir', default=DEFAULT_BUILD_DIR,
        help='where the library is built (default: %(default)s)')
    add('--library', help='use this prebuilt library instead of building')
    add('--random-shapes', type=int, help='how many random shapes (default: 200, 50 with --quick)')
    add('--repeats', type=int, help='timed calls per measurement (default: 20, 5 with --quick)')
    add('--sanitize-child', action='store_true', help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    log = functools.partial(print, file=sys.stderr, flush=True)
    if args.sanitize_child:
        return sanitize_child(args.library, log)
    started = time.time()
    nvcc = None if args.library else find_nvcc(args.nvcc)
    try:
        if not (args.library or nvcc):
            where = args.nvcc or 'PATH, $NVCC, $CUDA_HOME/bin, /usr/local/cuda/bin'
            raise HarnessUnavailable(f'nvcc not found (looked in: {where}). Install the CUDA '
                                     'toolkit, put nvcc on PATH, or pass --nvcc /path/to/nvcc.')
        library_path = args.library or build_library(nvcc, args.arch, args.build_dir, log)
        library = Library(library_path)
        try:
            device = library.device_info()
        except CapiError as error:
            raise HarnessUnavailable(f'no usable CUDA device: {error}. This check needs an NVIDIA '
                                     'GPU with a driver new enough for the toolkit.') from error
    except (HarnessUnavailable, OSError, ValueError) as error:
        log(f'run_gpu_checks: cannot run: {error}')
        return EXIT_UNAVAILABLE

    random_count = args.random_shapes if args.random_shapes is not None else (
        50 if args.quick else 200)
    repeats, warmup = args.repeats or (5 if args.quick else 20), 1 if args.quick else 3
    groups, problems, copy_ms = [], [], {}
    try:
        groups += run_group(library, f'op test shapes ({len(CPU_TEST_SHAPES)} x 2 fills)',
                            [(s, f) for f in FILL_BYTES for s in CPU_TEST_SHAPES], log)
        groups += run_group(library, f'op test shapes, grid of {SMALL_GRID_X} blocks across',
                            [(s, FILL_BYTES[0]) for s in CPU_TEST_SHAPES], log,
                            max_grid_x=SMALL_GRID_X)
        for kernels, name in BASELINES.items():  # what the op's kernels are timed against
            groups += run_group(library, f'op test shapes, {name} kernels',
                                [(s, FILL_BYTES[0]) for s in CPU_TEST_SHAPES], log, kernels)
        groups += run_group(library, f'random ({random_count}, seed {RANDOM_SEED})',
                            [(s, FILL_BYTES[i % 2])
                             for i, s in enumerate(random_shapes(random_count))], log)
        for shape in [s for s in CITYSCAPES_SHAPES if not (args.quick and s.num > 1)]:
            for group in run_group(library, str(shape), [(shape, FILL_BYTES[0])], log):
                groups.append(group)
                time_group(library, group, shape, warmup, repeats, copy_ms)
    except CapiError as error:
        # A kernel fault (an illegal address, say) poisons the CUDA context:
        # nothing after it can run, so report what ran.
        problems.append(f'CUDA call failed, checks stopped: {error}')
    except Exception as error:  # report what ran rather than only a traceback
        log(traceback.format_exc())
        problems.append(f'checks stopped by {type(error).__name__}: {error}')

    sanitizer_rows = []
    if args.sanitize:  # in fresh processes: a context poisoned here does not matter
        sanitizer = find_sanitizer(nvcc or find_nvcc())
        sanitizer_rows = run_sanitizer(sanitizer, library_path, log) if sanitizer else [
            ('compute-sanitizer', 'unavailable', 'not found next to nvcc or on PATH: not run')]

    failed = bool(problems) or any(g.failures for g in groups) or \
        any(verdict == 'FAIL' for _, verdict, _ in sanitizer_rows)
    header = format_header(device, library_path, nvcc, args.arch, warmup, repeats)
    report = format_report(header, groups, copy_ms, problems, sanitizer_rows)
    report += ['', f"**{'FAILED' if failed else 'PASSED'}** in {time.time() - started:.0f} s"]
    text = '\n'.join(report) + '\n'
    print(text)
    if args.out:
        with open(args.out, 'w') as f:
            f.write(text)
    return EXIT_FAILED if failed else 0


if __name__ == '__main__':
    sys.exit(main())
