"""Training loop: logging, evaluation, atomic checkpoints, exact resume, multi-process and fp16.

What it adds to paddleseg 2.8.0's ``core.train`` (which fails on Paddle 3):

* the logged loss (every term and the total) is the mean over all ranks,
  not rank 0's;
* every epoch reshuffles (``DistributedBatchSampler.set_epoch``, mixed
  with the seed), augmentation is seeded per (seed, epoch, sample) and
  Dropout per (seed, iteration, rank), so ``--resume_model`` continues with
  the losses an uninterrupted run has; all ranks use rank 0's seed;
* at each checkpoint the BatchNorm statistics (per process on CPU) are
  copied from rank 0 before evaluating and saving, so the evaluated and
  the saved model are rank 0's;
* checkpoints are written atomically, with a ``train_state.json``;
* a save_dir holds one run: another run's checkpoints there are refused (or
  deleted with ``overwrite``), a second run at once is refused by a lock, and
  Ctrl-C or SIGTERM ends with the checkpoint to resume from
  (:mod:`psanet.core.run_dir`); resuming checks the checkpoint fits the model;
* a NaN or Inf loss stops training with an error naming the iteration and
  the last good checkpoint;
* SyncBatchNorm only on more than one GPU (``sync_bn: false`` in the config
  turns it off), said in one log line.
"""
import os
import time

import numpy as np
import paddle

from psanet.core import checkpoint as ckpt
from psanet.core import dist, run_dir
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.errors import ConfigError, TrainingError
from psanet.core.loader import build_train_loader, raise_if_error
from psanet.core.logger import get_logger
from psanet.core.runtime import amp_enabled, autocast, on_gpu, set_device, to_plain_batchnorm
from psanet.core.val import evaluate, merge_test_config

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


def train(model, train_dataset, optimizer, losses, iters, batch_size, val_dataset=None,
          save_dir='output', save_interval=1000, log_iters=10, keep_checkpoint_max=5,
          num_workers=0, use_vdl=False, resume_model=None, seed=None, precision='fp32',
          amp_level='O1', test_config=None, sync_bn=True, overwrite=False, logger=None):
    """Trains ``model`` for ``iters`` iterations.

    Args:
        model (paddle.nn.Layer): the model; ``optimizer`` must hold its parameters.
        train_dataset (paddle.io.Dataset): a paddleseg dataset in 'train' mode.
        optimizer (paddle.optimizer.Optimizer): with an LR scheduler as learning rate.
        losses (dict): ``{'types': [...], 'coef': [...]}``, one type per logit.
        iters (int): the total number of iterations.
        batch_size (int): images per process and iteration.
        val_dataset (paddle.io.Dataset, optional): evaluated every save_interval
            (mIoU and validation loss); the best model goes to best_model/. Default: None.
        save_dir (str, optional): checkpoints, train.log and VisualDL logs. Default: 'output'.
        save_interval (int, optional): iterations between checkpoints (and evaluations).
            Default: 1000.
        log_iters (int, optional): iterations between log lines. Default: 10.
        keep_checkpoint_max (int, optional): iter_N folders kept (<= 0: all). Default: 5.
        num_workers (int, optional): DataLoader workers per process. Default: 0.
        use_vdl (bool, optional): write VisualDL scalars to save_dir. Default: False.
        resume_model (str, optional): an iter_N folder to continue from. Default: None.
        seed (int, optional): base seed of augmentation and Dropout; None draws one
            (a resumed run takes the checkpoint's). Default: None.
        precision (str, optional): 'fp32', or 'fp16' (autocast + GradScaler, GPU only).
            Default: 'fp32'.
        amp_level (str, optional): 'O1' or 'O2'. Default: 'O1'.
        test_config (dict, optional): inference options for the evaluations. Default: None.
        sync_bn (bool, optional): SyncBatchNorm when training on more than one GPU. Default: True.
        overwrite (bool, optional): delete the checkpoints of another run in save_dir (or,
            resuming, those after resume_model) instead of refusing it. Default: False.
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
        Interrupted: on Ctrl-C, or SIGTERM within ``errors.sigterm_raises`` (as under
            ``run_cli``), naming the checkpoint to resume from.
    """
    with run_dir.own_save_dir(save_dir, resume_model, overwrite, logger):
        return _train(model, train_dataset, optimizer, losses, iters, batch_size, val_dataset,
                      save_dir, save_interval, log_iters, keep_checkpoint_max, num_workers,
                      use_vdl, resume_model, seed, precision, amp_level, test_config, sync_bn,
                      logger)


