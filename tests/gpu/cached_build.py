"""A shared library compiled once per content: the grid emulator's (emulator.py, the host
C++ compiler) and the GPU harness's C ABI (run_gpu_checks.py, nvcc). Standard library
only, as the harness runs on GPU machines without Paddle."""
import hashlib
import os
import subprocess


def cached_build(compiler, flags, sources, library_dir, name, failed, log=None):
    """Compiles ``sources[0]`` (the others are files it includes) with ``compiler flags``
    into ``library_dir/<name>_<hash>.so``, the hash of the compiler, the flags and every
    source, so that a build of the same is reused; returns its path. A build that fails
    raises ``failed(the command and its output)``."""
    digest = hashlib.sha256(' '.join([os.path.realpath(compiler)] + flags).encode())
    for path in sources:
        with open(path, 'rb') as f:
            digest.update(f.read())
    os.makedirs(library_dir, exist_ok=True)
    library = os.path.join(library_dir, f'{name}_{digest.hexdigest()[:12]}.so')
    if os.path.isfile(library):
        return library
    partial = f'{library}.{os.getpid()}.partial'  # renamed once whole: never half a file
    command = [compiler, *flags, '-o', partial, sources[0]]
    if log is not None:
        log('building: ' + ' '.join(command))
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise failed(f'$ {" ".join(command)}\n{result.stdout}{result.stderr}')
    os.replace(partial, library)
    return library
