"""`pip install --no-build-isolation .` builds the op ahead of time into the package,
and the installed package uses that library (no JIT build, no source checkout)."""
import glob
import os
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

from conftest import ROOT, run_process

CHECK = r'''
import numpy as np, paddle, sys
import psanet.ops as ops
from psanet.ops import load_library, psa_mask
path = load_library()
assert path.startswith(sys.argv[1]), path
x = paddle.randn([2, 15, 4, 6])
for psa_type in ('collect', 'distribute'):
    custom = psa_mask(x, psa_type, (3, 5)).numpy()
    pure = psa_mask(x, psa_type, (3, 5), impl='paddle').numpy()
    assert np.array_equal(custom, pure), psa_type
print('installed op:', path)
'''


@pytest.mark.skipif(not any(os.access(os.path.join(d, 'c++'), os.X_OK)
                            for d in os.environ.get('PATH', '').split(os.pathsep)),
                    reason='no C++ compiler on PATH')
def test_wheel_carries_the_op_and_the_installed_package_uses_it(tmp_path):
    wheels = tmp_path / 'wheels'
    run_process([sys.executable, '-m', 'pip', 'wheel', '--no-build-isolation', '--no-deps',
                 '-q', '-w', str(wheels), ROOT], check=True, cwd=tmp_path)
    wheel, = glob.glob(str(wheels / 'psanet-*.whl'))
    # setuptools < 65 files a wheel with extension modules under psanet-*.data/purelib/,
    # which pip installs to the same place.
    names = [re.sub(r'^psanet-[^/]+\.data/(purelib|platlib)/', '', name)
             for name in zipfile.ZipFile(wheel).namelist()]
    assert 'psanet/ops/psa_mask_op.so' in names
    assert 'psanet/models/psanet.py' in names
    # The server's page, which is no Python module: package_data carries it.
    assert {'psanet/serve/explorer/index.html', 'psanet/serve/explorer/explorer.js',
            'psanet/serve/explorer/explorer.css'} <= set(names)
    # The license and the notice, in the metadata (under licenses/ from metadata 2.4).
    for name in ('LICENSE', 'NOTICE'):
        assert [n for n in names if re.fullmatch(rf'psanet-[^/]+\.dist-info/(licenses/)?{name}', n)]

    site = tmp_path / 'site'
    run_process([sys.executable, '-m', 'pip', 'install', '--no-deps', '-q', '--target',
                 str(site), wheel], check=True, cwd=tmp_path)
    env = dict(os.environ, PYTHONPATH=str(site), PSANET_OPS_CACHE=str(tmp_path / 'no-cache'))
    env.pop('PSANET_OPS_FORCE_JIT', None)
    result = run_process([sys.executable, '-c', CHECK, str(site)], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'building the psa_mask op' not in result.stderr
    assert not (tmp_path / 'no-cache').exists()


def _installed_psanet():
    """What installs psanet in this venv's site-packages: a wheel's or a PEP 660 editable
    install's dist-info, or a legacy ``setup.py develop`` egg-link (not the egg-info an
    editable install leaves in the checkout, which the tests' sys.path sees too); or None."""
    import sysconfig
    folders = {sysconfig.get_paths()[key] for key in ('purelib', 'platlib')}
    return next((path for folder in sorted(folders) for pattern in
                 ('psanet-*.dist-info', 'psanet.egg-link', 'psanet-*.egg-info')
                 for path in glob.glob(os.path.join(folder, pattern))), None)


@pytest.mark.skipif(_installed_psanet() is None,
                    reason='psanet is not installed in this venv (scripts/setup_env.sh '
                    'installs it editable; a plain `pytest` from the checkout runs without)')
def test_the_installed_package_imports_from_any_folder(tmp_path):
    # What scripts/setup_env.sh promises: `from psanet import Segmenter` outside the
    # repository, with nothing on PYTHONPATH and another folder as the working directory.
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    code = 'import psanet; from psanet import Segmenter; print(psanet.__file__)'
    result = run_process([sys.executable, '-c', code], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert result.returncode == 0, result.stderr
    found = os.path.realpath(result.stdout.strip().splitlines()[-1])
    editable = os.path.realpath(os.path.join(ROOT, 'psanet', '__init__.py'))
    assert found == editable or 'site-packages' in found, found


def test_the_sdist_carries_the_license_and_the_notice(tmp_path):
    run_process([sys.executable, 'setup.py', '-q', 'egg_info', '--egg-base', str(tmp_path),
                 'sdist', '-d', str(tmp_path / 'dist')], check=True, cwd=ROOT,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sdist, = glob.glob(str(tmp_path / 'dist' / 'psanet-*.tar.gz'))
    with tarfile.open(sdist) as archive:
        names = {name.split('/', 1)[1] for name in archive.getnames() if '/' in name}
    assert {'LICENSE', 'NOTICE'} <= names
    with open(os.path.join(ROOT, 'LICENSE')) as f:
        assert 'Apache License\n                           Version 2.0' in f.read(200)


def _requirement_names():
    names = set()
    for path in glob.glob(os.path.join(ROOT, 'requirements*.txt')):
        with open(path) as f:
            for line in f:
                name = re.match(r'[A-Za-z0-9_.-]+', line.split('#')[0].strip())
                if name and not line.startswith('-'):
                    names.add(name.group())
    return names


def test_notice_names_every_requirement_with_its_license():
    with open(os.path.join(ROOT, 'NOTICE')) as f:
        listed = {m.group(1).lower() for m in re.finditer(r'^  (\S+)\s+(\S+)', f.read(), re.M)}
    assert {'paddlepaddle', 'paddleseg', 'cityscapesscripts', 'opencv-python'} <= listed
    assert not {name for name in _requirement_names() if name.lower() not in listed}
