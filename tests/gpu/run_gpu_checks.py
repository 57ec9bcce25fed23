"""Standalone GPU check of the PSA mask CUDA kernels, without Paddle.

The GPU machines cannot install Paddle, so this script proves the kernels of
``ops/psa_mask_kernel.h`` on their own: it builds ``psa_mask_capi.cu`` (a C ABI
over the same launchers) with nvcc, drives it through ctypes with numpy host
buffers, or CuPy device buffers when CuPy works, and checks forward and
backward, collect and distribute, float32/float64/float16 bit for bit against
the numpy reference below, on the op's test shapes, seeded random shapes and
the Cityscapes shapes. Every output buffer is pre-filled with NaN or garbage
before the launch, so "exact" also proves every entry outside the window was
written as +0.0. It then times the kernels against a device-to-device copy of
the same bytes and prints a markdown table.

    python tests/gpu/run_gpu_checks.py [--quick] [--sanitize] [--out results.md]

Exit status: 0 all checks pass, 1 a check failed, 2 the machine cannot run
the checks (no nvcc, no CUDA device, the build failed).
"""
import argparse
import concurrent.futures
import ctypes
import functools
import hashlib
import importlib
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import namedtuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CAPI_SOURCE = os.path.join(HERE, 'psa_mask_capi.cu')
KERNEL_HEADER = os.path.normpath(os.path.join(HERE, '..', '..', 'ops', 'psa_mask_kernel.h'))
DEFAULT_BUILD_DIR = os.path.join(HERE, 'build')
ABI_VERSION = 1

PSA_TYPES = {'collect': 0, 'distribute': 1}
TYPE_NAMES = {v: k for k, v in PSA_TYPES.items()}
# name -> (dtype code of psa_mask_capi.cu, numpy type)
DTYPES = {'float32': (0, np.float32), 'float64': (1, np.float64), 'float16': (2, np.float16)}
_BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}

EXIT_FAILED = 1
EXIT_UNAVAILABLE = 2

# N, mask_h, mask_w, H (feature_h), W (feature_w).
Shape = namedtuple('Shape', 'num mask_h mask_w feature_h feature_w')


def _describe_shape(s):
    return f'N={s.num} mask {s.mask_h}x{s.mask_w} map {s.feature_h}x{s.feature_w}'


# ----------------------------------------------------------------------------
# Reference. Written from the definition, not from the kernel's flat index
# math: window cell (i, j) at p = (h, w) sends x[n, k, h, w] to the entry of
# Y whose (row, column) is (q, p) (collect) or (p, q) (distribute), with
# q = p + (i - half_h, j - half_w). For a fixed cell those entries form a
# diagonal of the 5-D view Y[n, row_h, row_w, col_h, col_w]: a strided view
# that numpy (and CuPy) write in one slice assignment.
# ----------------------------------------------------------------------------

def _as_strided(xp):
    return importlib.import_module(xp.__name__ + '.lib.stride_tricks').as_strided


def _cell_ranges(cell, half, size):
    """Offset d of window cell ``cell`` and the range [lo, hi) of positions
    whose partner position + d stays on a map of ``size``."""
    offset = cell - half
    return offset, max(0, -offset), min(size, size - offset)


def _cell_diagonals(y5, psa_type, mask_h, mask_w, xp):
    """Yields (k, rows, cols, view): ``view[n, h, w]`` is the entry of ``y5``
    that window cell k at p = (h, w) (h in rows, w in cols) fills."""
    _, feature_h, feature_w = y5.shape[:3]
    half_h, half_w = (mask_h - 1) // 2, (mask_w - 1) // 2
    as_strided = _as_strided(xp)
    for i in range(mask_h):
        di, h0, h1 = _cell_ranges(i, half_h, feature_h)
        if h0 >= h1:
            continue
        for j in range(mask_w):
            dj, w0, w1 = _cell_ranges(j, half_w, feature_w)
            if w0 >= w1:
                continue
            p = (slice(h0, h1), slice(w0, w1))
            q = (slice(h0 + di, h1 + di), slice(w0 + dj, w1 + dj))
            block = y5[(slice(None),) + (q + p if psa_type == 0 else p + q)]
            s = block.strides
            # Stepping p by one row (column) steps q by one row (column) too.
            view = as_strided(block, shape=block.shape[:3],
                              strides=(s[0], s[1] + s[3], s[2] + s[4]))
            yield i * mask_w + j, p[0], p[1], view


def psa_mask_reference(x, psa_type, mask_h, mask_w, xp=np):
    """Forward: x [N, mask_h*mask_w, H, W] -> Y [N, H*W, H, W] (numpy or CuPy)."""
    num, cells, feature_h, feature_w = x.shape
    if cells != mask_h * mask_w:
        raise ValueError(f'x has {cells} channels, expected mask_h*mask_w = '
                         f'{mask_h * mask_w}.')
    y5 = xp.zeros((num, feature_h, feature_w, feature_h, feature_w), dtype=x.dtype)
    for k, rows, cols, view in _cell_diagonals(y5, psa_type, mask_h, mask_w, xp):
        view[...] = x[:, k, rows, cols]
    return y5.reshape(num, feature_h * feature_w, feature_h, feature_w)


def psa_mask_backward_reference(grad_y, psa_type, mask_h, mask_w, xp=np):
    """Backward: grad_Y [N, H*W, H, W] -> grad_x [N, mask_h*mask_w, H, W]."""
    num, positions, feature_h, feature_w = grad_y.shape
    if positions != feature_h * feature_w:
        raise ValueError(f'grad_y has {positions} rows, expected H*W = '
                         f'{feature_h * feature_w}.')
    y5 = xp.ascontiguousarray(grad_y).reshape(num, feature_h, feature_w, feature_h, feature_w)
    grad_x = xp.zeros((num, mask_h * mask_w, feature_h, feature_w), dtype=grad_y.dtype)
    for k, rows, cols, view in _cell_diagonals(y5, psa_type, mask_h, mask_w, xp):
        grad_x[:, k, rows, cols] = view
    return grad_x


