"""What a training run saves and how it continues: its state, a checkpoint's train_state,
loading one to resume exactly, and the command line that resumes.

:func:`resume` loads ``--resume_model`` into the model, optimizer and LR
scheduler and returns the :class:`RunState` to go on from; :func:`checkpoint_state`
is what an iter_N checkpoint records for that (docs/training.md).
"""
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from psanet.core import checkpoint as ckpt
from psanet.core import dist, run_dir
from psanet.errors import ConfigError

__all__ = ['RunState', 'resume', 'resume_changes', 'forget_best_elsewhere', 'draw_seed',
           'checkpoint_state', 'resume_command']


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


def resume(options, model, optimizer, scheduler, logger):
    """Loads ``options.resume_model`` (None: none) into the model, the optimizer and the
    scheduler.

    Returns:
        tuple: the :class:`RunState` to start from, its seed the checkpoint's (else
        ``options.seed``), and the checkpoint's train_state ({} without resume_model).
    """
    resume_model, iters, seed = options.resume_model, options.iters, options.seed
    if resume_model is None:
        return RunState(seed=seed), {}
    model_state, optimizer_state, saved = ckpt.load_checkpoint(resume_model)
    ckpt.check_state_fits(model, model_state, f'the weights of --resume_model {resume_model}',
                          _RESUME_ANOTHER_MODEL)
    model.set_state_dict(model_state)
    if 'parameter_names' in saved:
        optimizer_state = ckpt.rename_optimizer_state(optimizer_state, saved['parameter_names'],
                                                      model)
    optimizer.set_state_dict(optimizer_state)
    if scheduler is not None and 'lr_scheduler' in saved:
        scheduler.set_state_dict(saved['lr_scheduler'])
    start_iter = int(saved['iteration'])
    state = RunState(iteration=start_iter, start_iter=start_iter,
                      best_miou=float(saved.get('best_miou', -1.0)),
                      best_iter=int(saved.get('best_iter', -1)), last_checkpoint=resume_model,
                      seed=seed)
    if start_iter >= iters:
        raise ConfigError(f'--resume_model {resume_model} is at iteration {start_iter} and '
                          f'iters is {iters}: raise --iters to train further.')
    if 'seed' in saved:
        if seed is not None and seed != saved['seed']:
            logger.warning(f'--seed {seed} ignored: resuming with the checkpoint\'s seed '
                           f'{saved["seed"]}.')
        state.seed = int(saved['seed'])
    logger.info(f'Resumed from {resume_model} at iteration {start_iter}.')
    return state, saved


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
    """A resumed best mIoU whose best_model/ is not in this save_dir (resumed into a new
    folder, or deleted by --overwrite) starts over, so that this run keeps a best_model/."""
    if state.best_iter < 0 or os.path.isdir(os.path.join(save_dir, run_dir.BEST_MODEL)):
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
    }
    if run.scaler is not None:
        checkpoint_state['grad_scaler'] = run.scaler.state_dict()
    return checkpoint_state


def resume_command(path, world_size):
    """train.py's command line with ``--resume_model path`` (and no other --resume_model)."""
    argv = sys.argv
    if os.path.basename(argv[0]) != 'train.py':
        return f'the same call with resume_model={path!r}'
    kept, skip = [], False
    for arg in argv[1:]:
        if skip or arg.startswith('--resume_model='):
            skip = False
            continue
        if arg == '--resume_model':
            skip = True
            continue
        kept.append(arg)
    launch = (['-m', 'paddle.distributed.launch', '--nproc_per_node', str(world_size)]
              if world_size > 1 else [])
    return shlex.join(['python'] + launch + [argv[0]] + kept + ['--resume_model', path])
