"""Evaluation: mIoU, Acc, Kappa, Dice and per-class IoU / precision / recall, on one or more ranks.

Each rank evaluates its share of the images (rank r: r, r + world, ...); the
per-class intersection / prediction / label areas are summed over ranks, so a
distributed run reports exactly the single-process numbers. With
``save_dir`` the predictions are also written as PNGs: Cityscapes label ids
named ``<city>_<seq>_<frame>_labelIds.png`` for the official evaluator
(``CITYSCAPES_RESULTS=<save_dir> csEvalPixelLevelSemanticLabeling``), or the
raw class ids for other datasets.
"""
import math
import os
import time

import cv2
import numpy as np
import paddle
from paddleseg.datasets import Cityscapes
from paddleseg.utils import TimeAverager

from psanet import interrupts
from psanet.contract import check_save_dir
from psanet.core import dist, inference
from psanet.core.checkpoint import load_model_weights, resolve_weights_path
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.loader import build_eval_loader, raise_if_error, sample_paths
from psanet.core.metrics import class_areas, summarize
from psanet.core.runtime import autocast, progress_bar, set_device
from psanet.data.prepare_cityscapes import train_ids_to_label_ids
from psanet.data.validate import IMAGE_SUFFIX
from psanet.errors import ConfigError
from psanet.log import get_logger

__all__ = ['evaluate', 'evaluate_from_config', 'merge_test_config', 'check_inference_flags',
           'prediction_file_name', 'format_report']

# The Cityscapes image name without its extension, e.g. '_leftImg8bit'.
IMAGE_STEM_SUFFIX = os.path.splitext(IMAGE_SUFFIX)[0]


def prediction_file_name(image_path, dataset):
    """Output path, relative to save_dir, of an image's prediction.

    Cityscapes images keep their ``<city>/`` folder and
    ``<city>_<seq>_<frame>_leftImg8bit.png`` becomes
    ``<city>_<seq>_<frame>_labelIds.png``, which the official evaluator
    matches by its ``<city>_<seq>_<frame>*.png`` pattern. Other datasets keep
    the image's path below dataset_root, with a .png suffix.
    """
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
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ids = pred.astype('uint8')
    if isinstance(dataset, Cityscapes):
        ids = train_ids_to_label_ids(ids)
    if not cv2.imwrite(path, ids):
        raise OSError(f'cannot write {path}: check the permissions and free space of --save_dir.')
    return path


def format_report(result):
    """PaddleSeg's [EVAL] lines for a result of :func:`evaluate`."""
    lines = ['[EVAL] #Images: {} mIoU: {:.4f} Acc: {:.4f} Kappa: {:.4f} Dice: {:.4f}'.format(
        result['num_images'], result['miou'], result['acc'], result['kappa'], result['mdice'])]
    if result.get('loss') is not None:
        lines[0] += ' Loss: {:.4f}'.format(result['loss'])
    with np.printoptions(suppress=True):
        lines.append('[EVAL] Class IoU: \n' + str(np.round(result['class_iou'], 4)))
        lines.append('[EVAL] Class Precision: \n' + str(np.round(result['class_precision'], 4)))
        lines.append('[EVAL] Class Recall: \n' + str(np.round(result['class_recall'], 4)))
    return lines


