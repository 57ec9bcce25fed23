"""Device, mixed precision, BatchNorm and progress-bar choices shared by training, evaluation
and prediction."""
import contextlib
import sys

import paddle
import paddle.nn as nn

from psanet.core import dist
from psanet.errors import ConfigError

__all__ = ['set_device', 'on_gpu', 'amp_enabled', 'autocast', 'to_plain_batchnorm',
           'progress_bar']


@contextlib.contextmanager
def progress_bar(total, enabled=True):
    """PaddleSeg's progress bar (on stderr; rank 0 updates it), or None when not enabled or
    ``total`` is 0. When the block stops half-way the bar's line is ended, so that the
    error that follows starts on a line of its own."""
    from paddleseg.utils import progbar
    bar = progbar.Progbar(target=total, verbose=1 if dist.rank() == 0 else 2) \
        if enabled and total else None
    try:
        yield bar
    except BaseException:
        if bar is not None and dist.rank() == 0:
            sys.stderr.write('\n')
            sys.stderr.flush()
        raise


def set_device(device=None):
    """Selects 'cpu' or 'gpu' (None: gpu when Paddle sees one, else cpu) and returns it; ``gpu``
    on a CPU-only Paddle or a machine without a visible GPU is a ConfigError."""
    has_gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if device is None:
        device = 'gpu' if has_gpu else 'cpu'
    if device not in ('cpu', 'gpu'):
        raise ConfigError(f'--device {device!r} is not supported: use cpu or gpu.')
    if device == 'gpu' and not has_gpu:
        raise ConfigError('--device gpu, but this Paddle has no CUDA support or sees no GPU: '
                          'install paddlepaddle-gpu, check CUDA_VISIBLE_DEVICES, or pass '
                          '--device cpu.')
    paddle.set_device(device)
    return device


def on_gpu():
    """True when Paddle's current device is a GPU."""
    return paddle.get_device().startswith('gpu')


def amp_enabled(precision):
    """fp16 autocast runs only on GPU; fp32 everywhere else (``precision`` as the options
    checked it)."""
    return precision == 'fp16' and on_gpu()


def autocast(precision, amp_level='O1'):
    """paddle.amp.auto_cast for fp16 on GPU (paddleseg's op lists), else a no-op context."""
    if not amp_enabled(precision):
        return contextlib.nullcontext()
    return paddle.amp.auto_cast(
        enable=True, level=amp_level,
        custom_white_list={'elementwise_add', 'batch_norm', 'sync_batch_norm'},
        custom_black_list={'bilinear_interp_v2'})


def to_plain_batchnorm(layer):
    """Replaces every nn.SyncBatchNorm under ``layer`` (or ``layer`` itself) by nn.BatchNorm2D
    sharing its parameters, and returns the layer. paddleseg's ``layers.SyncBatchNorm`` builds
    SyncBatchNorm on multi-GPU runs, so turning synchronisation off means converting back;
    shared, not copied, so an optimizer built before still updates them."""
    if isinstance(layer, nn.SyncBatchNorm):
        plain = nn.BatchNorm2D(layer._num_features, momentum=layer._momentum,
                               epsilon=layer._epsilon, weight_attr=layer._weight_attr,
                               bias_attr=layer._bias_attr, data_format=layer._data_format)
        if layer._weight_attr is not False and layer._bias_attr is not False:
            with paddle.no_grad():
                plain.weight = layer.weight
                plain.bias = layer.bias
        plain._mean = layer._mean
        plain._variance = layer._variance
        return plain
    for name, sublayer in layer.named_children():
        replaced = to_plain_batchnorm(sublayer)
        if replaced is not sublayer:
            setattr(layer, name, replaced)  # Layer.__setattr__ files it as a sublayer
    return layer
