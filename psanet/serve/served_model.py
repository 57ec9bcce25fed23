"""What the server serves: a :class:`psanet.Segmenter`, its classes, palette and contract.

From an export (``deploy.yaml``: any backend, INT8 included) the Segmenter runs
the export; from a training config and weights it runs the dygraph model, whose
attention the explorer page reads (:mod:`psanet.serve.explore`).
"""
import dataclasses
import hashlib
import os
from typing import Any, Dict, List, Optional, Tuple

import yaml

from psanet.contract import DEPLOY_FILE, DEPLOY_SECTION, color_map, palette_for
from psanet.errors import ConfigError

__all__ = ['ServedModel', 'check_config', 'config_kind', 'export_hash', 'weights_hash',
           'load_served_model', 'warmup_shape']


@dataclasses.dataclass
class ServedModel:
    """A Segmenter and what the server says about it.

    Attributes:
        segmenter (psanet.Segmenter): preprocess, run and postprocess.
        source (str): the export's deploy.yaml, or the config and weights.
        num_classes (int | None): None when an export does not record it.
        names (list): class names.
        colors (list): the flat [r, g, b, ...] palette of 256 colours.
        model (paddle.nn.Layer | None): the dygraph model (the explorer's), None for an export
            and in the server's process (:meth:`front`).
        digest (str): which weights: ``export_hash`` of an export, ``weights_hash`` of a
            checkpoint's model.
        align_corners (bool | None): the explorer's model's, None without one.
    """
    segmenter: Any
    source: str
    num_classes: Optional[int]
    names: List[str]
    colors: List[int]
    model: Any = None
    digest: str = ''
    align_corners: Optional[bool] = None

    def front(self, runner: Any) -> 'ServedModel':
        """What the server's process keeps (it crosses a pipe): this, without the model, its
        Segmenter's pre- and postprocessing around ``runner`` (the model's worker)."""
        from psanet.api import Segmenter
        seg = self.segmenter
        front = Segmenter(runner, seg.transforms, seg.output_op, backend=seg.backend,
                          deploy=seg.deploy)
        return ServedModel(front, self.source, self.num_classes, self.names, self.colors,
                           model=None, digest=self.digest, align_corners=self.align_corners)

    def describe(self, limits: dict) -> dict:
        """``GET /v1/model``: the classes, palette and input contract."""
        seg = self.segmenter
        palette = [self.colors[3 * i:3 * i + 3] for i in range(self.num_classes or 256)]
        return {
            'source': self.source, 'backend': seg.backend, 'digest': self.digest,
            'num_classes': self.num_classes,
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
            'explorer': self.align_corners is not None,
        }


def config_kind(config: str) -> str:
    """'export' for an export's deploy.yaml (or its folder), 'training' for a training config;
    a ConfigError naming what else the file is (missing, empty, not text, broken YAML)."""
    flag = f'--config {config}'
    want = "pass an export's deploy.yaml (or its folder), or a training config with --model_path"
    if os.path.isdir(config):
        if os.path.isfile(os.path.join(config, DEPLOY_FILE)):
            return 'export'
        raise ConfigError(f'{flag} is a folder without a {DEPLOY_FILE}: {want}.')
    if not os.path.exists(config):
        raise ConfigError(f'{flag} does not exist (cwd {os.getcwd()}): {want}.')
    try:
        with open(config, 'rb') as f:
            data = f.read()
    except OSError as error:
        raise ConfigError(f'{flag} cannot be read ({error.strerror}).') from None
    if not data.strip():
        raise ConfigError(f'{flag} is empty: {want}.')
    try:
        dic = yaml.safe_load(data.decode('utf-8'))
    except UnicodeDecodeError as error:
        raise ConfigError(f'{flag} is not text (byte {error.start} is not UTF-8; a binary '
                          f'file?): {want}.') from None
    except yaml.YAMLError as error:
        mark = getattr(error, 'problem_mark', None)
        where = f' at line {mark.line + 1}, column {mark.column + 1}' if mark else ''
        problem = getattr(error, 'problem', None) or type(error).__name__
        raise ConfigError(f'{flag} is not valid YAML ({problem}{where}): fix it, or {want}.') \
            from None
    if isinstance(dic, dict) and DEPLOY_SECTION in dic:
        return 'export'
    if isinstance(dic, dict) and ('model' in dic or '_base_' in dic):
        return 'training'
    held = f'keys {sorted(map(str, dic))[:5]}' if isinstance(dic, dict) else \
        f'a {type(dic).__name__}'
    raise ConfigError(f'{flag} is neither an export\'s deploy.yaml (a {DEPLOY_SECTION}: section) '
                      f'nor a training config (model: or _base_:); it holds {held}: {want}.')


