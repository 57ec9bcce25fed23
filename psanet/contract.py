"""What the engine, export and the deploy runtime agree on, in one small module.

The files an export writes and ``deploy.yaml`` names, the input name and
output ops of the exported graph, the palettes of predictions and which
dataset gets which, which files count as images to predict, and how a JSON
file or an image is read and a prediction written
(``<save_dir>/pseudo_color_prediction/<rel>.png``, a palette PNG of class ids,
and ``<save_dir>/added_prediction/<rel>``, the image blended with the class
colours), and how a file or a folder is written whole (a hidden temporary beside
it, then renamed in). It imports only :mod:`psanet.errors` of ours, so the
runtime and the data tools can use it without the engine.
"""
import contextlib
import errno
import io
import json
import os
import re
import secrets
import shutil
import tempfile

import cv2
import numpy as np
from PIL import Image

from psanet.errors import ConfigError, DatasetError, DiskFullError

__all__ = ['DEPLOY_FILE', 'DEPLOY_SECTION', 'PROGRAM_FILE', 'PARAMS_FILE', 'ONNX_FILE',
           'INPUT_NAME', 'DYNAMIC_INPUT_SHAPE', 'DEFAULT_TRANSFORMS', 'OUTPUT_OPS', 'PALETTES',
           'IMAGE_EXTENSIONS', 'TEMP_MARK', 'RETIRED_SUFFIX', 'PREVIOUS', 'palette_for',
           'get_image_list', 'output_paths', 'check_outputs', 'color_map', 'check_save_dir',
           'check_output_file', 'read_json', 'read_images', 'make_output_dir', 'fsync',
           'raise_if_disk_full', 'write_file_whole', 'write_folder', 'write_bytes', 'write_image',
           'save_prediction']

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
# Marks the hidden temporaries of a file or folder written whole: `.<name>.tmp-<pid>...`;
# a folder being replaced waits in `.<name>.old.tmp-<pid>-*/previous` until the swap is done.
TEMP_MARK = '.tmp-'
RETIRED_SUFFIX = '.old'
PREVIOUS = 'previous'


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


def _read_list_lines(image_path, flag):
    """The lines of a list file; a file that is not text (a weights file, a video) is refused
    naming what ``flag`` takes."""
    with open(image_path, 'rb') as f:
        data = f.read()
    try:
        if b'\0' in data:
            raise UnicodeDecodeError('utf-8', data, 0, 1, 'NUL byte')
        return data.decode('utf-8').splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f'{flag} {image_path} is neither an image '
                          f'({", ".join(IMAGE_EXTENSIONS)}) nor a text file listing images: pass '
                          'an image, a folder of images, or a list file.') from None


def _list_entry(line, base, image_path, number):
    """The image of one list-file line: the whole line when it names a file (a path with
    spaces), else its first field (PaddleSeg's ``image label`` lines)."""
    line = line.strip()
    candidates = [line] + ([line.split()[0]] if len(line.split()) > 1 else [])
    for entry in candidates:
        path = entry if os.path.isabs(entry) else os.path.join(base, entry)
        if os.path.isfile(path):
            return path
    tried = (f'neither `{candidates[0]}` nor `{candidates[1]}` is' if len(candidates) > 1
             else f'`{candidates[0]}` is not')
    raise DatasetError(f'{image_path} line {number}: {tried} an image file (relative paths are '
                       f'relative to the list file, {base or "."}): fix the list.')


def _outputs_below(paths, base):
    """Output paths for list entries: relative to ``base`` (the list file's folder) for those
    inside it, relative to the deepest folder the others share for those outside, so that no
    output lands outside --save_dir and two inputs keep two names."""
    base = os.path.abspath(base or '.')
    absolute = [os.path.abspath(path) for path in paths]
    outside = [path for path in absolute if os.path.commonpath([path, base]) != base]
    common = os.path.commonpath([os.path.dirname(p) for p in outside]) if outside else base
    return [os.path.relpath(path, base if os.path.commonpath([path, base]) == base else common)
            for path in absolute]


