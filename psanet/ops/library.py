"""Finds, builds when needed, and registers the PSA mask op library.

Order: the library installed inside the package by ``setup.py``; else a build
cached under ``$PSANET_OPS_CACHE`` (default ``~/.cache/psanet/ops``) in a folder
named by ``build.source_hash`` (the sources, Paddle, Python and, for the CUDA
kernels, the architectures chosen and nvcc's version), built once under a file
lock so that many processes starting together (``paddle.distributed.launch``)
share one build. On a CUDA Paddle with no nvcc (a paddlepaddle-gpu wheel alone)
the JIT build is the CPU-only library, with one warning line: the op still
runs on CPU tensors (the CPU predictor, export), and a GPU tensor raises.

The library also answers, through ctypes, how many threads its CPU kernels
use (``psa_mask_cpu_threads``, ``psa_mask_last_cpu_threads``), and runs the
float32 CPU backward kernel alone for the bench (``psa_mask_cpu_backward_into``).
"""
import ctypes
import fcntl
import os
import sys

from . import build

_INSTALLED = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          build.LIBRARY_NAME + '.so')
_loaded_path = None
_handle = None


class OpLibraryError(RuntimeError):
    """The op library cannot be built or cached here; the message names the folder and the
    fix (the command lines print it as one line: psanet.cli)."""


def cache_dir():
    return os.environ.get('PSANET_OPS_CACHE',
                          os.path.join(os.path.expanduser('~'), '.cache', 'psanet', 'ops'))


def library_path():
    """Path of a usable op library, building it into the cache if needed."""
    if os.path.isfile(_INSTALLED) and not os.environ.get('PSANET_OPS_FORCE_JIT'):
        return _INSTALLED
    folder = os.path.join(cache_dir(), build.source_hash(cpu_fallback=True))
    path = os.path.join(folder, build.LIBRARY_NAME + '.so')
    if os.path.isfile(path):
        return path
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, 'build.lock'), 'w')
    except OSError as error:
        raise OpLibraryError(
            f'cannot build the psa_mask op into {folder}: {error.strerror or error}. Set '
            f'PSANET_OPS_CACHE to a folder you can write (now: {cache_dir()}), or install '
            'the op ahead of time (pip install --no-build-isolation .).') from error
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not os.path.isfile(path):  # another process may have built it meanwhile
                print(f'psanet: building the psa_mask op into {folder} (once: about '
                      '10 s, up to a minute with the CUDA kernels)', file=sys.stderr,
                      flush=True)
                build.compile_library(path, cpu_fallback=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path


def _elf_whole(path):
    """Whether ``path`` is a 64-bit ELF file that ends where its section table says: a
    library cut short would pass dlopen's first checks and crash the process (SIGBUS)
    when a missing page is touched."""
    try:
        with open(path, 'rb') as f:
            header = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(header) < 64 or header[:5] != b'\x7fELF\x02':
        return False
    order = 'little' if header[5] == 1 else 'big'
    table = int.from_bytes(header[0x28:0x30], order)
    entry, count = (int.from_bytes(header[i:i + 2], order) for i in (0x3A, 0x3C))
    return table + entry * count <= size


def load_library():
    """Registers the op with Paddle (once per process); returns the library path.

    A cached build that cannot be loaded (cut short by a full disk or a killed
    build) is deleted and built again, once, with one line saying so.
    """
    global _loaded_path
    if _loaded_path is None:
        path = library_path()
        if path != _INSTALLED:
            reason = None if _elf_whole(path) else 'not a whole shared library'
            if reason is None:
                try:
                    register_op_library(path)
                except (RuntimeError, OSError) as error:
                    reason = str(error).strip().splitlines()[0][:200]
            if reason is not None:
                print(f'psanet: the cached psa_mask op {path} cannot be loaded ({reason}); '
                      'building it again', file=sys.stderr, flush=True)
                os.remove(path)
                path = library_path()
                register_op_library(path)
        else:
            register_op_library(path)
        _loaded_path = path
    return _loaded_path


def register_op_library(path):
    """Registers the ops of a built library with Paddle; returns their names.

    A Paddle-version workaround (psanet.compat.OP_REGISTRATION):
    Paddle has no public API for it; ``load_op_meta_info_and_register_op`` is
    what the stubs of its own ``cpp_extension.setup`` call, re-exported by
    ``paddle.utils.cpp_extension`` though not in its ``__all__``.
    """
    try:
        from paddle.utils.cpp_extension import load_op_meta_info_and_register_op
    except ImportError:
        from paddle.utils.cpp_extension.extension_utils import \
            load_op_meta_info_and_register_op
    return load_op_meta_info_and_register_op(path)


def _library():
    global _handle
    if _handle is None:
        # The library Paddle loaded: dlopen of the same file returns it.
        _handle = ctypes.CDLL(load_library())
    return _handle


def psa_mask_cpu_threads():
    """How many threads a CPU ``psa_mask`` call made from this thread may use.

    ``PSA_MASK_NUM_THREADS`` if set to a positive integer; else the count
    Paddle's own CPU kernels run with on this thread (OpenMP's
    ``omp_get_max_threads()``: ``OMP_NUM_THREADS``, which ``import paddle``
    sets to 1 when unset, then ``paddle.base.core.set_num_threads(n)`` or the
    predictor's ``set_cpu_math_library_num_threads(n)``); else, on a Paddle
    without OpenMP, every hardware thread. A call on a small map uses fewer
    (one per 65536 output elements at most).
    """
    return _library().psa_mask_cpu_threads()


def psa_mask_last_cpu_threads():
    """Threads the last CPU ``psa_mask`` forward or backward in this process ran on
    (0 before the first); for tests and benchmarks."""
    return _library().psa_mask_last_cpu_threads()


def psa_mask_cpu_backward_into(grad_y, grad_x, psa_type, mask_h, mask_w):
    """Runs the float32 CPU backward kernel of ``psa_type`` (COLLECT or DISTRIBUTE)
    from ``grad_y`` [N, H*W, H, W] into ``grad_x`` [N, mask_h*mask_w, H, W], both
    C-contiguous float32 numpy arrays, with no Paddle tensor and no allocation:
    bench/bench_psa_mask.py times the kernel with it."""
    num, cells, height, width = grad_x.shape
    for array, shape in ((grad_y, (num, height * width, height, width)),
                         (grad_x, (num, mask_h * mask_w, height, width))):
        if array.dtype.str != '<f4' or not array.flags.c_contiguous or array.shape != shape:
            raise ValueError(f'psa_mask_cpu_backward_into: need C-contiguous float32 arrays '
                             f'{(num, height * width, height, width)} and '
                             f'{(num, mask_h * mask_w, height, width)}, got {grad_y.shape} '
                             f'{grad_y.dtype} and {grad_x.shape} {grad_x.dtype}.')
    function = _library().psa_mask_cpu_backward_float
    function.restype = None
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5 + \
        [ctypes.c_int]
    function(grad_y.ctypes.data, grad_x.ctypes.data, num, height, width, mask_h, mask_w,
             psa_type)