def evaluate(model, dataset, aug_eval=False, scales=1.0, flip_horizontal=False, flip_vertical=False,
             is_slide=False, crop_size=None, stride=None, aug_combine='logits', precision='fp32',
             amp_level='O1', num_workers=0, losses=None, save_dir=None, print_detail=True,
             logger=None):
    """Evaluates ``model`` on ``dataset`` (this rank's share; areas summed over ranks).

    Args:
        model (paddle.nn.Layer): the model (not a DataParallel wrapper).
        dataset (paddle.io.Dataset): a paddleseg dataset in 'val' mode.
        aug_eval (bool, optional): average over ``scales`` and flips
            (:func:`psanet.core.inference.aug_inference`). Default: False.
        scales (float | list, optional): scales for aug_eval. Default: 1.0.
        flip_horizontal (bool, optional): horizontal flips for aug_eval. Default: False.
        flip_vertical (bool, optional): vertical flips for aug_eval. Default: False.
        is_slide (bool, optional): sliding-window inference. Default: False.
        crop_size (tuple, optional): (w, h) window when is_slide. Default: None.
        stride (tuple, optional): (w, h) step when is_slide. Default: None.
        aug_combine (str, optional): with aug_eval, average the 'logits' (paddleseg
            2.8's aug_inference) or their 'softmax'. Default: 'logits'.
        precision (str, optional): 'fp32' or 'fp16' (GPU only). Default: 'fp32'.
        amp_level (str, optional): 'O1' or 'O2'. Default: 'O1'.
        num_workers (int, optional): DataLoader workers. Default: 0.
        losses (dict, optional): the training losses; when given (and not
            aug_eval) the validation loss of the main logit (its coef times its
            loss, averaged over images) is reported too. Default: None.
        save_dir (str, optional): also write predictions there. Default: None.
        print_detail (bool, optional): show PaddleSeg's progress bar (on stderr, rank 0)
            and log its [EVAL] lines. Default: True.
        logger (logging.Logger, optional): Default: the 'psanet' logger.

    Returns:
        dict: ``num_images``, ``miou``, ``acc``, ``kappa``, ``mdice``, ``class_iou``,
        ``class_precision``, ``class_recall``, ``class_dice``, ``areas`` ([3, C]
        summed over ranks) and ``loss`` (None unless computed).
    """
    logger = logger or get_logger()
    if is_slide:
        crop_size, stride = inference.check_slide_args(crop_size, stride)
    was_training = model.training
    model.eval()
    loader, sampler = build_eval_loader(dataset, num_workers=num_workers)
    num_classes, ignore_index = dataset.num_classes, dataset.ignore_index
    areas = np.zeros([3, num_classes], dtype='int64')
    loss_sum, loss_count = 0.0, 0
    with_loss = losses is not None and not aug_eval
    total = len(sampler)
    if print_detail:
        logger.info(f'Start evaluating (total_samples: {len(dataset)}, this rank: {total})...')
    batch_cost, reader_cost = TimeAverager(), TimeAverager()
    start = time.time()
    # PaddleSeg's evaluate shows this bar; only rank 0 updates it.
    with paddle.no_grad(), progress_bar(total, print_detail) as bar:
        for step, data in enumerate(loader):
            interrupts.raise_if_interrupted()
            reader_cost.record(time.time() - start)
            raise_if_error(data)
            image, label = data['img'], data['label']
            trans_info = data['trans_info'][0]
            with autocast(precision, amp_level):
                if aug_eval:
                    score = inference.aug_inference(model, image, trans_info, scales=scales,
                                                    flip_horizontal=flip_horizontal,
                                                    flip_vertical=flip_vertical,
                                                    is_slide=is_slide, crop_size=crop_size,
                                                    stride=stride, combine=aug_combine)
                else:
                    score = inference.inference(model, image, trans_info, is_slide=is_slide,
                                                crop_size=crop_size, stride=stride)
            score = score.astype('float32')
            if list(score.shape[-2:]) != list(label.shape[-2:]):
                raise ConfigError(
                    f'the prediction is {score.shape[-1]}x{score.shape[-2]} but the label is '
                    f'{label.shape[-1]}x{label.shape[-2]}: the val_dataset transforms change the '
                    'size in a way trans_info does not record; use Resize/Padding transforms.')
            pred = paddle.argmax(score, axis=1, keepdim=True, dtype='int32')
            areas += class_areas(pred, label, num_classes, ignore_index)
            if with_loss:
                coef, loss_fn = losses['coef'][0], losses['types'][0]
                loss_sum += float(coef * loss_fn(score, label.squeeze(1)))
                loss_count += 1
            if save_dir is not None:
                index = data['index'][0]
                image_path = sample_paths(dataset, index)[0] or f'{index:06d}.png'
                _write_prediction(pred.numpy()[0, 0], image_path, dataset, save_dir)
            batch_cost.record(time.time() - start, num_samples=1)
            if bar is not None and dist.rank() == 0:
                bar.update(step + 1, [('batch_cost', batch_cost.get_average()),
                                      ('reader cost', reader_cost.get_average())])
            batch_cost.reset()
            reader_cost.reset()
            start = time.time()
    summed = dist.all_reduce_sum(np.concatenate([areas.ravel(), [loss_sum, loss_count]]))
    areas = np.rint(summed[:-2]).astype('int64').reshape(3, num_classes)
    result = summarize(areas)
    result['areas'] = areas
    result['num_images'] = len(dataset)
    result['loss'] = float(summed[-2] / summed[-1]) if with_loss and summed[-1] > 0 else None
    if print_detail:
        for line in format_report(result):
            logger.info(line)
        if save_dir is not None:
            logger.info(f'[EVAL] predictions written to {save_dir}')
    if was_training:
        model.train()
    return result


def merge_test_config(test_config, **flags):
    """Command-line flags override the config's test_config; unset flags (None) keep it."""
    merged = dict(aug_eval=False, scales=1.0, flip_horizontal=False, flip_vertical=False,
                  is_slide=False, crop_size=None, stride=None, aug_combine='logits')
    unknown = [k for k in test_config if k not in merged]
    if unknown:
        raise ConfigError(f'test_config has unknown keys {unknown}: known are {list(merged)}.')
    merged.update(test_config)
    merged.update({k: v for k, v in flags.items() if v is not None})
    return merged


