"""Building the PSA mask op: the CUDA library builds and links end to end for the
architectures chosen, the JIT cache key follows those architectures and nvcc's
version (a CPU build's key holds no architecture or nvcc), a CUDA Paddle without nvcc gets the
CPU-only library with one warning (setup.py: an error), an nvcc of another CUDA
major is one warning, first loads share one build, loading a built library
prints no ccache warning, and a missing compiler gives one clear error.

The build tests start fresh Python processes or compile into empty folders, so
each costs one real build of the library (about 10 s for the CPU library,
30-50 s for the CUDA one on two shared cores).
"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap

import numpy as np
import paddle
import pytest

from conftest import ROOT, finish, run_process
from psanet import compat
from psanet.ops import build
from psa_mask_reference import reference_forward

BUILD_LINE = 'building the psa_mask op'
ARCH_LINE = 'psanet: building the CUDA kernels for'


def find_nvcc():
    """The nvcc a CUDA build should find ($NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH,
    /usr/local/cuda/bin); None where there is none."""
    homes = [os.environ.get(v) for v in ('CUDA_HOME', 'CUDA_PATH') if os.environ.get(v)]
    candidates = [os.environ.get('NVCC')] + [os.path.join(h, 'bin', 'nvcc') for h in homes]
    candidates += [shutil.which('nvcc'), '/usr/local/cuda/bin/nvcc']
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


needs_nvcc = pytest.mark.skipif(
    find_nvcc() is None,
    reason='nvcc not found ($NVCC, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): the CUDA '
           'library cannot be built here')
needs_binutils = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ('nm', 'readelf', 'objcopy')),
    reason='binutils (nm, readelf, objcopy) not installed')


def nvcc_archs(nvcc):
    """`nvcc --list-gpu-arch`, read here independently of psanet.ops.build."""
    listing = run_process([nvcc, '--list-gpu-arch'], capture_output=True, text=True,
                          check=True).stdout
    return sorted({int(n) for n in re.findall(r'compute_(\d+)', listing)})


# ------------------------------------------------ which architectures

CUDA_13 = ['75', '80', '86', '87', '88', '89', '90', '100', '103', '110', '120', '121']
CUDA_12_4 = ['50', '52', '53', '60', '61', '62', '70', '72', '75', '80', '86', '87', '89',
             '90']


@pytest.mark.parametrize('supported, expected', [
    (CUDA_13, ['75', '80', '86', '89', '90']),        # Volta dropped
    (CUDA_12_4, ['70', '75', '80', '86', '89', '90']),
])
def test_defaults_are_those_nvcc_supports(supported, expected):
    archs, ptx, why = build.select_cuda_archs(None, supported, [])
    assert (archs, ptx) == (expected, ['90'])
    assert 'defaults' in why


def test_defaults_none_supported_is_one_clear_error():
    with pytest.raises(RuntimeError, match=r'none of the default.*supports 10\.0 12\.0'):
        build.select_cuda_archs(None, ['100', '120'], [])


@pytest.mark.parametrize('requested, archs, ptx', [
    ('9.0', ['90'], ['90']),
    ('8.0;9.0', ['80', '90'], ['90']),
    ('8.6+PTX 9.0', ['86', '90'], ['86', '90']),
    ('sm_80, 90a', ['80', '90a'], ['90a']),
    ('12.0', ['120'], ['120']),
])
def test_arch_list_overrides_the_defaults_and_the_gpus(requested, archs, ptx):
    assert build.select_cuda_archs(requested, CUDA_13, ['86'])[:2] == (archs, ptx)


def test_arch_list_nvcc_does_not_support_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"'7\.0;9\.0' asks for 7\.0, which nvcc does not "
                                         r"support; it supports 7\.5 8\.0 .* 12\.1\."):
        build.select_cuda_archs('7.0;9.0', CUDA_13, [])


@pytest.mark.parametrize('requested', ['hopper', '9', '9.0.1'])
def test_arch_list_that_is_no_architecture_is_rejected(requested):
    with pytest.raises(ValueError, match='is not a CUDA architecture'):
        build.select_cuda_archs(requested, CUDA_13, [])


def test_visible_gpus_choose_the_archs():
    assert build.select_cuda_archs(None, CUDA_13, ['86', '90'])[:2] == (['86', '90'], ['90'])
    # A GPU newer than nvcc knows runs the PTX of the newest it does.
    assert build.select_cuda_archs(None, CUDA_12_4, ['86', '120'])[:2] == (
        ['86', '90'], ['90'])
    with pytest.raises(RuntimeError, match=r'7\.0 that Paddle sees are older'):
        build.select_cuda_archs(None, CUDA_13, ['70', '90'])


def test_missing_nvcc_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv('NVCC', str(tmp_path / 'no-such-nvcc'))
    with pytest.raises(RuntimeError, match='needs nvcc, not found.*no-such-nvcc'):
        build.compile_library(str(tmp_path / 'op.so'), with_cuda=True)
    assert not (tmp_path / 'op.so').exists()


@needs_nvcc
def test_arch_list_the_installed_nvcc_lacks_fails_before_compiling(monkeypatch, tmp_path):
    nvcc = find_nvcc()
    unsupported = next(n for n in (35, 50, 60, 70, 999) if n not in nvcc_archs(nvcc))
    monkeypatch.setenv('NVCC', nvcc)
    monkeypatch.setenv('PADDLE_CUDA_ARCH_LIST', f'{unsupported // 10}.{unsupported % 10}')
    with pytest.raises(ValueError, match='does not support; it supports'):
        build.compile_library(str(tmp_path / 'op.so'), with_cuda=True)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------ the JIT cache key

@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    """make(release): an executable nvcc answering --version and --list-gpu-arch (CUDA
    13's list) that logs each call; a fresh per-process cache of nvcc's answers."""
    build._ask_nvcc.cache_clear()

    def make(release='13.0'):
        home = tmp_path / f'cuda-{release}'
        (home / 'bin').mkdir(parents=True)
        nvcc = home / 'bin' / 'nvcc'
        archs = '\\n'.join(f'compute_{a}' for a in CUDA_13)
        nvcc.write_text(
            '#!/bin/sh\n'
            f'echo "$*" >> "{home}/calls.log"\n'
            'case "$1" in\n'
            "  --version) printf 'nvcc: NVIDIA (R) Cuda compiler driver\\n"
            f"Cuda compilation tools, release {release}, V{release}.88\\n' ;;\n"
            f"  --list-gpu-arch) printf '{archs}\\n' ;;\n"
            '  *) exit 1 ;;\n'
            'esac\n')
        nvcc.chmod(0o755)
        return str(nvcc)
    yield make
    build._ask_nvcc.cache_clear()  # the fakes' answers go with them


def nvcc_calls(nvcc):
    log = os.path.join(os.path.dirname(os.path.dirname(nvcc)), 'calls.log')
    return open(log).read().splitlines() if os.path.exists(log) else []


def test_cuda_key_follows_the_chosen_archs_and_nvcc(fake_nvcc, monkeypatch):
    """An NFS ~/.cache shared by A100 and H100 nodes, or a new PADDLE_CUDA_ARCH_LIST,
    gets a build of its own; the same inputs keep the same key, and nvcc is asked
    once per process."""
    nvcc = fake_nvcc('13.0')
    monkeypatch.setenv('NVCC', nvcc)
    visible = ['80']
    monkeypatch.setattr(build, 'visible_gpu_archs', lambda: list(visible))

    def key(arch_list=None):
        if arch_list is None:
            monkeypatch.delenv('PADDLE_CUDA_ARCH_LIST', raising=False)
        else:
            monkeypatch.setenv('PADDLE_CUDA_ARCH_LIST', arch_list)
        return build.source_hash(with_cuda=True)

    a100 = key()
    assert key() == a100
    visible[:] = ['90']
    h100 = key()
    assert h100 != a100 and key() == h100
    assert key('8.0') == a100                 # the same SASS + PTX as the A100's
    assert len({a100, key('8.0;9.0'), key('8.0+PTX;9.0'), key('9.0a')}) == 4
    assert key('8.0;9.0') == key('80 90')      # the same choice, written otherwise
    visible[:] = []
    assert key() not in (a100, h100)           # the defaults
    assert key() != build.source_hash(with_cuda=False)
    calls = nvcc_calls(nvcc)
    assert calls.count('--version') == 1 and calls.count('--list-gpu-arch') == 1, calls

    # Another nvcc (a CUDA 12.8 node, the same GPUs): another key.
    monkeypatch.setenv('NVCC', fake_nvcc('12.8'))
    visible[:] = ['80']
    assert key() != a100


def test_cpu_key_is_as_before_and_asks_no_nvcc(fake_nvcc, monkeypatch):
    import hashlib
    import paddle
    nvcc = fake_nvcc()
    monkeypatch.setenv('NVCC', nvcc)
    monkeypatch.setenv('PADDLE_CUDA_ARCH_LIST', '8.0')
    monkeypatch.setattr(paddle, 'is_compiled_with_cuda', lambda: False)
    digest = hashlib.sha256()
    for name in ('psa_mask_common.h', 'psa_mask_kernel.h', 'psa_mask.cc', 'psa_mask_cpu.cc'):
        with open(os.path.join(ROOT, 'ops', name), 'rb') as f:
            digest.update(name.encode() + b'\0' + f.read())
    digest.update(f'paddle={paddle.__version__};cuda=False;'
                  f'python={sys.version_info[:2]}'.encode())
    assert build.source_hash() == build.source_hash(with_cuda=False) \
        == build.source_hash(cpu_fallback=True) == digest.hexdigest()[:16]
    assert nvcc_calls(nvcc) == []


def test_a_new_arch_list_rebuilds_into_its_own_folder(fake_nvcc, monkeypatch, tmp_path):
    """The loader's side: a library built for 8.0 is not reused once 9.0 is asked for."""
    from psanet.ops import library
    monkeypatch.setenv('NVCC', fake_nvcc())
    monkeypatch.setenv('PSANET_OPS_CACHE', str(tmp_path / 'cache'))
    monkeypatch.setenv('PSANET_OPS_FORCE_JIT', '1')
    monkeypatch.setattr(build, 'with_cuda_default', lambda: True)
    built = []

    def compile_library(path, **kwargs):
        built.append(path)
        open(path, 'w').close()
    monkeypatch.setattr(build, 'compile_library', compile_library)
    paths = {}
    for arch_list in ('8.0', '9.0', '8.0'):
        monkeypatch.setenv('PADDLE_CUDA_ARCH_LIST', arch_list)
        paths.setdefault(arch_list, library.library_path())
        assert library.library_path() == paths[arch_list]
    assert built == [paths['8.0'], paths['9.0']] and paths['8.0'] != paths['9.0']


# ------------------------------------ a CUDA Paddle without nvcc

def recorded_build(monkeypatch):
    """Replaces the compiler runs with a record of their commands (the link makes an
    empty library)."""
    commands = []

    def run(command, verbose):
        commands.append(command)
        if '-shared' in command:
            open(command[command.index('-o') + 1], 'w').close()
    monkeypatch.setattr(build, '_run', run)
    return commands


def warning_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith('psanet: warning')]


