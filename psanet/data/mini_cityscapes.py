"""Generates mini Cityscapes: synthetic street scenes in the exact Cityscapes layout and encodings.

All 19 train classes as shapes with their own colour, texture, size and place, ignored
pixels and instance ids as in the real labels, so that every Cityscapes reader reads it
unchanged. Same seed, same bytes; a smaller dataset is a prefix of a larger one. Why and
what the scenes hold: docs/design.md.
"""
import json
import os

import cv2
import numpy as np

from psanet.errors import ConfigError, is_integer
from psanet.files import check_save_dir, write_folder

from .prepare_cityscapes import LABEL_IDS_SUFFIX, label_ids_to_train_ids
from .scene_canvas import LABEL_COLORS, LABEL_IDS, TRAIN_CLASSES
from .street_scenes import render
from .validate import IMAGE_SUFFIX, TRAIN_IDS_SUFFIX

__all__ = ['generate', 'format_summary', 'DEFAULT_CITIES', 'MARKER', 'TRAIN_CLASSES']

COLOR_SUFFIX = '_gtFine_color.png'
INSTANCE_IDS_SUFFIX = '_gtFine_instanceIds.png'
MARKER = 'mini_cityscapes.json'
DEFAULT_CITIES = {'train': ('aachen', 'bochum', 'bremen'),
                  'val': ('frankfurt', 'lindau', 'munster')}
SPLIT_SEEDS = {'train': 0, 'val': 1}
FRAME = 19  # the annotated frame of each Cityscapes sequence
MIN_SIZE = (32, 16)
MAX_SIZE = (4096, 2048)  # twice Cityscapes' 2048x1024; a scene is drawn in memory at once
_ATTEMPTS = 4

# Classes that a random scene may miss: each image is made to hold two of
# them in turn, so any ceil(11 / 2) = 6 consecutive images hold all 19.
_ROTATION = ('wall', 'fence', 'terrain', 'traffic light', 'truck', 'bus', 'train',
             'motorcycle', 'bicycle', 'rider', 'person')


