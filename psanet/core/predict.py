"""Prediction on image files: colour-coded masks and overlays, like PaddleSeg's predict.py.

For every input image it writes, keeping the image's path relative to
``--image_path`` (a folder, a list file, or the file name of a single image):

* ``<save_dir>/pseudo_color_prediction/<rel>.png``: a palette PNG of class
  ids (Cityscapes colours for the 19 Cityscapes classes);
* ``<save_dir>/added_prediction/<rel>``: the image blended with those colours.

An image that cannot be read is reported and skipped; the others are still
predicted, and the run ends with :class:`UnreadableImagesError` naming the
skipped ones.
"""
import os

import cv2
import numpy as np
import paddle
from PIL import Image
from paddleseg.datasets import Cityscapes
from paddleseg.transforms import Compose
from paddleseg.utils import visualize

from psanet.core import dist, infer
from psanet.core.checkpoint import load_model_weights, resolve_weights_path
from psanet.core.cli import check_inference_flags
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.errors import ConfigError, DatasetError
from psanet.core.logger import get_logger
from psanet.core.runtime import set_device
from psanet.core.val import merge_test_config

__all__ = ['IMAGE_EXTENSIONS', 'PALETTES', 'UnreadableImagesError', 'get_image_list',
           'palette_for', 'color_map', 'check_save_dir', 'read_image', 'save_prediction',
           'predict', 'predict_from_config']

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp')
PALETTES = ('cityscapes', 'default')


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


def palette_for(dataset_class):
    """The palette of a dataset's predictions: 'cityscapes' for Cityscapes, else 'default'.

    predict.py and export.py (for deploy.yaml's ``palette``) both decide with this.

    Args:
        dataset_class (type | None): the val dataset's class; None when the config has none.
    """
    is_cityscapes = dataset_class is not None and issubclass(dataset_class, Cityscapes)
    return 'cityscapes' if is_cityscapes else 'default'


def color_map(num_classes, custom_color=None, cityscapes=False):
    """A flat [r, g, b, ...] palette of 256 colours.

    Args:
        num_classes (int | None): number of classes (only checked against custom_color;
            None: not checked).
        custom_color (list, optional): r, g, b values for classes 0, 1, ... replacing the defaults.
        cityscapes (bool, optional): colour train ids 0-18 as Cityscapes does. Default: False.
    """
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


class UnreadableImagesError(DatasetError):
    """Some input images could not be read; every other one was predicted and written.

    Attributes:
        unreadable (list): paths of the images that could not be read.
        written (list): the outputs that were written.
    """

    def __init__(self, unreadable, total, written, save_dir):
        self.unreadable, self.written = list(unreadable), list(written)
        done = f'{len(self.written)} of {total} images written to {save_dir}'
        if len(self.unreadable) == 1:
            what = (f'image {self.unreadable[0]} cannot be read (corrupt or not an image): '
                    'replace it or leave it out of --image_path.')
        else:
            names = ', '.join(self.unreadable[:3])
            if len(self.unreadable) > 3:
                names += f' and {len(self.unreadable) - 3} more (listed above)'
            what = (f'{len(self.unreadable)} images cannot be read (corrupt or not images): '
                    f'{names}; replace them or leave them out of --image_path.')
        super().__init__(f'{done}; {what}')


def check_save_dir(save_dir, flag='--save_dir'):
    """Raises ConfigError unless ``save_dir`` is a folder or can be made one.

    Checked before any work, so that a file in the way (``--save_dir out.png``)
    is named at once rather than as a NotADirectoryError after the first image.
    """
    path = os.path.abspath(save_dir)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f'{flag} {save_dir} is a file, not a folder: pass a folder (it is '
                          'created when missing) or move the file away.')
    parent = path
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f'{flag} {save_dir} cannot be created: {parent} is a file, not a '
                          'folder; pass a path below a folder.')


def _make_dirs(path):
    try:
        os.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:
        raise ConfigError(f'cannot create the folder {path}: {error.strerror} (a file is in '
                          'the way); move it or pass another --save_dir.') from error


def read_image(path):
    """The BGR image at ``path``, or None when OpenCV cannot read it (corrupt, not an image)."""
    return cv2.imread(path, cv2.IMREAD_COLOR)


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