def get_image_list(image_path, flag='--image_path'):
    """Images to predict and their output paths.

    Args:
        image_path (str): an image file; a folder (searched recursively); or a
            text file with one image path per line (a whole line that names a file,
            else its first field; relative paths are relative to the list file's folder).
        flag (str, optional): the flag that named it, for messages. Default: '--image_path'.

    Returns:
        list: ``(image path, path relative to the output folders)`` pairs; a relative
        path never leaves the output folder (see :func:`check_outputs`).
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
        base = os.path.dirname(image_path)
        paths = [_list_entry(line, base, image_path, number) for number, line
                 in enumerate(_read_list_lines(image_path, flag), 1) if line.strip()]
        images = list(zip(paths, _outputs_below(paths, base)))
        where = f'list file {image_path}'
    else:
        raise ConfigError(f'{flag} {image_path} does not exist (cwd {os.getcwd()}): pass an '
                          'image, a folder of images, or a text file listing images.')
    if not images:
        raise DatasetError(f'no images ({", ".join(IMAGE_EXTENSIONS)}) in {where}.')
    return images


def output_paths(relative, save_dir):
    """``(pseudo colour path, overlay path)`` of the image whose output path is ``relative``."""
    return (os.path.join(save_dir, 'pseudo_color_prediction',
                         os.path.splitext(relative)[0] + '.png'),
            os.path.join(save_dir, 'added_prediction', relative))


def check_outputs(images, save_dir):
    """Raises ConfigError, before any work, when two images would write the same output
    (``a.png`` and ``a.jpg`` both give ``a.png``) or an output would land outside
    ``save_dir`` or on an input image, naming the images.

    Args:
        images (list): ``(image path, relative path)`` of :func:`get_image_list`.
        save_dir (str): the output root.
    """
    root = os.path.realpath(save_dir)
    inputs = {os.path.realpath(path): path for path, _ in images}
    writer = {}
    for path, relative in images:
        for output in output_paths(relative, save_dir):
            real = os.path.realpath(output)
            if os.path.commonpath([real, root]) != root:
                raise ConfigError(f'the output {output} of {path} would land outside --save_dir '
                                  f'{save_dir}: list the image by a path inside its folder.')
            if real in inputs:
                raise ConfigError(f'the output {output} of {path} would overwrite the input '
                                  f'image {inputs[real]}: pass another --save_dir.')
            if real in writer and writer[real] != path:
                raise ConfigError(f'{writer[real]} and {path} would both write {output}: rename '
                                  'one of them, or predict them in two runs with two --save_dir.')
            writer[real] = path


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


def make_output_dir(path):
    """``os.makedirs(path, exist_ok=True)`` for an output folder: a file in the way is a
    ConfigError, a full disk a DiskFullError."""
    try:
        os.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:
        raise ConfigError(f'cannot create the folder {path}: {error.strerror} (a file is in '
                          'the way); move it or pass another --save_dir.') from error
    except OSError as error:
        raise_if_disk_full(error, _existing_folder(path))
        raise


def _existing_folder(path):
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def fsync(path):
    """Flushes a file's or a folder's entries to disk, so a rename survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size(count):
    for unit in ('bytes', 'KiB', 'MiB', 'GiB'):
        if count < 1024 or unit == 'GiB':
            return f'{count:.0f} {unit}' if unit == 'bytes' else f'{count:.1f} {unit}'
        count /= 1024


def raise_if_disk_full(error, folder):
    """Raises DiskFullError (naming ``folder`` and its free space) from ``error`` when it is a
    failed write for lack of space; returns otherwise."""
    full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
    if not (full or 'No space left on device' in str(error)):
        return
    try:
        free = _size(shutil.disk_usage(folder).free)
    except OSError:
        free = 'unknown'
    raise DiskFullError(f'no space left in {folder} ({free} free): free some space there or '
                        'write to another folder; no file was left half-written.') from error


def write_file_whole(path, write, durable=False):
    """Writes the file ``path`` whole or not at all: ``write(temporary)`` fills a hidden file
    beside it, which then replaces ``path``. On any failure the temporary is removed and
    ``path`` is as it was; a full disk is a :class:`~psanet.errors.DiskFullError`.

    Args:
        path (str): the final file; its folder must exist.
        write (callable): writes the file it is given.
        durable (bool, optional): fsync the file and its folder, so that the rename
            survives a power loss. Default: False.
    """
    folder = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(folder, f'.{os.path.basename(path)}{TEMP_MARK}{os.getpid()}')
    try:
        write(temporary)
        if durable:
            fsync(temporary)
        os.replace(temporary, path)
        if durable:
            fsync(folder)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise_if_disk_full(error, folder)
        raise
    return path


