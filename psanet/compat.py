"""Every workaround for one Paddle or paddleseg version: listed here, done here where Python can.

Each entry: what breaks and what is done; the upstream issue; the versions
that need it; the check that turns it off; where it lives.

1. "No ccache found": every ``import paddle`` warns it (cpp_extension looks for ccache),
   before every real error of our tools; the op build does without ccache. Ignored.
   Paddle #75836. Paddle 3.0 to 3.3.1 at least. No check: a filter for a warning that
   is not printed does nothing. Here (``CCACHE_WARNING``, filtered on import:
   psanet.cli, psanet.core and psanet.models import this module first).
2. ``enable_memory_optim()`` fails predictor creation for PIR programs ("Not
   find predictor_id 0 and pass_name memory_optimize_pass"). Left off.
   Paddle #75496, open. Paddle >= 3.0. ``MEMORY_OPTIM.needed()``; where not
   needed, memory reuse is turned on. ``configure_inference``.
3. With oneDNN on, a saved ``bilinear_interp`` cannot run as a oneDNN kernel: Paddle
   3.3 refuses it ("ConvertPirAttribute2RuntimeAttribute not support
   ArrayAttribute<DoubleAttribute>"), 3.0 to 3.2 run it ignoring ``align_corners=True``,
   a silently wrong output (logits off by 8 in the mini PSANet).
   ``onednn_placement_pass`` is deleted: the fused convolutions still run in oneDNN,
   the other ops take their plain kernels. Paddle #79749, open. Paddle >= 3.0 (3.0.0,
   3.1.1, 3.2.2, 3.3.1 measured). ``ONEDNN_PLACEMENT.needed()``. ``configure_inference``.
   The deletion also keeps the pure-Paddle PSA op's ``pad`` off oneDNN's pad kernel,
   which crashes the process or pads the wrong axes there (3.3.1; tests/test_compat.py).
4. The CPU predictor with oneDNN hands a custom op its input in oneDNN's
   blocked layout, with no reorder in front as for built-in ops. The op
   reorders it with Paddle's ``TransDataLayoutFromOneDNN``, declared by hand
   (its header needs oneDNN headers) and weak. None filed. Paddle 3.x with
   oneDNN. No check: it acts on oneDNN-layout input only. ops/psa_mask.cc,
   the block at its top.
5. The inference executor reports ``PD_CHECK``'s exception as a bare "std::exception".
   The op throws Paddle's ``EnforceNotMet`` (InvalidArgument; External for a failed CUDA
   launch), built by hand. None filed. Paddle 3.x. No check: it is Paddle's own error
   type. ops/psa_mask_common.h (``PSA_MASK_CHECK``); ops/psa_mask.cc, at its top.
6. Only a private function, ``extension_utils._get_core_name()``, knows the name of
   Paddle's core library, which the op links. No public API. Paddle 3.x (libpaddle.so).
   A fallback, not a version: the file name of the ``paddle.base.libpaddle`` module.
   ``paddle_core_library()`` in psanet/ops/build.py (psanet/ops imports nothing of ours).
7. A built op library is registered with ``load_op_meta_info_and_register_op``:
   undocumented, not in ``cpp_extension.__all__``, but what the stubs of Paddle's own
   ``cpp_extension.setup`` call. No public API. Paddle 3.x. A fallback, not a version:
   the same function in ``extension_utils``. ``register_op_library()``, ops/library.py.
8. paddleseg 2.8.0's ``CrossEntropyLoss._post_process_loss`` mixes int64 and
   float32 operands, which Paddle 3 no longer promotes. None filed. Paddle >=
   3.0 with paddleseg 2.8.0. ``PADDLESEG_CROSS_ENTROPY.needed()``: only on
   paddleseg 2.8.0, whose code it patches. ``cross_entropy_post_process_loss``,
   applied by ``apply_paddleseg_fixes``.
9. paddleseg 2.8.0's ``metrics.calculate_area`` concatenates 0-D tensors,
   which Paddle >= 2.6 refuses. PaddleSeg #3556. Paddle >= 2.6 with
   paddleseg 2.8.0. ``PADDLESEG_CALCULATE_AREA.needed()``: only on paddleseg
   2.8.0. ``calculate_area``, applied by ``apply_paddleseg_fixes``.
10. A DataLoader iterator left before its end (an exception, a signal) is never shut
   down: its reader thread refers to it, so its ``__del__`` does not run, and at exit
   Paddle shuts down only the last loader; its workers and thread live on (an
   interrupted run waits for them or leaves their shared memory in /dev/shm).
   ``shut_down_loader`` calls the iterator's private ``_try_shutdown_all``. None
   filed. Paddle 3.x (3.3.1). No check: it does what the end of an epoch does.
   psanet/core/data_loader.py.
11. cityscapesScripts (2.3.0, the newest) calls ``np.in1d``, which numpy 2.4
   removed: its evaluators fail with AttributeError. ``numpy.in1d`` is set to
   the same function on ``np.isin``, in the evaluator's process only
   (tools/evaluate_cityscapes.py). None filed. numpy >= 2.4 with
   cityscapesScripts <= 2.3.0. Check: numpy has no ``in1d``.
   ``cityscapes_evaluator_fix``; tests/test_cityscapes_evaluator.py fails once
   cityscapesScripts stops calling it.
12. ``paddle::Tensor::contiguous()`` is not ``const`` before 3.1.1, so the op's
   kernels, which take their inputs as ``const Tensor&``, did not compile. They
   call it on a copy (``paddle::Tensor(x)``, which shares the storage), which
   builds everywhere. None filed (the declaration changed in 3.1.1). Paddle 3.0.0
   to 3.1.0. ``CONST_CONTIGUOUS``, for the test only. ops/psa_mask_cpu.cc,
   ops/psa_mask.cu.
13. The backward of ``paddle.gather(x, index, axis=1)`` is wrong for every row
   of ``x`` after the first (each gets the first row's gradient). The pure-Paddle
   op gathers with ``paddle.index_select``, exact everywhere and exported to ONNX
   alike. None filed (right from 3.1.0). Paddle 3.0.0. ``GATHER_AXIS_GRADIENT``,
   for the test only. psanet/ops/psa_mask.py.
14. ``paddle.amp.is_autocast_enabled`` / ``get_autocast_dtype`` arrive in 3.2.0.
   Before, the dygraph tracer's ``_amp_level`` and ``_amp_dtype`` (the static
   program's ``core._get_amp_attrs()``) say the same, which is what the API
   reads. Paddle 3.0 to 3.1. ``AMP_STATE_API.needed()``. ``autocast_dtype``.
15. The place classes (``CPUPlace``, ``CUDAPlace``) have no ``is_gpu_place``
   before 3.1.1, only the generic ``Place`` a tensor reports; the default device
   (``_current_expected_place()``) is such a class. It is wrapped in a generic
   ``Place``. None filed. Paddle 3.0 (3.1.0 not tried). ``PLACE_KIND.needed()``.
   ``generic_place``, used by psanet/deploy/attention_memory.py.
16. ``paddle.jit.save`` of a Layer wrapping another replaces the inner Layer's
   ``forward`` with a ``WeakMethod`` on 3.0.0, so a later export of that model itself
   fails ("'WeakMethod' object has no attribute '__name__'"); it is put back after the
   save. None filed. Paddle 3.0.0. ``JIT_SAVE_FORWARD.needed()``; ``keep_forward``.
17. For the tests only: Paddle 3.0.0's predictor cannot open a program without
   parameters (it wants the ``.pdiparams`` ``jit.save`` writes only when there are
   some): the tests' programs multiply by a parameter of 1. None filed. Paddle 3.0.0.
   ``PARAMETERLESS_PROGRAM``; tests/test_psa_mask_export.py and _threads.py.
18. For the tests only: the CPU build of Paddle 3.0.0 does not export
   ``paddle::Tensor::stream()``, which the CUDA launchers call, so the op library
   with CUDA kernels built against it does not load there (paddlepaddle-gpu
   exports it). tests/test_psa_mask_build.py skips loading it. None filed.
   Paddle 3.0 CPU builds (3.1.1 exports it). ``CPU_TENSOR_STREAM``.
19. The free memory of a GPU has a public API, ``paddle.cuda.mem_get_info``,
   from 3.3 (3.3.1 has it, 3.2.2 not; 3.3.0 not tried). Before, the private
   ``paddle.base.core.gpu_memory_available()`` (GPU builds) says it for the
   current device. None filed. Paddle 3.0 to 3.2. ``FREE_GPU_MEMORY.needed()``.
   ``free_gpu_memory``, used by psanet/deploy/attention_memory.py; tests/test_memory.py
   checks the record.
20. Paddle's ``BatchNorm`` warns "When training, we now always track global
   mean and variance." at every forward in training mode
   (paddle/nn/layer/norm.py): a notice with nothing to act on, which would stand
   between the user and the one-line error of a training that stops. Ignored,
   like 1. None filed. Paddle 3.0 to 3.3.1 at least. Here (``BATCHNORM_NOTICE``,
   filtered on import); tests/test_compat.py fails once Paddle stops printing it.
21. paddleseg 2.8.0's ``SegBuilder`` logs each config section as YAML (80 lines
   at the start of train and val). ``Builder.show_msg`` becomes a no-op
   (``quiet_builder_messages``, by ``apply_paddleseg_fixes``). None filed. paddleseg
   2.8.0. tests/test_compat.py fails once paddleseg stops printing it.
22. ``paddle.add`` (paddleseg's ResNet) passes ``out=None`` to its PIR op, and
   Paddle's C++ logs "Paddle static graph(PIR) not support input out tensor" at
   every export: a parameter no one set. 23. onnxruntime's optimiser, run by
   ``quant_pre_process``, logs a coloured "Removing initializer" for each of
   paddle2onnx's shape constants its folding left unused (8 on the mini PSANet).
   Both dropped from the C-level stderr of that call (``PIR_OUT_TENSOR``,
   ``ORT_UNUSED_INITIALIZER``, with ``psanet.log.without_stderr_lines`` in
   psanet/export.py). None filed. Paddle 3.3.1, onnxruntime 1.32.0 (others not
   checked). tests/test_compat.py fails once either stops printing its line.
24. With ``--elastic_level 1`` Paddle's launcher marks itself FAILED when its own pod
   fails (``ControllerBase.watch``) and counts on an etcd watch event to make it
   RESTARTING before its next ``ETCDMaster.wait_peer_ready``: the event comes late or,
   when another node deleted the keys first, never, and the node ended instead of
   restarting (4 of 8 two-node runs). Its ``Status.fail`` restarts. None filed. Paddle
   3.3.1 (others not checked). ``ELASTIC_OWN_FAILURE.needed()``. psanet/launch.py.
25. With oneDNN on, Paddle Inference's ``operator_scale_onednn_fuse_pass`` folds a
   ``scale`` (a tensor times a Python number) into the elementwise op before it, and
   the integer kernels of those ops drop it: ``arange(3) * w * 33`` comes out
   ``arange(3) * w``. The pure-Paddle PSA op's index math multiplies integer tensors by
   tensors only (``_int64`` in psanet/ops/psa_mask.py). None filed. Paddle 3.3.1 (others
   not checked). ``ONEDNN_INT_SCALE.needed()``, for the test only.

Issues: https://github.com/PaddlePaddle/{Paddle,PaddleSeg}/issues/<n>.

Below Paddle 3.0 ``import psanet`` stops with one line saying what to install
(psanet/__init__.py), before anything imports Paddle: Paddle 2.6's libpaddle.so
exports its own zlib, and numpy, scipy and OpenCV crash or misread PNGs after it.

Importing this module filters the warnings (1, 20); ``import psanet.models`` (by
every module of ours that needs the model) says in one line what to install when
paddleseg is missing (``require_paddleseg``) and applies the paddleseg fixes (8,
9); the predictor calls ``configure_inference`` (2, 3); the engine's loaders
call ``shut_down_loader`` (10); tools/evaluate_cityscapes.py calls
``cityscapes_evaluator_fix`` (11); psanet.launch, ``restart_own_failure`` (24). The
op's own (4 to 7) live with the op, which imports nothing of ours. This module imports
nothing of ours, and paddle (to check its version) and paddleseg only inside the
functions that need them: importing it is light, even for the deploy package.

To retire a workaround once upstream fixes it, set ``fixed`` of its record to
the first good version (its check then turns it off there), and delete it
when no supported version needs it. tests/test_compat.py has, for 2, 3, 8, 9,
12 to 18 and 20 to 25 (19: tests/test_memory.py), a test that fails as soon as
this Paddle no longer needs it (or needs it where its record says not).
The gates were set from runs on Paddle 3.0.0, 3.1.1, 3.2.2 and 3.3.1. paddleseg.core
is not patched: psanet.core is the engine, on paddleseg's components.
"""
import contextlib
import re
import warnings
from typing import NamedTuple, Optional, Tuple

