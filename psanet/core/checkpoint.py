"""Checkpoints: atomic writes, pruning, resume state, and weights loading that names mismatches.

A checkpoint is a folder ``<save_dir>/iter_N/`` (or ``best_model/``) holding
``model.pdparams``, ``model.pdopt`` (with the LR scheduler) and
``train_state.json`` (iteration, epoch, seed, best mIoU), written whole into a
hidden folder and then renamed into place (docs/reliability.md). The
reproduction's released weights load as they are (converted in memory) or are
converted once by :func:`convert_reproduction_file`.
"""
import json
import os
import re
import shutil
import tempfile

import numpy as np
import paddle

from psanet.contract import (PREVIOUS, RETIRED_SUFFIX, TEMP_MARK, check_output_file, fsync,
                             read_json, write_file_whole, write_folder)
from psanet.core.config import ComponentBuilder, load_config
from psanet.errors import CheckpointError, few
from psanet.log import get_logger
from psanet.models.reproduction import convert_reproduction_state, is_reproduction_state
from psanet.weights_download import fetch_weights, is_url

__all__ = ['WEIGHTS_FILE', 'OPTIMIZER_FILE', 'STATE_FILE', 'save_checkpoint',
           'list_checkpoints', 'newest_loadable_checkpoint', 'checkpoint_iteration',
           'prune_checkpoints', 'delete_checkpoints',
           'remove_stale_temporaries', 'load_checkpoint', 'resolve_weights_path',
           'check_state_fits', 'check_finite', 'load_model_weights', 'parameter_names',
           'rename_optimizer_state', 'convert_reproduction_file']

WEIGHTS_FILE = 'model.pdparams'
OPTIMIZER_FILE = 'model.pdopt'
STATE_FILE = 'train_state.json'
_ITER_DIR = re.compile(r'^iter_(\d+)$')
_RETIRED_DIR = re.compile(r'^\.(.+)' + re.escape(RETIRED_SUFFIX + TEMP_MARK))


def _to_json(value):
    """numpy scalars and arrays in LR scheduler states -> plain Python."""
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, paddle.Tensor):
        return value.numpy().tolist()
    return value


def save_checkpoint(directory, model, optimizer=None, state=None):
    """Writes a checkpoint folder atomically.

    Args:
        directory (str): the final folder, e.g. ``output/iter_1000``; an existing
            one is replaced only once the new one is complete.
        model (paddle.nn.Layer): the model (not its DataParallel wrapper).
        optimizer (paddle.optimizer.Optimizer, optional): saved as model.pdopt. Default: None.
        state (dict, optional): JSON-able training state, saved as train_state.json. Default: None.

    Returns:
        str: ``directory``.
    """
    def write(temporary):
        paddle.save(model.state_dict(), os.path.join(temporary, WEIGHTS_FILE))
        if optimizer is not None:
            paddle.save(optimizer.state_dict(), os.path.join(temporary, OPTIMIZER_FILE))
        if state is not None:
            with open(os.path.join(temporary, STATE_FILE), 'w') as f:
                json.dump(_to_json(state), f, indent=1)

    return write_folder(directory, write)


def list_checkpoints(save_dir):
    """Complete ``iter_N`` checkpoints in ``save_dir``, oldest first.

    Returns:
        list: ``(iteration, path)`` pairs sorted by iteration.
    """
    if not os.path.isdir(save_dir):
        return []
    found = []
    for name in os.listdir(save_dir):
        match = _ITER_DIR.match(name)
        path = os.path.join(save_dir, name)
        if match and os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def checkpoint_iteration(path):
    """The iteration a checkpoint folder was saved at (train_state.json, else its iter_N name).

    Returns:
        int | None: None when neither tells.
    """
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            return int(json.load(f)['iteration'])
    except (OSError, ValueError, KeyError, TypeError):
        match = _ITER_DIR.match(os.path.basename(os.path.normpath(path)))
        return int(match.group(1)) if match else None


def prune_checkpoints(save_dir, keep_checkpoint_max):
    """Deletes the oldest ``iter_N`` folders beyond ``keep_checkpoint_max`` (<= 0 keeps all).

    Returns:
        list: the deleted paths.
    """
    if keep_checkpoint_max is None or keep_checkpoint_max <= 0:
        return []
    checkpoints = list_checkpoints(save_dir)
    removed = [path for _, path in checkpoints[:-keep_checkpoint_max]]
    delete_checkpoints(removed)
    return removed


