"""Checks a segmentation dataset before training, with errors that name the file and the fix.

paddleseg's datasets fail late and vaguely on bad data: ``Cityscapes`` says
"The dataset is not Found or the folder structure is nonconfoumance." for any
layout problem, silently pairs the wrong label with an image when one
``*_labelTrainIds.png`` is missing (it zips two sorted globs), and a label
image holding Cityscapes label ids (0-33) instead of train ids only shows up
as a CUDA assert or a NaN loss hours later. The engine therefore calls, in
this order::

    check_dataset_config(cfg.dic['train_dataset'])   # before paddleseg builds it
    dataset = cfg.train_dataset                         # paddleseg's constructor
    validate_dataset(dataset, dataset.num_classes)      # before the first iteration

and the same for the validation dataset. ``check_dataset_root(root, mode)`` is
the Cityscapes-layout part of ``check_dataset_config`` for callers that hold a
path rather than a config.
"""
import glob
import os

import cv2
import numpy as np
from PIL import Image

__all__ = ['DatasetError', 'check_dataset_root', 'check_dataset_config',
           'validate_dataset', 'CITYSCAPES_LAYOUT', 'CITYSCAPES_DOWNLOAD']

CITYSCAPES_LAYOUT = """\
    <root>/leftImg8bit/{train,val,test}/<city>/<city>_<seq>_<frame>_leftImg8bit.png
    <root>/gtFine/{train,val,test}/<city>/<city>_<seq>_<frame>_gtFine_labelTrainIds.png"""

CITYSCAPES_DOWNLOAD = (
    'Download leftImg8bit_trainvaltest.zip and gtFine_trainvaltest.zip from '
    'https://www.cityscapes-dataset.com (free account), unzip both into <root>, '
    'then run `python tools/prepare_cityscapes.py --root <root>` to make the '
    '*_gtFine_labelTrainIds.png files. For a small synthetic stand-in run '
    '`python tools/make_mini_cityscapes.py --out data/mini_cityscapes`.')

IMAGE_SUFFIX = '_leftImg8bit.png'
TRAIN_IDS_SUFFIX = '_gtFine_labelTrainIds.png'
_CHECK_LABELS = ('all', 'sample', 'none')
_NAMES_SHOWN = 5


class DatasetError(ValueError):
    """A dataset on disk that cannot be trained on; the message names the file and the fix."""


def check_dataset_root(root, mode=None):
    """Raises DatasetError unless ``root`` has the Cityscapes folder layout.

    Args:
        root (str): the dataset root (``dataset_root`` in the config).
        mode (str, optional): 'train', 'val' or 'test'; when given, the
            ``leftImg8bit/<mode>`` and ``gtFine/<mode>`` folders must exist too.
            Default: None.
    """
    if root is None or not os.path.isdir(root):
        raise DatasetError(
            f'dataset root {root!r} does not exist (cwd {os.getcwd()}). Expected layout:\n'
            f'{CITYSCAPES_LAYOUT}\n{CITYSCAPES_DOWNLOAD}')
    missing = [d for d in ('leftImg8bit', 'gtFine')
               if not os.path.isdir(os.path.join(root, d))]
    if mode is not None:
        missing += [os.path.join(d, mode) for d in ('leftImg8bit', 'gtFine')
                    if d not in missing and not os.path.isdir(os.path.join(root, d, mode))]
    if missing:
        raise DatasetError(
            f'{root} is not a Cityscapes folder: missing '
            f'{", ".join(m + "/" for m in missing)}.{_nested_hint(root)} Expected layout:\n'
            f'{CITYSCAPES_LAYOUT}\n{CITYSCAPES_DOWNLOAD}')


def _nested_hint(root):
    """Names leftImg8bit/ or gtFine/ one level down: zips unpacked into folders of their own."""
    found = sorted(glob.glob(os.path.join(root, '*', 'leftImg8bit')) +
                   glob.glob(os.path.join(root, '*', 'gtFine')))
    if not found:
        return ''
    return (f' Found {", ".join(found)} one level down: move those folders up '
            f'into {root} so that both sit side by side.')


