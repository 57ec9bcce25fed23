"""Training loop: logging, evaluation, atomic checkpoints, exact resume, multi-process and fp16.

:func:`train` runs built components with one :class:`~psanet.core.options.TrainOptions`;
:func:`train_from_config` is train.py's work. What it adds to paddleseg 2.8.0's
``core.train``: docs/design.md.
"""
import dataclasses
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np
import paddle

from psanet import interrupts
from psanet.core import checkpoint as ckpt
from psanet.core import dist, run_dir
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.loader import build_train_loader, raise_if_error
from psanet.core.runtime import amp_enabled, autocast, on_gpu, set_device, to_plain_batchnorm
from psanet.core.options import InferenceOptions, TrainOptions
from psanet.core.val import evaluate
from psanet.errors import ConfigError, Interrupted, TrainingError
from psanet.log import get_logger, log_file, setup_logging
from psanet.visualize.charts import class_names, log_evaluation_figures

__all__ = ['train', 'train_from_config', 'loss_terms', 'iteration_seed']


def loss_terms(logits, label, losses):
    """The weighted loss terms, one per logit (a MixedLoss gives several).

    Args:
        logits (list): the model's logits, main first.
        label (Tensor): int64 [N, H, W].
        losses (dict): ``{'types': [...], 'coef': [...]}`` from the config.

    Returns:
        list: 0-D tensors ``coef_i * loss_i(logit_i, label)``.
    """
    types, coefs = losses['types'], losses['coef']
    if len(logits) != len(types):
        raise ConfigError(
            f'the model returns {len(logits)} logits (main first, then auxiliary ones) but the '
            f'loss config has {len(types)} types and coef {list(coefs)}: give one coef per logit, '
            'e.g. `coef: [1, 0.4]` with enable_auxiliary_loss: True, `coef: [1]` without.')
    terms = []
    for logit, loss_fn, coef in zip(logits, types, coefs):
        if type(loss_fn).__name__ == 'MixedLoss':
            terms.extend(coef * term for term in loss_fn(logit, label))
        else:
            terms.append(coef * loss_fn(logit, label))
    return terms


def iteration_seed(seed, iteration, rank=0):
    """Paddle's seed for one iteration on one rank.

    Dropout then does not depend on where a run was resumed, and ranks draw
    different masks for their different images.
    """
    return int(np.random.SeedSequence([int(seed), int(iteration), int(rank)]).generate_state(1)[0])


def _format_eta(seconds):
    seconds = int(max(seconds, 0))
    return f'{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}'


_RESUME_ANOTHER_MODEL = ('Resume with the config the checkpoint was trained with (same model, '
                         'backbone, num_classes and mask size), or train this config into a new '
                         '--save_dir.')


def format_batch_size(batch_size, world_size, recipe_batch_size=None, unit='card'):
    """How many images a step takes, for the start-of-training log line.

    One process: ``batch_size B x 1 process(es)``. More: batch_size is per
    process, so W processes take B x W images a step, not the B a config's
    recipe (written for one card) assumes; the line says so and which
    ``--batch_size`` gives the recipe's step.

    Args:
        batch_size (int): images per process and step.
        world_size (int): processes.
        recipe_batch_size (int, optional): images per step the config's recipe
            assumes (the config file's batch_size); None leaves the comparison out.
        unit (str, optional): what a process runs on, 'card' or 'process'. Default: 'card'.

    Returns:
        str: e.g. ``batch_size 8 per card x 4 cards = 32 images per step; the config's
        recipe assumes 8 per step on one card: use --batch_size 2 for it``.
    """
    if world_size == 1:
        return f'batch_size {batch_size} x {world_size} process(es)'
    units = unit + ('es' if unit.endswith('s') else 's')
    step = batch_size * world_size
    line = f'batch_size {batch_size} per {unit} x {world_size} {units} = {step} images per step'
    if recipe_batch_size is None:
        return line
    recipe = f"the config's recipe assumes {recipe_batch_size} per step on one card"
    if step == recipe_batch_size:
        return f"{line}, as the config's recipe ({recipe_batch_size} per step on one card)"
    if recipe_batch_size % world_size == 0:
        return f'{line}; {recipe}: use --batch_size {recipe_batch_size // world_size} for it'
    return f'{line}; {recipe}, which {world_size} {units} cannot split evenly'