def psa_mask_reference_loop(x, psa_type, mask_h, mask_w):
    """The definition as literal loops, for small shapes: checks the fast
    reference above (tests/test_gpu_harness_build.py)."""
    num, _, feature_h, feature_w = x.shape
    half_h, half_w = (mask_h - 1) // 2, (mask_w - 1) // 2
    y = np.zeros((num, feature_h * feature_w, feature_h, feature_w), dtype=x.dtype)
    flat = y.reshape(num, feature_h * feature_w, feature_h * feature_w)
    for n in range(num):
        for h in range(feature_h):
            for w in range(feature_w):
                for i in range(mask_h):
                    for j in range(mask_w):
                        qh, qw = h + i - half_h, w + j - half_w
                        if not (0 <= qh < feature_h and 0 <= qw < feature_w):
                            continue
                        p, q = h * feature_w + w, qh * feature_w + qw
                        row, col = (q, p) if psa_type == 0 else (p, q)
                        flat[n, row, col] = x[n, i * mask_w + j, h, w]
    return y


def psa_mask_backward_reference_loop(grad_y, psa_type, mask_h, mask_w):
    num, _, feature_h, feature_w = grad_y.shape
    half_h, half_w = (mask_h - 1) // 2, (mask_w - 1) // 2
    flat = grad_y.reshape(num, feature_h * feature_w, feature_h * feature_w)
    grad_x = np.zeros((num, mask_h * mask_w, feature_h, feature_w), dtype=grad_y.dtype)
    for n in range(num):
        for i in range(mask_h):
            for j in range(mask_w):
                for h in range(feature_h):
                    for w in range(feature_w):
                        qh, qw = h + i - half_h, w + j - half_w
                        if not (0 <= qh < feature_h and 0 <= qw < feature_w):
                            continue
                        p, q = h * feature_w + w, qh * feature_w + qw
                        row, col = (q, p) if psa_type == 0 else (p, q)
                        grad_x[n, i * mask_w + j, h, w] = flat[n, row, col]
    return grad_x


def window_entries(shape):
    """How many (n, cell, p) have their q on the map: the values the forward
    reads (and the backward gathers)."""
    half_h, half_w = (shape.mask_h - 1) // 2, (shape.mask_w - 1) // 2
    rows = sum(max(0, hi - lo) for _, lo, hi in
               (_cell_ranges(i, half_h, shape.feature_h) for i in range(shape.mask_h)))
    cols = sum(max(0, hi - lo) for _, lo, hi in
               (_cell_ranges(j, half_w, shape.feature_w) for j in range(shape.mask_w)))
    return shape.num * rows * cols


def traffic_bytes(shape, itemsize):
    """Bytes read + written by one call: (forward, backward). Forward reads
    the window entries of x and writes all of Y; backward reads the same
    number of entries of grad_Y and writes all of grad_x."""
    positions = shape.feature_h * shape.feature_w
    y_numel = shape.num * positions * positions
    x_numel = shape.num * shape.mask_h * shape.mask_w * positions
    read = window_entries(shape)
    return (read + y_numel) * itemsize, (read + x_numel) * itemsize


# ----------------------------------------------------------------------------
# Bit-exact comparison.
# ----------------------------------------------------------------------------

class Mismatch:
    """Entries of an output that differ bit for bit from the reference."""

    def __init__(self, total=0, mismatches=0, max_abs_error=0.0, outside_window=0):
        self.total = total
        self.mismatches = mismatches
        self.max_abs_error = max_abs_error
        # Of the mismatches, those where the reference holds the op's 0 (Y
        # outside the window, grad_x of cells off the map).
        self.outside_window = outside_window

    @property
    def exact(self):
        return self.mismatches == 0

    def merge(self, other):
        errors = (self.max_abs_error, other.max_abs_error)
        max_error = float('nan') if any(math.isnan(e) for e in errors) else max(errors)
        return Mismatch(self.total + other.total, self.mismatches + other.mismatches,
                        max_error, self.outside_window + other.outside_window)

    def describe(self):
        if self.exact:
            return 'exact'
        return (f'{self.mismatches}/{self.total} differ, {self.outside_window} of them '
                f'outside the window, max abs err {self.max_abs_error:.3g}')


def compare_exact(got, expected, window=None, xp=np):
    """Bit-for-bit comparison (NaN, -0.0 and +0.0 all count as values).

    ``window``: a function returning a bool array, True where the op writes
    a value of the input; asked only when something differs.
    """
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise ValueError(f'shape/dtype differ: got {got.shape} {got.dtype}, expected '
                         f'{expected.shape} {expected.dtype}')
    bits = _BITS[got.dtype.itemsize]
    bad = (xp.ascontiguousarray(got).view(bits) != xp.ascontiguousarray(expected).view(bits))
    mismatches = int(bad.sum())
    if mismatches == 0:
        return Mismatch(total=int(got.size))
    with np.errstate(invalid='ignore', over='ignore'):
        diff = xp.abs(got[bad].astype(xp.float64) - expected[bad].astype(xp.float64))
        max_error = float(diff.max())
    outside = int((bad & ~window()).sum()) if window is not None else 0
    return Mismatch(int(got.size), mismatches, max_error, outside)


# ----------------------------------------------------------------------------
# Building and loading the C ABI library.
# ----------------------------------------------------------------------------

class HarnessUnavailable(RuntimeError):
    """The machine cannot run the checks (no nvcc, no device, build failed)."""


def find_nvcc(explicit=None):
    """``explicit``, $NVCC, nvcc on PATH, $CUDA_HOME/bin, /usr/local/cuda/bin."""
    candidates = [explicit] if explicit else [
        os.environ.get('NVCC'), shutil.which('nvcc'),
        *(os.path.join(os.environ[v], 'bin', 'nvcc')
          for v in ('CUDA_HOME', 'CUDA_PATH') if os.environ.get(v)),
        '/usr/local/cuda/bin/nvcc']
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    where = explicit or 'PATH, $NVCC, $CUDA_HOME/bin, /usr/local/cuda/bin'
    raise HarnessUnavailable(f'nvcc not found (looked in: {where}). Install the CUDA '
                             'toolkit, put nvcc on PATH, or pass --nvcc /path/to/nvcc.')