# 1. Before paddle is imported: its import prints the warning.
CCACHE_WARNING = 'No ccache found'
warnings.filterwarnings('ignore', message=CCACHE_WARNING, category=UserWarning,
                        module='paddle.utils.cpp_extension')
# 20. Printed by every training forward of a BatchNorm.
BATCHNORM_NOTICE = 'When training, we now always track global mean and variance'
warnings.filterwarnings('ignore', message=BATCHNORM_NOTICE, category=UserWarning,
                        module=r'paddle\.')

__all__ = ['CCACHE_WARNING', 'BATCHNORM_NOTICE', 'Workaround', 'MEMORY_OPTIM', 'ONEDNN_PLACEMENT',
           'PADDLESEG_CROSS_ENTROPY', 'PADDLESEG_CALCULATE_AREA', 'configure_inference',
           'apply_paddleseg_fixes',
           'cross_entropy_post_process_loss', 'calculate_area', 'FIXES', 'ORIGINALS',
           'shut_down_loader', 'require_paddleseg', 'PADDLESEG_INSTALL',
           'cityscapes_evaluator_fix', 'CONST_CONTIGUOUS', 'GATHER_AXIS_GRADIENT',
           'AMP_STATE_API', 'PLACE_KIND', 'JIT_SAVE_FORWARD', 'autocast_dtype',
           'generic_place', 'keep_forward', 'PARAMETERLESS_PROGRAM', 'CPU_TENSOR_STREAM',
           'FREE_GPU_MEMORY', 'free_gpu_memory', 'BUILDER_MESSAGE', 'quiet_builder_messages',
           'PIR_OUT_TENSOR', 'ORT_UNUSED_INITIALIZER', 'ONEDNN_INT_SCALE']