def _sha256(chunks):
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()[:16]


def _file_chunks(paths):
    for path in paths:
        with open(path, 'rb') as f:
            yield from iter(lambda: f.read(1 << 20), b'')


def export_hash(deploy: Any) -> str:
    """Which export a server runs, for /metrics: the first 16 hex digits of the SHA-256 of
    deploy.yaml and the files it names (graph, parameters, ONNX models), one after another."""
    names = [deploy.path] + [getattr(deploy, key) for key in ('model', 'params', 'onnx',
                                                               'onnx_int8')]
    return _sha256(_file_chunks(p for p in names if p is not None and os.path.isfile(p)))


def weights_hash(model: Any) -> str:
    """Which weights a checkpoint's model holds: the SHA-256 (16 hex digits) of its parameters'
    bytes in the order of their names."""
    state = model.state_dict()
    return _sha256(state[name].numpy().tobytes() for name in sorted(state))


def load_served_model(config: str, model_path: Optional[str] = None,
                      backend: Optional[str] = None, device: Optional[str] = None,
                      int8: bool = False, cpu_threads: Optional[int] = None) -> ServedModel:
    """The :class:`ServedModel` of an export (``config`` a deploy.yaml) or a checkpoint
    (``config`` a training config with ``model_path``); ``device`` None is the API's default
    for the route (the CPU for an export, the GPU when Paddle sees one for a checkpoint)."""
    kind = check_config(config, model_path, backend, int8, cpu_threads)
    on_device: Dict[str, Any] = {} if device is None else {'device': device}
    from psanet.api import Segmenter
    from psanet.visualize.charts import class_names
    if kind == 'export':
        seg = Segmenter.from_export(config, backend=backend, int8=int8, cpu_threads=cpu_threads,
                                    **on_device)
        cityscapes = seg.deploy.palette == 'cityscapes'
        num_classes, model, source = seg.deploy.num_classes, None, seg.deploy.path
        dataset = None if cityscapes else object
        digest = export_hash(seg.deploy)
    else:
        from psanet.core.config import ComponentBuilder, load_config
        seg = Segmenter.from_config(config, str(model_path), backend='dygraph', **on_device)
        cfg = load_config(config)
        dataset = ComponentBuilder(cfg).val_dataset_class if cfg.dic.get('val_dataset') else None
        cityscapes = palette_for(dataset) == 'cityscapes'
        model, source = seg.runner.model, f'{config} + {model_path}'
        num_classes = int(model.num_classes)
        digest = weights_hash(model)
    names = class_names(num_classes, dataset) if num_classes else []
    return ServedModel(seg, source, num_classes, names,
                       color_map(num_classes, cityscapes=cityscapes), model, digest,
                       None if model is None else bool(model.align_corners))


def check_config(config: str, model_path: Optional[str] = None, backend: Optional[str] = None,
                 int8: bool = False, cpu_threads: Optional[int] = None) -> str:
    """``config_kind(config)``, with the flags that go with that kind (nothing loaded)."""
    kind = config_kind(config)
    if kind == 'export' and model_path is not None:
        raise ConfigError(f'--config {config} is an export (deploy.yaml), which holds its '
                          'weights: leave out --model_path, or pass the training config.')
    if kind == 'training' and model_path is None:
        raise ConfigError(f'--config {config} is a training config: give its weights with '
                          '--model_path, or pass an export\'s deploy.yaml.')
    if kind == 'training' and (backend is not None or int8 or cpu_threads is not None):
        raise ConfigError('--backend, --int8 and --cpu_threads choose how an export runs; a '
                          'training config runs as the dygraph model (export it with export.py '
                          'to serve it in a backend).')
    return kind


def warmup_shape(segmenter: Any, size: Optional[Tuple[int, int]] = None) -> Optional[tuple]:
    """The ``[3, H, W]`` input the model meets for images of ``size`` (width, height), or, for
    None, the one every image meets: an export's fixed input shape, or what the transforms make
    of any image (e.g. a Resize); None when the model takes each image at its own size."""
    import numpy as np
    rng = np.random.RandomState(0)

    def shape_of(width, height):
        image = rng.randint(0, 256, (height, width, 3)).astype('uint8')
        return tuple(segmenter.preprocess([image], ['the warm-up image'])[0].shape[1:])

    if size is not None:
        return shape_of(*size)
    deploy = segmenter.deploy
    if deploy is not None and min(deploy.input_shape[2:]) > 0:
        return (3, *deploy.input_shape[2:])
    first, second = shape_of(61, 37), shape_of(90, 50)
    return first if first == second else None