def arch_flags(arch):
    """'native' -> -arch=native; '80,90' (or 'sm_80,sm_90') -> SASS for each
    plus PTX of the newest, so a newer GPU can still JIT it."""
    if arch == 'native':
        return ['-arch=native']
    numbers = [a.strip().replace('sm_', '').replace('compute_', '')
               for a in arch.split(',') if a.strip()]
    if not numbers or not all(n.isdigit() or (n[:-1].isdigit() and n[-1] == 'a')
                              for n in numbers):
        raise ValueError(f"--arch must be 'native' or a list like '80,90', got {arch!r}.")
    flags = []
    for n in numbers:
        flags += ['-gencode', f'arch=compute_{n},code=sm_{n}']
    newest = max(numbers, key=lambda n: int(n.rstrip('a')))
    return flags + ['-gencode', f'arch=compute_{newest},code=compute_{newest}']


def nvcc_command(nvcc, arch, output):
    return [nvcc, '-O3', '-std=c++17', '-lineinfo', *arch_flags(arch),
            '-Xcompiler', '-fPIC,-Wall', '-shared', '-o', output, CAPI_SOURCE]


def build_library(nvcc, arch='native', build_dir=DEFAULT_BUILD_DIR, log=None):
    """Compiles psa_mask_capi.cu into ``build_dir``; reuses a build of the
    same sources, nvcc and flags. Returns the library's path."""
    for path in (CAPI_SOURCE, KERNEL_HEADER):
        if not os.path.isfile(path):
            raise HarnessUnavailable(f'{path} not found: copy ops/ and tests/gpu/ keeping '
                                     'their relative places (ops/ two levels above this file).')
    digest = hashlib.sha256()
    for path in (CAPI_SOURCE, KERNEL_HEADER):
        with open(path, 'rb') as f:
            digest.update(f.read())
    digest.update(' '.join(nvcc_command(os.path.realpath(nvcc), arch, '')).encode())
    os.makedirs(build_dir, exist_ok=True)
    library = os.path.join(build_dir, f'psa_mask_capi_{digest.hexdigest()[:12]}.so')
    if os.path.isfile(library):
        return library
    # Build under a temporary name, then rename: a reader never sees half a file.
    fd, partial = tempfile.mkstemp(suffix='.so', dir=build_dir)
    os.close(fd)
    command = nvcc_command(nvcc, arch, partial)
    if log:
        log('building: ' + ' '.join(command))
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            hint = (' (-arch=native needs a visible GPU; pass --arch, e.g. --arch 90)'
                    if arch == 'native' else '')
            raise HarnessUnavailable(f'nvcc failed{hint}:\n$ {" ".join(command)}\n'
                                     f'{result.stdout}{result.stderr}')
        os.replace(partial, library)
        if log and (result.stdout.strip() or result.stderr.strip()):
            log(f'nvcc said: {result.stdout.strip()} {result.stderr.strip()}')
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return library


_I64 = ctypes.c_int64
_SIGNATURES = {
    'psa_capi_abi_version': (ctypes.c_int, []),
    'psa_capi_last_error': (ctypes.c_char_p, []),
    'psa_capi_dtype_size': (ctypes.c_int, [ctypes.c_int]),
    'psa_capi_device_count': (ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
    'psa_capi_device_info': (ctypes.c_int, [
        ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_longlong),
        ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]),
    'psa_capi_synchronize': (ctypes.c_int, []),
    'psa_capi_forward': (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        _I64, _I64, _I64, _I64, _I64, ctypes.c_int,
                                        ctypes.c_void_p]),
    'psa_capi_backward': (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                         _I64, _I64, _I64, _I64, _I64, ctypes.c_int,
                                         ctypes.c_void_p]),
    'psa_capi_forward_host': (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                             _I64, _I64, _I64, _I64, _I64, ctypes.c_int,
                                             ctypes.c_int]),
    'psa_capi_backward_host': (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p,
                                              ctypes.c_void_p, _I64, _I64, _I64, _I64, _I64,
                                              ctypes.c_int, ctypes.c_int]),
    'psa_capi_time_forward': (ctypes.c_int, [ctypes.c_int, _I64, _I64, _I64, _I64, _I64,
                                             ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                             ctypes.POINTER(ctypes.c_double)]),
    'psa_capi_time_backward': (ctypes.c_int, [ctypes.c_int, _I64, _I64, _I64, _I64, _I64,
                                              ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                              ctypes.POINTER(ctypes.c_double)]),
    'psa_capi_time_copy': (ctypes.c_int, [_I64, ctypes.c_int, ctypes.c_int,
                                          ctypes.POINTER(ctypes.c_double)]),
}


class CapiError(RuntimeError):
    """A psa_capi_* call returned an error code."""


