"""PSANet (Point-wise Spatial Attention Network) for PaddlePaddle and PaddleSeg.

Importing the package loads nothing else. ``import psanet.models`` registers
``type: PSANet`` with paddleseg (for a PaddleSeg script of one's own); the
engine does it where it builds a config.
"""
__version__ = '0.1.0'
