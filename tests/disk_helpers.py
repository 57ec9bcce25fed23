"""Disks and folders for the tests of outputs: a small tmpfs a test mounts itself (a disk that
fills up, a folder that is a mount point) and the digests of a folder's files.

Mounting needs root (or CAP_SYS_ADMIN); where it is refused the test is skipped, saying so.
"""
import contextlib
import hashlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def small_tmpfs(path, size, inodes=None):
    """Mounts a tmpfs of ``size`` bytes (rounded up to pages), and at most ``inodes`` files
    and folders when given, at ``path`` for the block."""
    os.makedirs(path, exist_ok=True)
    options = f'size={int(size)}' + (f',nr_inodes={int(inodes)}' if inodes else '')
    done = subprocess.run(['mount', '-t', 'tmpfs', '-o', options, 'tmpfs', str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f'cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): '
                    'a full disk and a mount point need one')
    try:
        yield str(path)
    finally:
        subprocess.run(['umount', '-l', str(path)], check=False)


def fill(folder, leave):
    """Fills the file system of ``folder`` with a hidden filler file until about ``leave``
    bytes are free; returns the filler's path."""
    filler = os.path.join(folder, '.filler')
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    with open(filler, 'wb') as f:
        f.write(b'\0' * max(free - int(leave), 0))
    return filler


def whole_files(folder):
    """Every file below ``folder`` (the filler left out), for checks that none is cut short."""
    found = []
    for root, _, files in os.walk(folder):
        found += [os.path.join(root, name) for name in files if name != '.filler']
    return sorted(found)


def digests(folder):
    """{relative path: sha256} of every file under ``folder``, hidden ones included."""
    found = {}
    for parent, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(parent, name)
            with open(path, 'rb') as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found
