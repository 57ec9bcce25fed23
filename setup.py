"""Installs the psanet package and builds the PSA mask op library ahead of time.

    pip install --no-build-isolation .      # Paddle must be importable while building

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


class BuildPyWithOp(build_py):
    """Copies the Python files, then compiles ops/ into psanet/ops/psa_mask_op.so."""

    def run(self):
        super().run()
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
    python_requires='>=3.8',
    install_requires=['paddleseg==2.8.0', 'numpy<2', 'opencv-python<=4.6.0.66', 'Pillow', 'pyyaml',
                      'cityscapesScripts>=2.2'],
    cmdclass={'build_py': BuildPyWithOp},
    distclass=BinaryDistribution,
    zip_safe=False,
)
