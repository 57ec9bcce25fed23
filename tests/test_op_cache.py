"""A cached psa_mask op library that cannot be loaded (cut short by a full disk or a killed
build) is built again once, with one line saying so, and the op then gives the reference's
output."""
import os
import shutil
import sys
import textwrap

import numpy as np

from conftest import MINI_CONFIG, ROOT, run_process
from psa_mask_reference import reference_forward
from psanet.ops import build, library as op_library


def _cache_with_a_build(cache):
    """``cache`` holding this checkout's CPU build: copied from the default cache when it is
    there, else built by a fresh interpreter. Returns the library's path."""
    folder_name = build.source_hash(cpu_fallback=True)
    default = os.path.join(os.path.expanduser('~'), '.cache', 'psanet', 'ops', folder_name)
    library = os.path.join(str(cache), folder_name, build.LIBRARY_NAME + '.so')
    if os.path.isfile(os.path.join(default, build.LIBRARY_NAME + '.so')):
        shutil.copytree(default, os.path.dirname(library))
    else:
        done = run_process([sys.executable, '-c', 'from psanet.ops.library import library_path; '
                            'library_path()'], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, env=_environment(cache))
        assert done.returncode == 0, done.stderr[-3000:]
    assert os.path.isfile(library)
    return library


def _environment(cache):
    return dict(os.environ, PSANET_OPS_CACHE=str(cache), PSANET_OPS_FORCE_JIT='1',
                GLOG_minloglevel='2')


def test_a_cut_short_cached_library_is_built_again(tmp_path):
    cache = tmp_path / 'cache'
    library = _cache_with_a_build(cache)
    with open(library, 'rb') as f:
        head = f.read(4096)
    with open(library, 'wb') as f:
        f.write(head)
    x = np.random.default_rng(0).standard_normal((2, 12, 5, 4)).astype('float32')
    np.save(tmp_path / 'x.npy', x)
    script = f'''
        import numpy as np
        import paddle
        from psanet.ops import psa_mask
        y = psa_mask(paddle.to_tensor(np.load(r'{tmp_path}/x.npy')), 'distribute', (3, 4),
                     impl='custom')
        np.save(r'{tmp_path}/y.npy', y.numpy())
    '''
    done = run_process([sys.executable, '-c', textwrap.dedent(script)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=_environment(cache))
    assert done.returncode == 0 and 'Traceback' not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if 'cannot be loaded' in line]
    assert len(lines) == 1 and lines[0].startswith(f'psanet: the cached psa_mask op {library} '
                                                   'cannot be loaded ('), done.stderr
    assert lines[0].endswith('building it again')
    np.testing.assert_array_equal(np.load(tmp_path / 'y.npy'),
                                  reference_forward(x, 'distribute', 3, 4))
    assert os.path.getsize(library) > len(head)
    assert op_library.cache_dir() != str(cache)  # this process's cache was left alone


def test_a_cache_folder_that_cannot_be_written_is_one_line_from_train_py(tmp_path,
                                                                           mini_cityscapes):
    blocker = tmp_path / 'a_file'
    blocker.write_text('not a folder')
    cache = blocker / 'ops'  # below a file: no user, root included, can make it
    done = run_process([sys.executable, os.path.join(ROOT, 'train.py'), '--config', MINI_CONFIG,
                        '--device', 'cpu', '--save_dir', str(tmp_path / 'out'), '--iters', '1',
                        '--batch_size', '2',
                        '--num_workers', '0', '--opts',
                        f'train_dataset.dataset_root={mini_cityscapes}',
                        f'val_dataset.dataset_root={mini_cityscapes}'], cwd=str(tmp_path), capture_output=True,
                       text=True, timeout=600, env=_environment(cache))
    assert done.returncode == 2, done.stderr[-3000:]
    assert 'Traceback' not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith('error: ')]
    assert len(errors) == 1, done.stderr[-3000:]
    folder = os.path.join(str(cache), build.source_hash(cpu_fallback=True))
    assert errors[0].startswith(f'error: cannot build the psa_mask op into {folder}: '), errors
    assert f'Set PSANET_OPS_CACHE to a folder you can write (now: {cache})' in errors[0]