def _resume_changes(state, batch_size, world_size, iters_per_epoch, num_images):
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


def _batchnorm_setup(model, sync_bn, world_size, logger):
    if world_size == 1:
        logger.info('BatchNorm: plain BatchNorm (one process).')
        return model
    if not on_gpu():
        logger.info(f'BatchNorm: plain BatchNorm per process ({world_size} CPU processes; '
                    'SyncBatchNorm has no CPU kernel).')
        return model
    if sync_bn:
        logger.info(f'BatchNorm: SyncBatchNorm across {world_size} GPUs.')
        return paddle.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    logger.info(f'BatchNorm: plain BatchNorm per GPU (sync_bn: false) on {world_size} GPUs.')
    return to_plain_batchnorm(model)


def _lr_scheduler(optimizer):
    scheduler = optimizer._learning_rate
    return scheduler if isinstance(scheduler, paddle.optimizer.lr.LRScheduler) else None


class _Averager:
    """Sums of loss terms and timings between two log lines."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.terms = None
        self.steps = 0
        self.batch_cost = 0.0
        self.reader_cost = 0.0
        self.samples = 0

    def add(self, terms, batch_cost, reader_cost, samples):
        self.terms = np.array(terms) if self.terms is None else self.terms + terms
        self.steps += 1
        self.batch_cost += batch_cost
        self.reader_cost += reader_cost
        self.samples += samples


@dataclass
class _RunState:
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


@dataclass
class _Run:
    """What stays fixed through a run: the model and its optimizer, the data, the options."""
    model: paddle.nn.Layer
    runner: paddle.nn.Layer  # the model, in paddle.DataParallel on more than one process
    optimizer: paddle.optimizer.Optimizer
    scheduler: Optional[paddle.optimizer.lr.LRScheduler]
    scaler: Optional[paddle.amp.GradScaler]
    losses: dict
    loader: paddle.io.DataLoader
    sampler: paddle.io.DistributedBatchSampler
    reader: paddle.io.Dataset
    iters_per_epoch: int
    num_images: int
    world_size: int
    val_dataset: Optional[paddle.io.Dataset]
    options: TrainOptions
    writer: object
    logger: object
    main: bool


class _Step(NamedTuple):
    """One iteration's loss terms: the mean over ranks and this rank's; the LR it used;
    whether a rank was signalled (every rank then stops after this step)."""
    terms: np.ndarray
    local_terms: np.ndarray
    lr: float
    stop: bool


def train(model, train_dataset, optimizer, losses, options, val_dataset=None, logger=None):
    """Trains ``model`` for ``options.iters`` iterations.

    Args:
        model (paddle.nn.Layer): the model; ``optimizer`` must hold its parameters.
        train_dataset (paddle.io.Dataset): a paddleseg dataset in 'train' mode.
        optimizer (paddle.optimizer.Optimizer): with an LR scheduler as learning rate.
        losses (dict): ``{'types': [...], 'coef': [...]}``, one type per logit.
        options (TrainOptions): iters, batch_size, save_dir, intervals, seed, precision, ...
        val_dataset (paddle.io.Dataset, optional): evaluated every save_interval
            (mIoU and validation loss) as ``options.evaluation`` says; the best model
            goes to best_model/. Default: None.
        logger (logging.Logger, optional): Default: the 'psanet' logger, also writing
            <save_dir>/train.log.

    Returns:
        dict: ``losses`` (the global mean total loss of every iteration run here),
        ``loss_terms`` (per term), ``local_losses`` (this rank's totals), ``start_iter``,
        ``last_checkpoint``, ``best_miou``, ``best_iter``, ``evals`` ([(iteration, result)])
        and ``seed`` (the one used, as saved in the checkpoints).

    Raises:
        ConfigError: when save_dir holds another run's checkpoints or another process
            trains in it.
        CheckpointError: when resume_model does not fit the model.
        Interrupted: after the step in which Ctrl-C or SIGTERM came (recorded within
            ``psanet.interrupts.stop_at_boundaries``, as under ``run_cli``), once its
            checkpoint is saved; the message names it.
    """
    options.check_schedule()
    if logger is None:
        setup_logging(dist.is_main_process())
    with run_dir.own_save_dir(options.save_dir, options.resume_model, options.overwrite, logger), \
            log_file(os.path.join(options.save_dir, 'train.log'), dist.is_main_process()):
        return _train(model, train_dataset, optimizer, losses, options, val_dataset, logger)


def _train(model, train_dataset, optimizer, losses, options, val_dataset, logger):
    """:func:`train` in a save_dir that this run owns."""
    main = dist.is_main_process()
    world_size = dist.world_size()
    logger = logger or get_logger()
    if options.use_vdl and main:
        _check_visualdl()
    scheduler = _lr_scheduler(optimizer)
    state, saved = _resume(options, model, optimizer, scheduler, logger)
    # Only now that the checkpoint has loaded and fits: what --overwrite deletes.
    run_dir.clear_overwritten(options.save_dir)
    _forget_best_elsewhere(state, options.save_dir, logger)
    if state.seed is None:
        state.seed = _draw_seed(main)
    logger.info(f'Seed: {state.seed}')

    model = _batchnorm_setup(model, options.sync_bn, world_size, logger)
    model, optimizer, scaler = _mixed_precision_setup(model, optimizer, options, saved, logger)
    runner = paddle.DataParallel(model) if world_size > 1 else model
    loader, sampler, reader = build_train_loader(train_dataset, options.batch_size, state.seed,
                                                 options.num_workers)
    for change in _resume_changes(saved, options.batch_size, world_size, len(sampler),
                                  len(train_dataset)):
        logger.warning(f'resuming from {options.resume_model} {change}: the data order differs '
                       'from an uninterrupted run.')
    run = _Run(model=model, runner=runner, optimizer=optimizer, scheduler=scheduler,
               scaler=scaler, losses=losses, loader=loader, sampler=sampler, reader=reader,
               iters_per_epoch=len(sampler), num_images=len(train_dataset),
               world_size=world_size, val_dataset=val_dataset, options=options,
               writer=_visualdl_writer(options.save_dir) if options.use_vdl and main else None,
               logger=logger, main=main)

    model.train()
    images_per_step = format_batch_size(options.batch_size, world_size,
                                        options.recipe_batch_size,
                                        unit='card' if on_gpu() else 'process')
    logger.info(f'Training {options.iters} iterations from {state.start_iter}: '
                f'{len(train_dataset)} images, {run.iters_per_epoch} iterations per epoch, '
                f'{images_per_step}.')
    _train_loop(run, state)
    if run.writer is not None:
        run.writer.close()
    logger.info(f'Training done: {state.iteration} iterations, checkpoints in '
                f'{options.save_dir}.')
    return state.result()


def _train_loop(run, state):
    """The iterations from ``state.iteration`` to ``run.options.iters``.

    Each is a step; every log_iters (and the last) ends with a log line, every
    save_interval (and the last) with an evaluation and a checkpoint.
    """
    options = run.options
    averager = _Averager()
    batch_start = time.time()
    while state.iteration < options.iters:
        epoch = state.iteration // run.iters_per_epoch
        run.sampler.set_epoch(epoch, start_batch=state.iteration % run.iters_per_epoch)
        run.reader.set_epoch(epoch)
        epoch_start_iteration = state.iteration
        for data in run.loader:
            reader_cost = time.time() - batch_start
            raise_if_error(data)
            state.iteration += 1
            step = _train_step(run, state, data, epoch)
            state.record(step)
            averager.add(step.terms, time.time() - batch_start, reader_cost,
                         options.batch_size * run.world_size)
            last = state.iteration == options.iters
            if state.iteration % options.log_iters == 0 or last:
                _log_interval(run, state.iteration, averager, step.lr)
            stop = step.stop
            if state.iteration % options.save_interval == 0 or last:
                stop = _evaluate_and_checkpoint(run, state) or stop
            if stop and not last:
                _stop(run, state)
            batch_start = time.time()
            if state.iteration >= options.iters:
                break
        if state.iteration == epoch_start_iteration:
            # Guards the while loop against spinning on a loader that yields nothing.
            raise RuntimeError(f'the data loader gave no batch in epoch {epoch + 1}; see the '
                               'messages above for the failing worker.')


def _forget_best_elsewhere(state, save_dir, logger):
    """A resumed best mIoU whose best_model/ is not in this save_dir (resumed into a new
    folder, or deleted by --overwrite) starts over, so that this run keeps a best_model/."""
    if state.best_iter < 0 or os.path.isdir(os.path.join(save_dir, run_dir.BEST_MODEL)):
        return
    logger.info(f'No {run_dir.BEST_MODEL}/ in {save_dir}: the best mIoU of the resumed run '
                f'({state.best_miou:.4f} at iter {state.best_iter}) is not kept; this run saves '
                'its own best model.')
    state.best_miou, state.best_iter = -1.0, -1


def _resume(options, model, optimizer, scheduler, logger):
    """Loads ``options.resume_model`` (None: none) into the model, the optimizer and the
    scheduler.

    Returns:
        tuple: the :class:`_RunState` to start from, its seed the checkpoint's (else
        ``options.seed``), and the checkpoint's train_state ({} without resume_model).
    """
    resume_model, iters, seed = options.resume_model, options.iters, options.seed
    if resume_model is None:
        return _RunState(seed=seed), {}
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
    state = _RunState(iteration=start_iter, start_iter=start_iter,
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


def _draw_seed(main):
    # Drawn on rank 0 only and summed with zeros: every rank uses the seed that is saved.
    drawn = int(np.random.SeedSequence().generate_state(1)[0]) if main else 0
    return int(dist.all_reduce_sum([drawn])[0])


def _mixed_precision_setup(model, optimizer, options, saved, logger):
    """(model, optimizer, GradScaler or None); the scaler's state from ``saved`` when resuming."""
    precision, amp_level = options.precision, options.amp_level
    use_amp = amp_enabled(precision)
    if precision == 'fp16' and not use_amp:
        logger.warning('--precision fp16 is ignored on CPU (no fp16 kernels): training in fp32.')
    if not use_amp:
        return model, optimizer, None
    logger.info(f'Mixed precision: fp16 autocast, level {amp_level}, with GradScaler.')
    scaler = paddle.amp.GradScaler(init_loss_scaling=1024)
    if 'grad_scaler' in saved:
        scaler.load_state_dict(saved['grad_scaler'])
    if amp_level == 'O2':
        model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, level='O2',
                                               save_dtype='float32')
    return model, optimizer, scaler


