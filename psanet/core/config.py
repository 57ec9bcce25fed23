"""Config loading and component building on paddleseg's Config and SegBuilder, with clear errors.

paddleseg 2.8.0 reads the YAML (``_base_``, ``--opts``) and builds the components; this
module turns what it lacks for a command line (a misspelt top-level key, an unknown
component type, a bad ``--opts`` item, a loop of ``_base_`` files, a component that fails
to build) into one :class:`ConfigError` naming the file and the fix, instead of an
assertion, a RecursionError or a wrapped RuntimeError.
"""
import copy
import difflib
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

import yaml

from psanet import compat

compat.require_paddleseg()  # one line naming what to install, before paddleseg's ImportError

from paddleseg.cvlibs import Config, SegBuilder, manager  # noqa: E402
from paddleseg.cvlibs.config import parse_from_yaml  # noqa: E402

import psanet.models  # noqa: F401,E402  (registers PSANet; the paddleseg fixes)
from psanet.data.validate import check_dataset_config, validate_dataset  # noqa: E402
from psanet.errors import ArgumentError, ConfigError, is_integer  # noqa: E402
from psanet.log import get_logger  # noqa: E402

__all__ = ['KNOWN_KEYS', 'UNSUPPORTED_KEYS', 'LoadedConfig', 'load_config', 'set_schedule',
           'ComponentBuilder']

# Top-level keys the engine reads: paddleseg 2.8.0's, plus the engine's own ``sync_bn``.
KNOWN_KEYS = ('batch_size', 'iters', 'train_dataset', 'val_dataset', 'optimizer', 'lr_scheduler',
              'loss', 'model', 'test_config', 'sync_bn')
# paddleseg keys this engine would silently ignore: refused, so a run never differs unnoticed.
UNSUPPORTED_KEYS = {
    'distill_loss': 'knowledge distillation (paddleseg\'s slim/distill) is not implemented',
    'to_static_training': 'training runs in dynamic graph mode only',
    'export': 'export options come from export.py\'s flags (--input_shape, --output_op)',
}

# Which registries a section's ``type`` keys name, for suggestions in errors.
_SECTION_REGISTRIES = {
    'model': (manager.MODELS, manager.BACKBONES),
    'train_dataset': (manager.DATASETS, manager.TRANSFORMS),
    'val_dataset': (manager.DATASETS, manager.TRANSFORMS),
    'loss': (manager.LOSSES, ),
    'optimizer': (manager.OPTIMIZERS, ),
}
_ALL_REGISTRIES = (manager.MODELS, manager.BACKBONES, manager.DATASETS, manager.TRANSFORMS,
                   manager.LOSSES, manager.OPTIMIZERS)


