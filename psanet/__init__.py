"""PSANet (Point-wise Spatial Attention Network) for PaddlePaddle and PaddleSeg."""
import warnings

__version__ = '0.1.0'

# Every `import paddle` of Paddle 3.x warns "No ccache found" (paddle.utils imports
# cpp_extension, which looks for ccache when imported), printed before every real
# error of our tools; ccache only matters when compiling, and the op build does
# without it. https://github.com/PaddlePaddle/Paddle/issues/75836 (3.0 to 3.3.1)
warnings.filterwarnings('ignore', message='No ccache found', category=UserWarning,
                        module='paddle.utils.cpp_extension')

from . import compat  # noqa: F401,E402  (fixes paddleseg 2.8.0 on Paddle 3)
from . import models  # noqa: F401,E402  (registers PSANet with paddleseg)
