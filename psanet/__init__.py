"""PSANet (Point-wise Spatial Attention Network) for PaddlePaddle and PaddleSeg.

Importing the package loads nothing else; ``from psanet import Segmenter`` loads
the deploy runtime (:mod:`psanet.deploy.segmenter`) at that moment.
``import psanet.models`` registers ``type: PSANet`` with paddleseg (for a PaddleSeg script of one's own); the
engine does it where it builds a config.
"""
__version__ = '0.1.0'

__all__ = ['Segmenter']


def __getattr__(name):
    # Lazy (PEP 562), so that `import psanet` stays light.
    if name == 'Segmenter':
        from psanet.deploy.segmenter import Segmenter
        return Segmenter
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
