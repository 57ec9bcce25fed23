"""One checkpoint folder (``iter_N/`` or ``best_model/``: model.pdparams, model.pdopt,
train_state.json): written whole, listed, pruned and read back. No paddleseg import, so
that a run's folder is locked before any config is built."""
import json
import os
import re

import numpy as np
import paddle

from psanet.contract import read_json
from psanet.errors import CheckpointError, is_integer
from psanet.files import delete_folders, write_folder

__all__ = ['WEIGHTS_FILE', 'OPTIMIZER_FILE', 'STATE_FILE', 'save_checkpoint',
           'list_checkpoints', 'named_iteration', 'checkpoint_iteration', 'prune_checkpoints',
           'load_checkpoint', 'load_saved', 'parameter_names', 'rename_optimizer_state']

WEIGHTS_FILE = 'model.pdparams'
OPTIMIZER_FILE = 'model.pdopt'
STATE_FILE = 'train_state.json'
_ITER_DIR = re.compile(r'^iter_(\d+)$')


def _plain(value):
    """json's ``default``: the numpy scalars and arrays (and tensors) of LR scheduler states."""
    if isinstance(value, paddle.Tensor):
        value = value.numpy()
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f'{type(value).__name__} is not JSON serializable')


def save_checkpoint(directory, model, optimizer=None, state=None):
    """Writes ``directory`` whole (:func:`psanet.files.write_folder`); ``model`` is not
    its DataParallel wrapper. Returns ``directory``."""
    def write(temporary):
        paddle.save(model.state_dict(), os.path.join(temporary, WEIGHTS_FILE))
        if optimizer is not None:
            paddle.save(optimizer.state_dict(), os.path.join(temporary, OPTIMIZER_FILE))
        if state is not None:
            with open(os.path.join(temporary, STATE_FILE), 'w') as f:
                json.dump(state, f, indent=1, default=_plain)

    return write_folder(directory, write)


def list_checkpoints(save_dir, whole=True):
    """``(iteration, path)`` of the ``iter_N`` folders in ``save_dir``, oldest first; with
    ``whole``, only those holding model.pdparams."""
    names = os.listdir(save_dir) if os.path.isdir(save_dir) else []
    found = [(named_iteration(name), os.path.join(save_dir, name)) for name in names]
    return sorted((n, path) for n, path in found if n is not None and os.path.isdir(path)
                  and (not whole or os.path.isfile(os.path.join(path, WEIGHTS_FILE))))


def named_iteration(path):
    """N for a folder named ``iter_N``, else None."""
    match = _ITER_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def checkpoint_iteration(path):
    """The iteration a checkpoint folder was saved at (train_state.json, else its iter_N
    name); None when neither tells."""
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            return int(json.load(f)['iteration'])
    except (OSError, ValueError, KeyError, TypeError):
        return named_iteration(path)


def prune_checkpoints(save_dir, keep_checkpoint_max):
    """Deletes the oldest ``iter_N`` folders beyond ``keep_checkpoint_max`` (<= 0 keeps all);
    returns their paths."""
    if keep_checkpoint_max is None or keep_checkpoint_max <= 0:
        return []
    removed = [path for _, path in list_checkpoints(save_dir)[:-keep_checkpoint_max]]
    delete_folders(removed)
    return removed


def load_saved(path, what, fix):
    """``paddle.load(path)``; a file that cannot be read is a CheckpointError naming
    ``what`` it is and ending with ``fix``."""
    try:
        return paddle.load(path)
    except Exception as error:  # paddle.load raises several types for a broken file
        raise CheckpointError(f'{what} {path} cannot be read ({type(error).__name__}: {error}): '
                              f'{fix}') from error


def load_checkpoint(path):
    """(model state_dict, optimizer state_dict, train_state) of a ``--resume_model`` folder;
    CheckpointError names the file that is missing or cannot be read."""
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
        named = named_iteration(path)
        raise CheckpointError(
            f'--resume_model {path} has no {STATE_FILE} (the iteration, seed and data order '
            f'an exact resume needs): {fix} A checkpoint of paddleseg\'s own train.py has none: '
            f'write {{"iteration": {"N" if named is None else named}}} into {state_path} to '
            'continue it with a new seed and data order.')
    state = read_json(state_path, lambda reason: CheckpointError(
        f'training state {state_path} cannot be read ({reason}): {fix}'))
    iteration = state.get('iteration') if isinstance(state, dict) else None
    if not is_integer(iteration, 0):
        raise CheckpointError(f'training state {state_path}: "iteration" must be a '
                              f'non-negative integer, got {iteration!r}: {fix}')
    model_state = load_saved(os.path.join(path, WEIGHTS_FILE), 'model weights', fix)
    optimizer_state = load_saved(os.path.join(path, OPTIMIZER_FILE), 'optimizer state', fix)
    return model_state, optimizer_state, state


def parameter_names(model):
    """{structured name: unique parameter name}; the optimizer state is keyed by the latter."""
    return {key: param.name for key, param in model.named_parameters()}


def rename_optimizer_state(optimizer_state, saved_names, model):
    """Re-keys an optimizer state_dict saved for another build of the same model: Paddle
    keys accumulators by the parameters' unique names (``conv2d_8.w_0_velocity_0``), which
    depend on how many layers the process had built before; ``saved_names`` (from
    :func:`parameter_names` at save time) maps the structured names onto them."""
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
