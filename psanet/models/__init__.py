"""Model components; importing registers them in paddleseg's manager.MODELS."""
from .psanet import PSAHead, PSANet

__all__ = ['PSANet', 'PSAHead']