_ISSUES = 'https://github.com/PaddlePaddle/{}/issues/{}'


def parse_version(text):
    """'3.3.1' -> (3, 3, 1); '3.0.0rc1' -> (3, 0, 0). A develop build ('0.0.0') counts
    as newer than any release."""
    numbers = tuple(int(n) for n in re.findall(r'\d+', text.split('+')[0])[:3])
    return (10 ** 6,) if not any(numbers) else numbers


def _three(version):
    return tuple(version) + (0,) * (3 - len(version))


class Workaround(NamedTuple):
    """Where a workaround is needed: Paddle from ``first`` up to, not including,
    ``fixed`` (None: no release fixes it yet); for a fix to paddleseg, only with
    the ``paddleseg`` release whose code it patches.
    """
    issue: str
    first: Tuple[int, ...]
    fixed: Optional[Tuple[int, ...]] = None
    paddleseg: Optional[Tuple[int, ...]] = None

    def needed(self, paddle_version=None, paddleseg_version=None):
        """The version check; the versions default to those installed."""
        import paddle
        version = parse_version(paddle.__version__) if paddle_version is None \
            else paddle_version
        version = _three(version)  # (3, 1) and (3, 1, 0) are one release
        if version < _three(self.first) or (self.fixed is not None and
                                             version >= _three(self.fixed)):
            return False
        if self.paddleseg is None:
            return True
        if paddleseg_version is None:
            import paddleseg
            paddleseg_version = parse_version(paddleseg.__version__)
        return paddleseg_version == self.paddleseg


