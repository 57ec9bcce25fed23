"""The work of tools/visualize_attention.py: a model's attention at chosen pixels of one image.

The model runs once on the image through the val transforms while
:func:`psanet.visualize.attention.capture_attention` records each PSA branch's
map; :func:`psanet.visualize.attention.attention_figures` draws them.
"""
import contextlib
import os

import cv2
import numpy as np
import paddle
from paddleseg.transforms import Compose

from psanet.contract import color_map, palette_for
from psanet.core import inference
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.device import set_device
from psanet.core.weights import load_model_weights, resolve_weights_path
from psanet.errors import ConfigError, DatasetError, unreadable_image
from psanet.files import check_save_dir
from psanet.log import get_logger
from psanet.models import PSANet
from psanet.ops import psa_impl as use_psa_impl
from psanet.visualize.attention import (MapGeometry, attention_figures, capture_attention,
                                        check_points, parse_points, psa_branches)
from psanet.visualize.charts import class_names
from psanet.visualize.drawing import write_png

__all__ = ['visualize_attention', 'visualize_attention_from_config']


def visualize_attention(model, image, points, transforms, colors=None, names=None, title=''):
    """The attention figures of ``points`` (``(x, y)`` pixels or ``'x,y'`` strings) on one BGR
    image: ``(figures, sheet)``, a BGR uint8 image per point and all of them stacked.

    Runs the model once on the whole image through the val ``transforms`` with
    :func:`psanet.visualize.attention.capture_attention`, maps each point to its cell of each
    branch's map and draws the figures. A point outside the image, or a model without PSA
    branches, is a ConfigError.
    """
    points = parse_points(points)
    check_points(points, image.shape[:2], title)
    data = Compose(list(transforms))({'img': image.astype('float32'), 'trans_info': []})
    tensor = paddle.to_tensor(data['img'][np.newaxis])
    model.eval()
    with paddle.no_grad(), capture_attention(model) as records:
        logit = inference.inference(model, tensor, data['trans_info'])
    if not records:  # a forward turned into a static program runs no Python hooks
        raise RuntimeError(f'{type(model).__name__} ran without calling its PSA branches in '
                           'dygraph (converted by paddle.jit.to_static?): pass the model as built.')
    label = paddle.argmax(logit, axis=1).numpy()[0].astype('int64')
    if label.shape != image.shape[:2]:
        label = cv2.resize(label.astype(np.int32), (image.shape[1], image.shape[0]),
                           interpolation=cv2.INTER_NEAREST).astype('int64')
    num_classes = int(logit.shape[1])
    names = list(names) if names is not None else class_names(num_classes)
    palette = np.asarray(colors or color_map(num_classes), np.uint8).reshape(-1, 3)[:, ::-1]
    geometries = [MapGeometry(tuple(image.shape[:2]), tuple(data['img'].shape[1:]),
                              tuple(data['trans_info']), record.feature_size, record.map_size,
                              bool(model.align_corners))
                  for record in records]
    return attention_figures(image, points, records, geometries, (label, palette), names, title)


def _read_image(image_path):
    if not os.path.isfile(image_path):
        raise ConfigError(f'--image_path {image_path} is not an image file (cwd {os.getcwd()}): '
                          'pass one image.')
    image = cv2.imread(image_path, cv2.IMREAD_COLOR)
    if image is None:
        raise DatasetError(unreadable_image(image_path, 'pass another image.'))
    return image


def visualize_attention_from_config(config, model_path, image_path, points, save_dir,
                                    device=None, opts=None, psa_impl=None):
    """tools/visualize_attention.py: writes ``<save_dir>/<image stem>_attention_x<x>_y<y>.png``
    per point and ``<save_dir>/<image stem>_attention_sheet.png``; returns the written paths,
    the sheet last."""
    set_device(device)
    resolve_weights_path(model_path)  # wrong paths and points fail before any building
    check_save_dir(save_dir)
    points = parse_points(points)
    image = _read_image(image_path)
    check_points(points, image.shape[:2], image_path)
    cfg = load_config(config, opts=opts)
    builder = ComponentBuilder(cfg, weights_follow=True)
    model = builder.model
    if not isinstance(model, PSANet):
        raise ConfigError(f'config {config}: model.type {type(model).__name__} has no PSA '
                          'branch: there is no attention to show; use a PSANet with use_psa: '
                          'true.')
    psa_branches(model)  # before the weights, which would not fit such a config
    logger = get_logger()
    logger.info(f'Loaded weights {load_model_weights(model, model_path)}')
    val_class = builder.val_dataset_class if cfg.dic.get('val_dataset') else None
    num_classes = int(model.num_classes)
    colors = color_map(num_classes, cityscapes=palette_for(val_class) == 'cityscapes')
    with use_psa_impl(psa_impl) if psa_impl else contextlib.nullcontext():
        figures, sheet = visualize_attention(model, image, points, builder.val_transforms,
                                             colors, class_names(num_classes, val_class),
                                             os.path.basename(image_path))
    stem = os.path.splitext(os.path.basename(image_path))[0]
    paths = [write_png(os.path.join(save_dir, f'{stem}_attention_x{x}_y{y}.png'), figure)
             for figure, (x, y) in zip(figures, points)]
    paths.append(write_png(os.path.join(save_dir, f'{stem}_attention_sheet.png'), sheet))
    logger.info(f'Attention at {len(points)} point{"s" * (len(points) > 1)} written to '
                f'{save_dir}: {os.path.basename(paths[-1])} and one PNG per point.')
    return paths
