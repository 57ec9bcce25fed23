"""Files and folders written whole: each is filled as a hidden temporary beside its place,
then renamed in, so that a reader, a crash or a full disk never sees one half-written.

A write that fails for lack of space is a :class:`~psanet.errors.DiskFullError` naming the
folder and its free space. Every writer of the package comes here but the op's build; it
imports only :mod:`psanet.errors` of ours, so that every layer can.
"""
import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import socket
import tempfile
import time

import cv2

from psanet.errors import ConfigError, DiskFullError

__all__ = ['TEMP_MARK', 'RETIRED_SUFFIX', 'PREVIOUS', 'check_save_dir', 'check_output_file',
           'make_output_dir', 'fsync', 'raise_if_disk_full', 'write_file_whole', 'write_folder',
           'write_bytes', 'write_image', 'delete_folders', 'remove_stale_temporaries',
           'LOCK_FILE', 'SaveDirLock']

# Marks the hidden temporaries of a file or folder written whole: `.<name>.tmp-<pid>...`;
# a folder being replaced waits in `.<name>.old.tmp-<pid>-*/previous` until the swap is done.
TEMP_MARK = '.tmp-'
RETIRED_SUFFIX = '.old'
PREVIOUS = 'previous'
LOCK_FILE = '.train.lock'  # in a training run's save_dir: SaveDirLock
_RETIRED = re.compile(r'^\.(.+)' + re.escape(RETIRED_SUFFIX + TEMP_MARK))


def check_save_dir(save_dir, flag='--save_dir'):
    """Raises ConfigError unless ``save_dir`` is a folder this process can write into, or can be
    made one: checked before any work, so that a file in the way or a folder without write
    permission is named at once. Nothing is created."""
    path = os.path.abspath(save_dir)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f'{flag} {save_dir} is a file, not a folder: pass a folder (it is '
                          'created when missing) or move the file away.')
    _check_can_write_below(path, f'{flag} {save_dir}')


def check_output_file(path, flag):
    """Raises ConfigError unless a file can be written at ``path`` (its folder is made
    when missing); checked before any work. Nothing is created."""
    if os.path.isdir(path):
        raise ConfigError(f'{flag} {path} is a folder: pass the path of the file to write, '
                          f'e.g. {os.path.join(path, "model.pdparams")}.')
    _check_can_write_below(os.path.dirname(os.path.abspath(path)), f'{flag} {path}')


def _check_can_write_below(path, what):
    """The nearest existing folder of ``path`` must be one this process can write into.
    ``os.access`` says yes to root on read-only or special file systems: make and remove
    a hidden folder instead."""
    folder = path
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ConfigError(f'{what} cannot be created: {folder} is a file, not a folder; pass a '
                          'path below a folder.')
    try:
        os.rmdir(tempfile.mkdtemp(prefix='.psanet-write-check-', dir=folder))
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(f'{what} cannot be written: {folder}: {reason}. Pass a folder '
                          'you can write to.') from None


def make_output_dir(path):
    """``os.makedirs(path, exist_ok=True)`` for an output folder: a file in the way is a
    ConfigError, a full disk a DiskFullError."""
    try:
        os.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:
        raise ConfigError(f'cannot create the folder {path}: {error.strerror} (a file is in '
                          'the way); move it or pass another --save_dir.') from error
    except OSError as error:
        raise_if_disk_full(error, _existing_folder(path))
        raise