MEMORY_OPTIM = Workaround(_ISSUES.format('Paddle', 75496), first=(3, 0))
ONEDNN_PLACEMENT = Workaround(_ISSUES.format('Paddle', 79749), first=(3, 0))
ONEDNN_PLACEMENT_PASS = 'onednn_placement_pass'
CONST_CONTIGUOUS = Workaround('none filed', first=(3, 0), fixed=(3, 1, 1))
GATHER_AXIS_GRADIENT = Workaround('none filed', first=(3, 0), fixed=(3, 1))
AMP_STATE_API = Workaround('none filed', first=(3, 0), fixed=(3, 2))
PLACE_KIND = Workaround('none filed', first=(3, 0), fixed=(3, 1, 1))
JIT_SAVE_FORWARD = Workaround('none filed', first=(3, 0), fixed=(3, 1))
PARAMETERLESS_PROGRAM = Workaround('none filed', first=(3, 0), fixed=(3, 1))
CPU_TENSOR_STREAM = Workaround('none filed', first=(3, 0), fixed=(3, 1))
FREE_GPU_MEMORY = Workaround('none filed', first=(3, 0), fixed=(3, 3))
ELASTIC_OWN_FAILURE = Workaround('none filed', first=(3, 0))
ONEDNN_INT_SCALE = Workaround('none filed', first=(3, 0))
PADDLESEG_CROSS_ENTROPY = Workaround('none filed', first=(3, 0), paddleseg=(2, 8, 0))
PADDLESEG_CALCULATE_AREA = Workaround(_ISSUES.format('PaddleSeg', 3556), first=(2, 6),
                                      paddleseg=(2, 8, 0))