def _check_visualdl():
    import importlib.util
    try:
        found = importlib.util.find_spec('visualdl') is not None
    except ValueError:  # a visualdl in sys.modules without a __spec__
        found = False
    if not found:
        raise ConfigError('--use_vdl needs VisualDL, which is not installed: pip install '
                          'visualdl (or train without --use_vdl).')


def _visualdl_writer(save_dir):
    from visualdl import LogWriter
    return LogWriter(save_dir)


def _train_step(run, state, data, epoch):
    """Forward, backward and optimizer step on one batch, at ``state.iteration``.

    Raises:
        TrainingError: when a loss term (the mean over ranks) is NaN or Inf; nothing is
            stepped then.
    """
    paddle.seed(iteration_seed(state.seed, state.iteration, dist.rank()))
    with autocast(run.options.precision, run.options.amp_level):
        logits = run.runner(data['img'])
        terms = loss_terms(logits, data['label'], run.losses)
        loss = paddle.add_n(terms) if len(terms) > 1 else terms[0]
    local_terms = paddle.stack([t.detach().astype('float32') for t in terms]).numpy()
    # The stop request travels with the loss: all ranks see it after the same step.
    summed = dist.all_reduce_sum(np.append(local_terms, interrupts.requested() is not None))
    mean_terms, stop = summed[:-1] / run.world_size, bool(summed[-1] > 0)
    if not np.all(np.isfinite(mean_terms)):
        raise _not_finite_error(mean_terms, state, epoch, run.options.save_interval)
    if run.scaler is not None:
        run.scaler.scale(loss).backward()
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        loss.backward()
        run.optimizer.step()
    lr = run.optimizer.get_lr()
    if run.scheduler is not None:
        run.scheduler.step()
    run.optimizer.clear_grad()
    return _Step(mean_terms, local_terms, lr, stop)