def _check_yaml_files(path, chain=(), entry=None):
    """The config and its ``_base_`` chain exist, are YAML mappings and do not loop.

    ``chain`` holds the files that led to ``path``, ``entry`` the ``_base_`` item naming it.
    """
    seen = [os.path.realpath(p) for p in chain]
    if os.path.realpath(path) in seen:
        loop = chain[seen.index(os.path.realpath(path)):] + (path, )
        raise ConfigError(f'config {chain[0]}: the _base_ files form a loop, '
                          f'{" -> ".join(os.path.normpath(p) for p in loop)}: remove '
                          f'_base_: {entry} from {os.path.normpath(chain[-1])}.')
    if os.path.isdir(path):
        where = f' (the _base_ of {chain[-1]})' if chain else ''
        found = sorted(n for n in os.listdir(path) if n.endswith(('.yml', '.yaml')))[:3]
        example = f', e.g. {os.path.join(path, found[0])}' if found else ''
        raise ConfigError(f'config {path}{where} is a folder: pass one of its .yml files'
                          f'{example}.')
    if not os.path.isfile(path):
        where = f' (the _base_ of {chain[-1]})' if chain else ''
        raise ConfigError(f'config {path}{where} does not exist (cwd {os.getcwd()}): pass a file '
                          'such as configs/psanet/psanet_resnet50_os8_cityscapes_1024x512_80k.yml.')
    if not path.endswith(('.yml', '.yaml')):
        raise ConfigError(f'config {path} is not a .yml/.yaml file: pass a YAML config.')
    try:
        with open(path, 'rb') as f:
            dic = yaml.load(f.read().decode('utf-8'), Loader=yaml.FullLoader)
    except yaml.YAMLError as error:
        raise ConfigError(f'config {path} is not valid YAML: {error}') from error
    except UnicodeDecodeError as error:
        raise ConfigError(f'config {path} is not UTF-8 text (byte {error.start}): save it as '
                          'UTF-8.') from None
    if not isinstance(dic, dict):
        raise ConfigError(f'config {path} does not hold a mapping of keys: fix its YAML.')
    bases = dic.get('_base_', [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f'config {path}: _base_ must be a file name or a list of them, '
                          f'got {dic["_base_"]!r}.')
    for base in bases:
        _check_yaml_files(os.path.join(os.path.dirname(path), base), chain + (path, ), base)


def _check_opts(dic, opts, path):
    for item in opts or []:
        if item.count('=') != 1:
            raise ConfigError(f'--opts item {item!r} is not key=value: write e.g. '
                              '`--opts batch_size=2 model.backbone.output_stride=16`.')
        key = item.split('=')[0]
        node = dic
        parts = key.split('.')
        for depth, part in enumerate(parts[:-1]):
            if not isinstance(node, dict) or part not in node:
                prefix = '.'.join(parts[:depth + 1])
                raise ConfigError(f'--opts {item}: {prefix} is not in {path}; keys there: '
                                  f'{_keys(node)}.')
            node = node[part]
        if len(parts) == 1 and parts[0] not in KNOWN_KEYS:
            raise ConfigError(f'--opts {item}: {parts[0]!r} is not a config key; known keys: '
                              f'{", ".join(KNOWN_KEYS)}.')


def _keys(node):
    return ', '.join(map(str, node)) if isinstance(node, dict) else '(not a mapping)'


# Sections paddleseg reads as mappings; anything else fails deep inside it.
_MAPPING_SECTIONS = ('train_dataset', 'val_dataset', 'optimizer', 'lr_scheduler', 'loss', 'model',
                     'test_config')
# The output strides a backbone module builds; any other value silently gives stride 32.
_OUTPUT_STRIDES = {'paddleseg.models.backbones.resnet_vd': (8, 16)}


def _check_top_level(dic, path):
    for key in _MAPPING_SECTIONS:
        if dic.get(key) is not None and not isinstance(dic[key], dict):
            raise ConfigError(f'config {path}: {key} must be a mapping of keys (such as '
                              f'`{key}: {{type: ...}}`), got {dic[key]!r}: fix the config or the '
                              '--opts item that sets it.')
    unsupported = [k for k in dic if k in UNSUPPORTED_KEYS]
    if unsupported:
        reasons = '; '.join(f'{k}: {UNSUPPORTED_KEYS[k]}' for k in unsupported)
        raise ConfigError(f'config {path} sets {", ".join(unsupported)}, which this engine does '
                          f'not support ({reasons}): remove them from the config.')
    unknown = [k for k in dic if k not in KNOWN_KEYS and k != '_inherited_']
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), KNOWN_KEYS, n=1)
            hints.append(f'{key!r}' + (f' (did you mean {close[0]!r}?)' if close else ''))
        raise ConfigError(f'config {path} has unknown top-level keys {", ".join(hints)}: '
                          f'fix or remove them; known keys: {", ".join(KNOWN_KEYS)}.')


def _check_types(node, where, registries, path):
    """Every ``type`` in a section must name a registered component."""
    if isinstance(node, dict):
        if 'type' in node:
            kind = node['type']
            if not any(kind in r.components_dict for r in _ALL_REGISTRIES):
                names = sorted({n for r in registries for n in r.components_dict})
                close = difflib.get_close_matches(str(kind), names, n=3, cutoff=0.5)
                if close:
                    hint = f'did you mean {", ".join(close)}?'
                else:
                    hint = f'known: {", ".join(names[:12])}' + (
                        f' and {len(names) - 12} more' if len(names) > 12 else '') + '.'
                registry_names = '/'.join(r.name for r in registries)
                raise ConfigError(f'config {path}: {where}.type {kind!r} is not a registered '
                                  f'component ({registry_names}): {hint}')
        for key, value in node.items():
            _check_types(value, f'{where}.{key}', registries, path)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_types(value, f'{where}[{i}]', registries, path)


