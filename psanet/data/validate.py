"""Checks a segmentation dataset before training, with errors that name the file and the fix.

:func:`check_dataset_config` runs before paddleseg builds a dataset, :func:`validate_dataset`
before the first iteration. What was read is remembered per file, so a second check reads
only the files that changed. Why: docs/design.md.
"""
import concurrent.futures
import glob
import hashlib
import json
import os
import time

import cv2
import numpy as np
from PIL import Image

from psanet import interrupts
from psanet.errors import ConfigError, DatasetError, few, is_integer, unreadable_image
from psanet.files import make_output_dir, write_bytes

__all__ = ['check_dataset_root', 'check_dataset_config',
           'validate_dataset', 'label_values', 'label_values_error', 'CITYSCAPES_LAYOUT', 'CITYSCAPES_DOWNLOAD',
           'CHECK_CACHE_NAME']

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

# What validate_dataset read, per file, in the dataset root (see _CheckCache).
CHECK_CACHE_NAME = '.psanet_dataset_check.json'
_CACHE_VERSION = 1
# A file modified this close to a check could change again within the file
# system's timestamp granularity unseen: it is not remembered (git's "racy" rule).
_RACY_NS = 2 * 10**9


def check_dataset_root(root, mode=None):
    """Raises DatasetError unless ``root`` has the Cityscapes folder layout (with ``mode``, its
    ``leftImg8bit/<mode>`` and ``gtFine/<mode>`` folders too)."""
    if root is not None and os.path.exists(root) and not os.path.isdir(root):
        raise DatasetError(f'dataset root {root} is a file, not a folder: pass the folder that '
                           'holds leftImg8bit/ and gtFine/.')
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
    """Checks the paths of a ``train_dataset`` / ``val_dataset`` config section (and for ``type:
    Dataset`` its list files) before paddleseg builds it."""
    kind = dataset_cfg.get('type')
    root = dataset_cfg.get('dataset_root')
    mode = str(dataset_cfg.get('mode', 'train')).lower()
    if kind == 'Cityscapes':
        check_dataset_root(root, mode)
        return
    if root is not None and os.path.exists(root) and not os.path.isdir(root):
        raise DatasetError(f'{kind} dataset_root {root} is a file, not a folder: fix '
                           'dataset_root in the config.')
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


