"""What the engine, export and the deploy package agree on, in one small module.

The files of an export and ``deploy.yaml``'s names, the graph's input name and output ops,
the palettes, which files are images to predict, how a JSON file or an image is read, and
a prediction's two files (``pseudo_color_prediction/``, ``added_prediction/``). It imports
only :mod:`psanet.errors` and :mod:`psanet.files` of ours, so the deploy package can use it
without the engine.
"""
import contextlib
import io
import json
import os

import cv2
import numpy as np
from PIL import Image

from psanet.errors import ConfigError, DatasetError
from psanet.files import make_output_dir, write_bytes, write_image

__all__ = ['DEPLOY_FILE', 'DEPLOY_SECTION', 'PROGRAM_FILE', 'PARAMS_FILE', 'ONNX_FILE',
           'INPUT_NAME', 'DYNAMIC_INPUT_SHAPE', 'DEFAULT_TRANSFORMS', 'OUTPUT_OPS',
           'MIN_INPUT_SIZE', 'PALETTES', 'IMAGE_EXTENSIONS', 'palette_for', 'get_image_list', 'output_paths', 'check_outputs',
           'color_map', 'read_json', 'read_images', 'save_prediction']

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
# deploy.yaml's smallest side of a network input the export runs on in every backend.
MIN_INPUT_SIZE = 'min_input_size'
PALETTES = ('cityscapes', 'default')
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp')


def palette_for(dataset_class):
    """The palette of the predictions of ``dataset_class`` (the val dataset's class; None when
    the config has none): 'cityscapes' for Cityscapes, else 'default'. predict.py and
    export.py (for deploy.yaml's ``palette``) both decide with this."""
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
    if b'\0' not in data:
        with contextlib.suppress(UnicodeDecodeError):
            return data.decode('utf-8').splitlines()
    raise ConfigError(f'{flag} {image_path} is neither an image ({", ".join(IMAGE_EXTENSIONS)}) '
                      'nor a text file listing images: pass an image, a folder of images, or a '
                      'list file.')


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
    """``(image path, path relative to the output folders)`` pairs of ``image_path``: an image,
    a folder (searched recursively) or a list file (a whole line that names a file, else its
    first field; relative to the list file's folder). A relative path never leaves the output
    folder (:func:`check_outputs`)."""
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
    """Raises ConfigError, before any work, when two of ``images`` (the pairs of
    :func:`get_image_list`) would write the same output (``a.png`` and ``a.jpg`` both give
    ``a.png``) or an output would land outside ``save_dir`` or on an input image, naming them.
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
    """A flat [r, g, b, ...] palette of 256 colours: ``custom_color`` for classes 0, 1, ... (at
    most ``num_classes`` when given), Cityscapes' for train ids 0-18 with ``cityscapes``."""
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


def read_json(path, error):
    """The JSON document in the file ``path``; ``error(reason)``, an exception, is raised
    (from the OSError or ValueError) when the file cannot be opened or is not JSON."""
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


def palette_png(label, colors):
    """The pseudo-colour PNG bytes of class ids ``label`` (uint8 [H, W]) in ``colors`` (a
    flat [r, g, b, ...] palette): what predict.py, infer.py and the server give."""
    mask = Image.fromarray(label)  # mode L; putpalette turns it into a palette image
    mask.putpalette(colors)
    encoded = io.BytesIO()
    mask.save(encoded, format='PNG')
    return encoded.getvalue()


def save_prediction(label, image, relative, save_dir, colors):
    """Writes the pseudo-colour PNG and the overlay of one uint8 [H, W] label map, each whole,
    below ``save_dir`` at the image's ``relative`` path; returns both paths."""
    pseudo_path, added_path = output_paths(relative, save_dir)
    for path in (pseudo_path, added_path):
        make_output_dir(os.path.dirname(path))
    write_bytes(pseudo_path, palette_png(label, colors))
    palette = np.asarray(colors, dtype='uint8').reshape(-1, 3)
    overlay = cv2.addWeighted(image, 0.6, cv2.cvtColor(palette[label], cv2.COLOR_RGB2BGR),
                              0.4, 0)
    write_image(added_path, overlay)
    return pseudo_path, added_path
