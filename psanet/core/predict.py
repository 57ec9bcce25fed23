"""Prediction on image files with the dygraph model: colour-coded masks and overlays, like
PaddleSeg's predict.py.

The model runs as a :class:`DygraphRunner` inside the API's
:class:`psanet.deploy.pipeline.Pipeline`, over the files of
:func:`psanet.deploy.infer_images.segment_files`, the loop deploy/python/infer.py runs. An
image that cannot be read is skipped; the run ends with UnreadableImagesError naming it.
"""
import dataclasses
import os

import paddle
from paddleseg.transforms import Compose

from psanet.contract import check_outputs, color_map, get_image_list, palette_for
from psanet.core import dist, inference
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.device import autocast, progress_bar, set_device
from psanet.core.options import DEFAULT_DEVICE, InferenceOptions
from psanet.core.weights import load_model_weights, resolve_weights_path
from psanet.deploy.infer_images import segment_files
from psanet.deploy.pipeline import Pipeline
from psanet.errors import ConfigError, UnreadableImagesError
from psanet.files import check_save_dir
from psanet.log import get_logger

__all__ = ['DygraphRunner', 'load_model', 'dygraph_runner', 'predict', 'predict_from_config']


class DygraphRunner:
    """The dygraph model (weights loaded) as a :class:`~psanet.deploy.pipeline.Pipeline` runner:
    ``run(batch)`` gives float32 ``[N, C, H, W]`` logits at the batch's size from
    :func:`psanet.core.inference.inference`, as ``options`` say."""

    def __init__(self, model, options=None):
        self.model = model
        self.options = options or InferenceOptions()
        model.eval()

    def run(self, batch):
        with paddle.no_grad(), autocast(self.options.precision, self.options.amp_level):
            score = inference.inference(self.model, paddle.to_tensor(batch), None, self.options)
        return score.numpy().astype('float32', copy=False)


def load_model(cfg, model_path, logger=None):
    """``(model, builder)``: the config's model with the weights of ``model_path`` loaded,
    and the :class:`~psanet.core.config.ComponentBuilder` that built it."""
    builder = ComponentBuilder(cfg, weights_follow=True)
    model = builder.model
    path = load_model_weights(model, model_path)
    (logger or get_logger()).info(f'Loaded weights {path}')
    return model, builder


def dygraph_runner(config, model_path, inference_options=None, device=DEFAULT_DEVICE):
    """``(DygraphRunner, val transforms)`` of a checkpoint, for ``psanet.Segmenter.from_config``
    with ``backend='dygraph'``; ``inference_options`` as a dict goes over the config's
    test_config, as predict.py's flags do."""
    set_device(device)
    resolve_weights_path(model_path)  # a wrong path fails before any building
    cfg = load_config(config)
    options = inference_options
    if not isinstance(options, InferenceOptions):
        options = dict(options or {})
        known = [f.name for f in dataclasses.fields(InferenceOptions)]
        unknown = [name for name in options if name not in known]
        if unknown:
            raise ConfigError(f'inference= has no option {", ".join(map(repr, unknown))}; its '
                              f'options (InferenceOptions\' fields) are {known}.')
        options = InferenceOptions.from_flags(options, cfg.dic.get('test_config'))
    model, builder = load_model(cfg, model_path)
    return DygraphRunner(model, options), Compose(list(builder.val_transforms))


def predict(model, transforms, image_list, save_dir='output/result', options=None, colors=None,
            logger=None):
    """Predicts this rank's share of ``image_list`` (from :func:`psanet.contract.get_image_list`)
    and writes both outputs; returns the ``(pseudo colour path, overlay path)`` written.

    Raises:
        UnreadableImagesError: after every readable image is written, when some could not be
            read (each is also logged as it is skipped).
        InferenceMemoryError: before an image too large for the memory runs.
    """
    logger = logger or get_logger()
    check_save_dir(save_dir)
    check_outputs(image_list, save_dir)
    colors = colors or color_map(19, cityscapes=True)
    segmenter = Pipeline(DygraphRunner(model, options), Compose(list(transforms)),
                         backend='dygraph')
    mine = image_list[dist.rank()::dist.world_size()]
    logger.info(f'Predicting {len(image_list)} images into {save_dir} ...')
    # PaddleSeg's predict shows this bar; only rank 0 updates it.
    with progress_bar(len(mine)) as bar:
        update = bar.update if bar is not None and dist.rank() == 0 else None
        written, unreadable = segment_files(segmenter, mine, save_dir, colors, logger,
                                            on_progress=update)
    logger.info(f'Predicted images are saved in {os.path.join(save_dir, "added_prediction")} '
                f'and {os.path.join(save_dir, "pseudo_color_prediction")} .')
    if unreadable:
        raise UnreadableImagesError(unreadable, len(mine), written, save_dir)
    return written


def predict_from_config(config, model_path, image_path, save_dir='output/result',
                        device=DEFAULT_DEVICE, custom_color=None, opts=None, **flags):
    """predict.py (its flags by name; None takes the config's test_config): builds the model,
    loads the weights, predicts; returns the ``(pseudo colour path, overlay path)`` pairs of
    this rank."""
    set_device(device)
    dist.init_parallel()
    logger = get_logger()
    resolve_weights_path(model_path)  # a wrong path fails before any building
    check_save_dir(save_dir)
    cfg = load_config(config, opts=opts)
    options = InferenceOptions.from_flags(flags, cfg.dic.get('test_config'), '--aug_pred')
    image_list = get_image_list(image_path)
    check_outputs(image_list, save_dir)
    model, builder = load_model(cfg, model_path, logger)
    val_class = builder.val_dataset_class if cfg.dic.get('val_dataset') else None
    colors = color_map(getattr(model, 'num_classes', None), custom_color,
                       cityscapes=palette_for(val_class) == 'cityscapes')
    return predict(model, builder.val_transforms, image_list, save_dir, options, colors, logger)
