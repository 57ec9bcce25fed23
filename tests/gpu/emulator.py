"""The CPU grid emulator of the PSA mask CUDA kernels, from Python.

Builds ``psa_mask_emulator.cc`` with the host C++ compiler (no nvcc, no Paddle) against
``ops/psa_mask_kernel.h`` (or a changed copy of it), and runs the kernels' phases over
every block and thread of their grid through ctypes: the output as the GPU would write
it, and what the emulator saw (races, accesses out of bounds, bank conflicts, sectors
per request, reads and writes per element). tests/test_psa_mask_emulator.py checks it
against tests/psa_mask_reference.py. What the figures mean: tests/gpu/README.md.

    python tests/gpu/emulator.py [N H W MASK ...]   # the access figures of those shapes
"""
import argparse
import ctypes
import os
import shutil
import sys

import numpy as np

from cached_build import cached_build  # tests/gpu/

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, 'psa_mask_emulator.cc')
OPS_DIR = os.path.normpath(os.path.join(HERE, '..', '..', 'ops'))
DEFAULT_BUILD_DIR = os.path.join(HERE, 'build')
MAX_GRID_X = 2**31 - 1  # the launcher's; lower values run the grid's second dimension
SHARED_BYTES_LIMIT = 48 * 1024


class Stats(ctypes.Structure):
    """What one run saw: struct Stats of psa_mask_emulator.cc, field for field."""
    _fields_ = [(name, ctypes.c_int64) for name in (
        'units', 'grid_x', 'grid_y', 'shared_bytes', 'pitch', 'span',
        'out_of_bounds', 'races', 'uninitialized_reads', 'divergent_requests',
        'shared_requests', 'shared_passes', 'shared_least_passes', 'conflicted_requests',
        'load_requests', 'load_sectors', 'load_least_sectors',
        'store_requests', 'store_sectors', 'store_least_sectors',
        'reads', 'max_reads_per_element', 'writes', 'min_writes_per_element',
        'max_writes_per_element')]

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


class EmulatorUnavailable(RuntimeError):
    """No C++ compiler, or the driver does not compile."""


def find_compiler():
    """$CXX, else c++ or g++ on PATH; None if there is none."""
    for candidate in (os.environ.get('CXX'), 'c++', 'g++'):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def build(build_dir=DEFAULT_BUILD_DIR, include_dir=OPS_DIR, optimize='-O2'):
    """Compiles the emulator against ``include_dir``'s psa_mask_kernel.h into ``build_dir``
    (:func:`cached_build.cached_build`); returns the library's path."""
    compiler = find_compiler()
    if compiler is None:
        raise EmulatorUnavailable('no C++ compiler (set CXX, or install g++)')
    flags = [optimize, '-std=c++17', '-shared', '-fPIC', '-Wall', '-Wextra', '-Werror',
             f'-I{include_dir}']
    sources = [SOURCE, os.path.join(include_dir, 'psa_mask_kernel.h')]
    return cached_build(compiler, flags, sources, build_dir, 'psa_mask_emulator', lambda output:
                        EmulatorUnavailable(f'the emulator does not compile:\n{output}'))


class Emulator:
    """ctypes bindings of psa_mask_emulator.cc."""

    def __init__(self, path):
        self._lib = ctypes.CDLL(path)
        self._lib.psa_emu_problem.restype = ctypes.c_char_p
        self._lib.psa_emu_run.restype = ctypes.c_int
        self._lib.psa_emu_run.argtypes = (
            [ctypes.c_int] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_void_p, ctypes.c_void_p,
                                                          ctypes.c_int64, ctypes.c_uint64,
                                                          ctypes.c_int, ctypes.POINTER(Stats)])
        if self._lib.psa_emu_stats_size() != ctypes.sizeof(Stats):
            raise EmulatorUnavailable(f'{path}: its Stats has {self._lib.psa_emu_stats_size()} '
                                      f'bytes, this module {ctypes.sizeof(Stats)}: rebuild it')

    def run(self, direction, array, psa_type, mask_h, mask_w, fill_byte=0xFF,
            max_grid_x=MAX_GRID_X, seed=0, instrument=False):
        """Forward (direction 0: x -> Y) or backward (1: grad_Y -> grad_x) of ``array``
        [N, C, H, W], the output first filled with ``fill_byte``: ``(output, stats,
        problem)``, ``problem`` the first thing the emulator saw wrong ('' if none).
        Raises ValueError for arguments the emulator refuses."""
        array = np.ascontiguousarray(array)
        num, _, feature_h, feature_w = array.shape
        channels = feature_h * feature_w if direction == 0 else mask_h * mask_w
        out = np.empty((num, channels, feature_h, feature_w), array.dtype)
        out.view(np.uint8).fill(fill_byte)
        stats = Stats()
        code = self._lib.psa_emu_run(array.itemsize, direction, psa_type, num, feature_h,
                                     feature_w, mask_h, mask_w, array.ctypes.data,
                                     out.ctypes.data, max_grid_x, seed, int(instrument),
                                     ctypes.byref(stats))
        problem = self._lib.psa_emu_problem().decode()
        if code != 0:
            raise ValueError(problem)
        return out, stats.as_dict(), problem


def efficiency(stats):
    """Sector efficiency of global loads and stores (the fewest sectors over those
    touched) and shared-memory passes over the fewest: figures of a run with
    ``instrument``."""
    def ratio(least, used):
        return least / used if used else 1.0
    return {'load': ratio(stats['load_least_sectors'], stats['load_sectors']),
            'store': ratio(stats['store_least_sectors'], stats['store_sectors']),
            'shared': ratio(stats['shared_least_passes'], stats['shared_passes'])}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('shape', nargs='*', type=int,
                        help='N H W MASK, repeated (default: the Cityscapes shapes at N=1)')
    parser.add_argument('--dtype', default='float32', choices=['float16', 'float32', 'float64'])
    args = parser.parse_args(argv)
    if len(args.shape) % 4:
        parser.error('give shapes as N H W MASK, four numbers each')
    shapes = [tuple(args.shape[k:k + 4]) for k in range(0, len(args.shape), 4)] or [
        (1, 32, 64, 59), (1, 64, 128, 97)]
    emulator = Emulator(build())
    print(f'| shape (N, H, W, mask) | kernel, {args.dtype} | blocks | shared bytes | load '
          'sectors (fewest / touched) | store sectors | shared passes (fewest / used) | races | '
          'reads per input element | writes per output element |')
    print('|' + '---|' * 10)
    for num, height, width, mask in shapes:
        for direction, name in enumerate(('forward', 'backward')):
            for psa_type, type_name in enumerate(('collect', 'distribute')):
                channels = mask * mask if direction == 0 else height * width
                array = np.zeros((num, channels, height, width), args.dtype)
                _, stats, problem = emulator.run(direction, array, psa_type, mask, mask,
                                                 instrument=True)
                share = efficiency(stats)
                print(f'| {num}, {height}, {width}, {mask}x{mask} | {name} {type_name} | '
                      f'{stats["units"]} | {stats["shared_bytes"]} | {100 * share["load"]:.1f}% '
                      f'| {100 * share["store"]:.1f}% | {100 * share["shared"]:.1f}% | '
                      f'{stats["races"]} | <= {stats["max_reads_per_element"]} | '
                      f'{stats["min_writes_per_element"]}-{stats["max_writes_per_element"]} |'
                      + (f' {problem}' if problem else ''), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