def predict(model, transforms, image_list, save_dir='output/result', aug_pred=False, scales=1.0,
            flip_horizontal=False, flip_vertical=False, is_slide=False, crop_size=None,
            stride=None, colors=None, logger=None):
    """Predicts every image of ``image_list`` (this rank's share) and writes both outputs.

    Args:
        model (paddle.nn.Layer): the model with its weights loaded.
        transforms (list): the val transforms (paddleseg transform objects).
        image_list (list): ``(image path, relative output path)`` from :func:`get_image_list`.
        save_dir (str, optional): output root. Default: 'output/result'.
        aug_pred (bool, optional): average softmax over scales and flips. Default: False.
        scales (float | list, optional): scales for aug_pred. Default: 1.0.
        flip_horizontal (bool, optional): horizontal flips for aug_pred. Default: False.
        flip_vertical (bool, optional): vertical flips for aug_pred. Default: False.
        is_slide (bool, optional): sliding-window inference. Default: False.
        crop_size (tuple, optional): (w, h) window when is_slide. Default: None.
        stride (tuple, optional): (w, h) step when is_slide. Default: None.
        colors (list, optional): flat palette from :func:`color_map`.
            Default: Cityscapes colours.
        logger (logging.Logger, optional): Default: the 'psanet' logger.

    Returns:
        list: ``(pseudo colour path, overlay path)`` written by this rank.

    Raises:
        UnreadableImagesError: after every readable image is written, when some
            could not be read (each is also logged as it is skipped).
        infer.InferenceMemoryError: before an image too large for the memory runs.
    """
    logger = logger or get_logger()
    check_save_dir(save_dir)
    if is_slide:
        crop_size, stride = infer.check_slide_args(crop_size, stride)
    colors = colors or color_map(19, cityscapes=True)
    compose = Compose(list(transforms))
    model.eval()
    mine = image_list[dist.rank()::dist.world_size()]
    written, unreadable = [], []
    logger.info(f'Predicting {len(image_list)} images into {save_dir} ...')
    with paddle.no_grad():
        for path, relative in mine:
            image = read_image(path)
            if image is None:
                logger.error(f'cannot read image {path} (corrupt or not an image); skipped.')
                unreadable.append(path)
                continue
            data = compose({'img': image.astype('float32'), 'trans_info': []})
            tensor = paddle.to_tensor(data['img'][np.newaxis])
            if aug_pred:
                score = infer.aug_inference(model, tensor, data['trans_info'], scales=scales,
                                            flip_horizontal=flip_horizontal,
                                            flip_vertical=flip_vertical, is_slide=is_slide,
                                            crop_size=crop_size, stride=stride)
            else:
                score = infer.inference(model, tensor, data['trans_info'], is_slide=is_slide,
                                        crop_size=crop_size, stride=stride)
            pred = paddle.argmax(score, axis=1).numpy()[0].astype('uint8')
            if pred.shape != image.shape[:2]:
                pred = cv2.resize(pred, (image.shape[1], image.shape[0]),
                                  interpolation=cv2.INTER_NEAREST)
            written.append(save_prediction(pred, image, relative, save_dir, colors))
    logger.info(f'Predicted images are saved in {os.path.join(save_dir, "added_prediction")} '
                f'and {os.path.join(save_dir, "pseudo_color_prediction")} .')
    if unreadable:
        raise UnreadableImagesError(unreadable, len(mine), written, save_dir)
    return written


def predict_from_config(config, model_path, image_path, save_dir='output/result', device=None,
                        aug_pred=None, scales=None, flip_horizontal=None, flip_vertical=None,
                        is_slide=None, crop_size=None, stride=None, custom_color=None, opts=None):
    """predict.py: builds the model from ``config``, loads ``model_path``, predicts ``image_path``.

    Flags left as None take their value from the config's ``test_config``.

    Returns:
        list: the written ``(pseudo colour path, overlay path)`` pairs of this rank.
    """
    set_device(device)
    dist.init_parallel()
    logger = get_logger()
    resolve_weights_path(model_path)  # a wrong path fails before any building
    check_save_dir(save_dir)
    cfg = load_config(config, opts=opts)
    check_inference_flags(dict(aug_pred=aug_pred, scales=scales, flip_horizontal=flip_horizontal,
                               flip_vertical=flip_vertical, is_slide=is_slide,
                               crop_size=crop_size, stride=stride),
                          '--aug_pred', cfg.dic.get('test_config'))
    image_list = get_image_list(image_path)
    builder = ComponentBuilder(cfg)
    model = builder.model
    path = load_model_weights(model, model_path)
    logger.info(f'Loaded weights {path}')
    options = merge_test_config(builder.test_config, aug_eval=aug_pred, scales=scales,
                                flip_horizontal=flip_horizontal, flip_vertical=flip_vertical,
                                is_slide=is_slide, crop_size=crop_size, stride=stride)
    options['aug_pred'] = options.pop('aug_eval')
    val_class = builder.val_dataset_class if cfg.val_dataset_cfg else None
    colors = color_map(getattr(model, 'num_classes', None), custom_color,
                       cityscapes=palette_for(val_class) == 'cityscapes')
    return predict(model, builder.val_transforms, image_list, save_dir=save_dir, colors=colors,
                   logger=logger, **options)
