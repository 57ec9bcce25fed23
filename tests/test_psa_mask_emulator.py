"""The CUDA kernels of ops/psa_mask_kernel.h, run on the CPU by the grid emulator.

tests/gpu/psa_mask_emulator.cc, built with the host compiler (no nvcc, no GPU, no
Paddle), runs the kernels' phases over every block of the grid and every thread of
a block, a phase for all threads (in a shuffled order, shared memory poisoned
before each block) before the next. Every output is compared bit for bit with
tests/psa_mask_reference.py after a NaN or garbage pre-fill; on the smaller shapes
the emulator also records each access: none out of bounds, no race between the
threads of a phase, no shared slot read before it is written, every input element
read at most once (the window entries exactly once), every output element written
once, no bank conflict, and (on maps a whole number of tiles wide) every store
request on the fewest sectors. The last tests compile changed copies of the
kernels (a wrong pitch, a missing barrier, off-by-one tile edges) and check that the
emulator fails each.
"""
import concurrent.futures
import functools
import importlib.util
import os
import sys

import numpy as np
import pytest

from conftest import ROOT
from psa_mask_reference import reference_backward, reference_forward, window_cells

GPU_TESTS = os.path.join(ROOT, 'tests', 'gpu')
sys.path.insert(0, GPU_TESTS)
import emulator  # noqa: E402  (tests/gpu/emulator.py)

_spec = importlib.util.spec_from_file_location(
    'run_gpu_checks', os.path.join(GPU_TESTS, 'run_gpu_checks.py'))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)
Shape = harness.Shape  # (num, mask_h, mask_w, feature_h, feature_w)

DTYPES = ('float16', 'float32', 'float64')
FILLS = (0xFF, 0x5A)  # NaN in every dtype; finite garbage
# Bits planted in every input: a NaN with a payload and -0.0, which must arrive unchanged.
SPECIAL_BITS = {'float16': (0x7E5A, 0x8000), 'float32': (0x7FC0A5A5, 0x80000000),
                'float64': (0x7FF80000A5A5A5A5, 0x8000000000000000)}
SMALL_GRID_X = 7  # a grid this narrow runs its second dimension, its last row ragged

# Shapes across the kernels' limits: maps 32 source columns (a tile) wide and 128
# target columns (a forward span) wide and one either side; masks 128 window columns
# (a backward span) wide and one either side; the largest slab (159 staged rows);
# masks far wider or taller than the map; even masks; 1x1 maps and masks.
BOUNDARY_SHAPES = [
    Shape(1, 3, 5, 2, 31), Shape(1, 3, 5, 2, 32), Shape(2, 3, 5, 2, 33), Shape(1, 1, 63, 2, 64),
    Shape(1, 2, 66, 2, 65), Shape(1, 3, 3, 1, 127), Shape(1, 2, 4, 2, 128),
    Shape(1, 3, 3, 1, 129), Shape(1, 1, 129, 2, 160), Shape(1, 2, 300, 1, 257),
    Shape(1, 2, 127, 2, 3), Shape(1, 1, 128, 3, 40), Shape(2, 2, 129, 2, 40),
    Shape(1, 1, 257, 1, 97), Shape(1, 1, 200, 1, 128), Shape(1, 1, 128, 1, 160),
    Shape(1, 9, 1, 2, 2), Shape(1, 12, 12, 3, 2), Shape(1, 1, 1, 1, 1), Shape(1, 4, 6, 5, 34),
]
# Maps a whole number of tiles wide, as the Cityscapes ones: every store request
# touches the fewest sectors.
ALIGNED_SHAPES = [Shape(1, 17, 17, 6, 64), Shape(1, 41, 41, 2, 128), Shape(1, 9, 33, 3, 32)]


@pytest.fixture(scope='module')
def emu(tmp_path_factory):
    if emulator.find_compiler() is None:
        pytest.skip('no C++ compiler (CXX, c++, g++): the emulator cannot be built')
    return emulator.Emulator(emulator.build(str(tmp_path_factory.mktemp('emulator'))))


