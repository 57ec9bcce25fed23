"""Every workaround for an upstream release, and every upstream name outside the public API the
project uses: a record each (``workarounds``, listed in ``WORKAROUNDS``), done in ``fixes`` and
``paddleseg_fixes`` where Python can. Importing it filters two Paddle notices and imports
neither paddle nor paddleseg (docs/design.md, "Version workarounds in one place")."""
import warnings

# Before paddle is imported: its import prints the warning (NO_CCACHE_NOTICE).
CCACHE_WARNING = 'No ccache found'
warnings.filterwarnings('ignore', message=CCACHE_WARNING, category=UserWarning,
                        module='paddle.utils.cpp_extension')
# Printed by every training forward of a BatchNorm (BATCHNORM_TRACKING_NOTICE).
BATCHNORM_NOTICE = 'When training, we now always track global mean and variance'
warnings.filterwarnings('ignore', message=BATCHNORM_NOTICE, category=UserWarning,
                        module=r'paddle\.')
# C-level stderr lines of Paddle and onnxruntime with nothing to act on (PIR_OUT_TENSOR_LINE,
# ORT_INITIALIZER_LINES), which psanet/export.py drops.
PIR_OUT_TENSOR = 'Paddle static graph(PIR) not support input out tensor'
ORT_UNUSED_INITIALIZER = 'Removing initializer'

from .workarounds import (  # noqa: E402
    AMP_STATE_API, BATCHNORM_TRACKING_NOTICE, BUILDER_YAML, CONST_CONTIGUOUS, CORE_LIBRARY_NAME,
    CPU_TENSOR_STREAM, CUSTOM_OP_CALL, ELASTIC_OWN_FAILURE, ENFORCE_NOT_MET, FREE_GPU_MEMORY,
    GATHER_AXIS_GRADIENT, JIT_SAVE_FORWARD, LOADER_SHUTDOWN, MEMORY_OPTIM, MKL_ON_AMD,
    NO_CCACHE_NOTICE, NUMPY_IN1D, ONEDNN_INT_SCALE, ONEDNN_LAYOUT_INPUT, ONEDNN_PLACEMENT,
    OP_REGISTRATION, OPTIMIZER_SCHEDULER, ORT_INITIALIZER_LINES, PADDLESEG_CALCULATE_AREA,
    PADDLESEG_CROSS_ENTROPY, PARAMETERLESS_PROGRAM, PIR_OUT_TENSOR_LINE, PLACE_KIND,
    SYNC_BATCHNORM_BACK, TO_STATIC_GLOBALS, WORKAROUNDS, Workaround, parse_version)
from .fixes import (  # noqa: E402
    ONEDNN_PLACEMENT_PASS, autocast_dtype, cityscapes_evaluator_fix, configure_inference,
    free_gpu_memory, generic_place, keep_forward, shut_down_loader)
from .paddleseg_fixes import (  # noqa: E402
    BUILDER_MESSAGE, FIXES, ORIGINALS, PADDLESEG_INSTALL, apply_paddleseg_fixes,
    cross_entropy_reduction, quiet_builder_messages, require_paddleseg)

__all__ = ['CCACHE_WARNING', 'BATCHNORM_NOTICE', 'PIR_OUT_TENSOR', 'ORT_UNUSED_INITIALIZER',
           'Workaround', 'WORKAROUNDS', 'parse_version', *(record.name for record in WORKAROUNDS),
           'ONEDNN_PLACEMENT_PASS', 'autocast_dtype', 'cityscapes_evaluator_fix',
           'configure_inference', 'free_gpu_memory', 'generic_place', 'keep_forward',
           'shut_down_loader', 'BUILDER_MESSAGE', 'FIXES', 'ORIGINALS', 'PADDLESEG_INSTALL',
           'apply_paddleseg_fixes', 'cross_entropy_reduction', 'quiet_builder_messages',
           'require_paddleseg']