def test_cuda_paddle_without_nvcc_builds_the_cpu_library_with_one_warning(
        monkeypatch, tmp_path, capfd):
    import paddle
    monkeypatch.setenv('NVCC', str(tmp_path / 'no-such-nvcc'))
    monkeypatch.setattr(build, 'with_cuda_default', lambda: True)
    monkeypatch.setattr(paddle.version, 'cuda', lambda: '12.6')
    commands = recorded_build(monkeypatch)
    capfd.readouterr()
    for with_cuda in (None, True):   # as Paddle is compiled, and asked for
        commands.clear()
        build.compile_library(str(tmp_path / 'op.so'), with_cuda=with_cuda,
                              cpu_fallback=True)
        assert (tmp_path / 'op.so').exists()
        flat = [' '.join(command) for command in commands]
        assert len(flat) == 3 and not any('no-such-nvcc' in c or 'psa_mask.cu ' in c
                                          or 'PSA_MASK_WITH_CUDA' in c or '-lcudart' in c
                                          for c in flat), flat
        warnings = warning_lines(capfd.readouterr().err)
        assert len(warnings) == 1, warnings
        for part in ('nvcc not found', 'no-such-nvcc', 'without its CUDA kernels',
                     build.NO_CUDA_ERROR, "CUDA toolkit's nvcc", 'CUDA 12.6',
                     'paddle.version.cuda()', 'NVCC or CUDA_HOME'):
            assert part in warnings[0], (part, warnings[0])
    # The key of that library is neither a CPU Paddle's nor (see the key tests) a
    # CUDA library's, and computing it says nothing.
    fallback = build.source_hash(cpu_fallback=True)
    assert capfd.readouterr().err == ''
    monkeypatch.setattr(build, 'with_cuda_default', lambda: False)
    assert fallback != build.source_hash()


