"""Pre- and post-processing around a segmentation model (an export, or the dygraph model):
images in, label maps or scores at the image size out."""
import os

import cv2
import numpy as np

from psanet.contract import OUTPUT_OPS, get_image_list
from psanet.errors import DatasetError, DeployError, unreadable_image

__all__ = ['check_image_file', 'check_input_size', 'image_names', 'preprocess', 'postprocess',
           'restore_label_map', 'restore_logits']


def check_image_file(path):
    """Raises DeployError unless the image path ``path`` is a file: a folder is named as one,
    with the images it holds and how to pass them."""
    if os.path.isdir(path):
        try:
            images = [image for image, _ in get_image_list(path)]
        except DatasetError:
            images = []
        if not images:
            raise DeployError(f'image {path} is a folder, and it holds no images: pass the path '
                              'of an image file, or a list of them.')
        nested = any(os.path.normpath(os.path.dirname(image)) != os.path.normpath(path)
                     for image in images)
        pattern = os.path.join(path, *(['**'] if nested else []),
                               '*' + os.path.splitext(images[0])[1])
        listing = f'glob.glob({pattern!r}' + (', recursive=True)' if nested else ')')
        raise DeployError(f'image {path} is a folder, not an image ({len(images)} images in '
                          f'it, such as {images[0]}): pass a list of its images, e.g. '
                          f'seg(sorted({listing})).')
    if not os.path.isfile(path):
        # Before cv2.imread, which warns "can't open/read file" on stderr first.
        raise DeployError(f'image {path} does not exist (cwd {os.getcwd()}): check the path.')


def image_names(images, names=None):
    """What to call each of ``images`` (paths or arrays) in a message: ``names`` when given,
    else the paths, and "image <i>" for an array."""
    return names or [image if isinstance(image, str) else f'image {i}'
                     for i, image in enumerate(images)]


def check_input_size(batch, names, min_input_size):
    """Raises DeployError when the ``[N, 3, H, W]`` network input ``batch`` has a side under
    ``min_input_size`` (deploy.yaml's: the smallest side the exported model runs on in every
    backend), naming the image and the size to reach."""
    height, width = batch.shape[-2:]
    if min_input_size is None or min(height, width) >= min_input_size:
        return
    raise DeployError(f'{", ".join(names)}: a {width}x{height} network input (after the '
                      f'transforms) is too small for this model, which needs at least {min_input_size} pixels '
                      f'a side (deploy.yaml\'s min_input_size): pass a larger image, or scale it '
                      f'up to at least {min_input_size}x{min_input_size} first (cv2.resize).')


def preprocess(image_paths, transforms, names=None):
    """Reads images (unless given read) and applies the val transforms.

    Args:
        image_paths (list[str | np.ndarray]): Image files (any format OpenCV reads), or
            BGR images already read.
        transforms (paddleseg.transforms.Compose): From ``DeployConfig.build_transforms()``.
        names (list[str], optional): What to call the images in an error. Default: the
            paths, or "image <i>" for images given read.

    Returns:
        tuple: ``(batch, trans_infos, images)``: float32 ``[N, 3, H, W]``; per image, the
        shape changes the transforms made (undone by ``postprocess``); the BGR images read.
    """
    inputs, infos, images = [], [], []
    for path in image_paths:
        if not isinstance(path, np.ndarray):
            check_image_file(path)
        image = path if isinstance(path, np.ndarray) else cv2.imread(path, cv2.IMREAD_COLOR)
        if image is None:
            raise DeployError(unreadable_image(path, 'check the path, and that the file is a '
                                                     'whole JPEG, PNG or BMP image.'))
        data = transforms({'img': image.astype('float32'), 'trans_info': []})
        images.append(image)
        inputs.append(data['img'])
        infos.append(list(data['trans_info']))
    if len({img.shape for img in inputs}) > 1:
        names = image_names(image_paths, names)
        sizes = ', '.join(f'{name} {img.shape[-1]}x{img.shape[-2]}'
                          for name, img in zip(names, inputs))
        raise DeployError(f'the images of one batch must have one size after the transforms, '
                          f'got {sizes}; use --batch_size 1, or images of one size.')
    return np.ascontiguousarray(np.stack(inputs), dtype='float32'), infos, images