def check_dataset_config(dataset_cfg):
    """Checks the paths of a ``train_dataset`` / ``val_dataset`` config dict before paddleseg builds it.

    Args:
        dataset_cfg (dict): the dataset section of a config, with ``type``,
            ``dataset_root``, ``mode`` and for ``type: Dataset`` the
            ``train_path`` / ``val_path`` / ``test_path`` list files.
    """
    kind = dataset_cfg.get('type')
    root = dataset_cfg.get('dataset_root')
    mode = str(dataset_cfg.get('mode', 'train')).lower()
    if kind == 'Cityscapes':
        check_dataset_root(root, mode)
        return
    if root is None or not os.path.isdir(root):
        raise DatasetError(
            f'{kind} dataset_root {root!r} does not exist (cwd {os.getcwd()}): '
            'fix dataset_root in the config.')
    if kind == 'Dataset':
        key = f'{mode}_path'
        path = dataset_cfg.get(key)
        if path is None or not os.path.isfile(path):
            raise DatasetError(
                f'{kind} with mode {mode!r} needs {key}, a text file of '
                f'"image_path label_path" lines relative to dataset_root; '
                f'{key}={path!r} is not a file: fix it in the config.')


def validate_dataset(dataset, num_classes, ignore_index=255, check_labels='sample', sample=8):
    """Checks that every sample of a paddleseg dataset can be read and has valid labels.

    Args:
        dataset: a paddleseg ``Dataset`` or ``Cityscapes`` (anything with
            ``file_list``, a list of ``[image_path, label_path]``; optional
            ``dataset_root`` and ``mode``).
        num_classes (int): labels must lie in ``[0, num_classes)`` or be ``ignore_index``.
        ignore_index (int, optional): the label value that is not trained on. Default: 255.
        check_labels (str, optional): 'all' reads every image and label,
            'sample' the first and last ``sample`` ones together, 'none' only
            checks that the files exist. Default: 'sample'.
        sample (int, optional): how many samples 'sample' reads. Default: 8.

    Returns:
        dict: ``{'samples': int, 'read': int}``, the number of samples and how many were read.

    Raises:
        DatasetError: naming the first bad file and the fix.
    """
    if check_labels not in _CHECK_LABELS:
        raise ValueError(f'check_labels must be one of {_CHECK_LABELS}, got {check_labels!r}')
    if check_labels == 'sample' and (not isinstance(sample, int) or sample < 1):
        raise ValueError(f'sample must be a positive int, got {sample!r}')
    root = getattr(dataset, 'dataset_root', None)
    mode = getattr(dataset, 'mode', None)
    if root is not None and not os.path.isdir(root):
        raise DatasetError(f'dataset root {root!r} does not exist (cwd {os.getcwd()}): '
                           'fix dataset_root in the config.')
    is_cityscapes = root is not None and all(
        os.path.isdir(os.path.join(root, d)) for d in ('leftImg8bit', 'gtFine'))
    if is_cityscapes and mode in ('train', 'val', 'test'):
        _check_cityscapes_pairs(root, mode)
    file_list = list(dataset.file_list)
    if not file_list:
        where = (f'{root}/leftImg8bit/{mode}/<city>/*{IMAGE_SUFFIX}' if is_cityscapes
                 else f'the {mode} list file')
        raise DatasetError(f'no images found in {where}. Expected layout:\n'
                           f'{CITYSCAPES_LAYOUT}\n{CITYSCAPES_DOWNLOAD}')

    needs_labels = mode in ('train', 'val')
    for image_path, label_path in file_list:
        _check_pair_names(image_path, label_path, root)
        if not os.path.isfile(image_path):
            raise DatasetError(f'image {image_path} does not exist: fix the file list or '
                               'restore the file.')
        if label_path is None:
            if needs_labels:
                raise DatasetError(f'image {image_path} has no label in {mode} mode: add '
                                   '"image_path label_path" to its line in the list file.')
        elif not os.path.isfile(label_path):
            raise DatasetError(f'label {label_path} (of image {image_path}) does not exist: '
                               f'{_label_fix(root, is_cityscapes)}')

    if check_labels == 'none':
        return {'samples': len(file_list), 'read': 0}
    indices = range(len(file_list))
    if check_labels == 'sample':
        head = (sample + 1) // 2
        indices = sorted(set(indices[:head]) | set(indices[len(file_list) - sample // 2:]))
    for i in indices:
        _check_sample(*file_list[i], num_classes, ignore_index, root, is_cityscapes)
    return {'samples': len(file_list), 'read': len(indices)}


def _check_cityscapes_pairs(root, mode):
    """paddleseg zips the sorted image and label globs: any unmatched file shifts every pair after it."""
    images = _stems(glob.glob(os.path.join(root, 'leftImg8bit', mode, '*', '*' + IMAGE_SUFFIX)),
                    IMAGE_SUFFIX)
    labels = _stems(glob.glob(os.path.join(root, 'gtFine', mode, '*', '*' + TRAIN_IDS_SUFFIX)),
                    TRAIN_IDS_SUFFIX)
    without_label = sorted(set(images) - set(labels))
    without_image = sorted(set(labels) - set(images))
    if without_label:
        raise DatasetError(
            f'{len(without_label)} of {len(images)} {mode} images in {root} have no '
            f'*{TRAIN_IDS_SUFFIX}, e.g. {_few(images[s] for s in without_label)}. '
            f'Run `python tools/prepare_cityscapes.py --root {root}` to make them from '
            'the *_gtFine_polygons.json or *_gtFine_labelIds.png files.')
    if without_image:
        raise DatasetError(
            f'{len(without_image)} {mode} labels in {root} have no *{IMAGE_SUFFIX}, e.g. '
            f'{_few(labels[s] for s in without_image)}: unzip leftImg8bit_trainvaltest.zip '
            'into the same root or remove those labels.')


def _stems(paths, suffix):
    return {os.path.join(os.path.basename(os.path.dirname(p)), os.path.basename(p)[:-len(suffix)]): p
            for p in paths}


def _few(paths):
    paths = list(paths)
    shown = ', '.join(paths[:_NAMES_SHOWN])
    return shown + (f' and {len(paths) - _NAMES_SHOWN} more' if len(paths) > _NAMES_SHOWN else '')


def _check_pair_names(image_path, label_path, root):
    """Cityscapes-named pairs must share their stem, whatever list they come from."""
    if label_path is None:
        return
    image_name, label_name = os.path.basename(image_path), os.path.basename(label_path)
    if not (image_name.endswith(IMAGE_SUFFIX) and '_gtFine_' in label_name):
        return
    if image_name[:-len(IMAGE_SUFFIX)] != label_name.split('_gtFine_')[0]:
        raise DatasetError(
            f'image {image_path} is paired with label {label_path} of another frame: '
            f'a label is missing or extra in {root}; run '
            f'`python tools/prepare_cityscapes.py --root {root}` for its summary.')


def _label_fix(root, is_cityscapes):
    if is_cityscapes:
        return (f'run `python tools/prepare_cityscapes.py --root {root}` to make the '
                '*_gtFine_labelTrainIds.png files.')
    return 'fix the file list or restore the file.'


def _check_sample(image_path, label_path, num_classes, ignore_index, root, is_cityscapes):
    image = cv2.imread(image_path, cv2.IMREAD_COLOR)
    if image is None:
        raise DatasetError(f'image {image_path} cannot be read (corrupt or not an image): '
                           're-extract or re-download it.')
    if label_path is None:
        return
    try:
        label = np.asarray(Image.open(label_path))
    except Exception as error:  # PIL raises several types for a broken file
        raise DatasetError(f'label {label_path} cannot be read ({error}): re-extract it or '
                           f'{_label_fix(root, is_cityscapes)}') from error
    if label.ndim != 2:
        raise DatasetError(
            f'label {label_path} has shape {label.shape}: a label must be a single-channel '
            'image of class ids (a colour image such as *_gtFine_color.png is not a label); '
            + _label_fix(root, is_cityscapes))
    if label.shape != image.shape[:2]:
        raise DatasetError(f'label {label_path} is {label.shape[1]}x{label.shape[0]} but its '
                           f'image {image_path} is {image.shape[1]}x{image.shape[0]}: '
                           'pair each image with its own label.')
    values = np.unique(label)
    bad = values[((values < 0) | (values >= num_classes)) & (values != ignore_index)]
    if bad.size:
        if is_cityscapes:
            looks = ('this looks like Cityscapes label ids, not train ids'
                     if bad.max() <= 33 else 'labels must be Cityscapes train ids')
            fix = (f'{looks}: run '
                   f'`python tools/prepare_cityscapes.py --root {root} --overwrite` to make '
                   f'*_gtFine_labelTrainIds.png, or check num_classes ({num_classes}).')
        else:
            fix = (f'convert the labels to class ids 0..{num_classes - 1} (ignore_index for '
                   'void), or check num_classes / ignore_index in the config.')
        raise DatasetError(
            f'label {label_path} has values {bad[:10].tolist()} outside [0, {num_classes}) '
            f'that are not ignore_index {ignore_index}: {fix}')