def test_cuda_paddle_without_nvcc_stays_an_error_for_setup_py(monkeypatch, tmp_path):
    """setup.py installs the library every later load uses: no silent CPU-only one."""
    monkeypatch.setenv('NVCC', str(tmp_path / 'no-such-nvcc'))
    monkeypatch.setattr(build, 'with_cuda_default', lambda: True)
    recorded_build(monkeypatch)
    with pytest.raises(RuntimeError, match='needs nvcc, not found'):
        build.compile_library(str(tmp_path / 'op.so'))
    assert not (tmp_path / 'op.so').exists()
    with pytest.raises(RuntimeError, match='needs nvcc, not found'):
        build.source_hash()


def test_the_warning_quotes_the_error_gpu_tensors_raise():
    """A GPU tensor given to a library built without CUDA raises, forward and backward,
    the error the no-nvcc warning names (read in the source: no GPU Paddle here)."""
    with open(os.path.join(ROOT, 'ops', 'psa_mask.cc')) as f:
        source = f.read()
    branches = re.findall(r'is_gpu\(\)\) \{\n#ifdef PSA_MASK_WITH_CUDA\n.*?\n#else\n(.*?)'
                          r'#endif', source, re.DOTALL)
    assert len(branches) == 2, branches
    for branch in branches:
        assert 'PSA_MASK_CHECK(false, kNoCudaKernels)' in branch, branch
    message, = re.findall(r'kNoCudaKernels =\s*((?:"[^"]*"\s*)+);', source)
    assert re.sub(r'"\s+"', '', message).count(build.NO_CUDA_ERROR) == 1, message