class Library:
    """ctypes bindings of psa_mask_capi.cu; every call raises CapiError on failure."""

    def __init__(self, path):
        self.path = path
        self._lib = ctypes.CDLL(path)
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(self._lib, name)
            function.restype, function.argtypes = restype, argtypes
        version = self._lib.psa_capi_abi_version()
        if version != ABI_VERSION:
            raise HarnessUnavailable(f'{path} has C ABI version {version}, this script '
                                     f'expects {ABI_VERSION}: delete it and rebuild.')

    def _call(self, name, *args):
        code = getattr(self._lib, name)(*args)
        if code != 0:
            message = self._lib.psa_capi_last_error().decode(errors='replace')
            raise CapiError(f'{name}: {message}')

    def device_count(self):
        count = ctypes.c_int(0)
        self._call('psa_capi_device_count', ctypes.byref(count))
        return count.value

    def device_info(self):
        name = ctypes.create_string_buffer(256)
        major, minor, runtime, driver = (ctypes.c_int() for _ in range(4))
        total = ctypes.c_longlong()
        self._call('psa_capi_device_info', name, 256, ctypes.byref(major),
                   ctypes.byref(minor), ctypes.byref(total), ctypes.byref(runtime),
                   ctypes.byref(driver))
        return {'name': name.value.decode(), 'capability': (major.value, minor.value),
                'memory_bytes': total.value, 'runtime': runtime.value, 'driver': driver.value}

    def synchronize(self):
        self._call('psa_capi_synchronize')

    def forward_host(self, x, psa_type, mask_h, mask_w, fill_byte):
        x = np.ascontiguousarray(x)
        num, _, feature_h, feature_w = x.shape
        positions = feature_h * feature_w
        y = np.empty((num, positions, feature_h, feature_w), dtype=x.dtype)
        self._call('psa_capi_forward_host', _dtype_code(x.dtype), x.ctypes.data, y.ctypes.data,
                   num, feature_h, feature_w, mask_h, mask_w, psa_type, fill_byte)
        return y

    def backward_host(self, grad_y, psa_type, mask_h, mask_w, fill_byte):
        grad_y = np.ascontiguousarray(grad_y)
        num, _, feature_h, feature_w = grad_y.shape
        grad_x = np.empty((num, mask_h * mask_w, feature_h, feature_w), dtype=grad_y.dtype)
        self._call('psa_capi_backward_host', _dtype_code(grad_y.dtype), grad_y.ctypes.data,
                   grad_x.ctypes.data, num, feature_h, feature_w, mask_h, mask_w, psa_type,
                   fill_byte)
        return grad_x

    def forward_device(self, dtype, x_ptr, y_ptr, shape, psa_type, stream=0):
        self._call('psa_capi_forward', _dtype_code(dtype), x_ptr, y_ptr, shape.num,
                   shape.feature_h, shape.feature_w, shape.mask_h, shape.mask_w, psa_type,
                   stream)

    def backward_device(self, dtype, grad_y_ptr, grad_x_ptr, shape, psa_type, stream=0):
        self._call('psa_capi_backward', _dtype_code(dtype), grad_y_ptr, grad_x_ptr,
                   shape.num, shape.feature_h, shape.feature_w, shape.mask_h, shape.mask_w,
                   psa_type, stream)

    def time_forward(self, dtype, shape, psa_type, warmup, repeats):
        ms = ctypes.c_double()
        self._call('psa_capi_time_forward', _dtype_code(dtype), shape.num, shape.feature_h,
                   shape.feature_w, shape.mask_h, shape.mask_w, psa_type, warmup, repeats,
                   ctypes.byref(ms))
        return ms.value

    def time_backward(self, dtype, shape, psa_type, warmup, repeats):
        ms = ctypes.c_double()
        self._call('psa_capi_time_backward', _dtype_code(dtype), shape.num, shape.feature_h,
                   shape.feature_w, shape.mask_h, shape.mask_w, psa_type, warmup, repeats,
                   ctypes.byref(ms))
        return ms.value

    def time_copy(self, nbytes, warmup, repeats):
        ms = ctypes.c_double()
        self._call('psa_capi_time_copy', max(1, int(nbytes)), warmup, repeats,
                   ctypes.byref(ms))
        return ms.value


def _dtype_code(dtype):
    return DTYPES[np.dtype(dtype).name][0]


# ----------------------------------------------------------------------------
# Runners: the same checks on host buffers (numpy) or device buffers (CuPy).
# ----------------------------------------------------------------------------

# Past this many elements, host inputs repeat a random block of this prime
# length: generating billions of normals would dominate the run, and an index
# bug would have to be off by an exact multiple of it to go unseen.
_RANDOM_PERIOD = 1_048_573


class HostRunner:
    """numpy arrays through the host-pointer functions (copy in, launch, copy out)."""
    name = 'numpy + host-pointer API'
    xp = np

    def __init__(self, library):
        self.library = library

    def random(self, shape, dtype, seed):
        rng = np.random.default_rng(seed)
        size = int(np.prod(shape))
        draw = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        if size <= _RANDOM_PERIOD:
            values = rng.standard_normal(size, dtype=draw)
        else:
            values = np.resize(rng.standard_normal(_RANDOM_PERIOD, dtype=draw), size)
        return values.astype(dtype, copy=False).reshape(shape)

    def forward(self, x, shape, psa_type, fill_byte):
        return self.library.forward_host(x, psa_type, shape.mask_h, shape.mask_w, fill_byte)

    def backward(self, grad_y, shape, psa_type, fill_byte):
        return self.library.backward_host(grad_y, psa_type, shape.mask_h, shape.mask_w,
                                          fill_byte)

    def release(self):
        pass


class CupyRunner:
    """CuPy arrays through the device-pointer functions on CuPy's current stream."""
    name = 'CuPy + device-pointer API'

    def __init__(self, library, cupy):
        self.library = library
        self.xp = cupy

    def random(self, shape, dtype, seed):
        cp = self.xp
        draw = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        values = cp.random.RandomState(seed).standard_normal(shape, dtype=draw)
        return values.astype(dtype, copy=False)

    def _filled(self, shape, dtype, fill_byte):
        out = self.xp.empty(shape, dtype=dtype)
        if fill_byte >= 0:
            out.view(self.xp.uint8).fill(fill_byte)
        return out

    def forward(self, x, shape, psa_type, fill_byte):
        cp = self.xp
        x = cp.ascontiguousarray(x)
        positions = shape.feature_h * shape.feature_w
        y = self._filled((shape.num, positions, shape.feature_h, shape.feature_w), x.dtype,
                         fill_byte)
        self.library.forward_device(x.dtype, x.data.ptr, y.data.ptr, shape, psa_type,
                                    cp.cuda.get_current_stream().ptr)
        self.library.synchronize()
        return y

    def backward(self, grad_y, shape, psa_type, fill_byte):
        cp = self.xp
        grad_y = cp.ascontiguousarray(grad_y)
        grad_x = self._filled((shape.num, shape.mask_h * shape.mask_w, shape.feature_h,
                               shape.feature_w), grad_y.dtype, fill_byte)
        self.library.backward_device(grad_y.dtype, grad_y.data.ptr, grad_x.data.ptr, shape,
                                     psa_type, self.xp.cuda.get_current_stream().ptr)
        self.library.synchronize()
        return grad_x

    def release(self):
        self.xp.get_default_memory_pool().free_all_blocks()


