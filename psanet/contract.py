"""What the engine, export and the deploy runtime agree on, in one small module.

The files an export writes and ``deploy.yaml`` names, the input name and
output ops of the exported graph, the palettes of predictions and which
dataset gets which, which files count as images to predict, and how a JSON
file or an image is read and a prediction written
(``<save_dir>/pseudo_color_prediction/<rel>.png``, a palette PNG of class ids,
and ``<save_dir>/added_prediction/<rel>``, the image blended with the class
colours). It imports only :mod:`psanet.errors` of ours, so the runtime can use
it without the engine.
"""
import json
import os
import tempfile

import cv2
import numpy as np
from PIL import Image

from psanet.errors import ConfigError, DatasetError

__all__ = ['DEPLOY_FILE', 'DEPLOY_SECTION', 'PROGRAM_FILE', 'PARAMS_FILE', 'ONNX_FILE',
           'INPUT_NAME', 'DYNAMIC_INPUT_SHAPE', 'DEFAULT_TRANSFORMS', 'OUTPUT_OPS', 'PALETTES',
           'IMAGE_EXTENSIONS', 'palette_for', 'get_image_list', 'color_map', 'check_save_dir',
           'check_output_file', 'read_json', 'read_images', 'save_prediction']

# The files of an export, all in one folder: what paddle.jit.save writes on
# Paddle 3 (the PIR program and its parameters), the optional ONNX model, and
# deploy.yaml, whose `Deploy:` section names the others.
DEPLOY_FILE = 'deploy.yaml'
DEPLOY_SECTION = 'Deploy'
PROGRAM_FILE = 'model.json'
PARAMS_FILE = 'model.pdiparams'
ONNX_FILE = 'model.onnx'
# The exported graph's input: float32 [N, 3, H, W], -1 for a dynamic dimension.
INPUT_NAME = 'x'
DYNAMIC_INPUT_SHAPE = (-1, 3, -1, -1)
# The val transforms when a config (or deploy.yaml) names none.
DEFAULT_TRANSFORMS = ({'type': 'Normalize'}, )
# What the exported graph ends with, as in PaddleSeg's export: int32 class ids [N, H, W]
# (argmax), probabilities (softmax) or logits (none), float [N, C, H, W].
OUTPUT_OPS = ('argmax', 'softmax', 'none')
PALETTES = ('cityscapes', 'default')
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp')


def palette_for(dataset_class):
    """The palette of a dataset's predictions: 'cityscapes' for Cityscapes, else 'default'.

    predict.py and export.py (for deploy.yaml's ``palette``) both decide with this.

    Args:
        dataset_class (type | None): the val dataset's class; None when the config has none.
    """
    # By class name along the MRO rather than issubclass, so this leaf needs no paddleseg.
    is_cityscapes = dataset_class is not None and any(
        klass.__name__ == 'Cityscapes' for klass in dataset_class.__mro__)
    return 'cityscapes' if is_cityscapes else 'default'


def _is_image(path):
    return os.path.splitext(path)[1].lower() in IMAGE_EXTENSIONS


def get_image_list(image_path):
    """Images to predict and their output paths.

    Args:
        image_path (str): an image file; a folder (searched recursively); or a
            text file with one image path per line (first column; relative
            paths are relative to the list file's folder).

    Returns:
        list: ``(image path, path relative to the output folders)`` pairs.
    """
    if os.path.isdir(image_path):
        images = []
        for root, dirs, files in os.walk(image_path):
            dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
            for name in sorted(files):
                if not name.startswith('.') and _is_image(name):
                    path = os.path.join(root, name)
                    images.append((path, os.path.relpath(path, image_path)))
        where = f'folder {image_path}'
    elif os.path.isfile(image_path) and _is_image(image_path):
        images = [(image_path, os.path.basename(image_path))]
        where = image_path
    elif os.path.isfile(image_path):
        images = []
        base = os.path.dirname(image_path)
        with open(image_path) as f:
            for number, line in enumerate(f, 1):
                fields = line.split()
                if not fields:
                    continue
                path = fields[0] if os.path.isabs(fields[0]) else os.path.join(base, fields[0])
                if not os.path.isfile(path):
                    raise DatasetError(f'{image_path} line {number}: image {path} does not exist: '
                                       'fix the list (paths are relative to the list file).')
                relative = os.path.basename(path) if os.path.isabs(fields[0]) else \
                    os.path.normpath(fields[0])
                images.append((path, relative))
        where = f'list file {image_path}'
    else:
        raise ConfigError(f'--image_path {image_path} does not exist (cwd {os.getcwd()}): pass an '
                          'image, a folder of images, or a text file listing images.')
    if not images:
        raise DatasetError(f'no images ({", ".join(IMAGE_EXTENSIONS)}) in {where}.')
    return images