def _not_finite_error(mean_terms, state, epoch, save_interval):
    where = (f'The last good checkpoint is {state.last_checkpoint}: resume with '
             f'--resume_model {state.last_checkpoint}, e.g. with a lower --learning_rate.'
             if state.last_checkpoint else
             f'No checkpoint was saved yet (save_interval {save_interval}); lower '
             '--learning_rate and start again.')
    return TrainingError(f'the loss is {mean_terms.sum()} (terms {mean_terms.tolist()}) at '
                         f'iteration {state.iteration} (epoch {epoch + 1}): training stopped. '
                         + where)


def _log_interval(run, iteration, averager, lr):
    """Logs (and writes to VisualDL) the means since the last log line; starts the next."""
    mean_terms = averager.terms / averager.steps
    batch_cost = averager.batch_cost / averager.steps
    reader_cost = averager.reader_cost / averager.steps
    ips = averager.samples / max(averager.batch_cost, 1e-12)
    term_text = ''.join(f', loss_{i}: {v:.4f}' for i, v in enumerate(mean_terms)) \
        if len(mean_terms) > 1 else ''
    iters = run.options.iters
    run.logger.info(
        f'[TRAIN] epoch: {(iteration - 1) // run.iters_per_epoch + 1}, iter: '
        f'{iteration}/{iters}, loss: {mean_terms.sum():.4f}{term_text}, lr: {lr:.6f}, '
        f'batch_cost: {batch_cost:.4f}, reader_cost: {reader_cost:.5f}, ips: '
        f'{ips:.4f} samples/sec | ETA {_format_eta((iters - iteration) * batch_cost)}')
    if run.writer is not None:
        run.writer.add_scalar('Train/loss', float(mean_terms.sum()), iteration)
        if len(mean_terms) > 1:
            for i, v in enumerate(mean_terms):
                run.writer.add_scalar(f'Train/loss_{i}', float(v), iteration)
        run.writer.add_scalar('Train/lr', lr, iteration)
        run.writer.add_scalar('Train/batch_cost', batch_cost, iteration)
        run.writer.add_scalar('Train/reader_cost', reader_cost, iteration)
    averager.reset()


