"""What a training run saves and how it continues: its state, a checkpoint's train_state,
loading one to resume exactly, and the command line that resumes.

:func:`resume` loads ``--resume_model`` into the model, optimizer and LR
scheduler and returns the :class:`RunState` to go on from and the checkpoint's
train_state; :func:`checkpoint_state`
is what an iter_N checkpoint records for that (docs/training.md).
"""
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from psanet.contract import read_json
from psanet.core import checkpoint as ckpt
from psanet.core import dist, run_dir
from psanet.core.options import RESUME_AUTO
from psanet.core.weights import check_state_fits
from psanet.errors import CheckpointError, ConfigError, few

__all__ = ['RunState', 'resume', 'refuse_another_recipe', 'recipe_changes', 'resume_changes',
           'forget_best_elsewhere', 'draw_seed', 'checkpoint_state', 'resume_command']


_RESUME_ANOTHER_MODEL = ('Resume with the config the checkpoint was trained with (same model, '
                         'backbone, num_classes and mask size), or train this config into a new '
                         '--save_dir.')


@dataclass
class RunState:
    """What a run changes as it goes: where it is, its best evaluation, its losses.

    ``losses``, ``loss_terms``, ``local_losses`` and ``evals`` are per
    iteration (per evaluation) run here, as :func:`train` returns them.
    """
    iteration: int = 0
    start_iter: int = 0
    best_miou: float = -1.0
    best_iter: int = -1
    last_checkpoint: Optional[str] = None
    seed: Optional[int] = None
    losses: list = field(default_factory=list)
    loss_terms: list = field(default_factory=list)
    local_losses: list = field(default_factory=list)
    evals: list = field(default_factory=list)

    def record(self, step):
        self.losses.append(float(step.terms.sum()))
        self.local_losses.append(float(step.local_terms.sum()))
        self.loss_terms.append(step.terms.tolist())

    def result(self):
        return {'losses': self.losses, 'loss_terms': self.loss_terms,
                'local_losses': self.local_losses, 'start_iter': self.start_iter,
                'last_checkpoint': self.last_checkpoint, 'best_miou': self.best_miou,
                'best_iter': self.best_iter, 'evals': self.evals, 'seed': self.seed}


def resume(options, folder, model, optimizer, scheduler, logger):
    """Loads ``folder.resume_model`` (None: none) into the model, the optimizer and the
    scheduler.

    Args:
        options (TrainOptions): the run's; a checkpoint of another recipe is resumed
            with a warning naming each difference (:func:`refuse_another_recipe` has
            refused it for 'auto').
        folder (run_dir.RunFolder): the save_dir, with the checkpoint to resume and,
            on rank 0 for 'auto', what was read of it.

    Returns:
        tuple: the :class:`RunState` to start from, its seed the checkpoint's (else
        ``options.seed``), and the checkpoint's train_state ({} without resume_model).
    """
    resume_model, iters, seed = folder.resume_model, options.iters, options.seed
    auto = options.resume_model == RESUME_AUTO
    if resume_model is None:
        if auto:
            logger.info(f'--resume_model auto: no checkpoint in {options.save_dir}: starting at '
                        'iteration 0.')
        return RunState(seed=seed), {}
    # Taken from the folder, which lives as long as the run: not a second copy of the
    # weights and optimizer state held through training.
    loaded, folder.loaded = folder.loaded, None
    model_state, optimizer_state, saved = loaded or ckpt.load_checkpoint(resume_model)
    _warn_of_another_recipe(options, resume_model, saved, logger)
    check_state_fits(model, model_state, f'the weights of --resume_model {resume_model}',
                     _RESUME_ANOTHER_MODEL)
    model.set_state_dict(model_state)
    if 'parameter_names' in saved:
        optimizer_state = ckpt.rename_optimizer_state(optimizer_state, saved['parameter_names'],
                                                      model)
    optimizer.set_state_dict(optimizer_state)
    if scheduler is not None and saved.get('lr_scheduler'):
        scheduler.set_state_dict(saved['lr_scheduler'])
        _warn_of_another_schedule(options, saved, scheduler, logger)
    start_iter = int(saved['iteration'])
    state = RunState(iteration=start_iter, start_iter=start_iter,
                      best_miou=float(saved.get('best_miou', -1.0)),
                      best_iter=int(saved.get('best_iter', -1)), last_checkpoint=resume_model,
                      seed=seed)
    if start_iter >= iters and not auto:
        raise ConfigError(f'--resume_model {resume_model} is at iteration {start_iter} and '
                          f'iters is {iters}: raise --iters to train further.')
    if 'seed' in saved:
        if seed is not None and seed != saved['seed']:
            logger.warning(f'--seed {seed} ignored: resuming with the checkpoint\'s seed '
                           f'{saved["seed"]}.')
        state.seed = int(saved['seed'])
    if auto and start_iter >= iters:
        logger.info(f'--resume_model auto: {resume_model} is the last of {iters} iterations: '
                    'the run is done, nothing to train.')
    elif auto:
        logger.info(f'--resume_model auto: resuming from {resume_model}, the newest checkpoint '
                    f'in {options.save_dir} that loads, at iteration {start_iter}.')
    else:
        logger.info(f'Resumed from {resume_model} at iteration {start_iter}.')
    return state, saved