def color_map(num_classes, custom_color=None, cityscapes=False):
    """A flat [r, g, b, ...] palette of 256 colours.

    Args:
        num_classes (int | None): number of classes (only checked against custom_color;
            None: not checked).
        custom_color (list, optional): r, g, b values for classes 0, 1, ... replacing the defaults.
        cityscapes (bool, optional): colour train ids 0-18 as Cityscapes does. Default: False.
    """
    from paddleseg.utils import visualize
    colors = visualize.get_color_map_list(256)
    if cityscapes:
        from cityscapesscripts.helpers.labels import trainId2label
        for train_id in range(19):
            colors[3 * train_id:3 * train_id + 3] = list(trainId2label[train_id].color)
    if custom_color:
        if len(custom_color) % 3 or any(not 0 <= int(c) <= 255 for c in custom_color):
            raise ConfigError(f'--custom_color needs r g b triples of 0..255, got {custom_color}.')
        if num_classes is not None and len(custom_color) // 3 > num_classes:
            raise ConfigError(f'--custom_color gives {len(custom_color) // 3} colours for '
                              f'{num_classes} classes.')
        colors[:len(custom_color)] = [int(c) for c in custom_color]
    return colors


def check_save_dir(save_dir, flag='--save_dir'):
    """Raises ConfigError unless ``save_dir`` is a folder this process can write into, or
    can be made one.

    Checked before any work, so that a file in the way (``--save_dir out.png``)
    or a folder without write permission is named at once rather than as a
    traceback after the first image. Nothing is created.
    """
    path = os.path.abspath(save_dir)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f'{flag} {save_dir} is a file, not a folder: pass a folder (it is '
                          'created when missing) or move the file away.')
    _check_can_write_below(path, f'{flag} {save_dir}')


def check_output_file(path, flag):
    """Raises ConfigError unless a file can be written at ``path`` (its folder is made
    when missing); checked before any work. Nothing is created."""
    if os.path.isdir(path):
        raise ConfigError(f'{flag} {path} is a folder: pass the path of the file to write, '
                          f'e.g. {os.path.join(path, "model.pdparams")}.')
    _check_can_write_below(os.path.dirname(os.path.abspath(path)), f'{flag} {path}')


def _check_can_write_below(path, what):
    """The nearest existing folder of ``path`` must be one this process can write into.
    ``os.access`` says yes to root on read-only or special file systems: make and remove
    a hidden folder instead."""
    folder = path
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ConfigError(f'{what} cannot be created: {folder} is a file, not a folder; pass a '
                          'path below a folder.')
    try:
        os.rmdir(tempfile.mkdtemp(prefix='.psanet-write-check-', dir=folder))
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(f'{what} cannot be written: {folder}: {reason}. Pass a folder '
                          'you can write to.') from None


def read_json(path, error):
    """The JSON document in the file ``path``.

    Args:
        path (str): the file.
        error (callable): ``error(reason) -> Exception``, raised (from the OSError or
            ValueError) when the file cannot be opened or is not JSON.
    """
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as reason:
        raise error(reason) from reason


def read_images(images, unreadable, logger):
    """Yields ``(BGR image, relative path)`` for each ``(path, relative path)`` OpenCV reads.

    An image that cannot be read (corrupt, not an image) is logged as an error,
    appended to ``unreadable`` and left out, so that the images after it still
    run; the caller ends with ``psanet.errors.UnreadableImagesError`` naming them.
    """
    for path, relative in images:
        image = cv2.imread(path, cv2.IMREAD_COLOR)
        if image is None:
            logger.error(f'cannot read image {path} (corrupt or not an image); skipped.')
            unreadable.append(path)
            continue
        yield image, relative


def _make_dirs(path):
    try:
        os.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:
        raise ConfigError(f'cannot create the folder {path}: {error.strerror} (a file is in '
                          'the way); move it or pass another --save_dir.') from error


def save_prediction(label, image, relative, save_dir, colors):
    """Writes the pseudo-colour PNG and the overlay of one label map.

    Args:
        label (np.ndarray): uint8 [H, W] class ids at the image size.
        image (np.ndarray): the BGR image as read.
        relative (str): the image's path relative to the input, kept below save_dir.
        save_dir (str): output root.
        colors (list): flat palette from :func:`color_map`.

    Returns:
        tuple: ``(pseudo colour path, overlay path)``.
    """
    pseudo_path = os.path.join(save_dir, 'pseudo_color_prediction',
                               os.path.splitext(relative)[0] + '.png')
    added_path = os.path.join(save_dir, 'added_prediction', relative)
    for path in (pseudo_path, added_path):
        _make_dirs(os.path.dirname(path))
    mask = Image.fromarray(label)  # mode L; putpalette turns it into a palette image
    mask.putpalette(colors)
    mask.save(pseudo_path)
    palette = np.asarray(colors, dtype='uint8').reshape(-1, 3)
    overlay = cv2.addWeighted(image, 0.6, cv2.cvtColor(palette[label], cv2.COLOR_RGB2BGR),
                              0.4, 0)
    if not cv2.imwrite(added_path, overlay):
        raise OSError(f'cannot write {added_path}: check the permissions and free space of '
                      '--save_dir.')
    return pseudo_path, added_path