# ----------------------------------------------------------------- dygraph state

def autocast_dtype():
    """The dtype name autocast computes in ('float16', 'bfloat16'), or None when it is off (14)."""
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
    """``place`` (default: the default device) as a generic ``paddle.base.core.Place`` (15),
    which has ``is_gpu_place()``, ``is_cpu_place()`` and ``gpu_device_id()``."""
    import paddle
    place = place if place is not None else paddle.framework._current_expected_place()
    if not PLACE_KIND.needed() or hasattr(place, 'is_gpu_place'):
        return place
    generic = paddle.base.core.Place()
    generic.set_place(place)
    return generic


def free_gpu_memory(device):
    """Bytes free on GPU ``device`` as CUDA reports them (19); Paddle 3.0 to 3.2 read the
    current device."""
    import paddle
    if not FREE_GPU_MEMORY.needed():
        return int(paddle.cuda.mem_get_info(device)[0])
    return int(paddle.base.core.gpu_memory_available())


@contextlib.contextmanager
def keep_forward(layer):
    """Puts ``layer.forward`` back as it was after a ``paddle.jit.save`` in the block (16).

    Args:
        layer (paddle.nn.Layer): the Layer a saved wrapper calls.
    """
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
    """Ends the worker processes and thread of a DataLoader iterator left early (10).

    Args:
        iterator: what ``iter(paddle.io.DataLoader(...))`` returned.
        timeout (float, optional): seconds to wait for each worker to end. Default: 5.
    """
    shut_down = getattr(iterator, '_try_shutdown_all', None)
    if shut_down is None:
        return
    try:
        shut_down(timeout)
    except TypeError:  # the single-process iterator takes no timeout
        shut_down()


# ----------------------------------------------------------------- inference