def validate_dataset(dataset, num_classes, ignore_index=255, check_labels='all', sample=8,
                     num_workers=None, cache=True):
    """Checks that every sample of a paddleseg dataset (anything with ``file_list``) can be read
    and has valid labels; returns ``{'samples', 'read', 'cached'}`` counts.

    Every image must exist and its header decode (PNG: its chunks' checksums too); every label
    must decode to a single-channel image of the image's size holding only class ids in
    ``[0, num_classes)`` or ``ignore_index``. ``check_labels``: 'all' reads every image and
    label, 'sample' the first and last ``sample`` ones, 'none' only checks that the files
    exist. With ``cache`` what was read is remembered per file (path, size, modification time)
    in ``<dataset_root>/.psanet_dataset_check.json`` (``~/.cache/psanet/dataset_check/`` where
    the root is read-only), so a later check reads only new or changed files. A bad file is a
    DatasetError naming the first one, the fix, and how many more fail.
    """
    if check_labels not in _CHECK_LABELS:
        raise ValueError(f'check_labels must be one of {_CHECK_LABELS}, got {check_labels!r}')
    if check_labels == 'sample' and not is_integer(sample, 1):
        raise ValueError(f'sample must be a positive int, got {sample!r}')
    root = getattr(dataset, 'dataset_root', None)
    mode = getattr(dataset, 'mode', None)
    if root is not None and not os.path.isdir(root):
        raise DatasetError(f'dataset root {root!r} does not exist (cwd {os.getcwd()}): '
                           'fix dataset_root in the config.')
    is_cityscapes = _is_cityscapes(root)
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
        return {'samples': len(file_list), 'read': 0, 'cached': 0}
    indices = range(len(file_list))
    if check_labels == 'sample':
        head = (sample + 1) // 2
        indices = sorted(set(indices[:head]) | set(indices[len(file_list) - sample // 2:]))
    pairs = [file_list[i] for i in indices]
    memory = _CheckCache(root if cache else None)
    if num_workers is None:
        num_workers = min(8, len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity')
                          else os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max(1, int(num_workers))) as pool:
        results = list(pool.map(lambda pair: _read_sample(pair, memory), pairs))
    memory.save()  # before raising: what was read stays read
    problems = []
    for (image_path, label_path), (image, label, _) in zip(pairs, results):
        problem = _sample_problem(image_path, image, label_path, label, num_classes,
                                  ignore_index, root, is_cityscapes)
        if problem:
            problems.append(problem)
    if problems:
        message = problems[0][1]
        if len(problems) > 1:
            message += (f' {len(problems) - 1} more of the {len(pairs)} samples fail the check: '
                        f'{few(path for path, _ in problems[1:])}.')
        raise DatasetError(message)
    read = sum(1 for *_, fresh in results if fresh)
    return {'samples': len(file_list), 'read': read, 'cached': len(pairs) - read}


def _is_cityscapes(root):
    return root is not None and all(os.path.isdir(os.path.join(root, d))
                                    for d in ('leftImg8bit', 'gtFine'))


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
            f'*{TRAIN_IDS_SUFFIX}, e.g. {few(images[s] for s in without_label)}. '
            f'Run `python tools/prepare_cityscapes.py --root {root}` to make them from '
            'the *_gtFine_polygons.json or *_gtFine_labelIds.png files.')
    if without_image:
        raise DatasetError(
            f'{len(without_image)} {mode} labels in {root} have no *{IMAGE_SUFFIX}, e.g. '
            f'{few(labels[s] for s in without_image)}: unzip leftImg8bit_trainvaltest.zip '
            'into the same root or remove those labels.')


def _stems(paths, suffix):
    return {os.path.join(os.path.basename(os.path.dirname(p)), os.path.basename(p)[:-len(suffix)]): p
            for p in paths}


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


def _read_sample(pair, memory):
    """(image facts, label facts, whether a file was read); a fact is a dict or an error string."""
    interrupts.raise_if_requested()  # each image is a boundary; pool.map raises it
    image_path, label_path = pair
    image, image_fresh = memory.get(image_path, _read_image, ('shape', ))
    if label_path is None:
        return image, None, image_fresh
    label, label_fresh = memory.get(label_path, _read_label, ('shape', 'values'))
    return image, label, image_fresh or label_fresh


def _read_image(path):
    """{'shape': [h, w]} from the header (PNG: every chunk's checksum), else by decoding it."""
    try:
        with Image.open(path) as image:
            width, height = image.size
            try:
                image.verify()
            except Exception as error:  # PIL raises several types for a damaged file
                return (f'image {path} cannot be read: it is damaged or truncated ({error}); '
                        're-extract or re-download it.')
        return {'shape': [height, width]}
    except Exception:  # a format PIL does not know: OpenCV, which training uses, may read it
        pass
    image = cv2.imread(path, cv2.IMREAD_COLOR)
    if image is None:
        return unreadable_image(path, 're-extract or re-download it.')
    return {'shape': list(image.shape[:2])}


def _read_label(path):
    """{'shape': [...], 'values': [...]} of a label decoded as paddleseg does (PIL)."""
    try:
        with Image.open(path) as image:
            label = np.asarray(image)
    except Exception as error:  # PIL raises several types for a broken file
        return f'label {path} cannot be read ({error})'
    if label.ndim != 2:
        return {'shape': list(label.shape), 'values': []}
    return {'shape': list(label.shape), 'values': [int(v) for v in label_values(label)]}


def label_values(label):
    """The sorted distinct values of a label array."""
    label = np.asarray(label)
    if label.dtype == np.uint8:  # OpenCV's histogram: faster than numpy's, and without the GIL
        return np.flatnonzero(cv2.calcHist([np.ascontiguousarray(label).reshape(-1, 1)], [0],
                                           None, [256], [0, 256]).ravel())
    return np.unique(label)


def _sample_problem(image_path, image, label_path, label, num_classes, ignore_index, root,
                    is_cityscapes):
    """(the bad file, the error message) of one sample's facts, or None."""
    if isinstance(image, str):
        return image_path, image
    if label_path is None:
        return None
    if isinstance(label, str):
        return label_path, f'{label}: re-extract it or {_label_fix(root, is_cityscapes)}'
    if len(label['shape']) != 2:
        return label_path, (
            f'label {label_path} has shape {tuple(label["shape"])}: a label must be a '
            'single-channel image of class ids (a colour image such as *_gtFine_color.png is '
            'not a label); ' + _label_fix(root, is_cityscapes))
    if label['shape'] != image['shape']:
        (label_h, label_w), (image_h, image_w) = label['shape'], image['shape']
        return label_path, (f'label {label_path} is {label_w}x{label_h} but its image '
                            f'{image_path} is {image_w}x{image_h}: pair each image with its '
                            'own label.')
    message = label_values_error(label_path, label['values'], num_classes, ignore_index, root)
    return (label_path, message) if message else None


def label_values_error(label_path, values, num_classes, ignore_index=255, root=None):
    """The message for a label holding ids outside ``[0, num_classes)`` other than
    ``ignore_index``, naming the file, the bad values and the fix (``prepare_cityscapes.py``
    for a Cityscapes ``root``); None when there are none."""
    values = np.asarray(values, dtype=np.int64).ravel()
    bad = values[((values < 0) | (values >= num_classes)) & (values != ignore_index)]
    if not bad.size:
        return None
    if _is_cityscapes(root):
        looks = ('this looks like Cityscapes label ids, not train ids'
                 if bad.max() <= 33 else 'labels must be Cityscapes train ids')
        fix = (f'{looks}: run '
               f'`python tools/prepare_cityscapes.py --root {root} --overwrite` to make '
               f'*_gtFine_labelTrainIds.png, or check num_classes ({num_classes}).')
    else:
        fix = (f'convert the labels to class ids 0..{num_classes - 1} (ignore_index for '
               'void), or check num_classes / ignore_index in the config.')
    return (f'label {label_path} has values {bad[:10].tolist()} outside [0, {num_classes}) '
            f'that are not ignore_index {ignore_index}: {fix}')


class _CheckCache:
    """What ``validate_dataset`` read, per file, keyed by path and valid while size and mtime hold.

    Kept as JSON in ``<root>/.psanet_dataset_check.json``, or where the root is
    read-only in ``~/.cache/psanet/dataset_check/<hash of the root>.json``;
    written whole (:func:`psanet.files.write_bytes`), and merged with what another
    process wrote meanwhile. Unreadable or unwritable cache files (a full disk included)
    are ignored: the check then reads every file. ``root`` None: no cache.
    """

    def __init__(self, root):
        self.root = None if root is None else os.path.abspath(root)
        self.start_ns = time.time_ns()
        self.new = {}
        self.files = {}
        if self.root is not None:
            for path in self._paths():
                self.files = self._load(path)
                if self.files:
                    break

    def _paths(self):
        digest = hashlib.sha1(os.path.realpath(self.root).encode('utf-8')).hexdigest()[:16]
        home = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
        return [os.path.join(self.root, CHECK_CACHE_NAME),
                os.path.join(home, 'psanet', 'dataset_check', digest + '.json')]

    @staticmethod
    def _load(path):
        try:
            with open(path, encoding='utf-8') as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get('version') != _CACHE_VERSION:
            return {}
        files = data.get('files')
        return files if isinstance(files, dict) else {}

    def _key(self, path):
        path = os.path.abspath(path)
        relative = os.path.relpath(path, self.root)
        return path if relative.startswith(os.pardir) else relative

    def get(self, path, read, keys):
        """(facts, fresh): the remembered facts of ``path``, else ``read(path)``'s.

        ``keys``: the lists remembered facts must hold (a hand-edited entry is read again).
        """
        if self.root is None:
            return read(path), True
        try:
            stat = os.stat(path)
        except OSError:  # removed since the existence check: read() names it
            return read(path), True
        key = self._key(path)
        entry = self.files.get(key)
        if (isinstance(entry, list) and len(entry) == 3 and entry[0] == stat.st_size and
                entry[1] == stat.st_mtime_ns and isinstance(entry[2], dict) and
                all(isinstance(entry[2].get(k), list) for k in keys)):
            return entry[2], False
        facts = read(path)
        if isinstance(facts, dict) and stat.st_mtime_ns < self.start_ns - _RACY_NS:
            self.new[key] = [stat.st_size, stat.st_mtime_ns, facts]
        return facts, True

    def save(self):
        """Writes the new entries, merged into the cache file as it is now."""
        if self.root is None or not self.new:
            return
        for path in self._paths():
            files = self._load(path)
            files.update(self.new)
            try:
                make_output_dir(os.path.dirname(path))
                write_bytes(path, json.dumps({'version': _CACHE_VERSION, 'files': files},
                                             separators=(',', ':')).encode('utf-8'))
                return
            except (OSError, ConfigError):
                continue
