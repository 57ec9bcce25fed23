"""Prediction on image files: colour-coded masks and overlays, like PaddleSeg's predict.py.

For every input image it writes, keeping the image's path relative to
``--image_path`` (a folder, a list file, or the file name of a single image),
the pseudo-colour PNG and the overlay of :func:`psanet.contract.save_prediction`
(Cityscapes colours for the 19 Cityscapes classes).

An image that cannot be read is reported and skipped; the others are still
predicted, and the run ends with :class:`~psanet.errors.UnreadableImagesError`
naming the skipped ones.
"""
import os

import cv2
import numpy as np
import paddle
from paddleseg.transforms import Compose

from psanet.contract import (check_outputs, check_save_dir, color_map, get_image_list,
                             palette_for, read_images, save_prediction)
from psanet import interrupts
from psanet.core import dist, inference
from psanet.core.checkpoint import load_model_weights, resolve_weights_path
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.runtime import progress_bar, set_device
from psanet.core.options import InferenceOptions
from psanet.errors import UnreadableImagesError
from psanet.log import get_logger

__all__ = ['predict', 'predict_from_config']


def predict(model, transforms, image_list, save_dir='output/result', options=None, colors=None,
            logger=None):
    """Predicts every image of ``image_list`` (this rank's share) and writes both outputs.

    Args:
        model (paddle.nn.Layer): the model with its weights loaded.
        transforms (list): the val transforms (paddleseg transform objects).
        image_list (list): ``(image path, relative output path)`` from
            :func:`psanet.contract.get_image_list`.
        save_dir (str, optional): output root. Default: 'output/result'.
        options (InferenceOptions, optional): how each image is inferred (windows,
            scales and flips). Default: the whole image.
        colors (list, optional): flat palette from :func:`psanet.contract.color_map`.
            Default: Cityscapes colours.
        logger (logging.Logger, optional): Default: the 'psanet' logger.

    Returns:
        list: ``(pseudo colour path, overlay path)`` written by this rank.

    Raises:
        UnreadableImagesError: after every readable image is written, when some
            could not be read (each is also logged as it is skipped).
        InferenceMemoryError: before an image too large for the memory runs.
    """
    logger = logger or get_logger()
    check_save_dir(save_dir)
    check_outputs(image_list, save_dir)
    options = options or InferenceOptions()
    colors = colors or color_map(19, cityscapes=True)
    compose = Compose(list(transforms))
    model.eval()
    mine = image_list[dist.rank()::dist.world_size()]
    written, unreadable = [], []
    logger.info(f'Predicting {len(image_list)} images into {save_dir} ...')
    # PaddleSeg's predict shows this bar; only rank 0 updates it.
    with paddle.no_grad(), progress_bar(len(mine)) as bar:
        for image, relative in read_images(mine, unreadable, logger):
            interrupts.raise_if_interrupted()
            data = compose({'img': image.astype('float32'), 'trans_info': []})
            tensor = paddle.to_tensor(data['img'][np.newaxis])
            score = inference.inference(model, tensor, data['trans_info'], options)
            pred = paddle.argmax(score, axis=1).numpy()[0].astype('uint8')
            if pred.shape != image.shape[:2]:
                pred = cv2.resize(pred, (image.shape[1], image.shape[0]),
                                  interpolation=cv2.INTER_NEAREST)
            written.append(save_prediction(pred, image, relative, save_dir, colors))
            if bar is not None and dist.rank() == 0:
                bar.update(len(written) + len(unreadable))
        if bar is not None and dist.rank() == 0 and len(written) + len(unreadable) < len(mine):
            bar.update(len(mine))  # the last images could not be read
    logger.info(f'Predicted images are saved in {os.path.join(save_dir, "added_prediction")} '
                f'and {os.path.join(save_dir, "pseudo_color_prediction")} .')
    if unreadable:
        raise UnreadableImagesError(unreadable, len(mine), written, save_dir)
    return written


def predict_from_config(config, model_path, image_path, save_dir='output/result', device=None,
                        custom_color=None, opts=None, **flags):
    """predict.py: builds the model from ``config``, loads ``model_path``, predicts ``image_path``.

    Args:
        config (str): the config file.
        model_path (str): model.pdparams or a checkpoint folder.
        image_path (str): an image, a folder of images, or a list file.
        save_dir (str, optional): output root. Default: 'output/result'.
        device (str, optional): 'cpu' or 'gpu'; None: the GPU when Paddle sees one.
        custom_color (list, optional): r g b values for classes 0, 1, ... Default: None.
        opts (list, optional): ``key=value`` config overrides. Default: None.
        **flags: predict.py's inference flags (``aug_pred``, ``scales``, ... see
            :class:`InferenceOptions`); None, or absent, takes the config's test_config.

    Returns:
        list: the written ``(pseudo colour path, overlay path)`` pairs of this rank.
    """
    set_device(device)
    dist.init_parallel()
    logger = get_logger()
    resolve_weights_path(model_path)  # a wrong path fails before any building
    check_save_dir(save_dir)
    cfg = load_config(config, opts=opts)
    options = InferenceOptions.from_flags(flags, cfg.dic.get('test_config'), '--aug_pred')
    image_list = get_image_list(image_path)
    check_outputs(image_list, save_dir)
    builder = ComponentBuilder(cfg, weights_follow=True)
    model = builder.model
    path = load_model_weights(model, model_path)
    logger.info(f'Loaded weights {path}')
    val_class = builder.val_dataset_class if cfg.val_dataset_cfg else None
    colors = color_map(getattr(model, 'num_classes', None), custom_color,
                       cityscapes=palette_for(val_class) == 'cityscapes')
    return predict(model, builder.val_transforms, image_list, save_dir, options, colors, logger)