def postprocess(output, output_op, trans_infos=None, sizes=None):
    """Turns the model output into one uint8 label map per image.

    Scores are mapped back to the image first (:func:`restore_logits`) and their argmax
    taken there, as paddleseg's dygraph prediction does; class ids are mapped back by
    nearest neighbour (:func:`restore_label_map`).

    Args:
        output (np.ndarray): The model output, as PaddleSeg's export gives it:
            int ``[N, H, W]`` class ids (``output_op='argmax'``), or float ``[N, C, H, W]``
            ('softmax' or 'none').
        output_op (str): What the model ends with.
        trans_infos (list, optional): From ``preprocess``; shape changes to undo.
        sizes (list, optional): Each image's ``(height, width)``; a map that undoing the
            recorded transforms leaves at another size is resized to it.

    Returns:
        list[np.ndarray]: uint8 ``[H, W]`` label maps at each input image's size.
    """
    if output_op not in OUTPUT_OPS:
        raise DeployError(f'unknown output_op {output_op!r} in deploy.yaml; expected one of '
                          f'{OUTPUT_OPS}.')
    want = 3 if output_op == 'argmax' else 4
    if output.ndim != want:
        layout = '[N, H, W] class ids' if want == 3 else '[N, C, H, W] scores'
        raise DeployError(f'an export with output_op {output_op} gives {layout}, got shape '
                          f'{list(output.shape)}: deploy.yaml does not describe this model; '
                          'export it again with export.py.')
    trans_infos = trans_infos or [[] for _ in range(len(output))]
    sizes = sizes or [None] * len(output)
    if output_op == 'argmax':
        return [restore_label_map(label.astype('uint8'), info, size)
                for label, info, size in zip(output, trans_infos, sizes)]
    return [np.argmax(restore_logits(score, info, size), axis=0).astype('uint8')
            for score, info, size in zip(output, trans_infos, sizes)]


def restore_label_map(label, trans_info, size=None):
    """Undoes the transforms' resizes and paddings on a label map (nearest neighbour), then
    resizes it to ``size`` ``(height, width)`` where it is not that size yet."""
    for kind, (height, width) in reversed(trans_info):
        if kind == 'resize':
            label = cv2.resize(label, (int(width), int(height)),
                               interpolation=cv2.INTER_NEAREST)
        elif kind == 'padding':
            label = label[:int(height), :int(width)]
        else:
            raise DeployError(f'cannot undo the transform step {kind!r}.')
    if size is not None and label.shape != tuple(size):
        label = cv2.resize(label, (int(size[1]), int(size[0])), interpolation=cv2.INTER_NEAREST)
    return label


def restore_logits(logit, trans_info, size=None):
    """Undoes the transforms' resizes and paddings on a ``[C, H, W]`` float map (bilinear),
    as paddleseg's ``reverse_transform`` does on logits, then resizes it to ``size``
    ``(height, width)`` where it is not that size yet."""
    if not trans_info and (size is None or tuple(logit.shape[1:]) == tuple(size)):
        return logit
    hwc = np.ascontiguousarray(logit.transpose(1, 2, 0))
    for kind, (height, width) in reversed(trans_info):
        if kind == 'resize':
            hwc = _resize_scores(hwc, height, width)
        elif kind == 'padding':
            hwc = hwc[:int(height), :int(width)]
        else:
            raise DeployError(f'cannot undo the transform step {kind!r}.')
    if size is not None and hwc.shape[:2] != tuple(size):
        hwc = _resize_scores(hwc, *size)
    return np.ascontiguousarray(hwc.transpose(2, 0, 1))


def _resize_scores(hwc, height, width):
    hwc = cv2.resize(hwc, (int(width), int(height)), interpolation=cv2.INTER_LINEAR)
    return hwc[:, :, np.newaxis] if hwc.ndim == 2 else hwc  # OpenCV drops a single channel
