"""Pre- and post-processing around an exported model: images in, label maps out."""
import cv2
import numpy as np

from psanet.contract import OUTPUT_OPS
from psanet.errors import DeployError, unreadable_image

__all__ = ['preprocess', 'postprocess', 'restore_label_map', 'restore_logits']


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
        image = path if isinstance(path, np.ndarray) else cv2.imread(path, cv2.IMREAD_COLOR)
        if image is None:
            raise DeployError(unreadable_image(path, 'check the path, and that the file is a '
                                                     'whole JPEG, PNG or BMP image.'))
        data = transforms({'img': image.astype('float32'), 'trans_info': []})
        images.append(image)
        inputs.append(data['img'])
        infos.append(list(data['trans_info']))
    if len({img.shape for img in inputs}) > 1:
        names = names or [p if isinstance(p, str) else f'image {i}'
                          for i, p in enumerate(image_paths)]
        sizes = ', '.join(f'{name} {img.shape[-1]}x{img.shape[-2]}'
                          for name, img in zip(names, inputs))
        raise DeployError(f'the images of one batch must have one size after the transforms, '
                          f'got {sizes}; use --batch_size 1, or images of one size.')
    return np.ascontiguousarray(np.stack(inputs), dtype='float32'), infos, images


def postprocess(output, output_op, trans_infos=None):
    """Turns the model output into one uint8 label map per image.

    Args:
        output (np.ndarray): The exported model's output, as PaddleSeg's export gives it:
            int ``[N, H, W]`` class ids (``output_op='argmax'``), or float ``[N, C, H, W]``
            ('softmax' or 'none').
        output_op (str): What the exported graph ends with.
        trans_infos (list, optional): From ``preprocess``; shape changes to undo.

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
    labels = output if output_op == 'argmax' else np.argmax(output, axis=1)
    labels = labels.astype('uint8')
    trans_infos = trans_infos or [[] for _ in range(len(labels))]
    return [restore_label_map(label, info) for label, info in zip(labels, trans_infos)]


def restore_label_map(label, trans_info):
    """Undoes the transforms' resizes and paddings on a label map (nearest neighbour).

    Mirrors paddleseg's ``reverse_transform``, which does the same on logits.
    """
    for kind, (height, width) in reversed(trans_info):
        if kind == 'resize':
            label = cv2.resize(label, (int(width), int(height)),
                               interpolation=cv2.INTER_NEAREST)
        elif kind == 'padding':
            label = label[:int(height), :int(width)]
        else:
            raise DeployError(f'cannot undo the transform step {kind!r}.')
    return label


def restore_logits(logit, trans_info):
    """Undoes the transforms' resizes and paddings on a ``[C, H, W]`` float map (bilinear),
    as paddleseg's ``reverse_transform`` does on logits."""
    hwc = np.ascontiguousarray(logit.transpose(1, 2, 0))
    for kind, (height, width) in reversed(trans_info):
        if kind == 'resize':
            hwc = cv2.resize(hwc, (int(width), int(height)), interpolation=cv2.INTER_LINEAR)
            if hwc.ndim == 2:  # OpenCV drops a single channel
                hwc = hwc[:, :, np.newaxis]
        elif kind == 'padding':
            hwc = hwc[:int(height), :int(width)]
        else:
            raise DeployError(f'cannot undo the transform step {kind!r}.')
    return np.ascontiguousarray(hwc.transpose(2, 0, 1))