def _evaluate_and_checkpoint(run, state):
    """Evaluates (with a val_dataset), keeps the best model, saves iter_<iteration>.

    Returns:
        bool: True when a signal abandoned the evaluation (the checkpoint is saved).
    """
    # Plain BatchNorm statistics differ per process: evaluate and save rank 0's,
    # and let every rank continue from them, as a resumed run does.
    dist.broadcast_buffers(run.model)
    stopped = False
    if run.val_dataset is not None:
        try:
            _evaluate(run, state)
        except Interrupted:  # every rank raises it (psanet.core.val): the run stops
            run.model.train()
            run.logger.info(f'Evaluation at iter {state.iteration} abandoned for the stop.')
            stopped = True
    _save_checkpoint(run, state)
    return stopped


def _save_checkpoint(run, state):
    path = os.path.join(run.options.save_dir, f'iter_{state.iteration}')
    if run.main:
        ckpt.save_checkpoint(path, run.model, run.optimizer, _checkpoint_state(run, state))
        ckpt.prune_checkpoints(run.options.save_dir, run.options.keep_checkpoint_max)
        run.logger.info(f'Saved checkpoint {path}')
    state.last_checkpoint = path


def _stop(run, state):
    """Ends the run after the step in which a signal came: saves the step's checkpoint
    (unless it has one), logs how to resume and raises :class:`Interrupted`."""
    path = os.path.join(run.options.save_dir, f'iter_{state.iteration}')
    if state.last_checkpoint != path:
        _save_checkpoint(run, state)
    # No rank exits before rank 0 has written: the launcher ends the others when one exits.
    dist.all_reduce_sum([0])
    signum = interrupts.requested() or signal.SIGTERM  # a rank stopping for another's signal
    run.logger.info(f'resume with: {_resume_command(path, run.world_size)}')
    what = 'interrupted (Ctrl-C)' if signum == signal.SIGINT else 'stopped by SIGTERM'
    raise interrupts.stopped(signum, f'training {what} after iteration {state.iteration}; '
                                     f'its checkpoint is {path}')