@dataclass(frozen=True)
class LoadedConfig:
    """A checked config: paddleseg's Config (``--opts`` applied) and what the engine reads beside
    it. ``recipe_batch_size``: the file's batch_size before --opts, what its recipe assumes on
    one card; None unless a positive integer."""
    path: str
    paddleseg_config: Config
    recipe_batch_size: Optional[int] = None

    @property
    def dic(self):
        """The sections, as paddleseg's ``Config.dic``."""
        return self.paddleseg_config.dic


def load_config(path, learning_rate=None, opts=None):
    """Reads and checks a config like paddleseg's ``Config`` (``_base_`` files merged, ``opts``
    such as ``['model.num_classes=19']`` applied); raises ConfigError naming the problem.
    Training's iters and batch_size are TrainOptions' to check (:func:`set_schedule`)."""
    _check_yaml_files(path)
    try:
        merged = parse_from_yaml(path)
    except Exception as error:  # paddleseg raises bare exceptions on malformed bases
        raise ConfigError(f'config {path} cannot be read: {error}') from error
    _check_top_level(merged, path)
    _check_opts(merged, opts, path)
    if learning_rate and not isinstance(merged.get('lr_scheduler'), dict):
        raise ConfigError(f'--learning_rate needs an lr_scheduler section in {path}.')
    if learning_rate is not None and not (math.isfinite(learning_rate) and learning_rate > 0):
        raise ConfigError(f'--learning_rate must be a positive finite number, got '
                          f'{learning_rate}.')
    try:
        cfg = Config(path, learning_rate=learning_rate, opts=opts)
    except (AssertionError, RuntimeError, ValueError, KeyError, TypeError) as error:
        lines = str(error).strip().splitlines()
        detail = lines[-1] if lines else type(error).__name__
        raise ConfigError(f'config {path} fails paddleseg\'s checks: {detail}') from error
    _check_top_level(cfg.dic, path)  # again with the --opts applied
    for section, registries in _SECTION_REGISTRIES.items():
        if section in cfg.dic:
            _check_types(cfg.dic[section], section, registries, path)
    _check_output_stride(cfg.dic.get('model'), path)
    recipe = merged.get('batch_size')
    return LoadedConfig(path, cfg, recipe if isinstance(recipe, int) and recipe > 0 else None)


def set_schedule(cfg, iters, batch_size):
    """Writes a training job's iters and batch_size into ``cfg`` (a :class:`LoadedConfig`),
    where paddleseg's builder reads iters for the LR scheduler's decay steps."""
    cfg.dic['iters'], cfg.dic['batch_size'] = iters, batch_size


def _check_output_stride(model, path):
    backbone = model.get('backbone') if isinstance(model, dict) else None
    if not isinstance(backbone, dict) or 'output_stride' not in backbone:
        return
    component = manager.BACKBONES.components_dict.get(backbone.get('type'))
    strides = _OUTPUT_STRIDES.get(getattr(component, '__module__', None))
    value = backbone['output_stride']
    if strides and (not is_integer(value) or value not in strides):
        raise ConfigError(f'config {path}: model.backbone.output_stride must be one of '
                          f'{", ".join(map(str, strides))} for {backbone["type"]}, got {value!r} '
                          '(it builds no other stride): fix the config or the --opts item that '
                          'sets it.')


def _argument_error(error):
    """The models' ArgumentError behind ``error`` (SegBuilder re-raises it as a RuntimeError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ArgumentError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _is_url(value):
    return isinstance(value, str) and value.startswith(('http://', 'https://', 'ftp://'))


def _download_error(error):
    """Whether ``error`` (or what caused it) is a failed download."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        module = type(error).__module__ or ''
        if module.startswith(('requests', 'urllib', 'http.client', 'socket')) or \
                isinstance(error, (ConnectionError, TimeoutError)):
            return True
        error = error.__cause__ or error.__context__
    return False