def _train(model, train_dataset, optimizer, losses, iters, batch_size, val_dataset, save_dir,
           save_interval, log_iters, keep_checkpoint_max, num_workers, use_vdl, resume_model,
           seed, precision, amp_level, test_config, sync_bn, logger):
    """:func:`train` in a save_dir that this run owns."""
    main = dist.is_main_process()
    world_size = dist.world_size()
    logger = logger or get_logger(os.path.join(save_dir, 'train.log'))
    for name, value in (('iters', iters), ('batch_size', batch_size),
                        ('save_interval', save_interval), ('log_iters', log_iters)):
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f'--{name} must be a positive integer, got {value!r}.')
    scheduler = _lr_scheduler(optimizer)
    test_config = merge_test_config(test_config or {})

    start_iter, best_miou, best_iter, last_checkpoint = 0, -1.0, -1, None
    state = {}
    if resume_model is not None:
        model_state, optimizer_state, state = ckpt.load_checkpoint(resume_model)
        ckpt.check_state_fits(model, model_state, f'the weights of --resume_model {resume_model}',
                              _RESUME_ANOTHER_MODEL)
        model.set_state_dict(model_state)
        if 'parameter_names' in state:
            optimizer_state = ckpt.rename_optimizer_state(optimizer_state,
                                                          state['parameter_names'], model)
        optimizer.set_state_dict(optimizer_state)
        if scheduler is not None and 'lr_scheduler' in state:
            scheduler.set_state_dict(state['lr_scheduler'])
        start_iter = int(state['iteration'])
        best_miou = float(state.get('best_miou', -1.0))
        best_iter = int(state.get('best_iter', -1))
        last_checkpoint = resume_model
        if start_iter >= iters:
            raise ConfigError(f'--resume_model {resume_model} is at iteration {start_iter} and '
                              f'iters is {iters}: raise --iters to train further.')
        if 'seed' in state:
            if seed is not None and seed != state['seed']:
                logger.warning(f'--seed {seed} ignored: resuming with the checkpoint\'s seed '
                               f'{state["seed"]}.')
            seed = int(state['seed'])
        logger.info(f'Resumed from {resume_model} at iteration {start_iter}.')
    if seed is None:
        # Drawn on rank 0 only and summed with zeros: every rank uses the seed that is saved.
        drawn = int(np.random.SeedSequence().generate_state(1)[0]) if main else 0
        seed = int(dist.all_reduce_sum([drawn])[0])
    logger.info(f'Seed: {seed}')

    model = _batchnorm_setup(model, sync_bn, world_size, logger)
    use_amp = amp_enabled(precision)
    if precision == 'fp16' and not use_amp:
        logger.warning('--precision fp16 is ignored on CPU (no fp16 kernels): training in fp32.')
    scaler = None
    if use_amp:
        logger.info(f'Mixed precision: fp16 autocast, level {amp_level}, with GradScaler.')
        scaler = paddle.amp.GradScaler(init_loss_scaling=1024)
        if 'grad_scaler' in state:
            scaler.load_state_dict(state['grad_scaler'])
        if amp_level == 'O2':
            model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer,
                                                   level='O2', save_dtype='float32')
    runner = paddle.DataParallel(model) if world_size > 1 else model

    loader, sampler, reader = build_train_loader(train_dataset, batch_size, seed, num_workers)
    iters_per_epoch = len(sampler)
    for change in _resume_changes(state, batch_size, world_size, iters_per_epoch,
                                  len(train_dataset)):
        logger.warning(f'resuming from {resume_model} {change}: the data order differs from an '
                       'uninterrupted run.')
    writer = None
    if use_vdl and main:
        from visualdl import LogWriter
        writer = LogWriter(save_dir)

    history, history_terms, local_history, evals = [], [], [], []
    averager = _Averager()
    iteration = start_iter
    model.train()
    logger.info(f'Training {iters} iterations from {start_iter}: {len(train_dataset)} images, '
                f'{iters_per_epoch} iterations per epoch, batch_size {batch_size} x {world_size} '
                f'process(es).')
    batch_start = time.time()
    while iteration < iters:
        epoch = iteration // iters_per_epoch
        sampler.set_epoch(epoch, start_batch=iteration % iters_per_epoch)
        reader.set_epoch(epoch)
        epoch_start_iteration = iteration
        for data in loader:
            reader_cost = time.time() - batch_start
            raise_if_error(data)
            iteration += 1
            paddle.seed(iteration_seed(seed, iteration, dist.rank()))
            images, labels = data['img'], data['label']
            with autocast(precision, amp_level):
                logits = runner(images)
                terms = loss_terms(logits, labels, losses)
                loss = paddle.add_n(terms) if len(terms) > 1 else terms[0]
            local = paddle.stack([t.detach().astype('float32') for t in terms]).numpy()
            values = dist.all_reduce_sum(local) / world_size
            if not np.all(np.isfinite(values)):
                where = (f'The last good checkpoint is {last_checkpoint}: resume with '
                         f'--resume_model {last_checkpoint}, e.g. with a lower --learning_rate.'
                         if last_checkpoint else
                         f'No checkpoint was saved yet (save_interval {save_interval}); lower '
                         '--learning_rate and start again.')
                raise TrainingError(f'the loss is {values.sum()} (terms {values.tolist()}) at '
                                    f'iteration {iteration} (epoch {epoch + 1}): training stopped. '
                                    + where)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            lr = optimizer.get_lr()
            if scheduler is not None:
                scheduler.step()
            optimizer.clear_grad()

            history.append(float(values.sum()))
            local_history.append(float(local.sum()))
            history_terms.append(values.tolist())
            averager.add(values, time.time() - batch_start, reader_cost, batch_size * world_size)

            if iteration % log_iters == 0 or iteration == iters:
                mean_terms = averager.terms / averager.steps
                batch_cost = averager.batch_cost / averager.steps
                reader_cost_avg = averager.reader_cost / averager.steps
                ips = averager.samples / max(averager.batch_cost, 1e-12)
                term_text = ''.join(f', loss_{i}: {v:.4f}' for i, v in enumerate(mean_terms)) \
                    if len(mean_terms) > 1 else ''
                logger.info(
                    f'[TRAIN] epoch: {(iteration - 1) // iters_per_epoch + 1}, iter: '
                    f'{iteration}/{iters}, loss: {mean_terms.sum():.4f}{term_text}, lr: {lr:.6f}, '
                    f'batch_cost: {batch_cost:.4f}, reader_cost: {reader_cost_avg:.5f}, ips: '
                    f'{ips:.4f} samples/sec | ETA {_format_eta((iters - iteration) * batch_cost)}')
                if writer is not None:
                    writer.add_scalar('Train/loss', float(mean_terms.sum()), iteration)
                    if len(mean_terms) > 1:
                        for i, v in enumerate(mean_terms):
                            writer.add_scalar(f'Train/loss_{i}', float(v), iteration)
                    writer.add_scalar('Train/lr', lr, iteration)
                    writer.add_scalar('Train/batch_cost', batch_cost, iteration)
                    writer.add_scalar('Train/reader_cost', reader_cost_avg, iteration)
                averager.reset()

            if iteration % save_interval == 0 or iteration == iters:
                # Plain BatchNorm statistics differ per process: evaluate and save rank 0's,
                # and let every rank continue from them, as a resumed run does.
                dist.broadcast_buffers(model)
                result = None
                if val_dataset is not None:
                    result = evaluate(model, val_dataset, num_workers=num_workers, losses=losses,
                                      precision=precision, amp_level=amp_level, logger=logger,
                                      **test_config)
                    evals.append((iteration, result))
                    model.train()
                    if result['miou'] > best_miou:
                        best_miou, best_iter = result['miou'], iteration
                        if main:
                            ckpt.save_checkpoint(os.path.join(save_dir, 'best_model'), model,
                                                 state={'iteration': iteration,
                                                        'miou': best_miou})
                    logger.info(f'[EVAL] The model with the best validation mIoU '
                                f'({best_miou:.4f}) was saved at iter {best_iter}.')
                    if writer is not None:
                        writer.add_scalar('Evaluate/mIoU', result['miou'], iteration)
                        writer.add_scalar('Evaluate/Acc', result['acc'], iteration)
                        if result['loss'] is not None:
                            writer.add_scalar('Evaluate/loss', result['loss'], iteration)
                checkpoint_state = {
                    'iteration': iteration, 'epoch': iteration // iters_per_epoch,
                    'iters_per_epoch': iters_per_epoch, 'seed': seed, 'batch_size': batch_size,
                    'world_size': world_size, 'num_images': len(train_dataset),
                    'best_miou': best_miou, 'best_iter': best_iter,
                    'lr_scheduler': scheduler.state_dict() if scheduler is not None else None,
                    'parameter_names': ckpt.parameter_names(model),
                }
                if scaler is not None:
                    checkpoint_state['grad_scaler'] = scaler.state_dict()
                path = os.path.join(save_dir, f'iter_{iteration}')
                if main:
                    ckpt.save_checkpoint(path, model, optimizer, checkpoint_state)
                    ckpt.prune_checkpoints(save_dir, keep_checkpoint_max)
                    logger.info(f'Saved checkpoint {path}')
                last_checkpoint = path
            batch_start = time.time()
            if iteration >= iters:
                break
        if iteration == epoch_start_iteration:
            # Guards the while loop against spinning on a loader that yields nothing.
            raise RuntimeError(f'the data loader gave no batch in epoch {epoch + 1}; see the '
                               'messages above for the failing worker.')
    if writer is not None:
        writer.close()
    logger.info(f'Training done: {iteration} iterations, checkpoints in {save_dir}.')
    return {'losses': history, 'loss_terms': history_terms, 'local_losses': local_history,
            'start_iter': start_iter,
            'last_checkpoint': last_checkpoint, 'best_miou': best_miou, 'best_iter': best_iter,
            'evals': evals, 'seed': seed}


