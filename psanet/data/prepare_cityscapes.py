"""Prepares the real Cityscapes dataset for training, and maps between its label encodings.

Training uses the 19 train ids (``*_gtFine_labelTrainIds.png``, 255 = ignore); Cityscapes
ships polygons and label-id images (ids 0-33), which the official evaluator reads again.
Both directions come from the official table in ``cityscapesscripts.helpers.labels``.
"""
import contextlib
import glob
import io
import multiprocessing
import os

import cv2
import numpy as np

from psanet.errors import DatasetError, DiskFullError, is_integer
from psanet.files import write_file_whole, write_image

from .validate import (CITYSCAPES_DOWNLOAD, CITYSCAPES_LAYOUT, IMAGE_SUFFIX, TRAIN_IDS_SUFFIX,
                       check_dataset_root)

__all__ = ['prepare_cityscapes', 'format_summary', 'label_ids_to_train_ids',
           'train_ids_to_label_ids', 'LABEL_IDS_TO_TRAIN_IDS', 'TRAIN_IDS_TO_LABEL_IDS',
           'SPLITS']

SPLITS = ('train', 'val', 'test')
POLYGONS_SUFFIX = '_gtFine_polygons.json'
LABEL_IDS_SUFFIX = '_gtFine_labelIds.png'
IGNORE_INDEX = 255


def _lookup_tables():
    from cityscapesscripts.helpers.labels import labels
    to_train = np.full(256, IGNORE_INDEX, np.uint8)
    to_label = np.zeros(256, np.uint8)  # not a train id: 'unlabeled' (id 0)
    for label in labels:
        if label.id >= 0:
            to_train[label.id] = label.trainId if 0 <= label.trainId < 255 else IGNORE_INDEX
    # Several ids share a train id (all void ids share 255): the evaluator
    # wants the first one in the table, as cityscapesscripts' trainId2label.
    for label in reversed(labels):
        if label.id >= 0 and 0 <= label.trainId <= 255:
            to_label[label.trainId] = label.id
    return to_train, to_label


LABEL_IDS_TO_TRAIN_IDS, TRAIN_IDS_TO_LABEL_IDS = _lookup_tables()


def _lookup(table, array, name):
    array = np.asarray(array)
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f'{name} needs an integer array, got dtype {array.dtype}')
    if array.size and (array.min() < 0 or array.max() > 255):
        raise ValueError(f'{name} needs values in [0, 255], got [{array.min()}, {array.max()}]')
    return table[array]


def label_ids_to_train_ids(label_ids):
    """Maps Cityscapes label ids (0-33) to uint8 train ids (0-18, 255 for void and unknown ids)."""
    return _lookup(LABEL_IDS_TO_TRAIN_IDS, label_ids, 'label_ids_to_train_ids')


def train_ids_to_label_ids(train_ids):
    """Maps train ids (0-18) to uint8 Cityscapes label ids, for the official evaluator; any other
    value maps to 0 ('unlabeled'), which the evaluator ignores."""
    return _lookup(TRAIN_IDS_TO_LABEL_IDS, train_ids, 'train_ids_to_label_ids')


def _scan(root, split, folder, suffix):
    """{'<city>/<frame stem>': path} of the files ending in ``suffix``."""
    paths = glob.glob(os.path.join(root, folder, split, '*', '*' + suffix))
    return {os.path.join(os.path.basename(os.path.dirname(p)), os.path.basename(p)[:-len(suffix)]): p
            for p in sorted(paths)}


def _make_train_ids(task):
    """Writes one train-id image whole (a half-written one under the final name would be
    skipped as done on the next run); module level so that a process pool can run it."""
    source, target = task
    if not source.endswith(POLYGONS_SUFFIX):
        label_ids = cv2.imread(source, cv2.IMREAD_UNCHANGED)
        if label_ids is None or label_ids.ndim != 2:
            raise DatasetError(
                f'{source} is not a single-channel label-id image: re-extract '
                'gtFine_trainvaltest.zip.')
    try:
        if source.endswith(POLYGONS_SUFFIX):
            drawn = _polygons_to_train_ids(source)
            write_file_whole(target, lambda temporary: drawn.save(temporary, format='PNG'))
        else:
            write_image(target, label_ids_to_train_ids(label_ids))
    except DiskFullError:
        raise
    except OSError as error:
        raise DatasetError(f'cannot write {target} ({error.strerror or error}): check the '
                           'folder permissions.') from error
    return target


def _polygons_to_train_ids(json_path):
    """The train-id image (PIL, mode L) cityscapesscripts draws from a polygons file, as its
    ``json2labelImg`` draws it."""
    from cityscapesscripts.helpers.annotation import Annotation
    from cityscapesscripts.preparation.json2labelImg import createLabelImage
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            annotation = Annotation()
            annotation.fromJsonFile(json_path)
            return createLabelImage(annotation, 'trainIds')
    except SystemExit as error:
        # cityscapesscripts prints the reason and exits on an unknown label name.
        reason = printed.getvalue().strip().splitlines()
        raise DatasetError(
            f'{json_path}: cityscapesscripts cannot draw it ({reason[0] if reason else error}); '
            'the file is not from gtFine_trainvaltest.zip or is damaged: re-extract it.') from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DatasetError(f'{json_path} is not a valid Cityscapes polygons file ({error}): '
                           're-extract gtFine_trainvaltest.zip.') from error


