"""Training loop: steps, evaluation, atomic checkpoints, exact resume, multi-process and fp16.

:func:`train` runs built components in a :class:`~psanet.core.run_folder.RunFolder`, which
owns the save_dir; :func:`train_from_config` is train.py's work. What it adds to paddleseg
2.8.0's ``core.train``: docs/design.md.
"""
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import paddle

from psanet import interrupts
from psanet.core import dist
from psanet.core.config import ComponentBuilder, load_config, set_schedule
from psanet.core.data_loader import build_train_loader, raise_if_error
from psanet.core.options import RESUME_AUTO, TrainOptions
from psanet.core.run_folder import RunFolder
from psanet.core.device import amp_enabled, autocast, on_gpu, set_device, to_plain_batchnorm
from psanet.core.train_log import (Averager, check_visualdl, format_batch_size, log_evaluation,
                                   log_interval, visualdl_writer)
from psanet.core.val import evaluate
from psanet.errors import ConfigError, Interrupted, TrainingError
from psanet.log import get_logger, log_file, setup_logging

__all__ = ['train', 'train_from_config', 'loss_terms', 'iteration_seed', 'resume_command']


def loss_terms(logits, label, losses):
    """``coef_i * loss_i(logit_i, label)`` for each logit (main first), 0-D tensors; a
    MixedLoss gives several."""
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


@dataclass
class _Run:
    """What stays fixed through a run: the model and its optimizer, the data, the folder."""
    folder: RunFolder
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


def train(model, train_dataset, optimizer, losses, folder, val_dataset=None):
    """Trains ``model`` for ``folder.options.iters`` iterations in the open ``folder``
    (``with RunFolder(options) as folder:``); ``val_dataset`` is evaluated every
    save_interval, the best model kept in best_model/.

    Returns:
        dict: :meth:`RunState.result`: ``losses`` (the mean over ranks of every iteration run
        here), ``local_losses`` (this rank's), ``evals`` ([(iteration, result)]), the seed
        used, ...

    Raises:
        Interrupted: after the step in which Ctrl-C or SIGTERM came (recorded within
            ``psanet.interrupts.stop_at_boundaries``, as under ``run_cli``), once its
            checkpoint is saved; the message names it.
    """
    main = dist.is_main_process()
    setup_logging(main)
    with log_file(os.path.join(folder.path, 'train.log'), main):
        return _train(model, train_dataset, optimizer, losses, folder, val_dataset, get_logger())


def _train(model, train_dataset, optimizer, losses, folder, val_dataset, logger):
    options = folder.options
    if options.config is not None:
        logger.info(f'Config {options.config}; Paddle {paddle.__version__}, device '
                    f'{paddle.get_device()}, {dist.world_size()} process(es).')
    main = dist.is_main_process()
    world_size = dist.world_size()
    if options.use_vdl and main:
        check_visualdl()
    scheduler = _lr_scheduler(optimizer)
    state, saved = folder.resume(model, optimizer, scheduler)
    logger.info(f'Seed: {state.seed}')

    model = _batchnorm_setup(model, options.sync_bn, world_size, logger)
    model, optimizer, scaler = _mixed_precision_setup(model, optimizer, options, saved, logger)
    runner = paddle.DataParallel(model) if world_size > 1 else model
    loader, sampler, reader = build_train_loader(train_dataset, options.batch_size, state.seed,
                                                 options.num_workers)
    run = _Run(folder=folder, model=model, runner=runner, optimizer=optimizer,
               scheduler=scheduler, scaler=scaler, losses=losses, loader=loader, sampler=sampler,
               reader=reader, iters_per_epoch=len(sampler), num_images=len(train_dataset),
               world_size=world_size, val_dataset=val_dataset, options=options,
               writer=visualdl_writer(folder.path) if options.use_vdl and main else None,
               logger=logger, main=main)
    folder.warn_of_changes(run, saved)

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
                f'{folder.path}.')
    return state.result()


