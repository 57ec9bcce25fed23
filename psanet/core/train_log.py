"""What a training run logs: the [TRAIN] lines and their means, the batch-size line, VisualDL.

:func:`log_interval` writes one [TRAIN] line (and the VisualDL scalars) from an
:class:`Averager` of the steps since the last one; :func:`log_evaluation` the
scalars and figures of an evaluation.
"""
import numpy as np

from psanet.errors import ConfigError
from psanet.visualize.charts import class_names, log_evaluation_figures

__all__ = ['format_batch_size', 'format_eta', 'Averager', 'log_interval', 'log_evaluation',
           'check_visualdl', 'visualdl_writer']


def format_batch_size(batch_size, world_size, recipe_batch_size=None, unit='card'):
    """How many images a step takes, for the start-of-training log line: batch_size is per
    process, so W processes take B x W images a step, not the B a config's recipe (written for
    one card, ``recipe_batch_size``) assumes; the line says so and which ``--batch_size`` gives
    the recipe's step, e.g. ``batch_size 8 per card x 4 cards = 32 images per step; the
    config's recipe assumes 8 per step on one card: use --batch_size 2 for it``."""
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


def format_eta(seconds):
    seconds = int(max(seconds, 0))
    return f'{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}'


class Averager:
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


def log_interval(run, iteration, averager, lr):
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
        f'{ips:.4f} samples/sec | ETA {format_eta((iters - iteration) * batch_cost)}')
    if run.writer is not None:
        run.writer.add_scalar('Train/loss', float(mean_terms.sum()), iteration)
        if len(mean_terms) > 1:
            for i, v in enumerate(mean_terms):
                run.writer.add_scalar(f'Train/loss_{i}', float(v), iteration)
        run.writer.add_scalar('Train/lr', lr, iteration)
        run.writer.add_scalar('Train/batch_cost', batch_cost, iteration)
        run.writer.add_scalar('Train/reader_cost', reader_cost, iteration)
    averager.reset()


def check_visualdl():
    import importlib.util
    try:
        found = importlib.util.find_spec('visualdl') is not None
    except ValueError:  # a visualdl in sys.modules without a __spec__
        found = False
    if not found:
        raise ConfigError('--use_vdl needs VisualDL, which is not installed: pip install '
                          'visualdl (or train without --use_vdl).')


def visualdl_writer(save_dir):
    from visualdl import LogWriter
    return LogWriter(save_dir)


def log_evaluation(writer, result, dataset, iteration):
    """An evaluation's mIoU, Acc, loss and figures in VisualDL (``writer`` None: nothing)."""
    if writer is None:
        return
    writer.add_scalar('Evaluate/mIoU', result['miou'], iteration)
    writer.add_scalar('Evaluate/Acc', result['acc'], iteration)
    if result['loss'] is not None:
        writer.add_scalar('Evaluate/loss', result['loss'], iteration)
    log_evaluation_figures(writer, result, class_names(dataset.num_classes, dataset), iteration)