def prepare_cityscapes(root, num_workers=1, overwrite=False, splits=SPLITS, log=print):
    """Makes ``*_gtFine_labelTrainIds.png`` for every frame of a Cityscapes ``root``.

    For each ``gtFine/<split>/<city>/<frame>``: from ``*_gtFine_polygons.json`` with
    cityscapesscripts' ``json2labelImg`` when present, else from ``*_gtFine_labelIds.png``
    through the label table. Files already made are kept unless ``overwrite``. ``log`` takes
    one progress line (None: silent). A wrong layout, nothing found, or a file that cannot be
    converted is a DatasetError.

    Returns:
        dict: per split, ``images``, ``polygons``, ``label_ids_only``, ``made``, ``kept``,
        ``images_without_labels`` and ``labels_without_images`` (lists of '<city>/<frame>').
    """
    log = log or (lambda line: None)
    if not is_integer(num_workers, 1):
        raise ValueError(f'num_workers must be a positive int, got {num_workers!r}')
    check_dataset_root(root)
    summary = {}
    for split in splits:
        images = _scan(root, split, 'leftImg8bit', IMAGE_SUFFIX)
        polygons = _scan(root, split, 'gtFine', POLYGONS_SUFFIX)
        label_ids = _scan(root, split, 'gtFine', LABEL_IDS_SUFFIX)
        sources = dict(label_ids)
        sources.update(polygons)
        tasks, kept = [], 0
        for frame, source in sorted(sources.items()):
            target = source[:-len(POLYGONS_SUFFIX if source.endswith(POLYGONS_SUFFIX)
                                  else LABEL_IDS_SUFFIX)] + TRAIN_IDS_SUFFIX
            if os.path.exists(target) and not overwrite:
                kept += 1
            else:
                tasks.append((source, target))
        if images or sources:
            log(f'[{split}] {len(images)} images, {len(polygons)} polygon files, '
                f'{len(set(label_ids) - set(polygons))} label-id images without polygons; '
                f'making {len(tasks)} labelTrainIds, keeping {kept} already made')
        _run(tasks, num_workers, split, log)
        train_ids = _scan(root, split, 'gtFine', TRAIN_IDS_SUFFIX)
        summary[split] = {
            'images': len(images),
            'polygons': len(polygons),
            'label_ids_only': len(set(label_ids) - set(polygons)),
            'made': len(tasks),
            'kept': kept,
            'images_without_labels': sorted(set(images) - set(train_ids)),
            'labels_without_images': sorted(set(train_ids) - set(images)),
        }
    if not any(s['images'] or s['polygons'] or s['label_ids_only'] for s in summary.values()):
        raise DatasetError(
            f'{root} has leftImg8bit/ and gtFine/ but no images or labels in them for '
            f'splits {list(splits)}. Expected layout:\n{CITYSCAPES_LAYOUT}\n{CITYSCAPES_DOWNLOAD}')
    return summary


def _run(tasks, num_workers, split, log):
    if not tasks:
        return
    every = max(1, len(tasks) // 10)
    if num_workers == 1:
        results = map(_make_train_ids, tasks)
        pool = None
    else:
        pool = multiprocessing.get_context('spawn' if os.name == 'nt' else 'fork').Pool(num_workers)
        results = pool.imap_unordered(_make_train_ids, tasks, chunksize=8)
    try:
        for done, _ in enumerate(results, 1):
            if done % every == 0 or done == len(tasks):
                log(f'[{split}] {done}/{len(tasks)} labelTrainIds made')
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()


def format_summary(summary):
    """The summary of ``prepare_cityscapes`` as printable lines."""
    lines = [f'{"split":<6} {"images":>7} {"polygons":>9} {"labelIds only":>14} '
             f'{"made":>6} {"kept":>6} {"no label":>9} {"no image":>9}']
    for split, s in summary.items():
        lines.append(f'{split:<6} {s["images"]:>7} {s["polygons"]:>9} {s["label_ids_only"]:>14} '
                     f'{s["made"]:>6} {s["kept"]:>6} {len(s["images_without_labels"]):>9} '
                     f'{len(s["labels_without_images"]):>9}')
    for split, s in summary.items():
        for key, what in (('images_without_labels', 'images without labels'),
                          ('labels_without_images', 'labels without images')):
            if s[key]:
                shown = ', '.join(s[key][:5]) + (' ...' if len(s[key]) > 5 else '')
                lines.append(f'{split}: {len(s[key])} {what}: {shown}')
    if any(s['images_without_labels'] for s in summary.values()):
        lines.append('images without labels: unzip gtFine_trainvaltest.zip into the same root '
                     '(paddleseg pairs images and labels by sorted order, so training would '
                     'pair them wrongly).')
    return '\n'.join(lines)