def _flatten(value, prefix=''):
    if isinstance(value, dict):
        items = {}
        for key, item in value.items():
            items.update(_flatten(item, f'{prefix}.{key}' if prefix else str(key)))
        return items
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        items = {f'{prefix}.length': len(value)}
        for index, item in enumerate(value):
            items.update(_flatten(item, f'{prefix}[{index}]'))
        return items
    return {prefix: value}


def recipe_changes(saved, current):
    """``key: saved -> current`` for every config key (dotted, with list indices) whose
    value differs between two :func:`~psanet.core.options.training_recipe` records."""
    saved, current = _flatten(saved), _flatten(current)
    missing = object()
    return [f'{key}: {saved.get(key, "(none)")} -> {current.get(key, "(none)")}'
            for key in sorted(set(saved) | set(current))
            if saved.get(key, missing) != current.get(key, missing)]


def refuse_another_recipe(options, folder):
    """With ``--resume_model auto``: raises ConfigError, on every rank alike, when the
    checkpoint ``folder`` resumes was trained with another recipe (before anything is
    written: the same command re-run must not mix two runs in one save_dir)."""
    if options.resume_model != RESUME_AUTO or folder.resume_model is None \
            or options.recipe is None:
        return
    state_path = os.path.join(folder.resume_model, ckpt.STATE_FILE)
    if not os.path.isfile(state_path):  # rank 0 has read it: this rank's node does not see it
        raise CheckpointError(
            f'--resume_model auto: rank {dist.rank()} does not see {state_path}, which rank 0 '
            'resumes from: --save_dir must be a folder every node shares (a network file '
            'system), or the nodes resume different checkpoints.')
    saved = read_json(state_path, ValueError)
    changes = recipe_changes(saved['recipe'], options.recipe) if saved.get('recipe') else []
    if changes:
        raise ConfigError(
            f'--resume_model auto: the newest checkpoint in --save_dir {options.save_dir}, '
            f'{folder.resume_model}, was trained with another config or schedule '
            f'({few(changes, 4)}): run the command that trained it, pass --resume_model '
            f'{folder.resume_model} to continue it with this config anyway, or pick a new '
            '--save_dir.')


def _warn_of_another_recipe(options, resume_model, saved, logger):
    if options.recipe is None:
        return
    if saved.get('recipe') is None:
        logger.warning(f'{resume_model} does not record its config (saved by an older version): '
                       'that it was trained with this one is not checked.')
        return
    changes = recipe_changes(saved['recipe'], options.recipe)
    if changes:
        logger.warning(f'resuming {resume_model} with another config or schedule than it was '
                       f'trained with: {few(changes, 6)}.')


def _warn_of_another_schedule(options, saved, scheduler, logger):
    """Another iters stretches or shrinks the LR schedule (its decay steps are iters):
    says what the learning rate is now, against the saved run's."""
    saved_iters = (saved.get('recipe') or {}).get('iters')
    saved_lr = saved['lr_scheduler'].get('last_lr')
    if saved_iters is None or saved_iters == options.iters or saved_lr is None:
        return
    new_lr = float(scheduler.get_lr())
    if not np.isclose(new_lr, saved_lr, rtol=1e-6, atol=0):
        logger.warning(f'iters {saved["recipe"].get("iters")} -> {options.iters} changes the LR '
                       f'schedule ({type(scheduler).__name__} over iters): the learning rate at '
                       f'iteration {saved["iteration"]} is {new_lr:.6g}, where the saved run '
                       f'was at {saved_lr:.6g}.')


