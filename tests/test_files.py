"""psanet.files: the one place that renames a temporary into place (an AST scan of psanet/);
a durable file and every file and folder of a folder are fsynced before their rename and their
parent after it (the fsync calls recorded); a quota error is a full disk, in the same line;
an image is encoded in the format its extension names (read back by PIL)."""
import ast
import errno
import os

import cv2
import numpy as np
import pytest
from PIL import Image

from conftest import ROOT
from engine_helpers import IMAGE_FORMATS
from psanet import files
from psanet.cli import run_cli
from psanet.errors import DiskFullError

PACKAGE = os.path.join(ROOT, 'psanet')
RENAMES = {('os', 'replace'), ('os', 'rename'), ('os', 'renames'), ('shutil', 'move')}
# The modules that rename by hand, each with the reason it cannot use psanet.files.
RENAMING_BY_HAND = {
    'psanet/ops/build.py': 'psanet/ops imports nothing of ours (setup.py and the JIT build '
                           'load it alone): the library is linked in a hidden build folder '
                           'beside its place and renamed in',
}


def _renames(path):
    """``module.function`` of the rename calls in the file ``path``, with their line numbers."""
    with open(path, encoding='utf-8') as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and \
                (node.func.value.id, node.func.attr) in RENAMES:
            found.append(f'{node.func.value.id}.{node.func.attr} (line {node.lineno})')
        elif isinstance(node, ast.ImportFrom) and node.module in ('os', 'shutil') and any(
                (node.module, alias.name) in RENAMES for alias in node.names):
            found.append(f'from {node.module} import (line {node.lineno})')
    return found


def _package_files():
    for folder, _, names in os.walk(PACKAGE):
        for name in sorted(names):
            if name.endswith('.py'):
                yield os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, '/')


def test_only_psanet_files_renames_a_temporary_into_place():
    by_hand = {path: _renames(os.path.join(ROOT, path)) for path in _package_files()
               if path != 'psanet/files.py'}
    unlisted = {path: calls for path, calls in by_hand.items()
                if calls and path not in RENAMING_BY_HAND}
    assert not unlisted, f'write through psanet.files (write_file_whole, write_folder): {unlisted}'
    # An exception that no longer renames comes off the list.
    assert all(by_hand.get(path) for path in RENAMING_BY_HAND), by_hand


def test_the_scan_sees_each_form_of_a_rename(tmp_path):
    path = tmp_path / 'writer.py'
    path.write_text('import os, shutil\nfrom os import rename\n'
                    'def f(a, b):\n    os.replace(a, b)\n    os.rename(a, b)\n'
                    '    shutil.move(a, b)\n    a.replace("x", "y")\n')
    assert _renames(str(path)) == ['from os import (line 2)', 'os.replace (line 4)',
                                   'os.rename (line 5)', 'shutil.move (line 6)']


@pytest.fixture
def disk_calls(monkeypatch):
    """Every os.fsync (as ``('fsync', the real path of its descriptor)``) and os.replace
    (``('replace', source, target)``) in the order made."""
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(('fsync', os.path.realpath(os.readlink(f'/proc/self/fd/{fd}'))))
        return real_fsync(fd)

    def replace(source, target, **kwargs):
        calls.append(('replace', os.path.realpath(source), os.path.realpath(target)))
        return real_replace(source, target, **kwargs)

    monkeypatch.setattr(os, 'fsync', fsync)
    monkeypatch.setattr(os, 'replace', replace)
    return calls


def _tree(folder):
    """Every file and folder below ``folder`` and itself, as real paths."""
    found = [os.path.realpath(folder)]
    for root, folders, names in os.walk(folder):
        found += [os.path.realpath(os.path.join(root, name)) for name in folders + names]
    return sorted(found)


def _synced_before(calls, index):
    return {call[1] for call in calls[:index] if call[0] == 'fsync'}


def test_a_durable_file_is_fsynced_before_its_rename_and_its_folder_after(tmp_path,
                                                                          disk_calls):
    target = tmp_path / 'model.pdparams'
    target.write_bytes(b'old')
    written = []

    def write(temporary):
        with open(temporary, 'wb') as f:
            f.write(b'new weights')
        written.append(os.path.realpath(temporary))

    files.write_file_whole(str(target), write, durable=True)
    assert target.read_bytes() == b'new weights'
    renames = [i for i, call in enumerate(disk_calls) if call[0] == 'replace']
    assert len(renames) == 1 and disk_calls[renames[0]][1:] == (written[0], str(target))
    assert written[0] in _synced_before(disk_calls, renames[0]), disk_calls
    assert ('fsync', str(tmp_path)) in disk_calls[renames[0] + 1:], disk_calls


def test_a_plain_file_is_not_fsynced(tmp_path, disk_calls):
    """Predictions and figures are not worth a flush each: only ``durable`` files are."""
    files.write_bytes(str(tmp_path / 'a.png'), b'x')
    assert [call[0] for call in disk_calls] == ['replace']


