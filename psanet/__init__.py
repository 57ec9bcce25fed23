"""PSANet (Point-wise Spatial Attention Network) for PaddlePaddle and PaddleSeg."""
__version__ = '0.1.0'
