"""PSANet (Point-wise Spatial Attention Network) for PaddlePaddle and PaddleSeg.

Importing the package loads nothing else; ``from psanet import Segmenter`` loads
the Python API (:mod:`psanet.api`) and the deploy package at that moment, and
``Segmenter.from_config`` the model code when it is called.
``import psanet.models`` registers ``type: PSANet`` with paddleseg (for a
PaddleSeg script of one's own); every module of ours that needs the model imports it.
On a Linux AMD CPU with AVX2 the import sets ``MKL_DEBUG_CPU_TYPE=5`` unless it is set, for
Paddle's MKL to run its AVX2 path (psanet.compat.MKL_ON_AMD).

A Paddle below the supported range stops the import with one line saying what
to install: its version is read from the installed package's metadata, because
importing Paddle 2.x itself can crash the process (its libpaddle.so exports its
own zlib, which numpy's random, scipy and OpenCV then call).
"""
__version__ = '0.1.0'

PADDLE_RANGE = 'paddlepaddle>=3.0 (tested: 3.0.0 to 3.3.1)'
PADDLE_INSTALL = ('CPU: pip install paddlepaddle==3.3.1; GPU (CUDA 12.6; cu118, cu129 for '
                  'others): pip install paddlepaddle-gpu==3.3.1 -i '
                  'https://www.paddlepaddle.org.cn/packages/stable/cu126/')


def _paddle_below_range():
    """'paddlepaddle 2.6.2' for an installed Paddle below 3.0, else None (none installed,
    or a develop build, which reports 0.0.0)."""
    import re
    from importlib import metadata
    for name in ('paddlepaddle', 'paddlepaddle-gpu'):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        major = [int(n) for n in re.findall(r'\d+', version)[:3]]
        if any(major) and major[0] < 3:
            return f'{name} {version}'
    return None


def _stop_below_range():
    found = _paddle_below_range()
    if found is not None:
        import sys
        sys.stderr.write(f'psanet needs {PADDLE_RANGE}, found {found}: {PADDLE_INSTALL}\n')
        raise SystemExit(2)


_stop_below_range()


def amd_cpu_with_avx2(cpuinfo='/proc/cpuinfo'):
    """True on a Linux AMD processor with AVX2 and FMA (read from ``cpuinfo``)."""
    vendor = flags = None
    try:
        with open(cpuinfo, encoding='ascii', errors='replace') as lines:
            for line in lines:
                key, _, value = line.partition(':')
                key = key.strip()
                if key == 'vendor_id':
                    vendor = value.strip()
                elif key == 'flags':
                    flags = value.split()
                if vendor is not None and flags is not None:
                    break
    except OSError:  # not Linux
        return False
    return vendor == 'AuthenticAMD' and flags is not None and {'avx2', 'fma'} <= set(flags)


def mkl_avx2_on_amd(environ=None, cpuinfo='/proc/cpuinfo'):
    """Sets MKL_DEBUG_CPU_TYPE=5 on an AMD CPU with AVX2 unless it is set: the MKL in
    Paddle's wheels otherwise runs its generic path there (psanet.compat.MKL_ON_AMD).
    Returns True when it set it. MKL reads it at its first call: paddle imported before
    psanet is fine, a matmul run before it is not."""
    import os
    environ = os.environ if environ is None else environ
    if 'MKL_DEBUG_CPU_TYPE' in environ or not amd_cpu_with_avx2(cpuinfo):
        return False
    environ['MKL_DEBUG_CPU_TYPE'] = '5'
    return True


mkl_avx2_on_amd()


__all__ = ['Segmenter']


def __getattr__(name):
    # Lazy (PEP 562), so that `import psanet` stays light.
    if name == 'Segmenter':
        from psanet.api import Segmenter
        return Segmenter
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
