"""What the Paddle and numpy records of psanet.compat do where Python can: each function names
its record. Paddle is imported inside the functions only."""
import contextlib

from .workarounds import (AMP_STATE_API, FREE_GPU_MEMORY, JIT_SAVE_FORWARD, MEMORY_OPTIM,
                          ONEDNN_PLACEMENT, PLACE_KIND)

__all__ = ['ONEDNN_PLACEMENT_PASS', 'autocast_dtype', 'generic_place', 'free_gpu_memory',
           'keep_forward', 'shut_down_loader', 'configure_inference', 'cityscapes_evaluator_fix']

ONEDNN_PLACEMENT_PASS = 'onednn_placement_pass'


# ----------------------------------------------------------------- dygraph state

def autocast_dtype():
    """The dtype name autocast computes in ('float16', 'bfloat16'), or None when it is off
    (AMP_STATE_API)."""
    import paddle
    if not AMP_STATE_API.needed():
        return paddle.amp.get_autocast_dtype() if paddle.amp.is_autocast_enabled() else None
    from paddle.base import core
    from paddle.base.framework import _dygraph_tracer
    state = _dygraph_tracer() if paddle.in_dynamic_mode() else core._get_amp_attrs()
    if state is None or state._amp_level == core.AmpLevel.O0:
        return None
    return state._amp_dtype


def generic_place(place=None):
    """``place`` (default: the default device) as a generic ``paddle.base.core.Place``
    (PLACE_KIND), which has ``is_gpu_place()``, ``is_cpu_place()`` and ``gpu_device_id()``."""
    import paddle
    place = place if place is not None else paddle.framework._current_expected_place()
    if not PLACE_KIND.needed() or hasattr(place, 'is_gpu_place'):
        return place
    generic = paddle.base.core.Place()
    generic.set_place(place)
    return generic


def free_gpu_memory(device):
    """Bytes free on GPU ``device`` as CUDA reports them (FREE_GPU_MEMORY); Paddle 3.0 to 3.2
    read the current device."""
    import paddle
    if not FREE_GPU_MEMORY.needed():
        return int(paddle.cuda.mem_get_info(device)[0])
    return int(paddle.base.core.gpu_memory_available())


@contextlib.contextmanager
def keep_forward(layer):
    """Puts ``layer.forward`` back as it was after a ``paddle.jit.save`` in the block
    (JIT_SAVE_FORWARD)."""
    missing = object()
    before = layer.__dict__.get('forward', missing)
    try:
        yield layer
    finally:
        if JIT_SAVE_FORWARD.needed():
            if before is missing:
                layer.__dict__.pop('forward', None)
            else:
                layer.__dict__['forward'] = before


# ----------------------------------------------------------------- data loading

def shut_down_loader(iterator, timeout=5.0):
    """Ends the worker processes and thread of a DataLoader iterator left early, waiting
    ``timeout`` seconds for each worker (LOADER_SHUTDOWN)."""
    shut_down = getattr(iterator, '_try_shutdown_all', None)
    if shut_down is None:
        return
    try:
        shut_down(timeout)
    except TypeError:  # the single-process iterator takes no timeout
        shut_down()


# ----------------------------------------------------------------- inference

def configure_inference(config):
    """Applies every Paddle-version workaround a ``paddle.inference.Config`` needs, in place,
    and returns it. Call it after choosing the device and oneDNN, just before
    ``create_predictor``: what it does depends on them (MEMORY_OPTIM, ONEDNN_PLACEMENT)."""
    config.enable_memory_optim(not MEMORY_OPTIM.needed())
    if config.mkldnn_enabled() and ONEDNN_PLACEMENT.needed():
        config.delete_pass(ONEDNN_PLACEMENT_PASS)
    return config


# ----------------------------------------------------------------- cityscapesScripts

def _in1d(ar1, ar2, assume_unique=False, invert=False):
    """numpy < 2.4's ``in1d``: ``isin`` flattened."""
    import numpy
    return numpy.isin(ar1, ar2, assume_unique=assume_unique, invert=invert).ravel()


def cityscapes_evaluator_fix():
    """Gives numpy its ``in1d`` back for cityscapesScripts' evaluators (NUMPY_IN1D); call it
    only in the evaluator's process. Returns True when numpy lacked it."""
    import numpy
    if hasattr(numpy, 'in1d'):
        return False
    numpy.in1d = _in1d
    return True