def test_cuda_paddle_without_nvcc_runs_the_op_on_the_cpu(tmp_path):
    """The whole JIT path on a (simulated) paddlepaddle-gpu with no nvcc: one warning,
    a CPU-only library in a folder of its own, and the op runs on CPU tensors."""
    script = f'''
        import numpy as np
        import paddle
        from psanet.ops import build, load_library, psa_mask
        build.with_cuda_default = lambda: True
        paddle.version.cuda = lambda: '12.6'
        x = np.random.default_rng(0).standard_normal((2, 12, 5, 4)).astype('float32')
        y = psa_mask(paddle.to_tensor(x), 'distribute', (3, 4), impl='custom')
        np.save(r'{tmp_path}/x.npy', x)
        np.save(r'{tmp_path}/y.npy', y.numpy())
        print(load_library())
        print(build.source_hash(cpu_fallback=True))
        build.with_cuda_default = lambda: False
        print(build.source_hash())
    '''
    process = start_python(tmp_path / 'cache', script, NVCC=str(tmp_path / 'no-such-nvcc'))
    stdout, stderr = finish(process, 600)
    assert process.returncode == 0, stderr[-3000:]
    library, fallback_key, cpu_key = stdout.split()[-3:]
    assert library == str(tmp_path / 'cache' / fallback_key / (build.LIBRARY_NAME + '.so'))
    assert fallback_key != cpu_key
    warnings = warning_lines(stderr)
    assert len(warnings) == 1 and 'nvcc not found' in warnings[0], stderr[-3000:]
    if shutil.which('nm'):
        defined = run_process(['nm', '-D', '--defined-only', library],
                              capture_output=True, text=True, check=True).stdout
        assert 'psa_mask_cpu_threads' in defined and 'psa_mask_cuda' not in defined
    np.testing.assert_array_equal(np.load(tmp_path / 'y.npy'), reference_forward(
        np.load(tmp_path / 'x.npy'), 'distribute', 3, 4))


