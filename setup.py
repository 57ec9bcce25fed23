"""Installs the psanet package and builds the PSA mask op library ahead of time.

    pip install --no-build-isolation .      # Paddle must be importable while building
    pip install --no-build-isolation --no-deps -e .   # this checkout, op built just in time

On a CUDA build of Paddle (paddle.is_compiled_with_cuda()) the CUDA kernels are
built too, for the GPUs Paddle sees, else for Volta to Hopper less what the
installed nvcc no longer supports; PADDLE_CUDA_ARCH_LIST="8.0;9.0" chooses.
"""
import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))


def _requirements(name):
    with open(os.path.join(HERE, name)) as f:
        lines = (line.split('#')[0].strip() for line in f)
        return [line for line in lines if line and line not in ('setuptools', 'wheel')]


class BuildPyWithOp(build_py):
    """Copies the Python files, then compiles ops/ into psanet/ops/psa_mask_op.so."""

    def run(self):
        super().run()
        if getattr(self, 'editable_mode', False):
            # `pip install -e .` imports psanet from this checkout, where a library would
            # serve every venv and Paddle using it: the op stays the JIT build, cached per
            # Paddle and Python version (docs/build.md).
            print('editable install: the psa_mask op is built just in time into its cache')
            return
        sys.path.insert(0, HERE)
        from psanet.ops import build
        target = os.path.join(self.build_lib, 'psanet', 'ops', build.LIBRARY_NAME + '.so')
        print(f'building the psa_mask op into {target}')
        build.compile_library(target, source_dir=os.path.join(HERE, 'ops'))


class BinaryDistribution(Distribution):
    """The wheel carries a compiled library: tag it for this platform."""

    def has_ext_modules(self):
        return True


setup(
    name='psanet',
    version='0.1.0',
    description='PSANet (point-wise spatial attention) for PaddlePaddle / PaddleSeg',
    packages=find_packages(include=['psanet', 'psanet.*']),
    # The server's explorer page (serve.py, /explorer/): its HTML, script and style.
    package_data={'psanet.serve': ['explorer/*']},
    python_requires='>=3.9',
    license_files=['LICENSE', 'NOTICE'],  # into the wheel's metadata and the sdist
    # requirements.txt: what psanet and paddleseg 2.8.0 import. paddleseg itself is not
    # listed, as its declared opencv-python<=4.6 pin forces numpy<2: install it with
    # `pip install --no-deps -r requirements-paddleseg.txt` (README, Install).
    # Paddle (paddlepaddle>=3.0, or paddlepaddle-gpu>=3.0 from Paddle's index; tested 3.0.0
    # to 3.3.1) is not listed either: the build imports it, so it is installed first, and
    # pip would put the CPU package beside the GPU one. `import psanet` checks the range.
    install_requires=_requirements('requirements.txt'),
    cmdclass={'build_py': BuildPyWithOp},
    distclass=BinaryDistribution,
    zip_safe=False,
)
