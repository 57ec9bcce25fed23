"""The PSA mask op: functional, Layer, pure-Paddle form, and its library loader."""
from .psa_mask import (BI_DIRECTIONAL, COLLECT, DISTRIBUTE, PSA_TYPE_NAMES, PSA_TYPES,
                       PSAMask, current_psa_impl, psa_impl, psa_mask,
                       psa_mask_paddle)
from .library import (load_library, psa_mask_cpu_backward_into, psa_mask_cpu_threads,
                      psa_mask_last_cpu_threads)

__all__ = ['COLLECT', 'DISTRIBUTE', 'BI_DIRECTIONAL', 'PSA_TYPE_NAMES', 'PSA_TYPES',
           'PSAMask', 'current_psa_impl', 'psa_impl', 'psa_mask', 'psa_mask_paddle',
           'load_library', 'psa_mask_cpu_backward_into', 'psa_mask_cpu_threads',
           'psa_mask_last_cpu_threads']
