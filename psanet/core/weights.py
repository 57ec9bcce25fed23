"""Weights into a model: the file ``--model_path`` names, loaded only when it fits the model.

A .pdparams file, a checkpoint folder or an http(s) URL (:mod:`psanet.weights_download`);
a file whose tensors do not fit the model, or hold NaN or Inf, is refused naming them. The
reproduction's released weights are converted in memory or once to a file.
"""
import os

import numpy as np
import paddle

from psanet.core.checkpoint import WEIGHTS_FILE, load_saved
from psanet.core.config import ComponentBuilder, load_config
from psanet.errors import CheckpointError, few
from psanet.files import check_output_file, make_output_dir, write_file_whole
from psanet.log import get_logger
from psanet.models.reproduction import convert_reproduction_state, is_reproduction_state
from psanet.weights_download import fetch_weights, is_url

__all__ = ['resolve_weights_path', 'check_state_fits', 'check_finite', 'load_model_weights',
           'convert_reproduction_file']


def resolve_weights_path(model_path):
    """``--model_path`` as a weights file: a .pdparams file, a folder holding model.pdparams, or
    an http(s) URL of a .pdparams or an archive holding one, downloaded once into the cache;
    CheckpointError when neither exists, or the download fails."""
    if model_path is None:
        raise CheckpointError('--model_path is required: pass a model.pdparams file, a '
                              'checkpoint folder such as output/best_model, or an http(s) URL.')
    if is_url(model_path):
        model_path = fetch_weights(model_path)
    if os.path.isdir(model_path):
        candidate = os.path.join(model_path, WEIGHTS_FILE)
        if os.path.isfile(candidate):
            return candidate
        raise CheckpointError(f'--model_path {model_path} is a folder without {WEIGHTS_FILE}: '
                              'pass a checkpoint folder such as output/best_model or the '
                              '.pdparams file.')
    if not os.path.isfile(model_path):
        raise CheckpointError(f'--model_path {model_path} does not exist (cwd {os.getcwd()}): '
                              'pass a model.pdparams file or a checkpoint folder such as '
                              'output/best_model.')
    if model_path.endswith('.pdopt'):
        weights = os.path.join(os.path.dirname(model_path), WEIGHTS_FILE)
        beside = f': pass {weights} beside it' if os.path.isfile(weights) else \
            f': pass the {WEIGHTS_FILE} of the same checkpoint'
        raise CheckpointError(f'--model_path {model_path} is the optimizer state of a '
                              f'checkpoint, not its weights{beside} (or the checkpoint folder).')
    return model_path


def _mismatch_report(expected, loaded):
    missing = [k for k in expected if k not in loaded]
    unexpected = [k for k in loaded if k not in expected]
    wrong_shape = [
        f'{k} (file {list(loaded[k].shape)}, model {list(expected[k].shape)})'
        for k in expected if k in loaded and hasattr(loaded[k], 'shape')
        and list(loaded[k].shape) != list(expected[k].shape)
    ]

    parts = []
    if wrong_shape:
        parts.append(f'{len(wrong_shape)} with another shape: {few(wrong_shape)}')
    if missing:
        parts.append(f'{len(missing)} missing from the file: {few(missing)}')
    if unexpected:
        parts.append(f'{len(unexpected)} not in the model: {few(unexpected)}')
    return '; '.join(parts)


def check_state_fits(model, loaded, source, fix):
    """Raises CheckpointError unless ``loaded`` has exactly the keys and shapes of
    ``model.state_dict()``, naming the mismatching tensors (shape mismatches first), then
    ``source`` (what was read) and ``fix`` (the last sentence)."""
    expected = model.state_dict()
    report = _mismatch_report(expected, loaded)
    if not report:
        return
    extra = [key for key in loaded if key not in expected]
    if (extra and all(key.endswith('.bias') and key[:-len('bias')] + 'weight' in expected
                      for key in extra)
            and all(key in loaded for key in expected)):
        raise CheckpointError(
            f'{source} carry {len(extra)} convolution biases that {type(model).__name__} no '
            f'longer has (such as {extra[0]}): they were saved by this project before its '
            'model became tensor for tensor the reproduction\'s (no bias before BatchNorm or '
            'on the attention conv). Train again, or evaluate them with a checkout from '
            'before that change.')
    raise CheckpointError(f'{source} do not fit {type(model).__name__} built from the config: '
                          f'{report}. {fix}')


def check_finite(state, source):
    """Raises CheckpointError naming the tensors of ``state`` that hold NaN or Inf (weights of
    a run that diverged give a meaningless prediction, not an error, otherwise)."""
    bad = []
    for key, value in state.items():
        array = value.numpy() if isinstance(value, paddle.Tensor) else np.asarray(value)
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            bad.append(f'{key} ({int(np.isnan(array).sum())} NaN, '
                       f'{int(np.isinf(array).sum())} Inf)')
    if bad:
        raise CheckpointError(f'{source} hold non-finite values in {len(bad)} tensors: '
                              f'{few(bad, 3)}. They come from a run that diverged; pass the '
                              'weights of an earlier checkpoint.')


def load_model_weights(model, model_path):
    """Loads weights into ``model``, refusing any file that does not fit it exactly; returns
    the weights file loaded. A file in the layout of the PaddlePaddle reproduction's release
    is converted in memory (:mod:`psanet.models.reproduction`), with one log line saying so."""
    path = resolve_weights_path(model_path)
    loaded = load_saved(path, 'weights', 'pass a model.pdparams written by train.py.')
    if not isinstance(loaded, dict):
        raise CheckpointError(f'weights {path} hold a {type(loaded).__name__}, not a state_dict: '
                              'pass a model.pdparams written by train.py.')
    if is_reproduction_state(loaded):
        loaded = convert_reproduction_state(loaded, model.state_dict(), source=f'weights {path}')
        get_logger().info(f'Weights {path} are the PaddlePaddle reproduction\'s checkpoint: '
                          'converted to PSANet\'s names in memory.')
    check_state_fits(model, loaded, f'weights {path}', 'Pass the config the weights were trained '
                     'with (same model, backbone and num_classes).')
    check_finite(loaded, f'weights {path}')
    model.set_state_dict(loaded)
    return path


def convert_reproduction_file(src, dst, config):
    """Converts the PaddlePaddle reproduction's checkpoint ``src`` into a model.pdparams ``dst``
    (written whole) for ``config``'s model, which must take every tensor with the same shape
    and nothing else; returns the number of tensors written."""
    fix = 'pass the reproduction\'s model.pdparams as --src.'
    check_output_file(dst, '--dst')
    if not os.path.isfile(src):
        raise CheckpointError(f'--src {src} is not a file (cwd {os.getcwd()}): {fix}')
    loaded = load_saved(src, 'weights', fix)
    if not is_reproduction_state(loaded):
        names = ', '.join(list(loaded)[:3]) if isinstance(loaded, dict) else type(loaded).__name__
        raise CheckpointError(f'--src {src} is not in the layout of the PaddlePaddle '
                              f'reproduction (no psa.*, head.conv_bn_relu.*, head.conv.* or '
                              f'aux_head.* tensors; it holds {names}): {fix} A model.pdparams '
                              'written by train.py needs no conversion.')
    model = ComponentBuilder(load_config(config), weights_follow=True).model
    model.set_state_dict(convert_reproduction_state(loaded, model.state_dict(),
                                                    source=f'--src {src}'))
    state = model.state_dict()
    make_output_dir(os.path.dirname(os.path.abspath(dst)))
    write_file_whole(dst, lambda temporary: paddle.save(state, temporary), durable=True)
    return len(state)
