"""A training run's save_dir, owned by one :class:`RunFolder` from the run's start to its end.

Opening it locks the folder, picks and reads the checkpoint to resume
(``--resume_model auto``: the newest that loads) and refuses what would mix two
runs; only rank 0 looks, and one all-reduce tells every rank. Then it resumes the
model, optimizer and LR scheduler, saves ``iter_N``, keeps ``best_model/``, and on
closing removes what an interrupted save left and unlocks. Why: docs/design.md.
"""
import contextlib
import errno
import fcntl
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from psanet.contract import read_json
from psanet.core import checkpoint as ckpt
from psanet.core import dist
from psanet.core.options import RESUME_AUTO, recipe_changes
from psanet.errors import CheckpointError, ConfigError, few
from psanet.files import delete_folders, remove_stale_temporaries
from psanet.log import get_logger

__all__ = ['LOCK_FILE', 'BEST_MODEL', 'RunState', 'RunFolder']

LOCK_FILE = '.train.lock'
BEST_MODEL = 'best_model'


@dataclass
class RunState:
    """What a run changes as it goes: where it is, its best evaluation, its losses.

    ``losses``, ``loss_terms``, ``local_losses`` and ``evals`` are per
    iteration (per evaluation) run here, as :func:`~psanet.core.train.train` returns them.
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


class RunFolder:
    """``options.save_dir`` for one training run: ``with RunFolder(options) as folder:``.

    Entering raises, on every rank and before anything is written: ConfigError when
    the folder holds another run's checkpoints or another process trains in it, when
    a given checkpoint is not before ``options.iters``, or when the one 'auto' picks
    was trained with another recipe; CheckpointError when the checkpoint to resume
    does not load, or its name and its train_state.json disagree on its iteration.

    Attributes:
        options (TrainOptions): the run's.
        path (str): the folder (``options.save_dir``).
        resume_model (str): the checkpoint the run continues from: the one given, or
            for 'auto' the newest that loads (None: it starts).
    """

    def __init__(self, options):
        self.options, self.path = options, options.save_dir
        self._auto = options.resume_model == RESUME_AUTO
        self.resume_model = None if self._auto else options.resume_model
        self._main = dist.is_main_process()
        self._lock, self._open = None, False
        self._loaded = None  # rank 0: what was read of resume_model, until resume() takes it
        self._in_the_way = []  # rank 0, --overwrite: deleted once resume() has loaded

    def __enter__(self):
        self.options.check_schedule()
        error, picked = None, None
        if self._main:
            try:
                self._lock = _SaveDirLock(self.path)
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
                if error is not None:
                    raise error
                raise ConfigError(f'rank 0 refused --save_dir {self.path}: its error says why '
                                  '(workerlog.0 with paddle.distributed.launch).')
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
        """Rank 0: picks and reads the checkpoint to resume; refuses what would mix two runs."""
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
        """'auto': the newest iter_N that loads; a newer one that does not is named in a
        warning and passed over (it stays until this run saves that iteration again)."""
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
        """Refuses the checkpoints a new run would mix with its own, or with ``overwrite``
        returns them, to be deleted once the resumed checkpoint has loaded."""
        save_dir, resume_model = self.path, self.resume_model
        if resume_model is not None and not os.path.isdir(resume_model):
            return []  # load_checkpoint says what is wrong with it
        checkpoints = ckpt.list_checkpoints(save_dir)
        best = os.path.join(save_dir, BEST_MODEL)
        best = best if os.path.isdir(best) else None
        if not checkpoints and best is None:
            return []
        parent = os.path.dirname(os.path.abspath(os.path.normpath(resume_model or '.')))
        if resume_model is not None and os.path.realpath(parent) == os.path.realpath(save_dir):
            start = ckpt.checkpoint_iteration(resume_model)
            in_the_way = [path for iteration, path in checkpoints
                          if start is not None and iteration > start]
            best_iteration = ckpt.checkpoint_iteration(best) if best else None
            if start is not None and best_iteration is not None and best_iteration > start:
                in_the_way.append(best)
            if in_the_way and not self.options.overwrite:
                raise ConfigError(
                    f'--resume_model {resume_model} is not the latest checkpoint in --save_dir '
                    f'{save_dir}: continuing from it would overwrite {_names(in_the_way)}. '
                    f'Resume from {checkpoints[-1][1]}, write this run to a new --save_dir, or '
                    'pass --overwrite to delete them.')
            return in_the_way
        in_the_way = [path for _, path in checkpoints] + ([best] if best else [])
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
        """Loads ``resume_model`` (None: none) into the model, the optimizer and the scheduler,
        then deletes what ``--overwrite`` replaces and settles the best mIoU to beat.

        Returns:
            tuple: the :class:`RunState` to start from, its seed the checkpoint's, else
            ``options.seed``, else drawn; and the checkpoint's train_state ({}: none).
        """
        if not self._open:
            raise RuntimeError('a RunFolder resumes inside its block: with RunFolder(options) '
                               'as folder: train(..., folder)')
        # Imported here: the model stack, which locking a folder does not need.
        from psanet.core.weights import check_state_fits
        options, path, logger = self.options, self.resume_model, get_logger()
        state, saved = RunState(seed=options.seed), {}
        if path is None and self._auto:
            logger.info(f'--resume_model auto: no checkpoint in {self.path}: starting at '
                        'iteration 0.')
        elif path is not None:
            # Taken, not kept: no second copy of the weights held through training.
            loaded, self._loaded = self._loaded, None
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
        state = RunState(iteration=start, start_iter=start,
                         best_miou=float(saved.get('best_miou', -1.0)),
                         best_iter=int(saved.get('best_iter', -1)), last_checkpoint=path,
                         seed=options.seed)
        if 'seed' in saved:
            if options.seed is not None and options.seed != saved['seed']:
                logger.warning(f'--seed {options.seed} ignored: resuming with the checkpoint\'s '
                               f'seed {saved["seed"]}.')
            state.seed = int(saved['seed'])
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
        """Deletes what ``overwrite`` replaces (rank 0, once)."""
        if self._in_the_way:
            get_logger().warning(f'--overwrite: deleting {_names(self._in_the_way)} of the '
                                 f'previous run in {self.path}.')
            delete_folders(self._in_the_way)
            self._in_the_way = []

    def _settle_best(self, state):
        """The best mIoU to beat is that of this folder's best_model/: without one (resumed
        into a new folder, or deleted by --overwrite) the resumed best starts over, so that
        this run keeps a best_model/; one newer than the resumed checkpoint (``auto``
        passed over one that does not load) is adopted."""
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
        """Warns of what differs from the run that saved the resumed checkpoint, each by its
        cause: another batch_size or process count changes the iterations per epoch by
        itself; only a change they do not explain means the training set changed."""
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
        """Saves iter_<state.iteration> (rank 0), unless it is saved already, and prunes to
        ``keep_checkpoint_max``; its train_state.json holds what an exact resume needs.

        Returns:
            str: its path.
        """
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
    names = [os.path.basename(os.path.normpath(p)) for p in paths]
    if len(names) <= 5:
        return ', '.join(names)
    return f'{", ".join(names[:2])}, ..., {", ".join(names[-2:])} ({len(names)} folders)'


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
    """Another iters stretches or shrinks the LR schedule (its decay steps are iters):
    says what the learning rate is now, against the saved run's."""
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