def _scene(width, height, seed, split, index):
    rng = np.random.default_rng([seed, SPLIT_SEEDS[split], index])
    wanted = {_ROTATION[index % len(_ROTATION)],
              _ROTATION[(index + (len(_ROTATION) + 1) // 2) % len(_ROTATION)]}
    for _ in range(_ATTEMPTS):
        image, label_ids, instance_ids = render(width, height, rng, wanted)
        present = {name for name in wanted if (label_ids == LABEL_IDS[name]).any()}
        if present == wanted:  # else a nearer object hid it: draw the scene anew
            break
    return image, label_ids, instance_ids


def _cities(cities, split):
    if cities is None:
        chosen = DEFAULT_CITIES[split]
    elif isinstance(cities, dict):
        chosen = cities[split]
    else:
        chosen = cities
    chosen = tuple(chosen)
    if not chosen or any(not c or '_' in c or os.sep in c for c in chosen):
        raise ValueError(f'cities must be non-empty names without "_" or "{os.sep}", got {chosen!r}')
    return chosen


def _check_root(root):
    """Refuses a root that holds another dataset (a previous mini Cityscapes is replaced)."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise FileExistsError(f'--out {root} is a file, not a folder: choose a folder path '
                              '(it is made if missing).')
    parent = _existing_ancestor(root)
    if not os.path.isdir(parent):
        raise FileExistsError(f'--out {root} cannot be made: {parent} is a file, not a folder; '
                              'choose another --out path.')
    if os.path.exists(os.path.join(root, MARKER)):
        return
    for folder in ('leftImg8bit', 'gtFine'):
        if os.path.isdir(os.path.join(root, folder)) and os.listdir(os.path.join(root, folder)):
            raise FileExistsError(
                f'{os.path.join(root, folder)} exists and was not made by this generator '
                f'(no {MARKER}): choose an empty --out folder or remove that one.')
    try:
        check_save_dir(root, '--out')
    except ConfigError as error:
        raise OSError(str(error)) from None


def _existing_ancestor(path):
    """The nearest of ``path`` and its parents that exists (a file or a folder)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _write(path, array):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not cv2.imwrite(path, array):
        raise OSError(f'cannot write {path}: check the folder permissions and free space.')


def generate(root, num_train=40, num_val=10, size=(256, 128), seed=0, cities=None):
    """Writes mini Cityscapes into ``root``; returns its summary (also written to
    ``root/mini_cityscapes.json``): ``root``, ``size``, ``seed``, ``classes`` and per split
    ``images``, ``cities``, ``class_pixels``, ``ignore_pixels`` and ``class_images``.

    Layout, file names and encodings are those of Cityscapes::

        leftImg8bit/<split>/<city>/<city>_<seq:06d>_000019_leftImg8bit.png
        gtFine/<split>/<city>/<same stem>_gtFine_labelIds.png        (ids 0-33)
        gtFine/<split>/<city>/<same stem>_gtFine_labelTrainIds.png   (0-18, 255 ignore)
        gtFine/<split>/<city>/<same stem>_gtFine_color.png
        gtFine/<split>/<city>/<same stem>_gtFine_instanceIds.png     (16-bit: label id, or
            label id * 1000 + instance number on the classes with instances)

    A previous mini Cityscapes in ``root`` is replaced, any other dataset there is an error.
    ``size`` is (width, height), at least (32, 16). ``cities``: None for three real city names
    per split, a list for both splits, or ``{'train': [...], 'val': [...]}``.
    """
    width, height = (int(v) for v in size)
    if width < MIN_SIZE[0] or height < MIN_SIZE[1]:
        raise ValueError(f'size (width, height) must be at least {MIN_SIZE}, got {tuple(size)}')
    if width > MAX_SIZE[0] or height > MAX_SIZE[1]:
        raise ValueError(f'size (width, height) must be at most {MAX_SIZE} (twice Cityscapes), '
                         f'got {tuple(size)}')
    for name, value in (('num_train', num_train), ('num_val', num_val), ('seed', seed)):
        if not is_integer(value, 0):
            raise ValueError(f'{name} must be a non-negative int, got {value!r}')
    counts = {'train': int(num_train), 'val': int(num_val)}
    split_cities = {split: _cities(cities, split) for split in counts}
    _check_root(root)
    # Written into a hidden folder that then replaces root, so that an interrupted run
    # leaves the previous set (images and summary) as it was; the user's files stay.
    summary = {'root': root, 'size': [width, height], 'seed': int(seed),
               'classes': list(TRAIN_CLASSES), 'splits': {}}
    write_folder(root, lambda folder: _write_splits(folder, counts, split_cities, summary),
                 carry_over=lambda name: True)
    return summary


def _write_splits(root, counts, split_cities, summary):
    """Fills ``root`` (the hidden folder) with both splits; their statistics go to
    ``summary`` and the summary to ``root/mini_cityscapes.json``."""
    (width, height), seed = summary['size'], summary['seed']
    for split, count in counts.items():
        histogram = np.zeros(256, np.int64)
        class_images = np.zeros(256, np.int64)
        per_city = {}
        for index in range(count):
            city = split_cities[split][index % len(split_cities[split])]
            stem = f'{city}_{index // len(split_cities[split]):06d}_{FRAME:06d}'
            image, label_ids, instance_ids = _scene(width, height, seed, split, index)
            train_ids = label_ids_to_train_ids(label_ids)
            _write(os.path.join(root, 'leftImg8bit', split, city, stem + IMAGE_SUFFIX),
                   cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
            label_stem = os.path.join(root, 'gtFine', split, city, stem)
            _write(label_stem + LABEL_IDS_SUFFIX, label_ids)
            _write(label_stem + TRAIN_IDS_SUFFIX, train_ids)
            _write(label_stem + COLOR_SUFFIX, cv2.cvtColor(LABEL_COLORS[label_ids], cv2.COLOR_RGB2BGR))
            _write(label_stem + INSTANCE_IDS_SUFFIX, instance_ids)
            pixels = np.bincount(train_ids.ravel(), minlength=256)
            histogram += pixels
            class_images += pixels > 0
            per_city[city] = per_city.get(city, 0) + 1
        total = max(1, int(histogram.sum()))
        summary['splits'][split] = {
            'images': count,
            'cities': per_city,
            'class_pixels': {name: float(histogram[i]) / total for i, name in enumerate(TRAIN_CLASSES)},
            'ignore_pixels': float(histogram[255]) / total,
            'class_images': {name: int(class_images[i]) for i, name in enumerate(TRAIN_CLASSES)},
        }
    with open(os.path.join(root, MARKER), 'w') as f:
        json.dump(summary, f, indent=1)
    return summary


def format_summary(summary):
    """The summary of ``generate`` as a printable table."""
    splits = summary['splits']
    lines = [f'mini Cityscapes in {summary["root"]}: {summary["size"][0]}x{summary["size"][1]}, '
             f'seed {summary["seed"]}, '
             + ', '.join(f'{s["images"]} {name} images' for name, s in splits.items()),
             f'{"class":<14}' + ''.join(f'{name + " px%":>11}{"imgs":>6}' for name in splits)]
    for name in summary['classes']:
        lines.append(f'{name:<14}' + ''.join(
            f'{100 * s["class_pixels"][name]:>11.2f}{s["class_images"][name]:>6}'
            for s in splits.values()))
    lines.append(f'{"ignore (255)":<14}' + ''.join(
        f'{100 * s["ignore_pixels"]:>11.2f}{"":>6}' for s in splits.values()))
    return '\n'.join(lines)
