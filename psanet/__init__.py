"""PSANet (Point-wise Spatial Attention Network) for PaddlePaddle and PaddleSeg."""
__version__ = '0.1.0'

# compat first: it filters Paddle's "No ccache found" warning before paddle is
# imported. Every workaround for one Paddle or paddleseg version is listed there.
from . import compat  # noqa: E402

compat.require_paddleseg()
compat.apply_paddleseg_fixes()

from . import models  # noqa: F401,E402  (registers PSANet with paddleseg)