def delete_checkpoints(paths):
    """Deletes checkpoint folders of one save_dir, each at once or not at all.

    Each folder is first renamed into one hidden temporary folder, so a process
    killed while deleting leaves no half-deleted ``iter_N`` (one with model.pdparams
    but without model.pdopt would still be listed); the next run's
    :func:`remove_stale_temporaries` deletes what is left.
    """
    if not paths:
        return
    parent = os.path.dirname(os.path.normpath(paths[0])) or '.'
    trash = tempfile.mkdtemp(prefix='.deleted' + TEMP_MARK, dir=parent)
    for i, path in enumerate(paths):
        os.replace(path, os.path.join(trash, f'{i}_{os.path.basename(os.path.normpath(path))}'))
    fsync(parent)
    shutil.rmtree(trash, ignore_errors=True)


def remove_stale_temporaries(save_dir):
    """Deletes the hidden temporary folders a killed process left while saving.

    A checkpoint folder that a crash left only as ``.<name>.old.tmp-*/previous``
    (between the two renames of :func:`save_checkpoint`) is first renamed back
    to ``<name>``.
    """
    if not os.path.isdir(save_dir):
        return
    for name in sorted(os.listdir(save_dir)):
        match = _RETIRED_DIR.match(name)
        previous = os.path.join(save_dir, name, PREVIOUS)
        final = os.path.join(save_dir, match.group(1)) if match else None
        if final and os.path.isdir(previous) and not os.path.exists(final):
            os.replace(previous, final)
            fsync(save_dir)
    for name in os.listdir(save_dir):
        if name.startswith('.') and TEMP_MARK in name:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def _load(path, what, fix):
    try:
        return paddle.load(path)
    except Exception as error:  # paddle.load raises several types for a broken file
        raise CheckpointError(f'{what} {path} cannot be read ({type(error).__name__}: {error}): '
                              f'{fix}') from error


def load_checkpoint(path):
    """Reads a checkpoint folder written by :func:`save_checkpoint` for ``--resume_model``.

    Args:
        path (str): an ``iter_N`` folder.

    Returns:
        tuple: (model state_dict, optimizer state_dict, training state dict).

    Raises:
        CheckpointError: naming the file that is missing or cannot be read.
    """
    fix = 'pass another iter_N folder of the same save_dir to --resume_model.'
    if not os.path.isdir(path):
        raise CheckpointError(f'--resume_model {path} is not a folder: pass a checkpoint folder '
                              'such as output/iter_1000 (it holds model.pdparams and model.pdopt).')
    for name in (WEIGHTS_FILE, OPTIMIZER_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f'--resume_model {path} has no {name}: {fix}')
    state_path = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_path):
        # Without it the seed and the data order are unknown: the run would go on differently.
        match = _ITER_DIR.match(os.path.basename(os.path.normpath(path)))
        iteration = match.group(1) if match else 'N'
        raise CheckpointError(
            f'--resume_model {path} has no {STATE_FILE} (the iteration, seed and data order '
            f'an exact resume needs): {fix} A checkpoint of paddleseg\'s own train.py has none: '
            f'write {{"iteration": {iteration}}} into {state_path} to continue it with a new '
            'seed and data order.')
    state = read_json(state_path, lambda reason: CheckpointError(
        f'training state {state_path} cannot be read ({reason}): {fix}'))
    iteration = state.get('iteration') if isinstance(state, dict) else None
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise CheckpointError(f'training state {state_path}: "iteration" must be a '
                              f'non-negative integer, got {iteration!r}: {fix}')
    model_state = _load(os.path.join(path, WEIGHTS_FILE), 'model weights', fix)
    optimizer_state = _load(os.path.join(path, OPTIMIZER_FILE), 'optimizer state', fix)
    return model_state, optimizer_state, state


def newest_loadable_checkpoint(save_dir, logger=None):
    """The newest ``iter_N`` of ``save_dir`` that loads whole, for ``--resume_model auto``.

    A newer one that does not load (cut short, a file missing) is named in a
    warning and passed over; nothing is deleted.

    Returns:
        tuple: (N, path, what :func:`load_checkpoint` returns), or None when
        ``save_dir`` holds no ``iter_N`` folder.

    Raises:
        CheckpointError: when there are ``iter_N`` folders and none of them loads.
    """
    if not os.path.isdir(save_dir):
        return None
    folders = sorted((int(match.group(1)), os.path.join(save_dir, name))
                     for name in os.listdir(save_dir) for match in [_ITER_DIR.match(name)]
                     if match and os.path.isdir(os.path.join(save_dir, name)))
    failures = []
    for iteration, path in reversed(folders):
        try:
            return iteration, path, load_checkpoint(path)
        except CheckpointError as error:
            reason = str(error).replace(f'--resume_model {path} ', '').split(': pass ')[0]
            reason = reason.splitlines()[0][:300] if reason else type(error).__name__
            failures.append(f'{os.path.basename(path)}: {reason}')
            (logger or get_logger()).warning(
                f'--resume_model auto: {path} does not load ({reason}); trying the checkpoint '
                'before it. It stays as it is until this run saves that iteration again.')
    if not failures:
        return None
    raise CheckpointError(
        f'--resume_model auto: no checkpoint in --save_dir {save_dir} loads '
        f'({few(failures, 3)}): restore one, pass a --save_dir of another run, or start '
        'over in a new --save_dir (nothing was deleted).')


