"""Data loading for the engine: reproducible samples, per-epoch shuffles, exact eval splits.

:class:`SampleReader` seeds each sample's augmentation from (seed, epoch, index)
and turns a sample that fails to load into an error record;
:class:`TrainBatchSampler` shuffles per (seed, epoch) and can start an epoch
mid-way; :class:`EvalBatchSampler` splits images over ranks without padding.
Why each: docs/design.md.
"""
import os
import random
import signal
import traceback

import cv2
import numpy as np
import paddle

from psanet import compat, interrupts
from psanet.data.validate import label_values, label_values_error
from psanet.errors import ConfigError, DatasetError, unreadable_image

__all__ = ['SampleReader', 'collate', 'raise_if_error', 'TrainBatchSampler', 'EvalBatchSampler',
           'build_train_loader', 'build_eval_loader']


def sample_paths(dataset, index):
    """(image_path, label_path) of a paddleseg dataset's sample, or (None, None)."""
    file_list = getattr(dataset, 'file_list', None)
    if file_list is None or index >= len(file_list):
        return None, None
    entry = file_list[index]
    return entry[0], (entry[1] if len(entry) > 1 else None)


class SampleReader(paddle.io.Dataset):
    """A paddleseg dataset with seeded augmentation (from ``seed``), label checks and error records."""

    def __init__(self, dataset, seed, num_classes, ignore_index=255):
        self.dataset = dataset
        self.seed = int(seed)
        self.num_classes = int(num_classes)
        self.ignore_index = int(ignore_index)
        self.epoch = 0

    def set_epoch(self, epoch):
        """Selects the epoch of the per-sample seeds; call before iterating the loader."""
        self.epoch = int(epoch)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        python_seed, numpy_seed = np.random.SeedSequence(
            [self.seed, self.epoch, int(index)]).generate_state(2)
        random.seed(int(python_seed))
        np.random.seed(int(numpy_seed))
        image_path, label_path = sample_paths(self.dataset, index)
        try:
            data = self.dataset[index]
        except Exception as error:  # any failure must reach the main process as a record
            return {'error': _describe_failure(error, image_path, label_path)}
        label = np.asarray(data['label'])
        # validate_dataset checked the files; this catches a label changed since, or
        # a dataset handed to train() unchecked, before it reaches the loss.
        error = label_values_error(label_path, label_values(label), self.num_classes,
                                   self.ignore_index, getattr(self.dataset, 'dataset_root', None))
        if error:
            return {'error': error}
        sample = {'img': np.asarray(data['img'], dtype='float32'),
                  'label': label.astype('int64'),
                  'trans_info': [(str(op), [int(s) for s in size])
                                 for op, size in data.get('trans_info', [])],
                  'index': int(index)}
        return sample


def _describe_failure(error, image_path, label_path):
    if image_path is not None and os.path.isfile(image_path) and cv2.imread(image_path) is None:
        return unreadable_image(image_path, 're-extract it or remove it from the dataset.')
    if image_path is not None and not os.path.isfile(image_path):
        return f'image {image_path} does not exist: restore it or fix the file list.'
    if label_path is not None and not os.path.isfile(label_path):
        return f'label {label_path} does not exist: restore it or fix the file list.'
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return (f'sample {image_path} (label {label_path}) failed in its transforms with '
            f'{type(error).__name__}: {error} (at {os.path.basename(frame.filename)}:'
            f'{frame.lineno}): check the file and the transforms of this dataset in the config.')


def collate(samples):
    """Stacks images and labels; keeps trans_info and indices per sample; forwards errors."""
    errors = [s['error'] for s in samples if 'error' in s]
    if errors:
        # Paddle's loader drops a batch without arrays silently: keep the usual keys.
        return {'img': np.zeros([1, 1, 1, 1], 'float32'), 'label': np.zeros([1, 1, 1], 'int64'),
                'trans_info': [[]], 'index': [-1], 'error': errors[:1]}
    return {'img': np.stack([s['img'] for s in samples]),
            'label': np.stack([s['label'] for s in samples]),
            'trans_info': [s['trans_info'] for s in samples],
            'index': [s['index'] for s in samples]}