def test_nvcc_of_another_cuda_major_is_one_warning_line(fake_nvcc, monkeypatch, tmp_path,
                                                        capfd):
    import paddle
    nvcc = fake_nvcc('13.0')
    monkeypatch.setenv('NVCC', nvcc)
    monkeypatch.setenv('PADDLE_CUDA_ARCH_LIST', '9.0')
    monkeypatch.setattr(build, 'with_cuda_default', lambda: True)
    monkeypatch.setattr(build, 'cuda_library_dirs', lambda nvcc: [])
    for paddle_cuda, expected in (('12.6', 1), ('13.0', 0), ('13.2', 0), ('False', 0)):
        monkeypatch.setattr(paddle.version, 'cuda', lambda: paddle_cuda)
        commands = recorded_build(monkeypatch)
        capfd.readouterr()
        build.compile_library(str(tmp_path / 'op.so'))
        assert commands[0][0] == nvcc and len(commands) == 4   # the build goes on
        warnings = warning_lines(capfd.readouterr().err)
        assert len(warnings) == expected, (paddle_cuda, warnings)
    monkeypatch.setattr(paddle.version, 'cuda', lambda: '12.6')
    warning = build.nvcc_version_warning(nvcc)
    for part in (nvcc, 'is CUDA 13.0', 'built with CUDA 12.6', 'paddle.version.cuda()',
                 "CUDA 12 toolkit's nvcc", 'NVCC or CUDA_HOME'):
        assert part in warning, (part, warning)
    assert '\n' not in warning


# --------------------------------------- the CUDA library, end to end

def fatbin_archs(library, tmp_path):
    """(SASS, PTX) architectures in the library's .nv_fatbin section.

    The layout cuobjdump reads: a fat binary header (magic 0xBA55ED50, u16
    version, u16 header size, u64 size), then entries (u16 kind 1 = PTX,
    2 = ELF; u16 version; u32 header size; u64 payload size; ...; u32 arch at
    offset 28) each followed by its payload.
    """
    section = tmp_path / 'nv_fatbin.bin'
    run_process(['objcopy', '-O', 'binary', '--only-section=.nv_fatbin', library,
                 str(section)], check=True)
    data = section.read_bytes()
    sass, ptx, offset = [], [], 0
    while offset + 16 <= len(data):
        magic, _, header_size, size = struct.unpack_from('<IHHQ', data, offset)
        assert magic == 0xBA55ED50, f'no fat binary at offset {offset} of .nv_fatbin'
        entry, end = offset + header_size, offset + header_size + size
        while entry < end:
            kind, _, entry_header, payload = struct.unpack_from('<HHIQ', data, entry)
            arch = struct.unpack_from('<I', data, entry + 28)[0]
            {1: ptx, 2: sass}[kind].append(arch)
            entry += entry_header + payload
        offset = end
    return sorted(set(sass)), sorted(set(ptx))