def check_inference_flags(flags, aug_flag, test_config=None):
    """Raises ConfigError for an inference flag that would be ignored or has a bad value.

    ``--scales``, the flips and ``--aug_combine`` only act with ``aug_flag``,
    ``--crop_size`` and ``--stride`` only with ``--is_slide``: given without it,
    each would leave the result unchanged without a word. The config's
    ``test_config`` counts as given (its ``aug_eval`` switches on
    ``aug_flag``); its values are checked too.

    Args:
        flags (dict | argparse.Namespace): the command line's values of
            ``aug_eval`` / ``aug_pred`` (``aug_flag`` without dashes), ``scales``,
            ``flip_horizontal``, ``flip_vertical``, ``aug_combine``, ``is_slide``,
            ``crop_size`` and ``stride``; None (or absent) where not given.
        aug_flag (str): '--aug_eval' (val.py) or '--aug_pred' (predict.py).
        test_config (dict, optional): the config's ``test_config``. Default: None.

    Raises:
        ConfigError: naming the flag and the flag it needs, or the bad value.
    """
    flags = flags if isinstance(flags, dict) else vars(flags)
    given = {k: v for k, v in flags.items() if v is not None}
    test_config = test_config or {}
    if not isinstance(test_config, dict):
        raise ConfigError(f'test_config must be a mapping of keys such as aug_eval and scales, '
                          f'got {test_config!r}: fix it in the config.')
    aug_key = aug_flag.lstrip('-')
    aug = given.get(aug_key, test_config.get('aug_eval', False))
    slide = given.get('is_slide', test_config.get('is_slide', False))
    for name, switch, needs in (('scales', aug, aug_flag),
                                ('flip_horizontal', aug, aug_flag),
                                ('flip_vertical', aug, aug_flag),
                                ('aug_combine', aug, aug_flag),
                                ('crop_size', slide, '--is_slide'),
                                ('stride', slide, '--is_slide')):
        if name in given and not switch:
            raise ConfigError(f'--{name} only acts with {needs}, which is not set (on the command '
                              f'line or in test_config): add {needs} or drop --{name}.')

    def where(name):
        return f'--{name}' if name in given else f'test_config.{name}'

    combine = given.get('aug_combine', test_config.get('aug_combine'))
    if combine is not None and combine not in inference.AUG_COMBINES:
        raise ConfigError(f'{where("aug_combine")} must be one of '
                          f'{" or ".join(inference.AUG_COMBINES)}, got {combine!r}.')
    scales = given.get('scales', test_config.get('scales'))
    if scales is not None:
        values = scales if isinstance(scales, (list, tuple)) else [scales]
        if not values or not all(_positive_number(v) for v in values):
            raise ConfigError(f'{where("scales")} must be positive numbers, e.g. 0.75 1.0 1.25, '
                              f'got {scales!r}.')
    for name in ('crop_size', 'stride'):
        value = given.get(name, test_config.get(name))
        if value is None:
            if slide:
                raise ConfigError(f'--is_slide needs --{name} WIDTH HEIGHT (or '
                                  f'test_config.{name}): add it, e.g. --crop_size 1024 512 '
                                  '--stride 768 384.')
            continue
        if (not isinstance(value, (list, tuple)) or len(value) != 2 or
                not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
            raise ConfigError(f'{where(name)} must be two positive integers (width height), '
                              f'got {value!r}.')


def _positive_number(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and
            math.isfinite(value) and value > 0)


def evaluate_from_config(config, model_path, device=None, num_workers=0, aug_eval=None, scales=None,
                         flip_horizontal=None, flip_vertical=None, is_slide=None, crop_size=None,
                         stride=None, aug_combine=None, save_dir=None, precision='fp32',
                         amp_level='O1', opts=None):
    """val.py: builds the model and val dataset from ``config``, loads ``model_path`` and evaluates.

    Flags left as None take their value from the config's ``test_config``.

    Returns:
        dict: the result of :func:`evaluate`.
    """
    set_device(device)
    dist.init_parallel()
    logger = get_logger()
    resolve_weights_path(model_path)  # a wrong path fails before any building
    if save_dir is not None:
        check_save_dir(save_dir)
    cfg = load_config(config, opts=opts)
    check_inference_flags(dict(aug_eval=aug_eval, scales=scales, flip_horizontal=flip_horizontal,
                               flip_vertical=flip_vertical, is_slide=is_slide,
                               crop_size=crop_size, stride=stride, aug_combine=aug_combine),
                          '--aug_eval', cfg.dic.get('test_config'))
    builder = ComponentBuilder(cfg, weights_follow=True)
    dataset = builder.dataset('val')
    model = builder.model
    path = load_model_weights(model, model_path)
    logger.info(f'Loaded weights {path}')
    options = merge_test_config(builder.test_config, aug_eval=aug_eval, scales=scales,
                                 flip_horizontal=flip_horizontal, flip_vertical=flip_vertical,
                                 is_slide=is_slide, crop_size=crop_size, stride=stride,
                                 aug_combine=aug_combine)
    return evaluate(model, dataset, num_workers=num_workers, save_dir=save_dir,
                    precision=precision, amp_level=amp_level, logger=logger, **options)
