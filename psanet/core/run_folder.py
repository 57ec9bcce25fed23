"""A training run's save_dir, owned by one :class:`RunFolder` from the run's start to its end:
lock, pick and refuse on opening (rank 0 looks, one all-reduce tells every rank), resume,
save, keep the best, unlock. Why: docs/design.md."""
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from psanet.contract import read_json
from psanet.core import checkpoint as ckpt
from psanet.core import dist
from psanet.core.options import RESUME_AUTO, recipe_changes
from psanet.errors import CheckpointError, ConfigError, few
from psanet.files import SaveDirLock, delete_folders, remove_stale_temporaries
from psanet.log import get_logger

__all__ = ['BEST_MODEL', 'RunState', 'RunFolder']

BEST_MODEL = 'best_model'


@dataclass
class RunState:
    """What a run changes as it goes; the lists hold one entry per iteration (evaluation) run
    here, as :func:`~psanet.core.train.train` returns them."""
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
        return {k: v for k, v in vars(self).items() if k != 'iteration'}


class RunFolder:
    """``with RunFolder(options) as folder:``. Entering raises on every rank, before anything
    is written: ConfigError for what would mix two runs, CheckpointError for a checkpoint to
    resume that does not load. ``resume_model``: the one given, or for 'auto' the newest
    that loads (None: the run starts)."""

    def __init__(self, options):
        self.options, self.path = options, options.save_dir
        self._auto = options.resume_model == RESUME_AUTO
        self.resume_model = None if self._auto else options.resume_model
        self._main = dist.is_main_process()
        self._lock, self._open = None, False
        self._loaded, self._in_the_way = None, []  # rank 0's, until resume() takes them

    def __enter__(self):
        self.options.check_schedule()
        error, picked = None, None
        if self._main:
            try:
                self._lock = SaveDirLock(self.path, get_logger().warning)
                remove_stale_temporaries(self.path)
                self._look()
                picked = (ckpt.named_iteration(self.resume_model)
                          if self._auto and self.resume_model else None)
            except Exception as caught:  # the other ranks must hear of it before anyone raises
                error = caught
        try:
            # One all-reduce: whether rank 0 refused, and which iter_N auto resumes (0: none).
            failed, picked = dist.all_reduce_sum([error is not None,
                                                  0 if picked is None else picked + 1])
            if failed > 0:
                raise error or ConfigError(f'rank 0 refused --save_dir {self.path}: its error '
                                           'says why (workerlog.0 with paddle.distributed.launch).')
            if self._auto and picked and not self._main:
                self.resume_model = os.path.join(self.path, f'iter_{int(picked) - 1}')
                state_path = os.path.join(self.resume_model, ckpt.STATE_FILE)
                if not os.path.isfile(state_path):
                    raise CheckpointError(
                        f'--resume_model auto: rank {dist.rank()} does not see {state_path}, '
                        'which rank 0 resumes from: --save_dir must be a folder every node '
                        'shares (a network file system), or the nodes resume different '
                        'checkpoints.')
        except BaseException:
            self.close()
            raise
        self._open = True
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Removes the temporaries of an interrupted save and unlocks (rank 0; once)."""
        self._open = False
        if self._lock is not None:
            remove_stale_temporaries(self.path)
            self._lock.release()
            self._lock = None

    def _look(self):
        if self._auto:
            self._pick_newest()
        path = self.resume_model
        named = None if path is None else ckpt.named_iteration(path)
        saved_at = None if named is None else ckpt.checkpoint_iteration(path)
        if saved_at != named:  # what lists, prunes and refuses by name would go wrong
            raise CheckpointError(
                f'--resume_model{" auto:" if self._auto else ""} {path} holds iteration '
                f'{saved_at} by its {ckpt.STATE_FILE} but iteration {named} by its name (copied '
                f'or renamed?): rename the folder iter_{saved_at} or correct "iteration" in its '
                f'{ckpt.STATE_FILE}, so that the two agree.')
        if not self._auto or path is None:
            self._in_the_way = self._refuse_or_clear()
        if path is None:
            return
        self._loaded = self._loaded or ckpt.load_checkpoint(path)
        saved = self._loaded[2]
        changes = (recipe_changes(saved['recipe'], self.options.recipe)
                   if self._auto and saved.get('recipe') and self.options.recipe else [])
        if changes:
            raise ConfigError(
                f'--resume_model auto: the newest checkpoint in --save_dir {self.path}, {path}, '
                f'was trained with another config or schedule ({few(changes, 4)}): run the '
                f'command that trained it, pass --resume_model {path} to continue it with this '
                'config anyway, or pick a new --save_dir.')
        if not self._auto and saved['iteration'] >= self.options.iters:
            raise ConfigError(f'--resume_model {path} is at iteration {saved["iteration"]} and '
                              f'iters is {self.options.iters}: raise --iters to train further.')

    def _pick_newest(self):
        failures = []
        for _, path in reversed(ckpt.list_checkpoints(self.path, whole=False)):
            try:
                self._loaded = ckpt.load_checkpoint(path)
            except CheckpointError as error:
                reason = str(error).replace(f'--resume_model {path} ', '').split(': pass ')[0]
                reason = reason.splitlines()[0][:300] if reason else type(error).__name__
                failures.append(f'{os.path.basename(path)}: {reason}')
                get_logger().warning(
                    f'--resume_model auto: {path} does not load ({reason}); trying the checkpoint '
                    'before it. It stays as it is until this run saves that iteration again.')
                continue
            self.resume_model = path
            return
        if failures:
            raise CheckpointError(
                f'--resume_model auto: no checkpoint in --save_dir {self.path} loads '
                f'({few(failures, 3)}): restore one, pass a --save_dir of another run, or start '
                'over in a new --save_dir (nothing was deleted).')

    def _refuse_or_clear(self):
        """What a new run would mix with its own: refused, or with ``overwrite`` returned, to
        be deleted once the resumed checkpoint has loaded."""
        save_dir, resume_model = self.path, self.resume_model
        if resume_model is not None and not os.path.isdir(resume_model):
            return []  # load_checkpoint says what is wrong with it
        checkpoints = ckpt.list_checkpoints(save_dir)
        best = os.path.join(save_dir, BEST_MODEL)
        kept = checkpoints + ([(ckpt.checkpoint_iteration(best), best)]
                              if os.path.isdir(best) else [])
        if not kept:
            return []
        parent = os.path.dirname(os.path.abspath(os.path.normpath(resume_model or '.')))
        if resume_model is not None and os.path.realpath(parent) == os.path.realpath(save_dir):
            start = ckpt.checkpoint_iteration(resume_model)
            in_the_way = [path for iteration, path in kept
                          if None not in (start, iteration) and iteration > start]
            if in_the_way and not self.options.overwrite:
                raise ConfigError(
                    f'--resume_model {resume_model} is not the latest checkpoint in --save_dir '
                    f'{save_dir}: continuing from it would overwrite {_names(in_the_way)}. '
                    f'Resume from {checkpoints[-1][1]}, write this run to a new --save_dir, or '
                    'pass --overwrite to delete them.')
            return in_the_way
        in_the_way = [path for _, path in kept]
        if not self.options.overwrite:
            elsewhere = (f' (--resume_model {resume_model} is not in it)'
                         if resume_model is not None else '')
            latest = (f', continue that run with --resume_model {checkpoints[-1][1]}'
                      if checkpoints else '')
            clear = ('delete them to start over (--overwrite does not go with --resume_model '
                     'auto)' if self._auto else 'pass --overwrite to delete them and start over')
            raise ConfigError(
                f'--save_dir {save_dir} holds the checkpoints of another run '
                f'({_names(in_the_way)}){elsewhere}: a new run there would overwrite some of '
                f'them and mix with the others. Pick a new --save_dir{latest}, or {clear}.')
        return in_the_way

    def resume(self, model, optimizer, scheduler):
        """Loads ``resume_model`` into the model, optimizer and scheduler; returns the
        :class:`RunState` to start from and the checkpoint's train_state ({}: none)."""
        if not self._open:
            raise RuntimeError('a RunFolder resumes inside its block: with RunFolder(options) '
                               'as folder: train(..., folder)')
        from psanet.core.weights import check_state_fits  # the model stack: not for locking
        options, path, logger = self.options, self.resume_model, get_logger()
        state, saved = RunState(seed=options.seed), {}
        if path is None and self._auto:
            logger.info(f'--resume_model auto: no checkpoint in {self.path}: starting at '
                        'iteration 0.')
        elif path is not None:
            loaded, self._loaded = self._loaded, None  # no second copy of the weights kept
            model_state, optimizer_state, saved = loaded or ckpt.load_checkpoint(path)
            _warn_of_another_recipe(options, path, saved)
            check_state_fits(model, model_state, f'the weights of --resume_model {path}',
                             'Resume with the config the checkpoint was trained with (same '
                             'model, backbone, num_classes and mask size), or train this config '
                             'into a new --save_dir.')
            model.set_state_dict(model_state)
            if 'parameter_names' in saved:
                optimizer_state = ckpt.rename_optimizer_state(
                    optimizer_state, saved['parameter_names'], model)
            optimizer.set_state_dict(optimizer_state)
            if scheduler is not None and saved.get('lr_scheduler'):
                scheduler.set_state_dict(saved['lr_scheduler'])
                _warn_of_another_schedule(options, saved, scheduler)
            state = self._resumed_state(saved)
        self._clear_overwritten()
        self._settle_best(state)
        if state.seed is None:
            # Drawn on rank 0 only and summed with zeros: every rank uses the seed that is saved.
            drawn = int(np.random.SeedSequence().generate_state(1)[0]) if self._main else 0
            state.seed = int(dist.all_reduce_sum([drawn])[0])
        return state, saved

    def _resumed_state(self, saved):
        options, path, logger = self.options, self.resume_model, get_logger()
        start = int(saved['iteration'])
        seed = int(saved['seed']) if 'seed' in saved else options.seed
        if options.seed not in (None, seed):
            logger.warning(f'--seed {options.seed} ignored: resuming with the checkpoint\'s '
                           f'seed {seed}.')
        state = RunState(iteration=start, start_iter=start, last_checkpoint=path, seed=seed,
                         best_miou=float(saved.get('best_miou', -1.0)),
                         best_iter=int(saved.get('best_iter', -1)))
        if self._auto and start >= options.iters:
            logger.info(f'--resume_model auto: {path} is the last of {options.iters} iterations: '
                        'the run is done, nothing to train.')
        elif self._auto:
            logger.info(f'--resume_model auto: resuming from {path}, the newest checkpoint in '
                        f'{self.path} that loads, at iteration {start}.')
        else:
            logger.info(f'Resumed from {path} at iteration {start}.')
        return state

    def _clear_overwritten(self):
        if self._in_the_way:
            get_logger().warning(f'--overwrite: deleting {_names(self._in_the_way)} of the '
                                 f'previous run in {self.path}.')
            delete_folders(self._in_the_way)
            self._in_the_way = []

    def _settle_best(self, state):
        """The best mIoU to beat is that of this folder's best_model/ (none: it starts over,
        so that this run keeps one), also when newer than the resumed checkpoint."""
        best = os.path.join(self.path, BEST_MODEL)
        if not os.path.isdir(best):
            if state.best_iter >= 0:
                get_logger().info(
                    f'No {BEST_MODEL}/ in {self.path}: the best mIoU of the resumed run '
                    f'({state.best_miou:.4f} at iter {state.best_iter}) is not kept; this run '
                    'saves its own best model.')
                state.best_miou, state.best_iter = -1.0, -1
            return
        try:
            kept = read_json(os.path.join(best, ckpt.STATE_FILE), ValueError)
        except ValueError:
            return
        iteration = kept.get('iteration') if isinstance(kept, dict) else None
        if isinstance(iteration, int) and iteration > state.start_iter \
                and isinstance(kept.get('miou'), (int, float)):
            state.best_miou, state.best_iter = float(kept['miou']), iteration
            get_logger().info(f'{best} (mIoU {state.best_miou:.4f} at iter {iteration}) is '
                              'newer than the resumed checkpoint: it stays the best to beat.')

    def warn_of_changes(self, run, saved):
        """Warns of what changes the data order against the saved run, each by its cause."""
        batch_size, world_size = run.options.batch_size, run.world_size
        changes = []
        saved_batch = (saved.get('batch_size', batch_size), saved.get('world_size', world_size))
        saved_epoch = saved.get('iters_per_epoch', run.iters_per_epoch)
        if saved_batch != (batch_size, world_size):
            changes.append(f'with batch_size {batch_size} x {world_size} process(es) instead of '
                           f'{saved_batch[0]} x {saved_batch[1]}'
                           + (f' ({run.iters_per_epoch} iterations per epoch instead of '
                              f'{saved_epoch})' if saved_epoch != run.iters_per_epoch else ''))
        if saved.get('num_images', run.num_images) != run.num_images:
            changes.append(f'with {run.num_images} training images instead of '
                           f'{saved["num_images"]} (the training set changed since it was saved)')
        elif 'num_images' not in saved and saved_batch == (batch_size, world_size) \
                and saved_epoch != run.iters_per_epoch:
            changes.append(f'with {run.iters_per_epoch} iterations per epoch instead of '
                           f'{saved_epoch} at the same batch_size (the training set changed '
                           'since it was saved)')
        for change in changes:
            get_logger().warning(f'resuming from {self.resume_model} {change}: the data order '
                                 'differs from an uninterrupted run.')

    def save(self, run, state):
        """Saves iter_<state.iteration> (rank 0) unless saved already, prunes; returns its path."""
        path = os.path.join(self.path, f'iter_{state.iteration}')
        if state.last_checkpoint == path:
            return path
        if self._main:
            train_state = {
                'iteration': state.iteration, 'epoch': state.iteration // run.iters_per_epoch,
                'iters_per_epoch': run.iters_per_epoch, 'seed': state.seed,
                'batch_size': run.options.batch_size, 'world_size': run.world_size,
                'num_images': run.num_images, 'best_miou': state.best_miou,
                'best_iter': state.best_iter,
                'lr_scheduler': run.scheduler.state_dict() if run.scheduler is not None else None,
                'parameter_names': ckpt.parameter_names(run.model),
                'recipe': self.options.recipe}
            if run.scaler is not None:
                train_state['grad_scaler'] = run.scaler.state_dict()
            ckpt.save_checkpoint(path, run.model, run.optimizer, train_state)
            ckpt.prune_checkpoints(self.path, self.options.keep_checkpoint_max)
            get_logger().info(f'Saved checkpoint {path}')
        state.last_checkpoint = path
        return path

    def keep_best(self, model, state, miou):
        """A better ``miou`` than the best so far becomes the best, saved as best_model/."""
        if not miou > state.best_miou:
            return
        state.best_miou, state.best_iter = miou, state.iteration
        if self._main:
            ckpt.save_checkpoint(os.path.join(self.path, BEST_MODEL), model,
                                 state={'iteration': state.iteration, 'miou': miou})


