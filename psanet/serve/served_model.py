"""What the server serves: a :class:`psanet.Segmenter`, its classes, palette and contract.

From an export (``deploy.yaml``: any backend, INT8 included) the Segmenter runs
the export; from a training config and weights it runs the dygraph model, whose
attention the explorer page reads (:mod:`psanet.serve.explore`).
"""
import dataclasses
import os

import yaml

from psanet.contract import DEPLOY_FILE, DEPLOY_SECTION, color_map, palette_for
from psanet.errors import ConfigError

__all__ = ['ServedModel', 'is_export', 'load_served_model']


@dataclasses.dataclass
class ServedModel:
    """A Segmenter and what the server says about it.

    Attributes:
        segmenter (psanet.Segmenter): preprocess, run and postprocess.
        source (str): the export's deploy.yaml, or the config and weights.
        num_classes (int | None): None when an export does not record it.
        names (list): class names.
        colors (list): the flat [r, g, b, ...] palette of 256 colours.
        model (paddle.nn.Layer | None): the dygraph model (the explorer's), None for an export.
    """
    segmenter: object
    source: str
    num_classes: object
    names: list
    colors: list
    model: object = None

    def describe(self, limits):
        """``GET /v1/model``: the classes, palette and input contract."""
        seg = self.segmenter
        palette = [self.colors[3 * i:3 * i + 3] for i in range(self.num_classes or 256)]
        return {
            'source': self.source, 'backend': seg.backend, 'num_classes': self.num_classes,
            'classes': [{'id': i, 'name': name, 'color': palette[i]}
                        for i, name in enumerate(self.names)],
            'palette': palette,
            'input': {'content_types': ['image/png', 'image/jpeg', 'image/bmp',
                                        'application/octet-stream',
                                        'multipart/form-data (file field "image")'],
                      'color_order': 'any image file; decoded as cv2.imread does (BGR)',
                      'transforms': [type(t).__name__ for t in seg.transforms.transforms],
                      **limits},
            'output': {'formats': ['png (palette PNG of class ids)',
                                   'json (shape, class ids, per-class pixel counts)'],
                       'output_op': seg.output_op},
            'explorer': self.model is not None,
        }


def is_export(config):
    """Whether ``config`` is an export's deploy.yaml (or its folder), not a training config."""
    if os.path.isdir(config):
        return True
    try:
        with open(config, 'rb') as f:
            dic = yaml.safe_load(f)
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return os.path.basename(config) == DEPLOY_FILE  # let the loader name the problem
    return isinstance(dic, dict) and DEPLOY_SECTION in dic


def load_served_model(config, model_path=None, backend=None, device=None, int8=False,
                      cpu_threads=None):
    """The :class:`ServedModel` of an export (``config`` a deploy.yaml) or a checkpoint
    (``config`` a training config with ``model_path``); ``device`` None is the API's default
    for the route (the CPU for an export, the GPU when Paddle sees one for a checkpoint)."""
    on_device = {} if device is None else {'device': device}
    from psanet.api import Segmenter
    from psanet.visualize.charts import class_names
    if not os.path.exists(config):
        raise ConfigError(f'--config {config} does not exist (cwd {os.getcwd()}): pass an '
                          "export's deploy.yaml, or a training config with --model_path.")
    if is_export(config):
        if model_path is not None:
            raise ConfigError(f'--config {config} is an export (deploy.yaml), which holds its '
                              'weights: leave out --model_path, or pass the training config.')
        seg = Segmenter.from_export(config, backend=backend, int8=int8, cpu_threads=cpu_threads,
                                    **on_device)
        cityscapes = seg.deploy.palette == 'cityscapes'
        num_classes, model, source = seg.deploy.num_classes, None, seg.deploy.path
        dataset = None if cityscapes else object
    else:
        if model_path is None:
            raise ConfigError(f'--config {config} is a training config: give its weights with '
                              '--model_path, or pass an export\'s deploy.yaml.')
        if backend is not None or int8 or cpu_threads is not None:
            raise ConfigError('--backend, --int8 and --cpu_threads choose how an export runs; a '
                              'training config runs as the dygraph model (export it with '
                              'export.py to '
                              'serve it in a backend).')
        from psanet.core.config import ComponentBuilder, load_config
        seg = Segmenter.from_config(config, model_path, backend='dygraph', **on_device)
        cfg = load_config(config)
        dataset = ComponentBuilder(cfg).val_dataset_class if cfg.dic.get('val_dataset') else None
        cityscapes = palette_for(dataset) == 'cityscapes'
        model, source = seg.runner.model, f'{config} + {model_path}'
        num_classes = int(model.num_classes)
    names = class_names(num_classes, dataset) if num_classes else []
    return ServedModel(seg, source, num_classes, names,
                       color_map(num_classes, cityscapes=cityscapes), model)