def import_cupy():
    """CuPy if it imports and can run on the device, else (None, reason)."""
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        if int(cupy.arange(4).sum()) != 6:
            return None, 'CuPy computed a wrong sum'
        return cupy, None
    except Exception as error:  # any failure means: use numpy instead
        return None, f'{type(error).__name__}: {error}'.splitlines()[0]


def check_cupy_reference(cupy):
    """The CuPy run of the reference equals the numpy one (guards the strided
    views on CuPy); returns a failure message or None."""
    shape = Shape(2, 4, 3, 5, 6)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((shape.num, 12, 5, 6))
    grad_y = rng.standard_normal((shape.num, 30, 5, 6))
    for psa_type in (0, 1):
        host = psa_mask_reference(x, psa_type, 4, 3)
        device = cupy.asnumpy(psa_mask_reference(cupy.asarray(x), psa_type, 4, 3, xp=cupy))
        host_b = psa_mask_backward_reference(grad_y, psa_type, 4, 3)
        device_b = cupy.asnumpy(psa_mask_backward_reference(cupy.asarray(grad_y), psa_type,
                                                            4, 3, xp=cupy))
        if not (np.array_equal(host, device) and np.array_equal(host_b, device_b)):
            return f'the CuPy reference differs from the numpy one ({TYPE_NAMES[psa_type]})'
    return None


# ----------------------------------------------------------------------------
# Cases.
# ----------------------------------------------------------------------------

# The shapes of the op's CPU tests (tests/test_psa_mask.py): odd, even and
# mixed masks, 1x1, 1x5, 5x1, masks larger and smaller than the map, H or
# W = 1, N > 1; then an empty batch, a bigger batch and a PSANet-like 13x13.
CPU_TEST_SHAPES = [
    Shape(1, 3, 3, 5, 6), Shape(2, 4, 4, 5, 6), Shape(1, 3, 4, 4, 7), Shape(1, 4, 3, 6, 4),
    Shape(3, 1, 1, 3, 3), Shape(1, 1, 5, 4, 6), Shape(1, 5, 1, 6, 2), Shape(1, 7, 9, 3, 2),
    Shape(2, 3, 5, 1, 7), Shape(1, 6, 2, 6, 1), Shape(1, 3, 3, 1, 1), Shape(2, 2, 2, 9, 11),
    Shape(0, 3, 3, 4, 4), Shape(3, 5, 5, 6, 6), Shape(2, 13, 13, 8, 16),
]
# Small enough for compute-sanitizer; the last one is past the 4096x256
# threads of one grid, so the grid-stride loop runs more than once.
SANITIZE_SHAPES = [Shape(2, 3, 3, 5, 6), Shape(2, 4, 4, 5, 6), Shape(1, 3, 4, 4, 5),
                   Shape(1, 9, 9, 3, 4), Shape(2, 3, 3, 7, 1), Shape(1, 9, 9, 32, 40)]
# Cityscapes scale: mask 59x59 on a 32x64 map and 97x97 on 64x128, batch 1
# and 8; the largest Y is 8 * 8192^2 elements (2 GiB in float32).
CITYSCAPES_SHAPES = [Shape(1, 59, 59, 32, 64), Shape(8, 59, 59, 32, 64),
                     Shape(1, 97, 97, 64, 128), Shape(8, 97, 97, 64, 128)]
RANDOM_SEED = 2018
# Output pre-fills: 0xFF is NaN in every dtype; 0x5A is finite garbage.
FILL_BYTES = (0xFF, 0x5A)


def random_shapes(count, seed=RANDOM_SEED):
    rng = np.random.default_rng(seed)
    return [Shape(int(rng.integers(1, 4)), int(rng.integers(1, 13)), int(rng.integers(1, 13)),
                  int(rng.integers(1, 11)), int(rng.integers(1, 11))) for _ in range(count)]


# Reference chunks of at most this many elements: 256 MiB of float32 on the
# host, where big outputs are also split in up to _THREADS chunks checked at
# once; 4 GiB on the device, where each chunk costs a kernel launch per cell.
_CHUNK_ELEMENTS = 1 << 26
_DEVICE_CHUNK_ELEMENTS = 1 << 30
_THREADS = min(8, os.cpu_count() or 1)