class _SaveDirLock:
    """An exclusive ``flock`` on ``<save_dir>/.train.lock``, which names the holder."""

    def __init__(self, save_dir):
        try:
            os.makedirs(save_dir, exist_ok=True)
        except OSError as error:
            raise ConfigError(f'--save_dir {save_dir} cannot be created ({error}): pick a '
                              'folder you can write to.') from error
        self.path = os.path.join(save_dir, LOCK_FILE)
        self.fd = None
        while self.fd is None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except PermissionError as error:
                raise ConfigError(f'--save_dir {save_dir} is not writable ({error}): pick a '
                                  'folder you can write to.') from error
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors='replace').strip()
                os.close(fd)
                raise ConfigError(
                    f'--save_dir {save_dir} is in use by another training '
                    f'({holder or "pid unknown"}): two runs in one folder would mix their '
                    'checkpoints and train.log; wait for it to end or pick another '
                    '--save_dir.') from None
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                get_logger().warning(
                    f'--save_dir {save_dir} cannot be locked on this file system ({error}): '
                    'a second run started in it at once would not be refused.')
                return
            # A holder deletes the file before unlocking it: hold the file that is there now.
            try:
                current = os.stat(self.path)
            except FileNotFoundError:
                current = None
            if current is not None and os.path.samestat(os.fstat(fd), current):
                self.fd = fd
            else:
                os.close(fd)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f'pid {os.getpid()} on {socket.gethostname()}, started '
                          f'{time.strftime("%Y-%m-%d %H:%M:%S")}\n'.encode())

    def release(self):
        """Deletes the lock file, then unlocks it."""
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)
        os.close(self.fd)
        self.fd = None