def _train_loop(run, state):
    """The iterations from ``state.iteration`` to ``run.options.iters``."""
    options = run.options
    averager = Averager()
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
                log_interval(run, state.iteration, averager, step.lr)
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


def _train_step(run, state, data, epoch):
    """Forward, backward and optimizer step on one batch; a NaN or Inf loss term (the mean
    over ranks) raises TrainingError before anything is stepped."""
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


def _evaluate_and_checkpoint(run, state):
    """Evaluates (with a val_dataset), keeps the best model, saves iter_<iteration>; True
    when a signal abandoned the evaluation."""
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
    run.folder.save(run, state)
    return stopped


def _stop(run, state):
    """Ends the run after the step in which a signal came: saves the step's checkpoint
    (unless it has one), logs how to resume and raises :class:`Interrupted`."""
    path = run.folder.save(run, state)
    # No rank exits before rank 0 has written: the launcher ends the others when one exits.
    dist.all_reduce_sum([0])
    signum = interrupts.requested() or signal.SIGTERM  # a rank stopping for another's signal
    command = resume_command(path, run.world_size, run.options)
    run.logger.info(f'resume with: {command}')
    what = 'interrupted (Ctrl-C)' if signum == signal.SIGINT else 'stopped by SIGTERM'
    _tell_launcher_console(run, state, path, command)
    raise interrupts.stopped(signum, f'training {what} after iteration {state.iteration}; '
                                     f'its checkpoint is {path}')


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
    # psanet.launch names its stop note in the ranks' environment.
    launcher = 'psanet.launch' if os.environ.get(interrupts.STOP_NOTE) else \
        'paddle.distributed.launch'
    launch = (['-m', launcher, '--nproc_per_node', str(world_size)] if world_size > 1 else [])
    return shlex.join(['python'] + launch) + ' ' + train


def _tell_launcher_console(run, state, path, command):
    """The stop, where the user of the launcher looks: its console."""
    dist.tell_launcher(
        f'psanet: training stopped after iteration {state.iteration} on every rank (the '
        f'launcher passes a Ctrl-C or SIGTERM on as SIGTERM); its checkpoint is {path}; the '
        f'log: {os.path.join(run.folder.path, "train.log")}.\n'
        f'psanet: resume with: {command}\n')


def _evaluate(run, state):
    """Evaluates; a better mIoU than the best goes to best_model/."""
    result = evaluate(run.model, run.val_dataset, run.options.evaluation, losses=run.losses,
                      logger=run.logger)
    state.evals.append((state.iteration, result))
    run.model.train()
    run.folder.keep_best(run.model, state, result['miou'])
    run.logger.info(f'[EVAL] The model with the best validation mIoU '
                    f'({state.best_miou:.4f}) was saved at iter {state.best_iter}.')
    log_evaluation(run.writer, result, run.val_dataset, state.iteration)


def train_from_config(config, learning_rate=None, opts=None, **flags):
    """train.py (its flags by name): builds the options and the components from the config
    file and returns :func:`train`'s result."""
    cfg = load_config(config, learning_rate=learning_rate, opts=opts)
    options = TrainOptions.from_config(cfg, **flags)  # checked before anything is built or written
    options.check_schedule()
    set_schedule(cfg, options.iters, options.batch_size)
    set_device(options.device)
    dist.init_parallel()
    # Owned before anything is built: a refused run does no work and writes nothing there.
    with RunFolder(options) as folder:
        if options.seed is not None:
            paddle.seed(options.seed)
            np.random.seed(options.seed % 2**32)
        builder = ComponentBuilder(cfg)
        train_dataset = builder.dataset('train')
        val_dataset = builder.dataset('val') if options.do_eval else None
        model = builder.model
        losses = builder.losses
        optimizer = builder.optimizer
        return train(model, train_dataset, optimizer, losses, folder, val_dataset)