def random_input(shape, direction, dtype, seed):
    """The GPU harness's random input (normal values, repeating past a million), every
    7th a NaN with a payload, every 11th -0.0."""
    channels = shape.mask_h * shape.mask_w if direction == 0 else (
        shape.feature_h * shape.feature_w)
    array = harness.random_array((shape.num, channels, shape.feature_h, shape.feature_w),
                                 dtype, seed)
    bits = array.reshape(-1).view(f'u{array.itemsize}')
    nan, negative_zero = SPECIAL_BITS[dtype]
    bits[::7], bits[3::11] = nan, negative_zero
    return array


def check(emu, shape, dtype, psa_type, direction, fill=0xFF, max_grid_x=emulator.MAX_GRID_X,
          instrument=True, seed=0):
    """One emulated run against the reference: what is wrong (an empty list if nothing)
    and the run's stats."""
    source = random_input(shape, direction, dtype, seed)
    mask = (psa_type, shape.mask_h, shape.mask_w)
    got, stats, problem = emu.run(direction, source, *mask, fill, max_grid_x, seed, instrument)
    # The reference reshapes by N: an empty batch is compared by shape alone.
    expected = (reference_forward, reference_backward)[direction](source, *mask) \
        if shape.num else got.copy()
    return diagnose(got, expected, stats, problem, shape, instrument), stats


def diagnose(got, expected, stats, problem, shape, instrument):
    bits = f'u{got.itemsize}'
    wrong = int(np.count_nonzero(got.view(bits) != expected.view(bits)))
    found = [f'{wrong} of {got.size} entries differ'] if wrong else []
    found += [problem] if problem else []
    if stats['shared_bytes'] > emulator.SHARED_BYTES_LIMIT:
        found.append(f'{stats["shared_bytes"]} bytes of shared memory')
    if not instrument:
        return found
    found += [f'{stats[name]} {name.replace("_", " ")}' for name in (
        'out_of_bounds', 'races', 'uninitialized_reads', 'divergent_requests',
        'conflicted_requests') if stats[name]]
    moved = shape.num * len(window_cells(0, shape.mask_h, shape.mask_w, shape.feature_h,
                                         shape.feature_w)[0])
    if stats['reads'] != moved or stats['max_reads_per_element'] > 1:
        found.append(f'{stats["reads"]} reads, {moved} window entries, up to '
                     f'{stats["max_reads_per_element"]} reads of one element')
    if got.size and (stats['min_writes_per_element'], stats['max_writes_per_element']) != (1, 1):
        found.append(f'{stats["min_writes_per_element"]}-{stats["max_writes_per_element"]} '
                     'writes per output element')
    return found


def check_all(emu, cases, **kwargs):
    """check() over (shape, dtype, psa_type, direction) cases: the failures, described."""
    failures = []
    for index, (shape, dtype, psa_type, direction) in enumerate(cases):
        found, _ = check(emu, shape, dtype, psa_type, direction, seed=index, **kwargs)
        if found:
            failures.append(f'{shape} {dtype} {harness.TYPE_NAMES[psa_type]} '
                            f'{harness.DIRECTIONS[direction]}: {"; ".join(found)}')
    return failures


def every_case(shapes, dtypes=DTYPES):
    return [(shape, dtype, psa_type, direction) for shape in shapes for dtype in dtypes
            for psa_type in (0, 1) for direction in (0, 1)]


def assert_no_failures(failures):
    assert not failures, f'{len(failures)} failing cases:\n' + '\n'.join(failures[:20])


@pytest.mark.parametrize('fill', FILLS)
def test_op_test_shapes(emu, fill):
    """The shapes of the op's tests and the GPU harness, on the launcher's grid."""
    assert_no_failures(check_all(emu, every_case(harness.CPU_TEST_SHAPES), fill=fill))