def _resume_command(path, world_size):
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


def _evaluate(run, state):
    """Evaluates; a better mIoU than the best goes to best_model/."""
    result = evaluate(run.model, run.val_dataset, run.options.evaluation,
                      num_workers=run.options.num_workers, losses=run.losses, logger=run.logger)
    state.evals.append((state.iteration, result))
    run.model.train()
    if result['miou'] > state.best_miou:
        state.best_miou, state.best_iter = result['miou'], state.iteration
        if run.main:
            ckpt.save_checkpoint(os.path.join(run.options.save_dir, run_dir.BEST_MODEL),
                                 run.model,
                                 state={'iteration': state.iteration, 'miou': state.best_miou})
    run.logger.info(f'[EVAL] The model with the best validation mIoU '
                    f'({state.best_miou:.4f}) was saved at iter {state.best_iter}.')
    if run.writer is not None:
        run.writer.add_scalar('Evaluate/mIoU', result['miou'], state.iteration)
        run.writer.add_scalar('Evaluate/Acc', result['acc'], state.iteration)
        if result['loss'] is not None:
            run.writer.add_scalar('Evaluate/loss', result['loss'], state.iteration)
        log_evaluation_figures(run.writer, result,
                               class_names(run.val_dataset.num_classes, run.val_dataset),
                               state.iteration)


def _checkpoint_state(run, state):
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


def train_from_config(config, device=None, learning_rate=None, do_eval=False, opts=None,
                      **flags):
    """train.py: builds everything from ``config`` and calls :func:`train`.

    Args:
        config (str): the config file.
        device (str, optional): 'cpu' or 'gpu'; None: the GPU when Paddle sees one.
        learning_rate (float, optional): overrides lr_scheduler.learning_rate. Default: None.
        do_eval (bool, optional): evaluate every save_interval, keep best_model/.
            Default: False.
        opts (list, optional): ``key=value`` config overrides. Default: None.
        **flags: train.py's other flags, the fields of :class:`TrainOptions`
            (``iters`` and ``batch_size`` override the config when given).

    Returns:
        dict: the result of :func:`train`.
    """
    options = TrainOptions(**flags)  # checked before anything is built or written
    set_device(device)
    dist.init_parallel()
    cfg = load_config(config, learning_rate=learning_rate, batch_size=options.batch_size,
                      iters=options.iters, opts=opts)
    options = dataclasses.replace(
        options, iters=cfg.iters, batch_size=cfg.batch_size,
        sync_bn=bool(cfg.dic.get('sync_bn', True)), recipe_batch_size=_recipe_batch_size(config),
        evaluation=InferenceOptions.from_flags({}, cfg.dic.get('test_config')))
    # Owned before train.log is opened: a refused run writes nothing into the folder.
    with run_dir.own_save_dir(options.save_dir, options.resume_model, options.overwrite,
                              get_logger()):
        if options.seed is not None:
            paddle.seed(options.seed)
            np.random.seed(options.seed % 2**32)
        builder = ComponentBuilder(cfg)
        train_dataset = builder.dataset('train')
        val_dataset = builder.dataset('val') if do_eval else None
        model = builder.model
        losses = builder.losses
        optimizer = builder.optimizer
        with log_file(os.path.join(options.save_dir, 'train.log'), dist.is_main_process()):
            get_logger().info(f'Config {config}; Paddle {paddle.__version__}, device '
                              f'{paddle.get_device()}, {dist.world_size()} process(es).')
            # The folder is owned and train.log open already: train()'s body, not train().
            setup_logging(dist.is_main_process())
            return _train(model, train_dataset, optimizer, losses, options, val_dataset, None)


def _recipe_batch_size(config):
    """The config file's batch_size, before --batch_size and --opts; None if the file cannot
    be read without its --opts. Read only with more than one process, where the log uses it."""
    if dist.world_size() == 1:
        return None
    try:
        return load_config(config).batch_size
    except ConfigError:  # the file needs its --opts to pass the checks
        return None
