"""PSANet (Point-wise Spatial Attention Network) for PaddlePaddle and PaddleSeg."""
__version__ = '0.1.0'

from . import compat  # noqa: F401,E402  (fixes paddleseg 2.8.0 on Paddle 3)
from . import models  # noqa: F401,E402  (registers PSANet with paddleseg)
