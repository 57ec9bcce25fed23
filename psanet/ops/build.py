"""Compiles the PSA mask op library (``ops/*.cc``, ``ops/*.cu``) into one ``.so``.

The same function serves ``setup.py`` (ahead of time, into the installed
package) and :mod:`psanet.ops.library` (just in time, into a cache folder keyed by
``source_hash``: the sources, Paddle, Python and, with the CUDA kernels, the
architectures chosen and nvcc's version). Both write the library atomically,
so a reader never sees a half-written file.
"""
import functools
import glob
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

LIBRARY_NAME = 'psa_mask_op'
# ops/: the headers, the C++ sources (the schema and dispatch, the CPU kernels)
# and the CUDA launchers; each source is compiled into an object of its own.
_HEADERS = ('psa_mask_common.h', 'psa_mask_kernel.h')
_CXX_SOURCES = ('psa_mask.cc', 'psa_mask_cpu.cc')
_CUDA_SOURCES = ('psa_mask.cu',)
# Architectures built when PADDLE_CUDA_ARCH_LIST is unset and Paddle sees no
# GPU, less those the installed nvcc no longer supports (CUDA 13 dropped Volta):
# Volta to Hopper, plus PTX of the newest for what comes after.
DEFAULT_CUDA_ARCHS = ('70', '75', '80', '86', '89', '90')
_ARCH_LIST_FORMS = "'8.0;9.0', '80 90', 'sm_90', '9.0+PTX' or '9.0a'"
_CHOOSE_OTHERS = 'PADDLE_CUDA_ARCH_LIST="8.0;9.0" chooses others'