def train_from_config(config, device=None, save_dir='output', iters=None, batch_size=None,
                      learning_rate=None, save_interval=1000, log_iters=10, keep_checkpoint_max=5,
                      num_workers=0, do_eval=False, use_vdl=False, resume_model=None, seed=None,
                      precision='fp32', amp_level='O1', overwrite=False, opts=None):
    """train.py: builds everything from ``config`` and calls :func:`train`.

    The flags are PaddleSeg's train.py flags, and ``overwrite``; ``iters``,
    ``batch_size`` and ``learning_rate`` override the config when given.

    Returns:
        dict: the result of :func:`train`.
    """
    set_device(device)
    dist.init_parallel()
    cfg = load_config(config, learning_rate=learning_rate, batch_size=batch_size, iters=iters,
                      opts=opts)
    # Owned before train.log is opened: a refused run writes nothing into the folder.
    with run_dir.own_save_dir(save_dir, resume_model, overwrite, get_logger()):
        if seed is not None:
            paddle.seed(seed)
            np.random.seed(seed % 2**32)
        builder = ComponentBuilder(cfg)
        train_dataset = builder.dataset('train')
        val_dataset = builder.dataset('val') if do_eval else None
        model = builder.model
        losses = builder.losses
        optimizer = builder.optimizer
        # Opened after the builder, whose dataset checks log through get_logger(), which
        # reconfigures the logger without a file.
        logger = get_logger(os.path.join(save_dir, 'train.log'))
        logger.info(f'Config {config}; Paddle {paddle.__version__}, device '
                    f'{paddle.get_device()}, {dist.world_size()} process(es).')
        return train(model, train_dataset, optimizer, losses, iters=cfg.iters,
                     batch_size=cfg.batch_size, val_dataset=val_dataset, save_dir=save_dir,
                     save_interval=save_interval, log_iters=log_iters,
                     keep_checkpoint_max=keep_checkpoint_max, num_workers=num_workers,
                     use_vdl=use_vdl, resume_model=resume_model, seed=seed, precision=precision,
                     amp_level=amp_level, test_config=builder.test_config,
                     sync_bn=bool(cfg.dic.get('sync_bn', True)), logger=logger)