def raise_if_error(batch):
    """Raises DatasetError for a batch that holds an error record."""
    if 'error' in batch:
        raise DatasetError(batch['error'][0])


class TrainBatchSampler(paddle.io.DistributedBatchSampler):
    """Shuffled, drop-last DistributedBatchSampler that can start an epoch mid-way; ``seed`` is
    mixed into every epoch's shuffle, the same on all ranks, so that they split one
    permutation."""

    def __init__(self, dataset, batch_size, seed=0, num_replicas=None, rank=None):
        super().__init__(dataset, batch_size=batch_size, num_replicas=num_replicas, rank=rank,
                         shuffle=True, drop_last=True)
        self.seed = int(seed)
        self.start_batch = 0

    def set_epoch(self, epoch, start_batch=0):
        """Shuffles with (seed, ``epoch``); skips the first ``start_batch`` batches unread."""
        # The parent shuffles with RandomState(self.epoch): pass it a seed that mixes both.
        super().set_epoch(int(np.random.SeedSequence([self.seed, int(epoch)]).generate_state(1)[0]))
        self.start_batch = int(start_batch)

    def __iter__(self):
        for i, batch in enumerate(super().__iter__()):
            if i >= self.start_batch:
                yield batch


class EvalBatchSampler(paddle.io.DistributedBatchSampler):
    """One image per batch; rank r evaluates samples r, r + world_size, ... with no padding."""

    def __init__(self, dataset):
        super().__init__(dataset, batch_size=1, shuffle=False, drop_last=False)

    def _indices(self):
        return range(self.local_rank, len(self.dataset), self.nranks)

    def __iter__(self):
        for index in self._indices():
            yield [index]

    def __len__(self):
        return len(self._indices())


class _Loader(paddle.io.DataLoader):
    """A DataLoader whose workers leave signals to the main process
    (:func:`psanet.interrupts.worker_init`) and whose pass, left early, shuts them down."""

    def __init__(self, reader, batch_sampler, num_workers):
        super().__init__(reader, batch_sampler=batch_sampler, num_workers=num_workers,
                         collate_fn=collate, return_list=True,
                         worker_init_fn=interrupts.worker_init)

    def __iter__(self):
        # Before worker_init, Paddle's worker loop installs a SIGTERM handler that dies of
        # any SIGTERM its parent did not send (docs/reliability.md): the workers fork with
        # SIGINT and SIGTERM blocked (worker_init unblocks them), and one sent to this
        # process meanwhile reaches its handler when they are unblocked here.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, interrupts.HANDLED)
        try:
            batches = super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        try:
            yield from batches
        finally:
            compat.shut_down_loader(batches)


def build_train_loader(dataset, batch_size, seed, num_workers=0):
    """(loader, sampler, reader) for training; set the epoch on sampler and reader per pass."""
    reader = SampleReader(dataset, seed, dataset.num_classes, dataset.ignore_index)
    sampler = TrainBatchSampler(reader, batch_size, seed)
    if len(sampler) == 0:
        raise ConfigError(
            f'the training set has {len(dataset)} images, fewer than batch_size {batch_size} x '
            f'{sampler.nranks} process(es), so an epoch has no full batch: lower --batch_size or '
            'add images.')
    loader = _Loader(reader, sampler, num_workers)
    return loader, sampler, reader


def build_eval_loader(dataset, num_workers=0):
    """(loader, sampler) over this rank's share of ``dataset``, one image per batch."""
    reader = SampleReader(dataset, 0, dataset.num_classes, dataset.ignore_index)
    sampler = EvalBatchSampler(reader)
    loader = _Loader(reader, sampler, num_workers)
    return loader, sampler