def _existing_folder(path):
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def fsync(path):
    """Flushes a file's or a folder's entries to disk, so a rename survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size(count):
    for unit in ('bytes', 'KiB', 'MiB', 'GiB'):
        if count < 1024 or unit == 'GiB':
            return f'{count:.0f} {unit}' if unit == 'bytes' else f'{count:.1f} {unit}'
        count /= 1024


def raise_if_disk_full(error, folder):
    """Raises DiskFullError (naming ``folder`` and its free space) from ``error`` when it is a
    failed write for lack of space; returns otherwise."""
    full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
    if not (full or 'No space left on device' in str(error)):
        return
    try:
        free = _size(shutil.disk_usage(folder).free)
    except OSError:
        free = 'unknown'
    raise DiskFullError(f'no space left in {folder} ({free} free): free some space there or '
                        'write to another folder; no file was left half-written.') from error


def write_file_whole(path, write, durable=False):
    """Writes the file ``path`` (its folder must exist) whole or not at all: ``write(temporary)``
    fills a hidden file beside it, which then replaces ``path``; on any failure ``path`` is as
    it was. ``durable``: fsync the file and its folder, so that the rename survives a power
    loss."""
    folder = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(folder, f'.{os.path.basename(path)}{TEMP_MARK}{os.getpid()}')
    try:
        write(temporary)
        if durable:
            fsync(temporary)
        os.replace(temporary, path)
        if durable:
            fsync(folder)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise_if_disk_full(error, folder)
        raise
    return path


def _make_temporary_dir(parent, name):
    """Makes ``<parent>/.<name>.tmp-<pid>-<random>`` with the mode a plain mkdir gives
    (mkdtemp's 0700 would hide an export from a service running as another user); the pid
    tells a later writer a dead process's leftovers from a live one's."""
    while True:
        path = os.path.join(parent, f'.{name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}')
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _put_back(parent, retired, name):
    """Renames ``<parent>/<retired>/previous`` back to ``<parent>/<name>`` when a writer was
    stopped between the two renames of :func:`write_folder` (the old folder is then the
    only copy)."""
    previous = os.path.join(parent, retired, PREVIOUS)
    if os.path.isdir(previous) and not os.path.lexists(os.path.join(parent, name)):
        os.replace(previous, os.path.join(parent, name))
        fsync(parent)


def _remove_dead_writers_temporaries(parent, name):
    """Deletes the temporaries of ``<parent>/<name>`` that a killed writer left (a folder
    left only as ``.<name>.old.tmp-*/previous`` is renamed back first); a live process's stay."""
    pattern = re.compile(r'^\.' + re.escape(name) + r'(' + re.escape(RETIRED_SUFFIX) + r')?'
                         + re.escape(TEMP_MARK) + r'(\d+)-')
    for entry in sorted(os.listdir(parent)):
        match = pattern.match(entry)
        if not match or int(match.group(2)) == os.getpid() or _alive(int(match.group(2))):
            continue
        if match.group(1):
            _put_back(parent, entry, name)
        shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def remove_stale_temporaries(folder):
    """Deletes every hidden temporary in ``folder``, whoever left it: for a folder no other
    process writes in (a training run's locked save_dir). A folder left only as
    ``.<name>.old.tmp-*/previous`` is first renamed back to ``<name>``."""
    if not os.path.isdir(folder):
        return
    for entry in sorted(os.listdir(folder)):
        match = _RETIRED.match(entry)
        if match:
            _put_back(folder, entry, match.group(1))
    for entry in os.listdir(folder):
        if entry.startswith('.') and TEMP_MARK in entry:
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)


def _fsync_tree(folder):
    """Flushes every file and folder below ``folder``, and ``folder``, each folder after what
    it holds (a checkpoint's or an archive's files may sit in subfolders)."""
    for root, _, names in os.walk(folder, topdown=False):
        for name in names:
            if not os.path.islink(os.path.join(root, name)):
                fsync(os.path.join(root, name))
        fsync(root)