@pytest.fixture(scope='module')
def cuda_library(tmp_path_factory):
    """The CUDA-enabled library, built as setup.py builds it on paddlepaddle-gpu, with
    the default architectures; (path, the build's stderr)."""
    if find_nvcc() is None:
        pytest.skip('nvcc not found ($NVCC, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)')
    path = str(tmp_path_factory.mktemp('cuda') / (build.LIBRARY_NAME + '.so'))
    environment = dict(os.environ, GLOG_minloglevel='2')
    environment.pop('PADDLE_CUDA_ARCH_LIST', None)
    result = run_process(
        [sys.executable, '-c', 'import sys; from psanet.ops import build; '
         'build.compile_library(sys.argv[1], with_cuda=True)', path],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-5000:]
    return path, result.stderr


def expected_archs():
    """Default list & nvcc's, or the GPUs Paddle sees: (SASS, PTX) as integers."""
    import paddle
    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count():
        pytest.skip('Paddle sees GPUs: the library is built for them, not the defaults')
    supported = nvcc_archs(find_nvcc())
    sass = [int(a) for a in build.DEFAULT_CUDA_ARCHS if int(a) in supported]
    return sass, [max(sass)]


@needs_binutils
def test_cuda_library_carries_the_default_archs_nvcc_supports(cuda_library, tmp_path):
    path, stderr = cuda_library
    sass, ptx = expected_archs()
    assert fatbin_archs(path, tmp_path) == (sass, ptx)
    chosen = [line for line in stderr.splitlines() if line.startswith(ARCH_LINE)]
    dotted = ' '.join(f'{a // 10}.{a % 10}' for a in sass)
    assert len(chosen) == 1 and f'for {dotted} (+PTX {dotted.split()[-1]})' in chosen[0], \
        stderr[-3000:]


@needs_binutils
def test_cuda_library_links_the_launchers_and_cudart(cuda_library):
    path, _ = cuda_library
    defined = run_process(['nm', '-D', '-C', '--defined-only', path], capture_output=True,
                          text=True, check=True).stdout
    relocations = run_process(['readelf', '-rW', '-C', path], capture_output=True,
                              text=True, check=True).stdout
    for launcher in ('psa_mask_cuda_forward', 'psa_mask_cuda_backward'):
        assert f' T {launcher}(paddle::Tensor const&, int, int, int)' in defined, launcher
        # psa_mask.cc dispatches to it: its call goes through the PLT.
        assert re.search(rf'JUMP_SLOT .* {launcher}\(', relocations), launcher
    needed = run_process(['readelf', '-d', path], capture_output=True, text=True,
                         check=True).stdout
    assert re.search(r'NEEDED.*\[libcudart\.so\.\d+\]', needed), needed


@pytest.mark.skipif(not paddle.is_compiled_with_cuda() and compat.CPU_TENSOR_STREAM.needed(),
                    reason='the CPU build of this Paddle does not export paddle::Tensor::stream(), '
                           'which the CUDA launchers call (psanet.compat.CPU_TENSOR_STREAM)')