def _make_temporary_dir(parent, name):
    """Makes ``<parent>/.<name>.tmp-<pid>-<random>`` with the mode a plain mkdir gives
    (mkdtemp's 0700 would hide an export from a service running as another user); the pid
    tells a later writer a dead process's leftovers from a live one's."""
    while True:
        path = os.path.join(parent, f'.{name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}')
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_writers_temporaries(parent, name):
    """Deletes the temporaries of ``<parent>/<name>`` that a killed writer left (a folder
    left only as ``.<name>.old.tmp-*/previous`` is renamed back first); a live process's stay."""
    pattern = re.compile(r'^\.' + re.escape(name) + r'(' + re.escape(RETIRED_SUFFIX) + r')?'
                         + re.escape(TEMP_MARK) + r'(\d+)-')
    for entry in sorted(os.listdir(parent)):
        match = pattern.match(entry)
        if not match or int(match.group(2)) == os.getpid() or _alive(int(match.group(2))):
            continue
        previous = os.path.join(parent, entry, PREVIOUS)
        final = os.path.join(parent, name)
        if match.group(1) and os.path.isdir(previous) and not os.path.lexists(final):
            os.replace(previous, final)
        shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def write_folder(directory, write, carry_over=None):
    """Writes a folder whole or not at all: ``write(temporary)`` fills a hidden folder
    beside ``directory``, which then replaces ``directory`` (an old one is moved aside
    first and deleted after). A failure or a signal before the swap leaves the old folder
    as it was; a full disk is a :class:`~psanet.errors.DiskFullError`. Temporaries a killed
    writer of the same folder left are deleted first.

    Args:
        directory (str): the final folder.
        write (callable): fills the folder it is given.
        carry_over (callable, optional): ``carry_over(name)`` is True for the entries of
            the old folder to move into the new one (files the new one does not have).
            Default: None, nothing is carried over.

    Returns:
        str: ``directory``.
    """
    directory = os.path.normpath(directory)
    parent = os.path.dirname(directory) or '.'
    name = os.path.basename(directory)
    os.makedirs(parent, exist_ok=True)
    _remove_dead_writers_temporaries(parent, name)
    temporary = _make_temporary_dir(parent, name)
    try:
        write(temporary)
        for entry in os.listdir(temporary):
            fsync(os.path.join(temporary, entry))
        fsync(temporary)
        if os.path.exists(directory):
            # rename() cannot replace a non-empty folder: move the old one aside first.
            retired = _make_temporary_dir(parent, name + RETIRED_SUFFIX)
            previous = os.path.join(retired, PREVIOUS)
            os.replace(directory, previous)
            os.replace(temporary, directory)
            fsync(parent)
            for entry in os.listdir(previous) if carry_over else ():
                if carry_over(entry) and not os.path.lexists(os.path.join(directory, entry)):
                    os.replace(os.path.join(previous, entry), os.path.join(directory, entry))
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(temporary, directory)
            fsync(parent)
    except BaseException as error:
        shutil.rmtree(temporary, ignore_errors=True)
        raise_if_disk_full(error, parent)
        raise
    return directory


def write_bytes(path, data):
    """Writes ``data`` to ``path`` whole or not at all (:func:`write_file_whole`)."""
    def write(temporary):
        with open(temporary, 'wb') as f:
            f.write(data)
    return write_file_whole(path, write)


def write_image(path, array, extension=None):
    """Encodes ``array`` as OpenCV does for ``extension`` (default: ``path``'s) and writes it
    whole (:func:`write_file_whole`)."""
    ok, encoded = cv2.imencode(extension or os.path.splitext(path)[1] or '.png', array)
    if not ok:
        raise OSError(f'OpenCV cannot encode {path}.')
    return write_bytes(path, encoded.tobytes())


def save_prediction(label, image, relative, save_dir, colors):
    """Writes the pseudo-colour PNG and the overlay of one label map, each whole.

    Args:
        label (np.ndarray): uint8 [H, W] class ids at the image size.
        image (np.ndarray): the BGR image as read.
        relative (str): the image's path relative to the input, kept below save_dir.
        save_dir (str): output root.
        colors (list): flat palette from :func:`color_map`.

    Returns:
        tuple: ``(pseudo colour path, overlay path)``.
    """
    pseudo_path, added_path = output_paths(relative, save_dir)
    for path in (pseudo_path, added_path):
        make_output_dir(os.path.dirname(path))
    mask = Image.fromarray(label)  # mode L; putpalette turns it into a palette image
    mask.putpalette(colors)
    encoded = io.BytesIO()
    mask.save(encoded, format='PNG')
    write_bytes(pseudo_path, encoded.getvalue())
    palette = np.asarray(colors, dtype='uint8').reshape(-1, 3)
    overlay = cv2.addWeighted(image, 0.6, cv2.cvtColor(palette[label], cv2.COLOR_RGB2BGR),
                              0.4, 0)
    write_image(added_path, overlay)
    return pseudo_path, added_path
