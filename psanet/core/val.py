"""Evaluation: mIoU, Acc, Kappa, Dice and per-class IoU / precision / recall, on one or more ranks.

Each rank evaluates its share of the images; the per-class areas are summed over ranks, so
a distributed run reports exactly the single-process numbers. With ``save_dir`` the
predictions are also written as PNGs: Cityscapes label ids for the official evaluator
(tools/evaluate_cityscapes.py), or the raw class ids for other datasets.
"""
import os
import signal
import time

import numpy as np
import paddle
from paddleseg.datasets import Cityscapes
from paddleseg.utils import TimeAverager

from psanet import interrupts
from psanet.core import dist, inference
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.data_loader import build_eval_loader, raise_if_error, sample_paths
from psanet.core.metrics import class_areas, confusion_matrix, summarize
from psanet.core.options import DEFAULT_DEVICE, EvalOptions
from psanet.core.device import autocast, progress_bar, set_device
from psanet.core.weights import load_model_weights, resolve_weights_path
from psanet.data.prepare_cityscapes import train_ids_to_label_ids
from psanet.data.validate import IMAGE_SUFFIX
from psanet.errors import ConfigError
from psanet.files import check_save_dir, make_output_dir, write_image
from psanet.log import get_logger
from psanet.visualize.charts import class_names, write_evaluation_figures

__all__ = ['evaluate', 'evaluate_from_config', 'prediction_file_name', 'format_report']

# The Cityscapes image name without its extension, e.g. '_leftImg8bit'.
IMAGE_STEM_SUFFIX = os.path.splitext(IMAGE_SUFFIX)[0]


def prediction_file_name(image_path, dataset):
    """Output path, relative to save_dir, of an image's prediction: for Cityscapes
    ``<city>/<city>_<seq>_<frame>_labelIds.png``, which the official evaluator matches by its
    ``<city>_<seq>_<frame>*.png`` pattern; else the image's path below dataset_root, as .png."""
    root = getattr(dataset, 'dataset_root', None) or os.path.dirname(image_path)
    image_root = os.path.join(root, 'leftImg8bit', str(getattr(dataset, 'mode', '')))
    base = image_root if os.path.isdir(image_root) else root
    relative = os.path.relpath(os.path.abspath(image_path), os.path.abspath(base))
    if relative.startswith('..'):
        relative = os.path.basename(image_path)
    stem = os.path.splitext(relative)[0]
    if isinstance(dataset, Cityscapes):
        if stem.endswith(IMAGE_STEM_SUFFIX):
            stem = stem[:-len(IMAGE_STEM_SUFFIX)]
        return stem + '_labelIds.png'
    return stem + '.png'


def _write_prediction(pred, image_path, dataset, save_dir):
    path = os.path.join(save_dir, prediction_file_name(image_path, dataset))
    make_output_dir(os.path.dirname(path))
    ids = pred.astype('uint8')
    if isinstance(dataset, Cityscapes):
        ids = train_ids_to_label_ids(ids)
    return write_image(path, ids)


def format_report(result, names=None):
    """PaddleSeg's [EVAL] summary line for a result of :func:`evaluate`, then a table of each
    class's IoU, precision and recall by name (default: :func:`class_names` of the count)."""
    lines = ['[EVAL] #Images: {} mIoU: {:.4f} Acc: {:.4f} Kappa: {:.4f} Dice: {:.4f}'.format(
        result['num_images'], result['miou'], result['acc'], result['kappa'], result['mdice'])]
    if result.get('loss') is not None:
        lines[0] += ' Loss: {:.4f}'.format(result['loss'])
    iou, precision, recall = (result[k] for k in ('class_iou', 'class_precision', 'class_recall'))
    names = names or class_names(len(iou))
    width = max(len('class'), *(len(name) for name in names))
    rows = [f'  {"class":<{width}}     IoU  Precision  Recall']
    rows += [f'  {name:<{width}}  {i:6.4f}     {p:6.4f}  {r:6.4f}'
             for name, i, p, r in zip(names, iou, precision, recall)]
    lines.append('[EVAL] Per class:\n' + '\n'.join(rows))
    return lines


