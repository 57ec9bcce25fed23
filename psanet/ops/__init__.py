"""The PSA mask op: functional, Layer, pure-Paddle form, and its library loader."""
from .psa_mask import PSA_TYPES, PSAMask, psa_impl, psa_mask, psa_mask_paddle
from .loader import load_library

__all__ = ['PSA_TYPES', 'PSAMask', 'psa_impl', 'psa_mask', 'psa_mask_paddle',
           'load_library']
