"""Compiles the PSA mask op library (``ops/*.cc``, ``ops/*.cu``) into one ``.so``.

The same function serves ``setup.py`` (ahead of time, into the installed
package) and the loader (just in time, into a cache folder keyed by the
sources' hash). Both write the library atomically, so a reader never sees a
half-written file.
"""
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

LIBRARY_NAME = 'psa_mask_op'
_HEADER = 'psa_mask_kernel.h'
_CPU_SOURCE = 'psa_mask.cc'
_CUDA_SOURCE = 'psa_mask.cu'
# Architectures built when PADDLE_CUDA_ARCH_LIST is unset: Volta to Hopper, plus
# PTX of the newest for what comes after.
_DEFAULT_CUDA_ARCHS = ('70', '75', '80', '86', '89', '90')


def default_source_dir():
    """``ops/`` of the source checkout this package sits in."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), 'ops')


def with_cuda_default():
    import paddle
    return paddle.is_compiled_with_cuda()


def _sources(source_dir, with_cuda):
    names = [_HEADER, _CPU_SOURCE] + ([_CUDA_SOURCE] if with_cuda else [])
    paths = [os.path.join(source_dir, name) for name in names]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(
            f'psa_mask op sources not found: {missing}. Run from a full source '
            'checkout of psanet, or install it with '
            '`pip install --no-build-isolation .` so the op is built ahead of time.')
    return paths


def source_hash(source_dir=None, with_cuda=None):
    """Hash of what the library depends on: sources, Paddle version, CUDA or not."""
    import paddle
    source_dir = source_dir or default_source_dir()
    with_cuda = with_cuda_default() if with_cuda is None else with_cuda
    digest = hashlib.sha256()
    for path in _sources(source_dir, with_cuda):
        with open(path, 'rb') as f:
            digest.update(os.path.basename(path).encode() + b'\0' + f.read())
    digest.update(f'paddle={paddle.__version__};cuda={with_cuda};'
                  f'python={sys.version_info[:2]}'.encode())
    return digest.hexdigest()[:16]


def _run(command, verbose):
    if verbose:
        print(' '.join(command), file=sys.stderr)
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    if result.returncode != 0:
        raise RuntimeError(f'building the psa_mask op failed:\n$ {" ".join(command)}\n'
                           f'{result.stdout}')


def _find_compiler(name, env, install_hint):
    compiler = os.environ.get(env, name)
    found = shutil.which(compiler)
    if found is None:
        raise RuntimeError(
            f'building the psa_mask op needs the compiler `{compiler}`, which is not '
            f'on PATH. {install_hint}')
    return found


def compile_library(output_path, source_dir=None, with_cuda=None, verbose=False):
    """Builds the op library into ``output_path`` (written atomically)."""
    from paddle.utils.cpp_extension import extension_utils as eu

    source_dir = source_dir or default_source_dir()
    with_cuda = with_cuda_default() if with_cuda is None else with_cuda
    sources = _sources(source_dir, with_cuda)
    cxx = _find_compiler('c++', 'CXX', 'Install a C++17 compiler (e.g. `apt install g++`).')
    includes = [f'-I{d}' for d in [source_dir] + eu.find_paddle_includes(with_cuda)
                + eu.find_python_includes()]
    defines = ['-DPADDLE_WITH_CUSTOM_KERNEL', f'-DPADDLE_EXTENSION_NAME={LIBRARY_NAME}',
               '-D_GLIBCXX_USE_CXX11_ABI=1']
    if with_cuda:
        defines += ['-DPADDLE_WITH_CUDA', '-DEIGEN_USE_GPU']
    lib_dirs = eu.find_paddle_libraries(with_cuda)

    out_dir = os.path.dirname(os.path.abspath(output_path))
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix='.build-') as tmp:
        objects = []
        if with_cuda:
            nvcc = _find_compiler(
                os.path.join(eu.find_cuda_home() or '', 'bin', 'nvcc'), 'NVCC',
                'Install the CUDA toolkit matching your paddlepaddle-gpu build.')
            archs = os.environ.get('PADDLE_CUDA_ARCH_LIST')
            archs = ([a.replace('.', '') for a in archs.replace(';', ' ').replace(
                ',', ' ').split()] if archs else list(_DEFAULT_CUDA_ARCHS))
            gencode = [f'-gencode=arch=compute_{a},code=sm_{a}' for a in archs]
            gencode.append(f'-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}')
            cuda_object = os.path.join(tmp, 'psa_mask_cu.o')
            _run([nvcc, '-c', sources[-1], '-o', cuda_object, '-O3', '-std=c++17',
                  '--expt-relaxed-constexpr', '-Xcompiler', '-fPIC', '-w',
                  '-DPADDLE_NO_PYTHON'] + gencode + defines + includes, verbose)
            objects.append(cuda_object)
        cpu_object = os.path.join(tmp, 'psa_mask.o')
        _run([cxx, '-c', sources[1], '-o', cpu_object, '-O3', '-std=c++17', '-fPIC', '-w',
              '-pthread'] + defines + includes, verbose)
        objects.append(cpu_object)
        linked = os.path.join(tmp, LIBRARY_NAME + '.so')
        link = [cxx, '-shared', '-o', linked] + objects + [f'-L{d}' for d in lib_dirs]
        link += [f'-Wl,-rpath,{d}' for d in lib_dirs]
        link += ['-Wl,--no-as-needed', f'-l:{eu._get_core_name()}', '-Wl,--as-needed',
                 '-pthread']
        if with_cuda:
            link.append('-lcudart')
        _run(link, verbose)
        os.replace(linked, output_path)
    return output_path
