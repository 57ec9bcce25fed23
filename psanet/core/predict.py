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
from paddleseg.datasets import Cityscapes
from paddleseg.transforms import Compose

from psanet.contract import (check_save_dir, color_map, get_image_list, read_images,
                             save_prediction)
from psanet import interrupts
from psanet.core import dist, inference
from psanet.core.checkpoint import load_model_weights, resolve_weights_path
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.runtime import progress_bar, set_device
from psanet.core.val import check_inference_flags, merge_test_config
from psanet.errors import UnreadableImagesError
from psanet.log import get_logger

__all__ = ['palette_for', 'predict', 'predict_from_config']


def palette_for(dataset_class):
    """The palette of a dataset's predictions: 'cityscapes' for Cityscapes, else 'default'.

    predict.py and export.py (for deploy.yaml's ``palette``) both decide with this.

    Args:
        dataset_class (type | None): the val dataset's class; None when the config has none.
    """
    is_cityscapes = dataset_class is not None and issubclass(dataset_class, Cityscapes)
    return 'cityscapes' if is_cityscapes else 'default'


def predict(model, transforms, image_list, save_dir='output/result', aug_pred=False, scales=1.0,
            flip_horizontal=False, flip_vertical=False, is_slide=False, crop_size=None,
            stride=None, aug_combine='logits', colors=None, logger=None):
    """Predicts every image of ``image_list`` (this rank's share) and writes both outputs.

    Args:
        model (paddle.nn.Layer): the model with its weights loaded.
        transforms (list): the val transforms (paddleseg transform objects).
        image_list (list): ``(image path, relative output path)`` from
            :func:`psanet.contract.get_image_list`.
        save_dir (str, optional): output root. Default: 'output/result'.
        aug_pred (bool, optional): average over scales and flips
            (:func:`psanet.core.inference.aug_inference`). Default: False.
        scales (float | list, optional): scales for aug_pred. Default: 1.0.
        flip_horizontal (bool, optional): horizontal flips for aug_pred. Default: False.
        flip_vertical (bool, optional): vertical flips for aug_pred. Default: False.
        is_slide (bool, optional): sliding-window inference. Default: False.
        crop_size (tuple, optional): (w, h) window when is_slide. Default: None.
        stride (tuple, optional): (w, h) step when is_slide. Default: None.
        aug_combine (str, optional): with aug_pred, average the 'logits' (paddleseg
            2.8's aug_inference) or their 'softmax'. Default: 'logits'.
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
    if is_slide:
        crop_size, stride = inference.check_slide_args(crop_size, stride)
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
            if aug_pred:
                score = inference.aug_inference(model, tensor, data['trans_info'], scales=scales,
                                                flip_horizontal=flip_horizontal,
                                                flip_vertical=flip_vertical, is_slide=is_slide,
                                                crop_size=crop_size, stride=stride,
                                                combine=aug_combine)
            else:
                score = inference.inference(model, tensor, data['trans_info'], is_slide=is_slide,
                                            crop_size=crop_size, stride=stride)
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
                        aug_pred=None, scales=None, flip_horizontal=None, flip_vertical=None,
                        is_slide=None, crop_size=None, stride=None, aug_combine=None,
                        custom_color=None, opts=None):
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
                               crop_size=crop_size, stride=stride, aug_combine=aug_combine),
                          '--aug_pred', cfg.dic.get('test_config'))
    image_list = get_image_list(image_path)
    builder = ComponentBuilder(cfg, weights_follow=True)
    model = builder.model
    path = load_model_weights(model, model_path)
    logger.info(f'Loaded weights {path}')
    options = merge_test_config(builder.test_config, aug_eval=aug_pred, scales=scales,
                                flip_horizontal=flip_horizontal, flip_vertical=flip_vertical,
                                is_slide=is_slide, crop_size=crop_size, stride=stride,
                                aug_combine=aug_combine)
    options['aug_pred'] = options.pop('aug_eval')
    val_class = builder.val_dataset_class if cfg.val_dataset_cfg else None
    colors = color_map(getattr(model, 'num_classes', None), custom_color,
                       cityscapes=palette_for(val_class) == 'cityscapes')
    return predict(model, builder.val_transforms, image_list, save_dir=save_dir, colors=colors,
                   logger=logger, **options)