def test_op_test_shapes_on_a_narrow_grid(emu):
    assert_no_failures(check_all(emu, every_case(harness.CPU_TEST_SHAPES),
                                 max_grid_x=SMALL_GRID_X))


def test_random_shapes(emu):
    """The GPU harness's 200 random shapes (N 1-3, masks and maps 1-10 or 1-12 a side),
    every type and direction, the dtypes, fills and grids taking turns."""
    failures = []
    for index, shape in enumerate(harness.random_shapes(200)):
        failures += check_all(emu, every_case([shape], [DTYPES[index % 3]]),
                              fill=FILLS[index % 2],
                              max_grid_x=(emulator.MAX_GRID_X, 1, 2, SMALL_GRID_X)[index % 4])
    assert_no_failures(failures)


def test_tile_and_grid_boundaries(emu):
    """Every dtype on the launcher's grid, float32 on a narrow one too."""
    failures, seen = [], []
    for max_grid_x, dtypes in ((emulator.MAX_GRID_X, DTYPES), (SMALL_GRID_X, ('float32',))):
        for index, case in enumerate(every_case(BOUNDARY_SHAPES, dtypes)):
            found, stats = check(emu, *case, max_grid_x=max_grid_x, seed=index,
                                 fill=FILLS[index % 2])
            seen.append(stats)
            failures += [f'{case}, grid x <= {max_grid_x}: {"; ".join(found)}'] if found else []
    assert_no_failures(failures)
    # The shapes reach what they are there for.
    assert max(s['grid_y'] for s in seen) > 1
    assert max(s['shared_bytes'] for s in seen) > 40 * 1024
    assert any(s['units'] % s['grid_x'] for s in seen if s['grid_y'] > 1)  # a ragged last row


def test_a_grid_of_more_than_65535_blocks(emu):
    """A forward of 90000 tiles: one grid row of 90000 blocks, past the 65535 a grid's
    y or z dimension holds."""
    shape = Shape(1, 3, 1, 300, 1)
    for case in every_case([shape], ('float32',)):
        found, stats = check(emu, *case)
        assert not found, (case, found)
    assert check(emu, shape, 'float32', 0, 0)[1]['grid_x'] == 90000


@pytest.mark.parametrize('shape', ALIGNED_SHAPES, ids=str)
def test_accesses_are_coalesced(emu, shape):
    """Stores on the fewest sectors; loads (whose window edges fall anywhere in a
    sector) on at most 1.25 times the fewest; shared memory in the fewest passes."""
    for dtype in DTYPES:
        for psa_type in (0, 1):
            for direction in (0, 1):
                found, stats = check(emu, shape, dtype, psa_type, direction)
                share = emulator.efficiency(stats)
                label = (shape, dtype, psa_type, direction)
                assert not found, (label, found)
                assert stats['store_sectors'] == stats['store_least_sectors'], (label, stats)
                assert share['load'] >= 0.8 and share['shared'] == 1.0, (label, share)


def run_beside_reference(emu, shape, source, psa_type, direction):
    """A large case in fast mode (no recording), the emulator and the reference on
    two threads (both release the GIL)."""
    mask = (psa_type, shape.mask_h, shape.mask_w)
    reference = (reference_forward, reference_backward)[direction]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        emulated = pool.submit(emu.run, direction, source, *mask, 0xFF)
        expected = reference(source, *mask)
        got, stats, problem = emulated.result()
    return diagnose(got, expected, stats, problem, shape, instrument=False)


@pytest.mark.parametrize('shape, dtypes', [
    (Shape(1, 59, 59, 32, 64), DTYPES),
    (Shape(1, 97, 97, 64, 128), ('float32',)),
], ids=str)
def test_cityscapes_shapes_at_batch_1(emu, shape, dtypes):
    failures = []
    for dtype in dtypes:
        sources = [random_input(shape, direction, dtype, seed=direction) for direction in (0, 1)]
        for psa_type in (0, 1):
            for direction in (0, 1):
                found = run_beside_reference(emu, shape, sources[direction], psa_type, direction)
                failures += [f'{dtype} {psa_type} {direction}: {found}'] if found else []
            window_cells.cache_clear()  # about 1 GB at 97x97 on 64x128
    assert_no_failures(failures)


