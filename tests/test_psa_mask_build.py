"""Building the PSA mask op: the CUDA source compiles, first loads share one build,
and a missing compiler gives one clear error.

The build tests start fresh Python processes with an empty cache folder, so
each costs one real build of the library (about 15-30 s).
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import paddle
import pytest

from test_psa_mask import reference_forward

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = os.path.join(REPO, 'ops')
BUILD_LINE = 'building the psa_mask op'


def find_nvcc():
    for candidate in (shutil.which('nvcc'), '/usr/local/cuda/bin/nvcc'):
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


def test_cuda_source_compiles(tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip('nvcc not found (neither on PATH nor /usr/local/cuda/bin)')
    include = os.path.join(os.path.dirname(paddle.__file__), 'include')
    includes = [include, os.path.join(include, 'third_party'),
                os.path.join(include, 'paddle', 'phi', 'api', 'include', 'compat'), OPS]
    command = [nvcc, '-c', os.path.join(OPS, 'psa_mask.cu'),
               '-o', str(tmp_path / 'psa_mask_cu.o'), '-DPADDLE_WITH_CUDA',
               '-DEIGEN_USE_GPU', '-DPADDLE_NO_PYTHON', '-std=c++17',
               '--expt-relaxed-constexpr', '-Xcompiler', '-fPIC']
    command += [f'-I{folder}' for folder in includes]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    assert (tmp_path / 'psa_mask_cu.o').stat().st_size > 0


def start_python(cache, script, **env):
    """A fresh interpreter in the repository, building the op into ``cache``."""
    environment = dict(os.environ, PSANET_OPS_CACHE=str(cache), PSANET_OPS_FORCE_JIT='1',
                       GLOG_minloglevel='2', **env)
    return subprocess.Popen([sys.executable, '-c', textwrap.dedent(script)], cwd=REPO,
                            env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_processes_starting_together_share_one_build(tmp_path):
    x = np.random.default_rng(0).standard_normal((2, 12, 5, 4)).astype('float32')
    np.save(tmp_path / 'x.npy', x)
    script = '''
        import numpy as np
        import paddle
        from psanet.ops import psa_mask
        x = paddle.to_tensor(np.load(r'{folder}/x.npy'))
        y = psa_mask(x, 'distribute', (3, 4), impl='custom')
        np.save(r'{folder}/y{k}.npy', y.numpy())
    '''
    cache = tmp_path / 'cache'
    processes = [start_python(cache, script.format(folder=tmp_path, k=k)) for k in range(2)]
    outputs = [process.communicate(timeout=600) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr[-3000:]
    assert sum(stderr.count(BUILD_LINE) for _, stderr in outputs) == 1, \
        [stderr for _, stderr in outputs]
    expected = reference_forward(x, 'distribute', 3, 4)
    for k in range(2):
        np.testing.assert_array_equal(np.load(tmp_path / f'y{k}.npy'), expected)


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
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report['error'] == 'RuntimeError'
    assert 'psanet-no-such-compiler' in report['message']
    assert 'Install a C++17 compiler' in report['message']
