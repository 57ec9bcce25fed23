"""The PSANet model. Importing this package registers PSANet in paddleseg's manager.MODELS
and applies psanet.compat's paddleseg fixes, as PaddleSeg's own model modules register."""
from psanet import compat

compat.require_paddleseg()
compat.apply_paddleseg_fixes()

from .psanet import PSAHead, PSANet  # noqa: E402

__all__ = ['PSANet', 'PSAHead']