def default_source_dir():
    """``ops/`` of the source checkout this package sits in."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), 'ops')


def with_cuda_default():
    import paddle
    return paddle.is_compiled_with_cuda()


def _sources(source_dir, with_cuda):
    names = list(_HEADERS + _CXX_SOURCES) + (list(_CUDA_SOURCES) if with_cuda else [])
    paths = [os.path.join(source_dir, name) for name in names]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(
            f'psa_mask op sources not found: {missing}. Run from a full source '
            'checkout of psanet, or install it with '
            '`pip install --no-build-isolation .` so the op is built ahead of time.')
    return paths


def source_hash(source_dir=None, with_cuda=None, cpu_fallback=False):
    """Hash of what the library depends on, which names its JIT cache folder.

    Always: the sources, the Paddle version, CUDA or not, the Python version.
    A CUDA build adds the architectures it would be built for (SASS and PTX,
    as :func:`selected_cuda_archs` chooses them: PADDLE_CUDA_ARCH_LIST, else the
    GPUs Paddle sees, else the defaults) and nvcc's release line, so that
    machines sharing one cache (NFS ``~/.cache``) with other GPUs, another
    PADDLE_CUDA_ARCH_LIST or another nvcc each get their own build. A CPU-only
    library on a CUDA Paddle (``cpu_fallback``: no nvcc) adds Paddle's CUDA
    version and ``nvcc=none``; once nvcc is there the key, and so the build,
    changes. On a CPU Paddle the key is the sources, the Paddle version, no CUDA
    and the Python version only.
    """
    import paddle
    source_dir = source_dir or default_source_dir()
    nvcc, _ = plan_cuda(with_cuda, cpu_fallback, quiet=True)
    digest = hashlib.sha256()
    for path in _sources(source_dir, nvcc is not None):
        with open(path, 'rb') as f:
            digest.update(os.path.basename(path).encode() + b'\0' + f.read())
    digest.update(f'paddle={paddle.__version__};cuda={nvcc is not None};'
                  f'python={sys.version_info[:2]}'.encode())
    if nvcc is not None:
        archs, ptx, _ = selected_cuda_archs(nvcc)
        digest.update(f';archs={",".join(archs)};ptx={",".join(ptx)};'
                      f'nvcc={nvcc_release(nvcc)}'.encode())
    elif with_cuda_default():
        digest.update(f';paddle_cuda={paddle.version.cuda()};nvcc=none'.encode())
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


# ------------------------------------------------------------------ CUDA

def _nvcc_candidates():
    if os.environ.get('NVCC'):
        return [os.environ['NVCC']]
    homes = [os.environ.get(v) for v in ('CUDA_HOME', 'CUDA_PATH') if os.environ.get(v)]
    return ([os.path.join(home, 'bin', 'nvcc') for home in homes]
            + ['nvcc', '/usr/local/cuda/bin/nvcc'])


def find_nvcc():
    """$NVCC; else nvcc of $CUDA_HOME or $CUDA_PATH; else on PATH; else /usr/local/cuda."""
    candidates = _nvcc_candidates()
    for candidate in candidates:
        found = shutil.which(candidate)
        if found:
            return found
    raise RuntimeError(
        f'building the psa_mask op with CUDA kernels needs nvcc, not found (looked for '
        f'{", ".join(candidates)}). Install the CUDA toolkit matching your '
        'paddlepaddle-gpu build, and put its bin/ on PATH or set CUDA_HOME.')


# What the GPU kernels of a library built without them answer (ops/psa_mask.cc).
NO_CUDA_ERROR = 'psa_mask: the op library was built without CUDA kernels'


def paddle_cuda_version():
    """The CUDA version Paddle was built with ('12.6'); None on a CPU Paddle."""
    import paddle
    version = str(paddle.version.cuda())
    return version if re.match(r'\d+\.\d+', version) else None


def no_nvcc_warning():
    """The one line said when a CUDA Paddle gets the CPU-only library for want of nvcc."""
    wanted = paddle_cuda_version()
    toolkit = f'CUDA {wanted}, as paddle.version.cuda() says' if wanted else \
        'the CUDA version of paddle.version.cuda()'
    return (f'psanet: warning: nvcc not found (looked for {", ".join(_nvcc_candidates())}), '
            'so the psa_mask op is built without its CUDA kernels: it runs on CPU tensors '
            f'only, and a GPU tensor raises "{NO_CUDA_ERROR}". For the CUDA kernels, '
            f"install the CUDA toolkit's nvcc matching this Paddle ({toolkit}) or set "
            'NVCC or CUDA_HOME to one; the next load then builds them.')


def plan_cuda(with_cuda=None, cpu_fallback=False, quiet=False):
    """Which library to build: ``(nvcc, None)`` with the CUDA kernels, ``(None, None)``
    without; ``with_cuda`` None: as ``paddle.is_compiled_with_cuda()``.

    With no nvcc to be found, CUDA kernels wanted are a RuntimeError, unless
    ``cpu_fallback`` (the JIT build: the op stays usable on the CPU, e.g. by the
    CPU predictor, on a paddlepaddle-gpu wheel, which ships no nvcc): then
    ``(None, warning)``, the warning printed to stderr unless ``quiet``.
    """
    with_cuda = with_cuda_default() if with_cuda is None else with_cuda
    if not with_cuda:
        return None, None
    try:
        return find_nvcc(), None
    except RuntimeError:
        if not cpu_fallback:
            raise
    warning = no_nvcc_warning()
    if not quiet:
        print(warning, file=sys.stderr, flush=True)
    return None, warning


@functools.lru_cache(maxsize=None)  # asked once per process
def _ask_nvcc(nvcc, flag):
    result = subprocess.run([nvcc, flag], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    return result.returncode, result.stdout


def nvcc_release(nvcc):
    """The release line of ``nvcc --version`` ('Cuda compilation tools, release 13.0,
    V13.0.88'); asked once per process."""
    returncode, output = _ask_nvcc(nvcc, '--version')
    lines = [line.strip() for line in output.splitlines() if 'release' in line]
    if returncode != 0 or not lines:
        raise RuntimeError(f'`{nvcc} --version` printed no release line:\n{output}')
    return lines[0]


def nvcc_version_warning(nvcc):
    """One line when nvcc's CUDA major version is not Paddle's; None when they match
    (or Paddle has no CUDA)."""
    wanted = paddle_cuda_version()
    match = re.search(r'release (\d+)\.(\d+)', nvcc_release(nvcc))
    if wanted is None or match is None or match.group(1) == wanted.split('.')[0]:
        return None
    return (f'psanet: warning: {nvcc} is CUDA {match.group(1)}.{match.group(2)}, but this '
            f'Paddle was built with CUDA {wanted} (paddle.version.cuda()): the op is built '
            f'anyway, but may fail to load or run; install the CUDA {wanted.split(".")[0]} '
            "toolkit's nvcc and set NVCC or CUDA_HOME to it if it does.")


def cuda_library_dirs(nvcc):
    """The folders holding ``libcudart.so`` of the CUDA toolkit that ``nvcc`` belongs to.

    Asked of nvcc itself (``--dryrun`` prints the folders it passes to its own
    linker): nvcc may be a wrapper script outside the toolkit
    (``/usr/local/bin/nvcc`` running ``/usr/local/cuda-13.0/bin/nvcc``), and the
    libraries may sit under ``targets/<platform>/lib``.
    """
    result = subprocess.run([nvcc, '--dryrun', '-c', 'psanet_probe.cu'],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    folders = []
    for line in result.stdout.splitlines():
        if line.startswith('#$ LIBRARIES='):
            folders += [flag[2:] for flag in shlex.split(line[len('#$ LIBRARIES='):])
                        if flag.startswith('-L')]
    if not folders:   # an nvcc that prints no LIBRARIES: the folders beside its bin/
        top = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        folders = [os.path.join(top, 'lib64'), os.path.join(top, 'lib')] + glob.glob(
            os.path.join(top, 'targets', '*', 'lib'))
    # lib/stubs holds a libcuda.so for linking without a driver: not wanted here.
    folders = [d for d in _existing(folders) if os.path.basename(d) != 'stubs']
    if not any(glob.glob(os.path.join(d, 'libcudart.so*')) for d in folders):
        raise RuntimeError(
            f'libcudart.so not found in the CUDA toolkit of {nvcc} (looked in: '
            f'{folders or "no library folder"}). Point CUDA_HOME (or NVCC) at a complete '
            'CUDA toolkit.')
    return folders


def _existing(folders):
    """The folders that exist, each once, in order."""
    return list(dict.fromkeys(os.path.normpath(f) for f in folders if os.path.isdir(f)))


def supported_cuda_archs(nvcc):
    """The architectures ``nvcc`` compiles for (``--list-gpu-arch``, asked once per
    process), e.g. ['75', '80']."""
    returncode, output = _ask_nvcc(nvcc, '--list-gpu-arch')
    archs = re.findall(r'^compute_(\d+)\s*$', output, re.MULTILINE)
    if returncode != 0 or not archs:
        raise RuntimeError(f'`{nvcc} --list-gpu-arch` did not list the GPU architectures '
                           f'it supports (CUDA 11 or newer is needed):\n{output}')
    return sorted(set(archs), key=int)


def visible_gpu_archs():
    """Compute capabilities of the GPUs Paddle sees, e.g. ['86']; [] on a CPU Paddle."""
    import paddle
    if not paddle.is_compiled_with_cuda():
        return []
    cuda = paddle.device.cuda
    return sorted({'%d%d' % tuple(cuda.get_device_capability(i))
                   for i in range(cuda.device_count())}, key=int)


def _parse_arch_list(text):
    """PADDLE_CUDA_ARCH_LIST ('8.0;9.0+PTX', '80 90a', 'sm_90') -> (['80', '90a'], {'90'})."""
    archs, ptx = [], set()
    for token in re.split(r'[;,\s]+', text.strip()):
        if not token:
            continue
        arch = token.lower()
        with_ptx = arch.endswith('+ptx')
        arch = re.sub(r'^(sm_|compute_)', '', arch[:-4] if with_ptx else arch)
        match = re.fullmatch(r'(\d+)\.(\d)([af]?)|(\d{2,3})([af]?)', arch)
        if match is None:
            raise ValueError(f'PADDLE_CUDA_ARCH_LIST={text!r}: {token!r} is not a CUDA '
                             f'architecture; write them as {_ARCH_LIST_FORMS}.')
        major, minor, suffix, number, number_suffix = match.groups()
        arch = (major + minor + suffix) if number is None else (number + number_suffix)
        if arch not in archs:
            archs.append(arch)
        if with_ptx:
            ptx.add(arch)
    if not archs:
        raise ValueError(f'PADDLE_CUDA_ARCH_LIST={text!r} names no architecture.')
    return archs, ptx


def _number(arch):
    return int(arch.rstrip('af'))


def _dotted(archs):
    return ' '.join(f'{_number(a) // 10}.{_number(a) % 10}{a[-1] if a[-1] in "af" else ""}'
                    for a in archs)


def select_cuda_archs(requested, supported, visible, nvcc='nvcc'):
    """Which architectures to build: ``(sass, ptx, why)``.

    ``requested`` (PADDLE_CUDA_ARCH_LIST) wins and must be ones ``supported``
    (nvcc's list) holds (else ValueError); else the ``visible`` GPUs' (a GPU
    newer than nvcc knows runs the PTX of the newest it does; one older is a
    RuntimeError); else the default list, less what ``supported`` lacks. PTX
    of the newest architecture is always embedded, so later GPUs can JIT it.
    """
    supported_numbers = {_number(a) for a in supported}
    if requested:
        archs, ptx = _parse_arch_list(requested)
        unknown = [a for a in archs if _number(a) not in supported_numbers]
        if unknown:
            raise ValueError(
                f'PADDLE_CUDA_ARCH_LIST={requested!r} asks for {_dotted(unknown)}, which '
                f'{nvcc} does not support; it supports {_dotted(supported)}.')
        why = 'as PADDLE_CUDA_ARCH_LIST asks'
    elif visible:
        oldest, newest = min(supported_numbers), max(supported_numbers)
        too_old = [a for a in visible if _number(a) < oldest]
        if too_old:
            raise RuntimeError(
                f'the GPU(s) of compute capability {_dotted(too_old)} that Paddle sees are '
                f'older than anything {nvcc} supports ({_dotted(supported)}): install a '
                'CUDA toolkit that still supports them, or set PADDLE_CUDA_ARCH_LIST.')
        archs = [a for a in visible if _number(a) in supported_numbers]
        if any(_number(a) > newest for a in visible):
            # Not yet known to this nvcc: such a GPU JITs the PTX of the newest.
            archs.append(max(supported, key=int))
        archs, ptx = sorted(set(archs), key=_number), set()
        why = f'the GPUs Paddle sees; {_CHOOSE_OTHERS}'
    else:
        archs = [a for a in DEFAULT_CUDA_ARCHS if _number(a) in supported_numbers]
        if not archs:
            raise RuntimeError(f'{nvcc} supports none of the default architectures '
                             f'({_dotted(DEFAULT_CUDA_ARCHS)}); it supports '
                             f'{_dotted(supported)}. Set PADDLE_CUDA_ARCH_LIST.')
        archs, ptx = list(archs), set()
        why = f'the defaults that {nvcc} supports; {_CHOOSE_OTHERS}'
    newest = max(archs, key=_number)
    return archs, sorted(ptx | {newest}, key=_number), why


def selected_cuda_archs(nvcc):
    """``select_cuda_archs`` for this process: PADDLE_CUDA_ARCH_LIST, nvcc's list and
    the GPUs Paddle sees (not asked when PADDLE_CUDA_ARCH_LIST is set)."""
    requested = os.environ.get('PADDLE_CUDA_ARCH_LIST')
    return select_cuda_archs(requested, supported_cuda_archs(nvcc),
                             [] if requested else visible_gpu_archs(), nvcc)


def cuda_arch_flags(nvcc):
    """nvcc's -gencode flags; prints one line saying which architectures and why."""
    archs, ptx, why = selected_cuda_archs(nvcc)
    print(f'psanet: building the CUDA kernels for {_dotted(archs)} (+PTX {_dotted(ptx)}): '
          f'{why}', file=sys.stderr, flush=True)
    return ([f'-gencode=arch=compute_{a},code=sm_{a}' for a in archs]
            + [f'-gencode=arch=compute_{a},code=compute_{a}' for a in ptx])


# ----------------------------------------------------------------- build

def paddle_core_library():
    """File name of Paddle's core library (``libpaddle.so``), which the op links.

    A Paddle-version workaround (psanet.compat.CORE_LIBRARY_NAME): only
    the private ``extension_utils._get_core_name()`` knows the name; should it
    go, the file name of the ``paddle.base.libpaddle`` module is the same.
    """
    try:
        from paddle.utils.cpp_extension import extension_utils
        return extension_utils._get_core_name()
    except (ImportError, AttributeError):
        import paddle
        return os.path.basename(paddle.base.libpaddle.__file__)


def compile_library(output_path, source_dir=None, with_cuda=None, verbose=False,
                    cpu_fallback=False):
    """Builds the op library into ``output_path`` (written atomically).

    ``with_cuda`` None: with the CUDA kernels when Paddle is compiled with CUDA.
    Without nvcc that is an error (``setup.py``: the library it installs is the
    one always loaded), unless ``cpu_fallback`` (the JIT build): then the CPU-only
    library, and one warning line on stderr (see :func:`plan_cuda`).
    """
    from paddle.utils.cpp_extension import extension_utils as eu

    source_dir = source_dir or default_source_dir()
    nvcc, _ = plan_cuda(with_cuda, cpu_fallback)
    with_cuda = nvcc is not None
    _sources(source_dir, with_cuda)   # all there, or one clear error
    cxx = _find_compiler('c++', 'CXX', 'Install a C++17 compiler (e.g. `apt install g++`).')
    # PADDLE_NO_PYTHON: the library is registered through Paddle's op registry
    # and needs no Python bindings (paddle/extension.h would include pybind.h).
    defines = ['-DPADDLE_WITH_CUSTOM_KERNEL', f'-DPADDLE_EXTENSION_NAME={LIBRARY_NAME}',
               '-D_GLIBCXX_USE_CXX11_ABI=1', '-DPADDLE_NO_PYTHON']
    includes = [f'-I{d}' for d in [source_dir] + eu.find_paddle_includes(False)
                + eu.find_python_includes()]
    lib_dirs = _existing(eu.find_paddle_libraries(False))
    cxx_defines = defines
    if with_cuda:
        # Only the .cu sees PADDLE_WITH_CUDA: under it Paddle's phi/core headers,
        # which psa_mask.cc includes, want cuBLAS and cuDNN headers that a CUDA
        # toolkit alone does not ship (Paddle 3.3.1). The C++ sources need only
        # to know that the CUDA launchers are there.
        cxx_defines = defines + ['-DPSA_MASK_WITH_CUDA']
        mismatch = nvcc_version_warning(nvcc)
        if mismatch:
            print(mismatch, file=sys.stderr, flush=True)
        lib_dirs += [d for d in cuda_library_dirs(nvcc) if d not in lib_dirs]
        gencode = cuda_arch_flags(nvcc)

    out_dir = os.path.dirname(os.path.abspath(output_path))
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix='.build-') as tmp:
        units = [(nvcc, source, ['-O3', '-std=c++17', '--expt-relaxed-constexpr',
                                 '-Xcompiler', '-fPIC', '-w'] + gencode + defines
                  + ['-DPADDLE_WITH_CUDA', '-DEIGEN_USE_GPU'] + includes)
                 for source in (_CUDA_SOURCES if with_cuda else ())]
        units += [(cxx, source, ['-O3', '-std=c++17', '-fPIC', '-w', '-pthread']
                   + cxx_defines + includes) for source in _CXX_SOURCES]
        objects = []
        for compiler, source, flags in units:
            objects.append(os.path.join(tmp, source.replace('.', '_') + '.o'))
            _run([compiler, '-c', os.path.join(source_dir, source), '-o', objects[-1]]
                 + flags, verbose)
        linked = os.path.join(tmp, LIBRARY_NAME + '.so')
        link = [cxx, '-shared', '-o', linked] + objects + [f'-L{d}' for d in lib_dirs]
        link += [f'-Wl,-rpath,{d}' for d in lib_dirs]
        link += ['-Wl,--no-as-needed', f'-l:{paddle_core_library()}', '-Wl,--as-needed',
                 '-pthread']
        if with_cuda:
            link.append('-lcudart')
        _run(link, verbose)
        os.replace(linked, output_path)
    return output_path