@pytest.mark.parametrize('existing', [False, True])
def test_every_file_and_folder_of_a_folder_is_fsynced_before_its_rename(tmp_path, disk_calls,
                                                                        existing):
    target = tmp_path / 'iter_10'
    if existing:  # with a file of the user's carried over into the new folder
        (target / 'old').mkdir(parents=True)
        (target / 'old' / 'model.pdparams').write_bytes(b'old')
        (target / 'notes.txt').write_bytes(b'mine')
    seen = []

    def write(temporary):
        os.makedirs(os.path.join(temporary, 'psanet_r50', 'deeper'))
        os.makedirs(os.path.join(temporary, 'empty'))
        for name in ('train_state.json', os.path.join('psanet_r50', 'model.pdparams'),
                     os.path.join('psanet_r50', 'deeper', 'model.pdopt')):
            with open(os.path.join(temporary, name), 'wb') as f:
                f.write(name.encode())
        seen.append(_tree(temporary))

    files.write_folder(str(target), write, carry_over=lambda name: name == 'notes.txt')
    assert sorted(os.path.relpath(p, target) for p in _tree(target)) == sorted(
        ['.', 'empty', 'psanet_r50', os.path.join('psanet_r50', 'deeper'), 'train_state.json',
         os.path.join('psanet_r50', 'model.pdparams'),
         os.path.join('psanet_r50', 'deeper', 'model.pdopt')] + ['notes.txt'] * existing)
    temporary = seen[0][0]
    swap = next(i for i, call in enumerate(disk_calls)
                if call[:2] == ('replace', temporary))
    assert disk_calls[swap][2] == str(target)
    unsynced = [path for path in seen[0] if path not in _synced_before(disk_calls, swap)]
    assert not unsynced, f'not fsynced before the rename: {unsynced}'
    assert ('fsync', str(tmp_path)) in disk_calls[swap + 1:], disk_calls
    if existing:
        carried = next(i for i, call in enumerate(disk_calls)
                       if call[0] == 'replace' and call[2] == str(target / 'notes.txt'))
        assert ('fsync', str(target)) in disk_calls[carried + 1:], disk_calls
        assert (target / 'notes.txt').read_bytes() == b'mine'


@pytest.mark.parametrize('code', [errno.ENOSPC, errno.EDQUOT])
def test_a_quota_error_is_a_full_disk_in_the_same_line(tmp_path, capsys, code):
    """Over a disk quota (EDQUOT, 'Disk quota exceeded') as out of space (ENOSPC): the folder,
    its free space, no file left half-written; through each writer and as the command line
    prints it."""
    def fail(temporary):
        with open(temporary, 'wb') as f:
            f.write(b'part')
        raise OSError(code, os.strerror(code))

    line = f'no space left in {tmp_path} ('
    for write in (lambda: files.write_file_whole(str(tmp_path / 'a.bin'), fail),
                  lambda: files.write_folder(str(tmp_path / 'export'),
                                             lambda folder: fail(os.path.join(folder, 'x')))):
        with pytest.raises(DiskFullError) as error:
            write()
        assert str(error.value).startswith(line) and ' free): free some space there or write ' \
            'to another folder; no file was left half-written.' in str(error.value), error.value
        assert isinstance(error.value.__cause__, OSError) and error.value.__cause__.errno == code
        assert os.listdir(tmp_path) == []
    assert run_cli(files.write_file_whole, str(tmp_path / 'a.bin'), fail) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'error: {line}') and err.count('\n') == 1, err


def test_a_quota_error_making_a_folder_is_a_full_disk(tmp_path, monkeypatch):
    def makedirs(path, exist_ok=False):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), path)
    monkeypatch.setattr(os, 'makedirs', makedirs)
    with pytest.raises(DiskFullError, match=f'^no space left in {tmp_path} '):
        files.make_output_dir(str(tmp_path / 'out' / 'added_prediction'))


@pytest.mark.parametrize('name, extension', [('a.png', None), ('a.jpg', None), ('a.JPG', None),
                                             ('a.jpeg', None), ('a.bmp', None),
                                             ('a.jpg', '.png')])
def test_an_image_is_written_in_the_format_its_extension_names(tmp_path, name, extension):
    """Read back by PIL: the format of ``extension`` (default: the name's), the pixels as
    given where it is lossless, within JPEG's loss where not."""
    rng = np.random.RandomState(0)
    bgr = cv2.resize(rng.randint(0, 256, (4, 6, 3)).astype('uint8'), (60, 40),
                     interpolation=cv2.INTER_CUBIC)  # smooth, so that JPEG keeps it close
    path = files.write_image(str(tmp_path / name), bgr, extension)
    assert path == str(tmp_path / name) and os.listdir(tmp_path) == [name]
    format_ = IMAGE_FORMATS[(extension or os.path.splitext(name)[1]).lower()]
    with Image.open(path) as image:
        assert image.format == format_
        difference = np.abs(np.asarray(image.convert('RGB'), int) - bgr[:, :, ::-1])
    if format_ == 'JPEG':
        assert 0 < difference.mean() < 3, difference.mean()
    else:
        assert difference.max() == 0