def test_bad_arguments_are_refused(emu):
    with pytest.raises(ValueError, match='bad argument'):
        emu.run(0, np.zeros((1, 9, 2, 2), np.float32), 2, 3, 3)
    with pytest.raises(ValueError, match='more than 65535'):
        emu.run(0, np.zeros((1, 1, 300, 1), np.float32), 0, 1, 1, max_grid_x=1)


# ---------------------------------------------------------------- planted bugs

HEADER = os.path.join(emulator.OPS_DIR, 'psa_mask_kernel.h')

# name: (replacements in the kernels, the shape they run on, what must show).
PLANTS = {
    # Forward distribute's slab pitch 32: lanes a whole row apart share a bank;
    # every value is still right, so only the bank count can see it.
    'wrong pitch': ([('conflict_free_pitch(kTileColumns, psa_type == kCollect ? -1 : 0, '
                      'element_bytes)', 'kTileColumns')], Shape(1, 5, 5, 3, 40),
                    'conflicted requests'),
    # Stage and write in one phase: a thread reads slots other threads have yet to write.
    'missing barrier': ([('kPhases = 2;', 'kPhases = 1;'),
                         ('      kernel.stage(t, lane, warp, slab);\n',
                          '      kernel.stage(t, lane, warp, slab);\n'
                          '      kernel.write(t, lane, warp, slab);\n')],
                        Shape(1, 5, 5, 3, 40), 'races'),
    # A forward tile one target column too wide: it writes its neighbour's first
    # column again (the same value: only the write count sees it).
    'tile edge +1': ([('t.qw_end = min64(t.qw0 + plan.span, g.feature_w);',
                       't.qw_end = min64(t.qw0 + plan.span + 1, g.feature_w);')],
                     Shape(1, 3, 3, 2, 130), 'writes per output element'),
    # A backward tile staging one target column too few.
    'slab edge -1': ([('max64(0, qw_hi - t.qw_lo + 1)', 'max64(0, qw_hi - t.qw_lo)')],
                     Shape(1, 3, 5, 2, 40), 'differ'),
}


@functools.lru_cache(maxsize=None)
def planted_emulator(name, folder):
    with open(HEADER) as f:
        source = f.read()
    for old, new in PLANTS[name][0]:
        assert source.count(old) == 1, f'plant {name!r}: {old!r} is no longer in {HEADER}'
        source = source.replace(old, new)
    include = os.path.join(folder, name.replace(' ', '_'))
    os.makedirs(include, exist_ok=True)
    with open(os.path.join(include, 'psa_mask_kernel.h'), 'w') as f:
        f.write(source)
    return emulator.Emulator(emulator.build(include, include_dir=include, optimize='-O0'))


@pytest.fixture(scope='module')
def plants_folder(tmp_path_factory):
    if emulator.find_compiler() is None:
        pytest.skip('no C++ compiler (CXX, c++, g++): the emulator cannot be built')
    folder = str(tmp_path_factory.mktemp('plants'))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the compiler runs outside the GIL
        list(pool.map(lambda name: planted_emulator(name, folder), PLANTS))
    return folder


@pytest.mark.parametrize('name', PLANTS)
def test_emulator_fails_a_planted_bug(plants_folder, name):
    planted = planted_emulator(name, plants_folder)
    _, shape, sign = PLANTS[name]
    found = [line for case in every_case([shape], ('float32',))
             for line in check(planted, *case)[0]]
    assert any(sign in line for line in found), found
    if name == 'missing barrier':  # values alone show it too: poison, shuffled threads
        assert any('differ' in line for case in every_case([shape], ('float32',))
                   for line in check(planted, *case, instrument=False)[0])