def test_cuda_library_loads_and_runs_the_op(cuda_library, tmp_path):
    """Every symbol resolves (RTLD_NOW), and the loader uses the library: on CPU, and
    on the GPU where Paddle sees one."""
    path, _ = cuda_library
    script = '''
        import ctypes, os, shutil, sys
        import numpy as np
        import paddle
        from psanet.ops import build, load_library, psa_mask
        folder = os.path.join(os.environ['PSANET_OPS_CACHE'], build.source_hash())
        os.makedirs(folder)
        library = os.path.join(folder, build.LIBRARY_NAME + '.so')
        shutil.copy(sys.argv[1], library)
        ctypes.CDLL(library, mode=os.RTLD_NOW)   # the loader then reuses this handle
        assert load_library() == library, load_library()
        places = ['cpu'] + (['gpu'] if paddle.device.cuda.device_count() else [])
        x = np.load(sys.argv[2])
        for place in places:
            paddle.set_device(place)
            y = psa_mask(paddle.to_tensor(x), 'distribute', (3, 4), impl='custom')
            np.save(os.path.join(os.path.dirname(sys.argv[2]), place + '.npy'), y.numpy())
        print(' '.join(places))
    '''
    x = np.random.default_rng(0).standard_normal((2, 12, 5, 4)).astype('float32')
    np.save(tmp_path / 'x.npy', x)
    environment = dict(os.environ, PSANET_OPS_CACHE=str(tmp_path / 'cache'),
                       PSANET_OPS_FORCE_JIT='1', GLOG_minloglevel='2')
    result = run_process([sys.executable, '-c', textwrap.dedent(script), path,
                          str(tmp_path / 'x.npy')], cwd=ROOT, env=environment,
                         capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert BUILD_LINE not in result.stderr
    expected = reference_forward(x, 'distribute', 3, 4)
    for place in result.stdout.split():
        np.testing.assert_array_equal(np.load(tmp_path / f'{place}.npy'), expected,
                                      err_msg=place)


# ------------------------------------------------ the CPU library

def start_python(cache, script, **env):
    """A fresh interpreter in the repository, building the op into ``cache``."""
    environment = dict(os.environ, PSANET_OPS_CACHE=str(cache), PSANET_OPS_FORCE_JIT='1',
                       GLOG_minloglevel='2', **env)
    return subprocess.Popen([sys.executable, '-c', textwrap.dedent(script)], cwd=ROOT,
                            env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.fixture(scope='module')
def shared_build(tmp_path_factory):
    """Two processes start together on an empty cache: (cache, x, their stderr)."""
    folder = tmp_path_factory.mktemp('shared')
    x = np.random.default_rng(0).standard_normal((2, 12, 5, 4)).astype('float32')
    np.save(folder / 'x.npy', x)
    script = '''
        import numpy as np
        import paddle
        from psanet.ops import psa_mask
        x = paddle.to_tensor(np.load(r'{folder}/x.npy'))
        y = psa_mask(x, 'distribute', (3, 4), impl='custom')
        np.save(r'{folder}/y{k}.npy', y.numpy())
    '''
    cache = folder / 'cache'
    processes = [start_python(cache, script.format(folder=folder, k=k)) for k in range(2)]
    outputs = [finish(process, 600) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr[-3000:]
    return folder, x, [stderr for _, stderr in outputs]


def test_processes_starting_together_share_one_build(shared_build):
    folder, x, stderrs = shared_build
    assert sum(stderr.count(BUILD_LINE) for stderr in stderrs) == 1, stderrs
    expected = reference_forward(x, 'distribute', 3, 4)
    for k in range(2):
        np.testing.assert_array_equal(np.load(folder / f'y{k}.npy'), expected)


def test_loading_a_built_library_prints_nothing(shared_build):
    """No build line. (Paddle's "No ccache found" notice is psanet.compat's to filter, which
    the op package does not import: tests/test_compat.py.)"""
    folder, _, _ = shared_build
    process = start_python(folder / 'cache',
                           'from psanet.ops import load_library; print(load_library())')
    stdout, stderr = finish(process, 300)
    assert process.returncode == 0, stderr[-3000:]
    assert stdout.strip().startswith(str(folder / 'cache')), stdout
    assert BUILD_LINE not in stderr, stderr


def test_missing_compiler_is_one_clear_error(tmp_path):
    script = '''
        import json
        from psanet.ops import load_library
        try:
            load_library()
            print(json.dumps({'error': None}))
        except Exception as error:
            print(json.dumps({'error': type(error).__name__, 'message': str(error)}))
    '''
    process = start_python(tmp_path / 'cache', script, CXX='psanet-no-such-compiler')
    stdout, stderr = finish(process, 300)
    assert process.returncode == 0, stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report['error'] == 'RuntimeError'
    assert 'psanet-no-such-compiler' in report['message']
    assert 'Install a C++17 compiler' in report['message']