class ComponentBuilder:
    """Builds the config's components through paddleseg's SegBuilder, with clear errors. With
    ``weights_follow`` (val, predict, export: trained weights replace the model's) the
    config's pretrained weights are neither downloaded nor loaded."""

    def __init__(self, cfg, weights_follow=False):
        self.cfg = cfg
        self.path = cfg.path
        self.weights_follow = weights_follow
        if weights_follow:
            model = cfg.dic.get('model') or {}
            for section in (model, model.get('backbone')):
                if isinstance(section, dict) and section.get('pretrained') is not None:
                    section['pretrained'] = None
        self._builder = SegBuilder(cfg.paddleseg_config)

    def _get(self, name, section):
        try:
            return getattr(self._builder, name)
        except ConfigError:
            raise
        except (AssertionError, AttributeError, RuntimeError, ValueError, KeyError,
                TypeError, OSError) as error:
            argument = _argument_error(error)
            if argument is not None:
                raise ConfigError(f'config {self.path}: {section}.{argument.argument} must be '
                                  f'{argument.requirement}, got {argument.value!r}: fix it in '
                                  'the config or the --opts item that sets it.') from error
            lines = [l for l in str(error).strip().splitlines() if l.strip()]
            detail = lines[-1] if lines else type(error).__name__
            if section == 'model' and _download_error(error):
                raise ConfigError(self._download_message(detail)) from error
            raise ConfigError(f'config {self.path}: cannot build {section}: {detail}. Fix the '
                              f'{section} section of the config.') from error

    @property
    def model(self):
        """The model (cached)."""
        if not self.weights_follow:
            return self._get('model', 'model')
        from paddleseg.utils import logger
        level, logger.log_level = logger.log_level, 1  # warnings only
        try:
            return self._get('model', 'model')
        finally:
            logger.log_level = level

    def _download_message(self, detail):
        model = self.cfg.dic.get('model') or {}
        urls = [(key, section.get('pretrained')) for key, section in
                (('model', model), ('model.backbone', model.get('backbone')))
                if isinstance(section, dict) and _is_url(section.get('pretrained'))]
        what = ', '.join(f'{key}.pretrained {url}' for key, url in urls) or 'the pretrained weights'
        key = urls[-1][0] if urls else 'model.backbone'
        return (f'config {self.path}: cannot download {what} ({detail}). Without network, '
                f'download the file elsewhere and pass its local path (--opts '
                f'{key}.pretrained=/path/to/model.pdparams), or start from random weights '
                f'with --opts {key}.pretrained=None.')

    @property
    def losses(self):
        """``{'types': [loss layers], 'coef': [floats]}`` (cached)."""
        return self._get('loss', 'loss')

    @property
    def optimizer(self):
        """The optimizer over the model's parameters, with the LR scheduler (cached)."""
        return self._get('optimizer', 'optimizer / lr_scheduler')

    @property
    def val_dataset_class(self):
        """The val_dataset's class (not built)."""
        return self._get('val_dataset_class', 'val_dataset')

    @property
    def val_transforms(self):
        """The val_dataset transforms, for prediction."""
        return self._get('val_transforms', 'val_dataset.transforms')

    def dataset(self, split, check_labels='all'):
        """The 'train' or 'val' dataset, its paths and labels checked before use;
        ``check_labels`` ('all', 'sample' or 'none') says how many samples are read (files read
        before and unchanged since are not read again)."""
        section = f'{split}_dataset'
        dataset_cfg = self.cfg.dic.get(section)
        if not dataset_cfg:
            raise ConfigError(f'config {self.path} has no {section} section: add one (see '
                              'configs/_base_/cityscapes.yml).')
        check_dataset_config(copy.deepcopy(dataset_cfg))
        dataset = self._get(section, section)
        start = time.time()
        report = validate_dataset(dataset, dataset.num_classes, dataset.ignore_index,
                                  check_labels=check_labels)
        if report['read'] + report['cached']:
            get_logger().info(
                f'Checked the {report["read"] + report["cached"]} {split} samples in '
                f'{time.time() - start:.2f} s ({report["read"]} read, {report["cached"]} '
                'unchanged since the last check)')
        return dataset