def _chunks(num, per_sample, limit=_CHUNK_ELEMENTS, parts=1):
    """Sample ranges [n0, n1) covering 0..num, each under ``limit`` elements
    (one sample at least), in about ``parts`` of them where num allows."""
    step = max(1, min(limit // max(1, per_sample), -(-num // parts)))
    return [(n, min(num, n + step)) for n in range(0, num, step)] or [(0, 0)]


def _compare_in_chunks(got, source, reference, window, per_sample, xp):
    """Compares ``got`` with ``reference(source)`` a few samples at a time;
    numpy chunks run on threads (its copies and compares release the GIL)."""
    def one(bounds):
        n0, n1 = bounds
        chunk = source[n0:n1]
        return compare_exact(got[n0:n1], reference(chunk), functools.partial(window, chunk),
                             xp=xp)

    host = xp is np
    threads = _THREADS if host and got.size > (1 << 22) else 1
    chunks = _chunks(got.shape[0], per_sample,
                     _CHUNK_ELEMENTS if host else _DEVICE_CHUNK_ELEMENTS, threads)
    if threads == 1 or len(chunks) == 1:
        results = [one(bounds) for bounds in chunks]
    else:
        with concurrent.futures.ThreadPoolExecutor(min(threads, len(chunks))) as pool:
            results = list(pool.map(one, chunks))
    return functools.reduce(Mismatch.merge, results, Mismatch())


def check_case(runner, shape, dtype, psa_type, fill_byte, seed):
    """Forward and backward of one case against the reference: two Mismatch."""
    xp = runner.xp
    cells, positions = shape.mask_h * shape.mask_w, shape.feature_h * shape.feature_w
    mask = (psa_type, shape.mask_h, shape.mask_w)
    x = runner.random((shape.num, cells, shape.feature_h, shape.feature_w), dtype, seed)
    y = runner.forward(x, shape, psa_type, fill_byte)
    forward = _compare_in_chunks(
        y, x, lambda chunk: psa_mask_reference(chunk, *mask, xp=xp),
        lambda chunk: psa_mask_reference(xp.ones_like(chunk), *mask, xp=xp) != 0,
        positions * positions, xp)
    del x, y
    grad_y = runner.random((shape.num, positions, shape.feature_h, shape.feature_w), dtype,
                           seed + 1)
    grad_x = runner.backward(grad_y, shape, psa_type, fill_byte)
    backward = _compare_in_chunks(
        grad_x, grad_y, lambda chunk: psa_mask_backward_reference(chunk, *mask, xp=xp),
        lambda chunk: psa_mask_backward_reference(xp.ones_like(chunk), *mask, xp=xp) != 0,
        positions * max(positions, cells), xp)
    del grad_y, grad_x
    if shape.num * positions * max(positions, cells) > _CHUNK_ELEMENTS:
        runner.release()
    return forward, backward


class GroupResult:
    """Checks of one group of shapes for one dtype and psa_type."""

    def __init__(self, label, dtype, psa_type):
        self.label, self.dtype, self.psa_type = label, dtype, psa_type
        self.cases = 0
        self.forward_exact = self.backward_exact = 0
        self.forward = Mismatch()
        self.backward = Mismatch()
        self.failures = []   # (shape, fill_byte, forward, backward)
        self.timing = None   # dict of ms and GB/s, Cityscapes rows only

    def add(self, shape, fill_byte, forward, backward):
        self.cases += 1
        self.forward_exact += forward.exact
        self.backward_exact += backward.exact
        self.forward = self.forward.merge(forward)
        self.backward = self.backward.merge(backward)
        if not (forward.exact and backward.exact):
            self.failures.append((shape, fill_byte, forward, backward))

    @property
    def passed(self):
        return not self.failures

    def cell(self, exact_count, mismatch):
        if self.cases == 1:
            return mismatch.describe()
        if exact_count == self.cases:
            return f'exact ({self.cases}/{self.cases})'
        return f'FAIL {self.cases - exact_count}/{self.cases}: {mismatch.describe()}'


def run_group(runner, label, cases, dtypes, seed, log):
    """Checks ``cases`` (pairs of Shape and output fill byte) for every dtype
    and psa_type: one GroupResult per dtype and psa_type."""
    results = []
    start = time.time()
    for dtype in dtypes:
        for psa_type in (0, 1):
            result = GroupResult(label, dtype, psa_type)
            for index, (shape, fill) in enumerate(cases):
                case_seed = seed + 1000 * index + 10 * psa_type
                forward, backward = check_case(runner, shape, DTYPES[dtype][1], psa_type,
                                               fill, case_seed)
                result.add(shape, fill, forward, backward)
                logged = sum(len(r.failures) for r in results) + len(result.failures)
                if not (forward.exact and backward.exact) and logged <= 10:
                    log(f'  FAIL {_describe_shape(shape)} {dtype} {TYPE_NAMES[psa_type]}: '
                        f'forward {forward.describe()}; backward {backward.describe()}')
            results.append(result)
    log(f'{label}: {len(cases)} cases x {len(dtypes)} dtypes x 2 types checked in '
        f'{time.time() - start:.1f} s')
    return results


def time_case(library, shape, dtype, psa_type, warmup, repeats, copy_cache):
    itemsize = np.dtype(DTYPES[dtype][1]).itemsize
    forward_bytes, backward_bytes = traffic_bytes(shape, itemsize)
    forward_ms = library.time_forward(DTYPES[dtype][1], shape, psa_type, warmup, repeats)
    backward_ms = library.time_backward(DTYPES[dtype][1], shape, psa_type, warmup, repeats)

    def copy_ms(moved):
        # A copy of b bytes reads b and writes b: the same traffic as `moved`.
        size = max(1, moved // 2)
        if size not in copy_cache:
            copy_cache[size] = library.time_copy(size, warmup, repeats)
        return copy_cache[size], 2 * size

    timing = {'forward_ms': forward_ms, 'backward_ms': backward_ms}
    for key, moved, ms in (('forward', forward_bytes, forward_ms),
                           ('backward', backward_bytes, backward_ms)):
        reference_ms, reference_bytes = copy_ms(moved)
        rate = moved / max(ms * 1e-3, 1e-12) / 1e9
        copy_rate = reference_bytes / max(reference_ms * 1e-3, 1e-12) / 1e9
        timing[key + '_gbps'] = rate
        timing[key + '_copy_gbps'] = copy_rate
        timing[key + '_fraction'] = rate / copy_rate
    return timing


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------

def format_table(results):
    header = ('| shapes | dtype | direction | forward | backward | fwd ms | bwd ms | '
              'fwd GB/s | fwd / copy | bwd GB/s | bwd / copy |')
    lines = [header, '|' + '---|' * 11]
    for r in results:
        t = r.timing
        timing = ['-'] * 6 if t is None else [
            f"{t['forward_ms']:.3f}", f"{t['backward_ms']:.3f}",
            f"{t['forward_gbps']:.0f}", f"{100 * t['forward_fraction']:.0f}%",
            f"{t['backward_gbps']:.0f}", f"{100 * t['backward_fraction']:.0f}%"]
        lines.append('| ' + ' | '.join([r.label, r.dtype, TYPE_NAMES[r.psa_type],
                                        r.cell(r.forward_exact, r.forward),
                                        r.cell(r.backward_exact, r.backward)] + timing) + ' |')
    return '\n'.join(lines)


def format_failures(results, limit=40):
    lines = []
    for r in results:
        for shape, fill, forward, backward in r.failures:
            lines.append(f'- {_describe_shape(shape)} {r.dtype} {TYPE_NAMES[r.psa_type]} '
                         f'(output pre-filled with 0x{fill:02X}): forward '
                         f'{forward.describe()}; backward {backward.describe()}')
    if len(lines) > limit:
        lines = lines[:limit] + [f'- ... and {len(lines) - limit} more failing cases']
    return lines


def _nvcc_release(nvcc):
    try:
        out = subprocess.run([nvcc, '--version'], capture_output=True, text=True,
                             timeout=60).stdout
        match = re.search(r'release [^\n]*', out)
        return match.group(0) if match else 'unknown'
    except (OSError, subprocess.SubprocessError):
        return 'unknown'


def _version(code):
    return f'{code // 1000}.{code % 1000 // 10}'


# ----------------------------------------------------------------------------
# compute-sanitizer.
# ----------------------------------------------------------------------------

SANITIZER_TOOLS = ('memcheck', 'racecheck', 'initcheck')


def find_sanitizer(nvcc):
    candidates = [shutil.which('compute-sanitizer')]
    if nvcc:
        cuda = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        candidates += [os.path.join(os.path.dirname(nvcc), 'compute-sanitizer'),
                       os.path.join(cuda, 'bin', 'compute-sanitizer'),
                       os.path.join(cuda, 'compute-sanitizer', 'compute-sanitizer')]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def parse_sanitizer_output(output, code, timeout):
    """('ok' | 'FAIL' | 'unavailable', one-line summary) of a compute-sanitizer
    run that exited with ``code`` (None: killed after ``timeout`` s). 'ok'
    needs exit 0 and a summary of 0 errors or 0 hazards; no summary at all
    means the tool never got to check anything (an unsupported device, say)."""
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
    """Re-runs SANITIZE_SHAPES under each tool: list of (tool, verdict, summary)."""
    rows = []
    for tool in SANITIZER_TOOLS:
        command = [sanitizer, '--tool', tool, '--error-exitcode', '86', sys.executable,
                   os.path.abspath(__file__), '--sanitize-child', '--library', library_path]
        log(f'sanitizer: {" ".join(command)}')
        start = time.time()
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
            output, code = result.stdout + result.stderr, result.returncode
        except subprocess.TimeoutExpired as error:
            output, code = str(error.stdout or '') + str(error.stderr or ''), None
        verdict, summary = parse_sanitizer_output(output, code, timeout)
        log(f'sanitizer {tool}: {verdict}: {summary} [{time.time() - start:.0f} s]')
        rows.append((tool, verdict, summary))
    return rows


def sanitize_child(library_path):
    """The subset run under compute-sanitizer: host-pointer API only."""
    runner = HostRunner(Library(library_path))
    cases = [(dtype, psa_type, index, shape) for dtype in DTYPES for psa_type in (0, 1)
             for index, shape in enumerate(SANITIZE_SHAPES)]
    failed = 0
    for dtype, psa_type, index, shape in cases:
        try:
            forward, backward = check_case(runner, shape, DTYPES[dtype][1], psa_type, 0xFF,
                                           RANDOM_SEED + index)
        except CapiError as error:
            print(f'sanitize subset stopped: {error}')
            return EXIT_FAILED
        if not (forward.exact and backward.exact):
            failed += 1
            print(f'FAIL {_describe_shape(shape)} {dtype} {TYPE_NAMES[psa_type]}: '
                  f'{forward.describe()}; {backward.describe()}')
    print(f'sanitize subset: {len(cases) - failed} of {len(cases)} cases exact')
    return EXIT_FAILED if failed else 0


# ----------------------------------------------------------------------------
# Main.
# ----------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Check and time the PSA mask CUDA kernels without Paddle.')
    parser.add_argument('--quick', action='store_true',
                        help='50 random shapes, batch-1 Cityscapes shapes only, fewer repeats')
    parser.add_argument('--sanitize', action='store_true',
                        help='also run a small subset under compute-sanitizer '
                             '(memcheck, racecheck, initcheck)')
    parser.add_argument('--out', help='also write the markdown report to this file')
    parser.add_argument('--backend', choices=('auto', 'cupy', 'numpy'), default='auto',
                        help='device buffers through CuPy, or host buffers through numpy; '
                             'auto: CuPy when it works (default: %(default)s)')
    parser.add_argument('--arch', default='native',
                        help="'native' or a list like '80,90' (default: %(default)s)")
    parser.add_argument('--nvcc', help='path of nvcc (default: found on PATH or CUDA_HOME)')
    parser.add_argument('--build-dir', default=DEFAULT_BUILD_DIR,
                        help='where the library is built (default: %(default)s)')
    parser.add_argument('--library', help='use this prebuilt library instead of building')
    parser.add_argument('--random-shapes', type=int, default=None,
                        help='how many random shapes (default: 200, 50 with --quick)')
    parser.add_argument('--repeats', type=int, default=None,
                        help='timed calls per measurement (default: 20, 5 with --quick)')
    parser.add_argument('--sanitize-child', action='store_true', help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)

    def log(message):
        print(message, file=sys.stderr, flush=True)

    if args.sanitize_child:
        return sanitize_child(args.library)
    started = time.time()
    nvcc = None
    try:
        if args.library:
            library_path = args.library
        else:
            nvcc = find_nvcc(args.nvcc)
            library_path = build_library(nvcc, args.arch, args.build_dir, log)
        library = Library(library_path)
        try:
            count = library.device_count()
        except CapiError as error:
            raise HarnessUnavailable(f'no usable CUDA device: {error}. This check needs an '
                                     'NVIDIA GPU with a driver new enough for the toolkit.')
        if count < 1:
            raise HarnessUnavailable('no CUDA device found (cudaGetDeviceCount gave 0).')
        device = library.device_info()
    except (HarnessUnavailable, CapiError, OSError, ValueError) as error:
        log(f'run_gpu_checks: cannot run: {error}')
        return EXIT_UNAVAILABLE

    cupy, cupy_reason = (None, 'not asked for') if args.backend == 'numpy' else import_cupy()
    if args.backend == 'cupy' and cupy is None:
        log(f'run_gpu_checks: --backend cupy, but CuPy cannot run: {cupy_reason}')
        return EXIT_UNAVAILABLE
    host = HostRunner(library)
    runner = CupyRunner(library, cupy) if cupy is not None else host
    random_count = args.random_shapes if args.random_shapes is not None else (
        50 if args.quick else 200)
    repeats = args.repeats or (5 if args.quick else 20)
    warmup = 1 if args.quick else 3
    cityscapes = [s for s in CITYSCAPES_SHAPES if not (args.quick and s.num > 1)]
    dtypes = list(DTYPES)

    problems = []
    if cupy is not None:
        problem = check_cupy_reference(cupy)
        if problem:
            problems.append(problem)
    results = []
    copy_cache = {}
    try:
        # The op's test shapes always go through the host-pointer API, so a
        # CuPy run exercises both halves of the C ABI.
        results += run_group(host, f'op test shapes ({len(CPU_TEST_SHAPES)} x 2 fills)',
                             [(s, f) for f in FILL_BYTES for s in CPU_TEST_SHAPES], dtypes,
                             RANDOM_SEED, log)
        shapes = random_shapes(random_count)
        results += run_group(runner, f'random ({random_count}, seed {RANDOM_SEED})',
                             [(s, FILL_BYTES[i % len(FILL_BYTES)])
                              for i, s in enumerate(shapes)], dtypes, RANDOM_SEED, log)
        for shape in cityscapes:
            for result in run_group(runner, _describe_shape(shape), [(shape, FILL_BYTES[0])],
                                    dtypes, RANDOM_SEED, log):
                results.append(result)
                result.timing = time_case(library, shape, result.dtype, result.psa_type,
                                          warmup, repeats, copy_cache)
    except CapiError as error:
        # A kernel fault (an illegal address, say) poisons the CUDA context:
        # nothing after it can run, so report what we have.
        problems.append(f'CUDA call failed, checks stopped: {error}')
    except Exception as error:  # report what ran rather than only a traceback
        log(traceback.format_exc())
        hint = ' (a CuPy problem? rerun with --backend numpy)' if cupy is not None else ''
        problems.append(f'checks stopped by {type(error).__name__}: {error}{hint}')

    sanitizer_rows, sanitizer_note = [], None
    if args.sanitize:
        # The sanitizer runs in fresh processes: a poisoned context here does not matter.
        sanitizer = find_sanitizer(nvcc or find_nvcc_quiet())
        if sanitizer is None:
            sanitizer_note = 'compute-sanitizer not found next to nvcc or on PATH: not run.'
            log(f'--sanitize: {sanitizer_note}')
        else:
            sanitizer_rows = run_sanitizer(sanitizer, library_path, log)

    failed = bool(problems) or not all(r.passed for r in results) or \
        any(verdict == 'FAIL' for _, verdict, _ in sanitizer_rows)
    capability = '%d%d' % device['capability']
    report = [
        '# PSA mask CUDA kernels: standalone check',
        '',
        f"- device: {device['name']} (sm_{capability}, "
        f"{device['memory_bytes'] / 2**30:.0f} GiB), CUDA runtime "
        f"{_version(device['runtime'])}, driver {_version(device['driver'])}",
        f'- library: {os.path.basename(library_path)}'
        + (f' (nvcc {_nvcc_release(nvcc)}, --arch {args.arch})' if nvcc else ''),
        (f'- buffers: {runner.name} for the random and Cityscapes shapes, {host.name} '
         'for the op test shapes' if cupy is not None else
         f'- buffers: {host.name} (CuPy not used: {cupy_reason})'),
        f'- python {platform.python_version()}, numpy {np.__version__}'
        + (f', cupy {cupy.__version__}' if cupy is not None else ''),
        '- forward/backward: bit-for-bit against the numpy reference; every output is '
        'pre-filled with 0xFF (NaN) or 0x5A (garbage) bytes before the launch, so "exact" '
        'includes each entry outside the window being +0.0',
        f'- timing: CUDA events, {warmup} warm-up + {repeats} timed calls; GB/s counts bytes '
        'read + written (forward: window entries of x + all of Y; backward: window entries '
        'of grad_Y + all of grad_x); "/ copy" is that rate over a device-to-device '
        'cudaMemcpy moving the same bytes, timed in this run',
        '',
        format_table(results),
    ]
    if copy_cache:
        size = max(copy_cache)
        report += ['', f'Largest reference copy: {size / 1e9:.2f} GB device to device in '
                   f'{copy_cache[size]:.3f} ms = {2 * size / copy_cache[size] / 1e6:.0f} GB/s '
                   '(read + write).']
    failures = format_failures(results)
    if failures or problems:
        report += ['', '## Failures', ''] + failures + [f'- {p}' for p in problems]
    if sanitizer_rows or sanitizer_note:
        report += ['', '## compute-sanitizer', '']
    if sanitizer_note:
        report += [sanitizer_note]
    if sanitizer_rows:
        report += [f'Subset: {len(SANITIZE_SHAPES)} shapes x {len(DTYPES)} dtypes x 2 types, '
                   'host-pointer API; "unavailable" (the tool reported nothing) does not '
                   'fail the run.', '', '| tool | result | summary |', '|---|---|---|']
        report += [f'| {tool} | {verdict} | {summary} |'
                   for tool, verdict, summary in sanitizer_rows]
    report += ['', f"**{'FAILED' if failed else 'PASSED'}** in {time.time() - started:.0f} s"]
    text = '\n'.join(report) + '\n'
    print(text)
    if args.out:
        with open(args.out, 'w') as f:
            f.write(text)
    return EXIT_FAILED if failed else 0


def find_nvcc_quiet():
    try:
        return find_nvcc()
    except HarnessUnavailable:
        return None


if __name__ == '__main__':
    sys.exit(main())