def _names(paths):
    return few(os.path.basename(os.path.normpath(p)) for p in paths)


def _warn_of_another_recipe(options, resume_model, saved):
    if options.recipe is None:
        return
    if saved.get('recipe') is None:
        get_logger().warning(f'{resume_model} does not record its config (saved by an older '
                             'version): that it was trained with this one is not checked.')
        return
    changes = recipe_changes(saved['recipe'], options.recipe)
    if changes:
        get_logger().warning(f'resuming {resume_model} with another config or schedule than it '
                             f'was trained with: {few(changes, 6)}.')


def _warn_of_another_schedule(options, saved, scheduler):
    """Another iters stretches or shrinks the LR schedule: says what the LR is now."""
    saved_iters = (saved.get('recipe') or {}).get('iters')
    saved_lr = saved['lr_scheduler'].get('last_lr')
    if saved_iters is None or saved_iters == options.iters or saved_lr is None:
        return
    new_lr = float(scheduler.get_lr())
    if not np.isclose(new_lr, saved_lr, rtol=1e-6, atol=0):
        get_logger().warning(
            f'iters {saved_iters} -> {options.iters} changes the LR schedule '
            f'({type(scheduler).__name__} over iters): the learning rate at iteration '
            f'{saved["iteration"]} is {new_lr:.6g}, where the saved run was at {saved_lr:.6g}.')
