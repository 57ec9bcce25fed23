"""Finds, builds when needed, and registers the PSA mask op library.

Order: the library installed inside the package by ``setup.py``; else a build
cached under ``$PSANET_OPS_CACHE`` (default ``~/.cache/psanet/ops``) in a folder
named by the sources' hash, built once under a file lock so that many
processes starting together (``paddle.distributed.launch``) share one build.
"""
import fcntl
import os
import sys

from . import build

_INSTALLED = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          build.LIBRARY_NAME + '.so')
_loaded_path = None


def cache_dir():
    return os.environ.get('PSANET_OPS_CACHE',
                          os.path.join(os.path.expanduser('~'), '.cache', 'psanet', 'ops'))


def library_path():
    """Path of a usable op library, building it into the cache if needed."""
    if os.path.isfile(_INSTALLED) and not os.environ.get('PSANET_OPS_FORCE_JIT'):
        return _INSTALLED
    folder = os.path.join(cache_dir(), build.source_hash())
    path = os.path.join(folder, build.LIBRARY_NAME + '.so')
    if os.path.isfile(path):
        return path
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, 'build.lock'), 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not os.path.isfile(path):  # another process may have built it meanwhile
                print(f'psanet: building the psa_mask op into {folder} (once: about '
                      '10 s, up to a minute with the CUDA kernels)', file=sys.stderr,
                      flush=True)
                build.compile_library(path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path


def load_library():
    """Registers the op with Paddle (once per process); returns the library path."""
    global _loaded_path
    if _loaded_path is None:
        from paddle.utils.cpp_extension.extension_utils import \
            load_op_meta_info_and_register_op
        path = library_path()
        load_op_meta_info_and_register_op(path)
        _loaded_path = path
    return _loaded_path
