"""Model components; importing registers them in paddleseg's manager.MODELS."""
from .psanet import ArgumentError, PSAHead, PSANet

__all__ = ['PSANet', 'PSAHead', 'ArgumentError']