def resume_changes(state, batch_size, world_size, iters_per_epoch, num_images):
    """What differs from the run that saved ``state``, each by its cause (empty: nothing).

    Another batch_size or process count changes the iterations per epoch by
    itself; only a change they do not explain means the training set changed.
    """
    changes = []
    saved_batch = (state.get('batch_size', batch_size), state.get('world_size', world_size))
    saved_epoch = state.get('iters_per_epoch', iters_per_epoch)
    if saved_batch != (batch_size, world_size):
        changes.append(f'with batch_size {batch_size} x {world_size} process(es) instead of '
                       f'{saved_batch[0]} x {saved_batch[1]}'
                       + (f' ({iters_per_epoch} iterations per epoch instead of {saved_epoch})'
                          if saved_epoch != iters_per_epoch else ''))
    if state.get('num_images', num_images) != num_images:
        changes.append(f'with {num_images} training images instead of {state["num_images"]} (the '
                       'training set changed since it was saved)')
    elif 'num_images' not in state and saved_batch == (batch_size, world_size) \
            and saved_epoch != iters_per_epoch:
        changes.append(f'with {iters_per_epoch} iterations per epoch instead of {saved_epoch} at '
                       'the same batch_size (the training set changed since it was saved)')
    return changes


def forget_best_elsewhere(state, save_dir, logger):
    """Settles the best mIoU to beat with the best_model/ of this save_dir.

    A resumed best whose best_model/ is not here (resumed into a new folder, or
    deleted by --overwrite) starts over, so that this run keeps a best_model/; a
    best_model/ newer than the resumed checkpoint (``auto`` passed over one that
    does not load) stays the one to beat.
    """
    best = os.path.join(save_dir, run_dir.BEST_MODEL)
    if os.path.isdir(best):
        try:
            kept = read_json(os.path.join(best, ckpt.STATE_FILE), ValueError)
        except ValueError:
            kept = None
        iteration = kept.get('iteration') if isinstance(kept, dict) else None
        if isinstance(iteration, int) and iteration > state.start_iter \
                and isinstance(kept.get('miou'), (int, float)):
            state.best_miou, state.best_iter = float(kept['miou']), iteration
            logger.info(f'{best} (mIoU {state.best_miou:.4f} at iter {iteration}) is newer '
                        f'than the resumed checkpoint: it stays the best to beat.')
        return
    if state.best_iter < 0:
        return
    logger.info(f'No {run_dir.BEST_MODEL}/ in {save_dir}: the best mIoU of the resumed run '
                f'({state.best_miou:.4f} at iter {state.best_iter}) is not kept; this run saves '
                'its own best model.')
    state.best_miou, state.best_iter = -1.0, -1


def draw_seed(main):
    # Drawn on rank 0 only and summed with zeros: every rank uses the seed that is saved.
    drawn = int(np.random.SeedSequence().generate_state(1)[0]) if main else 0
    return int(dist.all_reduce_sum([drawn])[0])


def checkpoint_state(run, state):
    """The train_state.json of iter_<iteration>: what an exact resume needs."""
    checkpoint_state = {
        'iteration': state.iteration, 'epoch': state.iteration // run.iters_per_epoch,
        'iters_per_epoch': run.iters_per_epoch, 'seed': state.seed,
        'batch_size': run.options.batch_size, 'world_size': run.world_size,
        'num_images': run.num_images, 'best_miou': state.best_miou,
        'best_iter': state.best_iter,
        'lr_scheduler': run.scheduler.state_dict() if run.scheduler is not None else None,
        'parameter_names': ckpt.parameter_names(run.model),
        'recipe': run.options.recipe,
    }
    if run.scaler is not None:
        checkpoint_state['grad_scaler'] = run.scaler.state_dict()
    return checkpoint_state


def resume_command(path, world_size, options=None):
    """train.py's command line with ``--resume_model path`` (and no other --resume_model);
    with ``--resume_model auto`` the same command. On several nodes: train.py's part, for
    each node's launch line."""
    argv = sys.argv
    auto = options is not None and options.resume_model == RESUME_AUTO
    if os.path.basename(argv[0]) != 'train.py':
        return ('the same call' if auto else f'the same call with resume_model={path!r}')
    if auto:
        path = RESUME_AUTO
    kept, skip = [], False
    for arg in argv[1:]:
        if skip or arg.startswith('--resume_model='):
            skip = False
            continue
        if arg == '--resume_model':
            skip = True
            continue
        kept.append(arg)
    train = shlex.join([argv[0]] + kept + ['--resume_model', path])
    nodes = os.environ.get('PADDLE_NNODES', '1')
    if nodes.isdigit() and int(nodes) > 1:  # the launch line is each node's own: not known here
        return f'the launch line of each of the {nodes} nodes, with {train}'
    launch = (['-m', 'paddle.distributed.launch', '--nproc_per_node', str(world_size)]
              if world_size > 1 else [])
    return shlex.join(['python'] + launch) + ' ' + train