def parameter_names(model):
    """{structured name: unique parameter name}; the optimizer state is keyed by the latter."""
    return {key: param.name for key, param in model.named_parameters()}


def rename_optimizer_state(optimizer_state, saved_names, model):
    """Re-keys an optimizer state_dict saved for another build of the same model.

    Paddle names optimizer accumulators after the parameters' unique names
    (``conv2d_8.w_0_velocity_0``), which depend on how many layers the process
    had built before; the model's structured names do not. ``saved_names``
    (from :func:`parameter_names` at save time) maps one onto the other.

    Args:
        optimizer_state (dict): the loaded model.pdopt.
        saved_names (dict): structured name -> unique name when it was saved.
        model (paddle.nn.Layer): the model now.

    Returns:
        dict: the state with keys of this build's parameter names.
    """
    current = parameter_names(model)
    rename = {saved_names[k]: v for k, v in current.items()
              if k in saved_names and saved_names[k] != v}
    if not rename:
        return optimizer_state
    # Longest first, so that conv2d_1.w_0 never matches inside conv2d_11.w_0_velocity_0.
    old_names = sorted(rename, key=len, reverse=True)
    renamed = {}
    for key, value in optimizer_state.items():
        for old in old_names:
            if key == old or key.startswith(old + '_'):
                key = rename[old] + key[len(old):]
                break
        renamed[key] = value
    return renamed


def resolve_weights_path(model_path):
    """``--model_path`` as a weights file: a .pdparams file, a folder holding model.pdparams,
    or an http(s) URL of either a .pdparams or an archive holding one, downloaded once
    into the cache (:func:`psanet.weights_download.fetch_weights`).

    Raises:
        CheckpointError: when neither exists, or the download fails.
    """
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
    """Raises unless ``loaded`` has exactly the keys and shapes of ``model.state_dict()``.

    Args:
        model (paddle.nn.Layer): the model built from the config.
        loaded (dict): a state_dict read from a file.
        source (str): what was read, for the message, e.g. ``weights out/model.pdparams``.
        fix (str): the last sentence of the message.

    Raises:
        CheckpointError: naming the mismatching tensors (shape mismatches first, with
            both shapes), the missing and the unexpected ones.
    """
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
    """Loads weights into ``model``, refusing any file that does not fit it exactly.

    A file in the layout of the PaddlePaddle reproduction's release is converted
    in memory (:mod:`psanet.models.reproduction`), with one log line saying so.

    Args:
        model (paddle.nn.Layer): the model built from the config.
        model_path (str): a .pdparams file, a checkpoint folder, or an http(s) URL
            (:func:`resolve_weights_path`).

    Returns:
        str: the weights file that was loaded.

    Raises:
        CheckpointError: naming the mismatching parameters when the file is not
            this model's (another backbone, num_classes, or head).
    """
    path = resolve_weights_path(model_path)
    loaded = _load(path, 'weights', 'pass a model.pdparams written by train.py.')
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
    """Converts the PaddlePaddle reproduction's checkpoint into a model.pdparams of PSANet.

    The model is built from ``config`` (without its pretrained weights) and must
    take every tensor of ``src`` with the same shape, and nothing else.

    Args:
        src (str): the reproduction's .pdparams.
        dst (str): the file to write (its folder is made); written whole or not at all.
        config (str): the config the weights are for.

    Returns:
        int: the number of tensors written.

    Raises:
        CheckpointError: when ``src`` cannot be read, is not in the reproduction's
            layout, or does not fit the model (naming the first tensor that does not).
    """
    fix = 'pass the reproduction\'s model.pdparams as --src.'
    check_output_file(dst, '--dst')
    if not os.path.isfile(src):
        raise CheckpointError(f'--src {src} is not a file (cwd {os.getcwd()}): {fix}')
    loaded = _load(src, 'weights', fix)
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
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    write_file_whole(dst, lambda temporary: paddle.save(state, temporary), durable=True)
    return len(state)