def write_folder(directory, write, carry_over=None):
    """Writes a folder whole or not at all: ``write(temporary)`` fills a hidden folder beside
    ``directory``, which then replaces it (an old one moved aside first, deleted after); a
    failure or a signal before the swap leaves the old folder as it was. Temporaries a killed
    writer of the same folder left are deleted first. ``carry_over(name)`` is True for the
    entries of the old folder to move into the new one. Returns ``directory``."""
    directory = os.path.normpath(directory)
    parent = os.path.dirname(directory) or '.'
    name = os.path.basename(directory)
    os.makedirs(parent, exist_ok=True)
    _remove_dead_writers_temporaries(parent, name)
    temporary = _make_temporary_dir(parent, name)
    try:
        write(temporary)
        _fsync_tree(temporary)
        if os.path.exists(directory):
            # rename() cannot replace a non-empty folder: move the old one aside first.
            retired = _make_temporary_dir(parent, name + RETIRED_SUFFIX)
            previous = os.path.join(retired, PREVIOUS)
            os.replace(directory, previous)
            os.replace(temporary, directory)
            fsync(parent)
            carried = [entry for entry in (os.listdir(previous) if carry_over else ())
                       if carry_over(entry) and not os.path.lexists(os.path.join(directory, entry))]
            for entry in carried:
                os.replace(os.path.join(previous, entry), os.path.join(directory, entry))
            if carried:  # their renames, before the old folder is deleted
                fsync(directory)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(temporary, directory)
            fsync(parent)
    except BaseException as error:
        shutil.rmtree(temporary, ignore_errors=True)
        raise_if_disk_full(error, parent)
        raise
    return directory


def write_bytes(path, data):
    """Writes ``data`` to ``path`` whole or not at all (:func:`write_file_whole`)."""
    def write(temporary):
        with open(temporary, 'wb') as f:
            f.write(data)
    return write_file_whole(path, write)


def write_image(path, array, extension=None):
    """Encodes ``array`` as OpenCV does for ``extension`` (default: ``path``'s) and writes it
    whole (:func:`write_file_whole`)."""
    ok, encoded = cv2.imencode(extension or os.path.splitext(path)[1] or '.png', array)
    if not ok:
        raise OSError(f'OpenCV cannot encode {path}.')
    return write_bytes(path, encoded.tobytes())


def delete_folders(paths):
    """Deletes folders of one parent, each at once or not at all.

    Each is first renamed into one hidden temporary folder, so a process killed while
    deleting leaves no folder half-deleted (a checkpoint with its model.pdparams but
    without its model.pdopt would still be listed); :func:`remove_stale_temporaries`
    deletes what is left.
    """
    if not paths:
        return
    parent = os.path.dirname(os.path.normpath(paths[0])) or '.'
    trash = _make_temporary_dir(parent, 'deleted')
    for i, path in enumerate(paths):
        os.replace(path, os.path.join(trash, f'{i}_{os.path.basename(os.path.normpath(path))}'))
    fsync(parent)
    shutil.rmtree(trash, ignore_errors=True)


class SaveDirLock:
    """An exclusive ``flock`` on ``<save_dir>/.train.lock`` (a training run's), which names
    the holder; ``warn(message)`` where the file system cannot lock."""

    def __init__(self, save_dir, warn):
        check_save_dir(save_dir)  # as every job's: a file in the way, no write permission
        os.makedirs(save_dir, exist_ok=True)
        self.path, self.fd = os.path.join(save_dir, LOCK_FILE), None
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors='replace').strip()
                os.close(fd)
                raise ConfigError(
                    f'--save_dir {save_dir} is in use by another training '
                    f'({holder or "pid unknown"}): two runs in one folder would mix their '
                    'checkpoints and train.log; wait for it to end or pick another '
                    '--save_dir.') from None
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                warn(f'--save_dir {save_dir} cannot be locked on this file system ({error}): '
                     'a second run started in it at once would not be refused.')
                return
            # A holder deletes the file before unlocking it: hold the file that is there now.
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    self.fd = fd
            if self.fd is None:
                os.close(fd)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f'pid {os.getpid()} on {socket.gethostname()}, started '
                          f'{time.strftime("%Y-%m-%d %H:%M:%S")}\n'.encode())

    def release(self):
        if self.fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
            os.close(self.fd)
            self.fd = None
