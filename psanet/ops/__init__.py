"""The PSA mask op: functional, Layer, pure-Paddle form, and its library loader."""
from .psa_mask import PSA_TYPES, PSAMask, psa_impl, psa_mask, psa_mask_paddle
from .loader import load_library, psa_mask_cpu_threads, psa_mask_last_cpu_threads

__all__ = ['PSA_TYPES', 'PSAMask', 'psa_impl', 'psa_mask', 'psa_mask_paddle',
           'load_library', 'psa_mask_cpu_threads', 'psa_mask_last_cpu_threads']