def configure_inference(config):
    """Applies every Paddle-version workaround a ``paddle.inference.Config`` needs.

    Call it after choosing the device and oneDNN, just before
    ``create_predictor``: what it does depends on them.

    * Memory reuse (``enable_memory_optim``) stays off where it fails predictor
      creation (entry 2 above), and is on elsewhere.
    * With oneDNN on, ``onednn_placement_pass`` is deleted where a saved
      ``bilinear_interp`` cannot run in oneDNN (3).

    Args:
        config (paddle.inference.Config): the predictor's config.

    Returns:
        paddle.inference.Config: ``config``, changed in place.
    """
    config.enable_memory_optim(not MEMORY_OPTIM.needed())
    if config.mkldnn_enabled() and ONEDNN_PLACEMENT.needed():
        config.delete_pass(ONEDNN_PLACEMENT_PASS)
    return config


# ----------------------------------------------------------------- paddleseg

def cross_entropy_post_process_loss(self, logit, label, semantic_weights, loss):
    """``CrossEntropyLoss._post_process_loss`` without integer/float mixing.

    Broken in 2.8.0 on Paddle 3: ``paddle.mean(mask * coef)`` multiplies the
    float32 mask by ``coef = ones_like(label)`` (int64), and with class
    weights ``F.one_hot(label * mask, ...)`` multiplies int64 by float32; both
    raise "Type promotion only support calculations between floating-point
    numbers". Fixed by making ``coef`` float32 and the masked label int64, the
    dtypes Paddle 2.5 promoted them to implicitly; the arithmetic is otherwise
    paddleseg's.
    """
    import paddle
    if self.avg_non_ignore:
        mask = paddle.cast(label != self.ignore_index, dtype='float32')
    else:
        mask = paddle.ones(label.shape, dtype='float32')
    mask.stop_gradient = True
    label.stop_gradient = True

    if loss.ndim > mask.ndim:
        loss = paddle.squeeze(loss, axis=-1)
    loss = loss * mask
    if semantic_weights is not None:
        loss = loss * semantic_weights

    if self.weight is not None:
        # Ignored pixels become class 0 here; their mask of 0 removes them again.
        masked_label = label * paddle.cast(label != self.ignore_index, 'int64')
        _one_hot = paddle.nn.functional.one_hot(masked_label, logit.shape[-1])
        coef = paddle.sum(_one_hot * self.weight, axis=-1)
    else:
        coef = paddle.ones(label.shape, dtype='float32')

    if self.top_k_percent_pixels == 1.0:
        return paddle.mean(loss) / (paddle.mean(mask * coef) + self.EPS)
    loss = loss.reshape((-1, ))
    top_k_pixels = int(self.top_k_percent_pixels * loss.numel())
    loss, indices = paddle.topk(loss, top_k_pixels)
    coef = paddle.gather(coef.reshape((-1, )), indices)
    coef.stop_gradient = True
    return loss.mean() / (paddle.mean(coef) + self.EPS)


def calculate_area(pred, label, num_classes, ignore_index=255):
    """``paddleseg.utils.metrics.calculate_area`` with per-class counts stacked, not concatenated.

    Broken in 2.8.0 on Paddle >= 2.6: ``paddle.sum`` returns 0-D tensors and
    ``paddle.concat`` of 0-D tensors raises "The axis is expected to be in
    range of [0, 0)", so ``paddleseg.core.evaluate`` fails on its first
    image. Fixed by ``paddle.stack``, which gives the [num_classes] int64
    tensors 2.8.0 returned on Paddle 2.5.

    Args:
        pred (Tensor): predicted class ids, [N, H, W] or [N, 1, H, W].
        label (Tensor): ground truth of the same shape.
        num_classes (int): number of classes.
        ignore_index (int, optional): label value left out of all three areas. Default: 255.

    Returns:
        tuple: intersect, prediction and label areas, int64 tensors of shape [num_classes].
    """
    import paddle
    if len(pred.shape) == 4:
        pred = paddle.squeeze(pred, axis=1)
    if len(label.shape) == 4:
        label = paddle.squeeze(label, axis=1)
    if not pred.shape == label.shape:
        raise ValueError('Shape of `pred` and `label should be equal, '
                         'but there are {} and {}.'.format(pred.shape, label.shape))
    pred_area = []
    label_area = []
    intersect_area = []
    mask = label != ignore_index
    for i in range(num_classes):
        pred_i = paddle.logical_and(pred == i, mask)
        label_i = label == i
        intersect_i = paddle.logical_and(pred_i, label_i)
        pred_area.append(paddle.sum(paddle.cast(pred_i, 'int64')))
        label_area.append(paddle.sum(paddle.cast(label_i, 'int64')))
        intersect_area.append(paddle.sum(paddle.cast(intersect_i, 'int64')))
    return paddle.stack(intersect_area), paddle.stack(pred_area), paddle.stack(label_area)


