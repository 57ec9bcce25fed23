"""PSANet (Point-wise Spatial Attention Network) for PaddlePaddle and PaddleSeg.

Importing the package loads nothing else; ``from psanet import Segmenter`` loads
the Python API (:mod:`psanet.api`) and the deploy package at that moment, and
``Segmenter.from_config`` the model code when it is called.
``import psanet.models`` registers ``type: PSANet`` with paddleseg (for a
PaddleSeg script of one's own); every module of ours that needs the model imports it.

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


__all__ = ['Segmenter']


def __getattr__(name):
    # Lazy (PEP 562), so that `import psanet` stays light.
    if name == 'Segmenter':
        from psanet.api import Segmenter
        return Segmenter
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