def evaluate(model, dataset, options=None, losses=None, logger=None):
    """Evaluates ``model`` (not a DataParallel wrapper) on this rank's share of ``dataset``.

    With ``losses`` (and not aug_eval) the validation loss of the main logit is reported too.

    Returns:
        dict: ``num_images``, ``miou``, ``acc``, ``kappa``, ``mdice``, ``class_iou``,
        ``class_precision``, ``class_recall``, ``class_dice``, ``areas`` ([3, C]),
        ``confusion_matrix`` ([C, C] pixel counts, rows the ground truth), both summed over
        ranks, and ``loss`` (None unless computed).
    """
    logger = logger or get_logger()
    options = options or EvalOptions()
    was_training = model.training
    model.eval()
    loader, sampler = build_eval_loader(dataset, num_workers=options.num_workers)
    num_classes, ignore_index = dataset.num_classes, dataset.ignore_index
    areas = np.zeros([3, num_classes], dtype='int64')
    confusion = np.zeros([num_classes, num_classes], dtype='int64')
    loss_sum, loss_count = 0.0, 0
    with_loss = losses is not None and not options.inference.aug_eval
    total = len(sampler)
    if options.print_detail:
        logger.info(f'Start evaluating (total_samples: {len(dataset)}, this rank: {total})...')
    batch_cost, reader_cost = TimeAverager(), TimeAverager()
    start = time.time()
    # PaddleSeg's evaluate shows this bar; only rank 0 updates it.
    with paddle.no_grad(), progress_bar(total, options.print_detail) as bar:
        for step, data in enumerate(loader):
            if interrupts.requested():
                break  # every rank hears of the stop in the sum below
            reader_cost.record(time.time() - start)
            raise_if_error(data)
            image, label = data['img'], data['label']
            trans_info = data['trans_info'][0]
            with autocast(options.inference.precision, options.inference.amp_level):
                score = inference.inference(model, image, trans_info, options.inference)
            score = score.astype('float32')
            if list(score.shape[-2:]) != list(label.shape[-2:]):
                raise ConfigError(
                    f'the prediction is {score.shape[-1]}x{score.shape[-2]} but the label is '
                    f'{label.shape[-1]}x{label.shape[-2]}: the val_dataset transforms change the '
                    'size in a way trans_info does not record; use Resize/Padding transforms.')
            pred = paddle.argmax(score, axis=1, keepdim=True, dtype='int32')
            areas += class_areas(pred, label, num_classes, ignore_index)
            confusion += confusion_matrix(pred, label, num_classes, ignore_index)
            if with_loss:
                coef, loss_fn = losses['coef'][0], losses['types'][0]
                loss_sum += float(coef * loss_fn(score, label.squeeze(1)))
                loss_count += 1
            if options.save_dir is not None:
                index = data['index'][0]
                image_path = sample_paths(dataset, index)[0] or f'{index:06d}.png'
                _write_prediction(pred.numpy()[0, 0], image_path, dataset, options.save_dir)
            batch_cost.record(time.time() - start, num_samples=1)
            if bar is not None and dist.rank() == 0:
                bar.update(step + 1, [('batch_cost', batch_cost.get_average()),
                                      ('reader cost', reader_cost.get_average())])
            batch_cost.reset()
            reader_cost.reset()
            start = time.time()
    summed = dist.all_reduce_sum(np.concatenate([areas.ravel(), confusion.ravel(),
                                                 [loss_sum, loss_count,
                                                  interrupts.requested() is not None]]))
    if summed[-1] > 0:  # a rank was signalled: all abandon the evaluation
        raise interrupts.stopped(interrupts.requested() or signal.SIGTERM)
    summed = summed[:-1]
    counts = np.rint(summed[:-2]).astype('int64')
    areas = counts[:areas.size].reshape(3, num_classes)
    result = summarize(areas)
    result['areas'] = areas
    result['confusion_matrix'] = counts[areas.size:].reshape(num_classes, num_classes)
    result['num_images'] = len(dataset)
    result['loss'] = float(summed[-2] / summed[-1]) if with_loss and summed[-1] > 0 else None
    if options.print_detail:
        for line in format_report(result, class_names(num_classes, dataset)):
            logger.info(line)
        if options.save_dir is not None:
            logger.info(f'[EVAL] predictions written to {options.save_dir}')
    if was_training:
        model.train()
    return result


def evaluate_from_config(config, model_path, opts=None, device=DEFAULT_DEVICE, **flags):
    """val.py (its flags by field name; None takes the config's test_config): builds the model
    and val dataset, loads the weights and returns :func:`evaluate`'s result."""
    cfg = load_config(config, opts=opts)
    options = EvalOptions.from_flags(flags, cfg.dic.get('test_config'))
    set_device(device)
    dist.init_parallel()
    logger = get_logger()
    resolve_weights_path(model_path)  # a wrong path fails before any building
    if options.save_dir is not None:
        check_save_dir(options.save_dir)
    builder = ComponentBuilder(cfg, weights_follow=True)
    dataset = builder.dataset('val')
    model = builder.model
    path = load_model_weights(model, model_path)
    logger.info(f'Loaded weights {path}')
    result = evaluate(model, dataset, options, logger=logger)
    if options.save_dir is not None and dist.is_main_process():
        figures = write_evaluation_figures(result, class_names(dataset.num_classes, dataset),
                                           options.save_dir)
        logger.info(f'[EVAL] per-class IoU and confusion matrix drawn in {", ".join(figures)}')
    return result