# (owner, attribute, replacement) of each paddleseg fix this Paddle and
# paddleseg need; filled by apply_paddleseg_fixes().
FIXES = ()
# The replaced functions, for tests that check the fixes are still needed.
ORIGINALS = {}


def _in1d(ar1, ar2, assume_unique=False, invert=False):
    """numpy < 2.4's ``in1d``: ``isin`` flattened."""
    import numpy
    return numpy.isin(ar1, ar2, assume_unique=assume_unique, invert=invert).ravel()


def cityscapes_evaluator_fix():
    """Gives numpy its ``in1d`` back for cityscapesScripts' evaluators (11); call it only in
    the evaluator's process. Returns True when numpy lacked it."""
    import numpy
    if hasattr(numpy, 'in1d'):
        return False
    numpy.in1d = _in1d
    return True


PADDLESEG_INSTALL = ('pip install -r requirements.txt && pip install --no-deps -r '
                     'requirements-paddleseg.txt')


def require_paddleseg():
    """Raises ImportError in one line saying what to install when paddleseg, or a module
    it imports without declaring it, is missing."""
    try:
        import paddleseg  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name == 'paddleseg':
            what = 'psanet needs paddleseg 2.8.0'
        else:
            what = f'paddleseg needs {error.name}, which is not installed'
        raise ImportError(f'{what}: {PADDLESEG_INSTALL} (in the repository; paddleseg goes '
                          'without its dependencies, whose opencv<=4.6 pin forces numpy<2).'
                          ) from None


def apply_paddleseg_fixes():
    """Patches the paddleseg 2.8.0 functions this Paddle breaks (8, 9), once, and quiets
    its builder (21).

    Returns:
        tuple: ``FIXES``, the (owner, attribute, replacement) applied.
    """
    global FIXES
    from paddleseg.models.losses import cross_entropy_loss
    from paddleseg.utils import metrics
    candidates = (
        (PADDLESEG_CROSS_ENTROPY, cross_entropy_loss.CrossEntropyLoss, '_post_process_loss',
         cross_entropy_post_process_loss),
        (PADDLESEG_CALCULATE_AREA, metrics, 'calculate_area', calculate_area),
    )
    FIXES = tuple((owner, name, fixed) for workaround, owner, name, fixed in candidates
                  if workaround.needed())
    for owner, name, fixed in FIXES:
        current = getattr(owner, name)
        if current is not fixed:
            ORIGINALS[(owner, name)] = current
            setattr(owner, name, fixed)
    quiet_builder_messages()
    return FIXES


# 21; 22 and 23, C-level stderr lines of Paddle and onnxruntime with nothing to act on.
BUILDER_MESSAGE = 'Use the following config to build'
PIR_OUT_TENSOR = 'Paddle static graph(PIR) not support input out tensor'
ORT_UNUSED_INITIALIZER = 'Removing initializer'


_NO_BUILDER_MESSAGE = classmethod(lambda cls, name, cfg: None)  # show_msg without the YAML


def quiet_builder_messages():
    """Makes paddleseg's ``Builder.show_msg`` a no-op (21), the original kept in ORIGINALS."""
    from paddleseg.cvlibs.builder import Builder
    if Builder.__dict__['show_msg'] is not _NO_BUILDER_MESSAGE:
        ORIGINALS[(Builder, 'show_msg')] = Builder.__dict__['show_msg']
        Builder.show_msg = _NO_BUILDER_MESSAGE
