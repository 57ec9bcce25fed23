"""Reads ``deploy.yaml``, the description ``export.py`` writes next to an exported model."""
import math
import os
import struct

import numpy as np
import yaml

from psanet.contract import (DEFAULT_TRANSFORMS, DEPLOY_FILE, DEPLOY_SECTION, DYNAMIC_INPUT_SHAPE,
                             MIN_INPUT_SIZE, PALETTES, read_json)
from psanet.errors import DeployError, is_integer

from .attention_memory import ATTENTION_MEMORY, AttentionCost

__all__ = ['DeployConfig', 'graph_holds_custom_op', 'graph_parameters', 'check_params_file']

CUSTOM_OP_NAME = 'psa_mask'
# The files deploy.yaml names, with the name export.py gives each.
FILE_KEYS = {'model': 'model.json', 'params': 'model.pdiparams', 'onnx': 'model.onnx',
             'onnx_int8': 'model_int8.onnx'}
# Files of a model that are not deploy.yaml (a path users pass for the export's).
MODEL_EXTENSIONS = ('.pdparams', '.pdiparams', '.pdmodel', '.pdopt', '.json', '.onnx')


def _pir_nodes(model_file):
    """Every JSON object of the saved PIR program ``model_file`` (``model.json``)."""
    program = read_json(model_file, lambda reason: DeployError(
        f'cannot read the model graph {model_file}: {reason}. Export the model again with '
        'export.py.'))
    stack = [program]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def graph_holds_custom_op(model_file):
    """True if the saved PIR program (``model.json``) holds the custom ``psa_mask`` op.

    Read from the graph itself, not from deploy.yaml, so a model exported by
    other means (or a hand-edited yaml) still gets its op library loaded.
    """
    # PIR serialises an op as {"#": "<dialect id>.<op name>", ...}.
    return any(isinstance(node.get('#'), str) and
               node['#'].split('.', 1)[-1] == CUSTOM_OP_NAME for node in _pir_nodes(model_file))


def graph_parameters(model_file):
    """``[(name, shape)]`` of the parameters the saved PIR program declares, sorted by name
    (the order ``paddle.jit.save`` writes them to model.pdiparams)."""
    found = []
    for node in _pir_nodes(model_file):
        # PIR serialises a parameter as {"#": "p", "A": [..., name], "O": {"TT": {"D":
        # [dtype, shape, ...]}}}.
        if node.get('#') == 'p':
            try:
                found.append((str(node['A'][-1]), [int(d) for d in node['O']['TT']['D'][1]]))
            except (KeyError, IndexError, TypeError, ValueError):
                pass
    return sorted(found)


def _check_params_fit(path, model_file, dims):
    parameters = graph_parameters(model_file)
    if not parameters:
        return  # a graph layout this reader does not know
    fix = ('they come from two different exports; copy model.json and model.pdiparams of one '
           'export together, or export the model again.')
    if len(parameters) != len(dims):
        raise DeployError(f'the parameters file {path} holds {len(dims)} tensors, but the graph '
                          f'{model_file} declares {len(parameters)}: {fix}')
    wrong = [f'{name} (graph {shape}, file {got})'
             for (name, shape), got in zip(parameters, dims) if list(shape) != list(got)]
    if wrong:
        raise DeployError(f'the parameters file {path} does not fit the graph {model_file}: '
                          f'{len(wrong)} tensors have another shape, such as {", ".join(wrong[:3])}'
                          f': {fix}')


class _CutShort(Exception):
    pass


def _tensor_dims(path, size):
    """The dims of each tensor of the parameters file ``path`` (``size`` bytes), its data
    skipped; None for a layout this walk does not know. Raises _CutShort(count, start)
    where the file ends inside tensor ``count + 1``, which starts at byte ``start``."""
    from google.protobuf.message import DecodeError
    from paddle.base import core
    from paddle.base.proto.framework_pb2 import VarType
    dims = []
    with open(path, 'rb') as f:
        def read(count):
            data = f.read(count)
            if len(data) < count:
                raise _CutShort(len(dims), start)
            return data

        while f.tell() < size:
            start = f.tell()
            version, lod_level = struct.unpack('<IQ', read(12))
            if version != 0 or lod_level > 8:
                return None
            for _ in range(lod_level):
                f.seek(struct.unpack('<Q', read(8))[0], os.SEEK_CUR)
            version, desc_size = struct.unpack('<Ii', read(8))
            if version != 0 or not 0 <= desc_size < 4096:
                return None
            try:
                desc = VarType.TensorDesc.FromString(read(desc_size))
                element_bytes = core.size_of_dtype(core.VarDesc.VarType(desc.data_type))
            except (DecodeError, NotImplementedError):
                return None
            end = f.tell() + math.prod(desc.dims) * element_bytes
            if end > size:
                raise _CutShort(len(dims), start)
            f.seek(end)
            dims.append(list(desc.dims))
    return dims


def check_params_file(path, model_file=None):
    """Raises DeployError when ``path`` (a ``model.pdiparams``) ends inside a tensor, or, with
    ``model_file``, when its tensors are not the shapes that graph declares.

    The file holds the tensors ``paddle.jit.save`` wrote one after another, each
    ``uint32 version, uint64 lod_level, lod_level x (uint64 size, bytes),
    uint32 version, int32 desc size, TensorDesc, data`` (Paddle's
    ``TensorToStream``); the TensorDesc is read with Paddle's own protobuf
    definition. Paddle says only "Cannot read tensor desc size" for a file cut
    short, loads one cut inside its last tensor without a word, and runs
    parameters of another model's export (another ``psa_channels``) without a
    word (docs/design.md); walking the headers (the data is skipped, not read)
    names the file and the fix. A layout this walk does not know passes unchecked.
    """
    size = os.path.getsize(path)
    fix = ('it was cut short (an interrupted copy or download, or a full disk); export the '
           'model again (python export.py --config <config> --model_path <weights> '
           f'--save_dir {os.path.dirname(path) or "."}), or copy the whole file again.')
    if size == 0:
        raise DeployError(f'the parameters file {path} is empty: {fix}')
    try:
        dims = _tensor_dims(path, size)
    except _CutShort as cut:
        tensors, start = cut.args
        raise DeployError(f'the parameters file {path} ({size} bytes) ends inside its tensor '
                          f'#{tensors + 1}, which starts at byte {start}: {fix}') from None
    if model_file is not None and dims is not None:
        _check_params_fit(path, model_file, dims)


class DeployConfig:
    """The contents of a ``deploy.yaml`` with paths resolved against its folder.

    Args:
        path (str): Path of ``deploy.yaml``, or of the folder holding it.
    """

    def __init__(self, path):
        if os.path.isdir(path):
            path = os.path.join(path, DEPLOY_FILE)
        if not os.path.isfile(path):
            raise DeployError(f'deploy config not found: {path}. Pass the deploy.yaml that '
                              f'export.py wrote (export.py --config ... --model_path ... '
                              f'--save_dir DIR writes DIR/deploy.yaml).')
        if os.path.splitext(path)[1].lower() in MODEL_EXTENSIONS:
            raise DeployError(f'{path} is a model file, not a deploy.yaml: pass the export\'s '
                              f'folder ({os.path.dirname(path) or "."}) or its deploy.yaml; a '
                              'checkpoint (model.pdparams) runs with Segmenter.from_config('
                              'config, weights), or export it with export.py.')
        with open(path, 'rb') as f:
            data = f.read()
        try:
            dic = yaml.safe_load(data.decode('utf-8'))
        except yaml.YAMLError as error:
            raise DeployError(f'{path} is not valid YAML: {error}') from error
        except UnicodeDecodeError as error:
            raise DeployError(f'{path} is not UTF-8 text (byte {error.start}): save it as '
                              'UTF-8, or export the model again.') from None
        if not isinstance(dic, dict) or not isinstance(dic.get(DEPLOY_SECTION), dict):
            raise DeployError(f'{path} has no `Deploy:` section; is it a deploy.yaml '
                              f'written by export.py?')
        self.path = path
        self.dir = os.path.dirname(os.path.abspath(path))
        self.dic = dic[DEPLOY_SECTION]
        for key in ('model', 'params'):
            if key not in self.dic:
                raise DeployError(f'{path}: Deploy.{key} is missing; export the model again.')
        for key, name in FILE_KEYS.items():
            value = self.dic.get(key)
            if (value is not None or key in ('model', 'params')) and (
                    not isinstance(value, str) or not value):
                raise DeployError(f'{path}: Deploy.{key} must be a file name such as {name}, '
                                  f'got {value!r}: fix it or export the model again.')
        for key in ('num_classes', MIN_INPUT_SIZE):
            value = self.dic.get(key)
            if value is not None and not is_integer(value, 1):
                raise DeployError(f'{path}: Deploy.{key} must be a positive integer, got '
                                  f'{value!r}: fix it or export the model again.')
        for file in (self.model, self.params):
            if not os.path.isfile(file):
                raise DeployError(f'model file not found: {file} (named by {path}). Export '
                                  f'the model again, or keep deploy.yaml next to its files.')
        shape = self.dic.get('input_shape', DYNAMIC_INPUT_SHAPE)
        if not isinstance(shape, (list, tuple)) or len(shape) != 4 or not all(
                is_integer(s) and (s > 0 or s == -1) for s in shape):
            raise DeployError(f'{path}: Deploy.input_shape must be four integers N, 3, H, W '
                              f'(-1 for a dynamic one), got {shape!r}: fix it or export the '
                              'model again.')

    def _file(self, key):
        return os.path.join(self.dir, self.dic[key])

    @property
    def model(self):
        return self._file('model')

    @property
    def params(self):
        return self._file('params')

    @property
    def onnx(self):
        """Path of model.onnx, or None when the export wrote none."""
        return self._file('onnx') if self.dic.get('onnx') else None

    @property
    def onnx_int8(self):
        """Path of the INT8 model (model_int8.onnx) psanet.deploy.quantize wrote, or None."""
        return self._file('onnx_int8') if self.dic.get('onnx_int8') else None

    @property
    def transforms(self):
        """The val transforms as written (a list of dicts)."""
        return [dict(t) for t in self.dic.get('transforms') or DEFAULT_TRANSFORMS]

    @property
    def input_shape(self):
        """``[N, C, H, W]`` with -1 for a dynamic dimension."""
        return [int(s) for s in self.dic.get('input_shape', DYNAMIC_INPUT_SHAPE)]

    @property
    def output_op(self):
        return self.dic.get('output_op', 'argmax')

    @property
    def num_classes(self):
        return self.dic.get('num_classes')

    @property
    def palette(self):
        """'cityscapes' or 'default', as export.py decided from the config's val dataset."""
        palette = self.dic.get('palette', 'default')
        if palette not in PALETTES:
            raise DeployError(f'{self.path}: Deploy.palette is {palette!r}; it must be one of '
                              f'{PALETTES}. Fix it or export the model again.')
        return palette

    @property
    def attention_cost(self):
        """The model's :class:`AttentionCost` (an N x 3 x H x W input's maps peak at
        N * (ceil(H / input_unit) * ceil(W / input_unit))**2 elements of
        bytes_per_element), or None when deploy.yaml has no ``attention_memory`` entry
        (a model without PSA branches, or an export that did not write one)."""
        entry = self.dic.get(ATTENTION_MEMORY)
        if entry is None:
            return None
        values = [entry.get(key) for key in ('input_unit', 'bytes_per_element')] \
            if isinstance(entry, dict) else [None]
        if not all(is_integer(v, 1) for v in values):
            raise DeployError(f'{self.path}: Deploy.{ATTENTION_MEMORY} must hold input_unit and '
                              f'bytes_per_element, positive integers, got {entry!r}: fix it or '
                              'export the model again.')
        return AttentionCost(*values)

    @property
    def min_input_size(self):
        """The smallest side of a network input the exported model runs on in every backend
        (``PSANet.min_input_size``), or None when deploy.yaml has no ``min_input_size``
        (another model, or an export that did not write one)."""
        return self.dic.get(MIN_INPUT_SIZE)

    @property
    def holds_custom_op(self):
        if not hasattr(self, '_holds_custom_op'):
            self._holds_custom_op = graph_holds_custom_op(self.model)
        return self._holds_custom_op

    def build_transforms(self):
        """The val transforms as a paddleseg ``Compose`` (reads BGR, converts to RGB, CHW)."""
        from paddleseg.cvlibs import manager
        from paddleseg.transforms import Compose
        ops = []
        for spec in self.transforms:
            spec = dict(spec)
            name = spec.pop('type', None)
            if name not in manager.TRANSFORMS.components_dict:
                raise DeployError(f'{self.path}: unknown transform {name!r}; known: '
                                  f'{sorted(manager.TRANSFORMS.components_dict)}.')
            try:
                ops.append(manager.TRANSFORMS[name](**spec))
            except (TypeError, ValueError, AssertionError) as error:
                raise DeployError(f'{self.path}: transform {name} {spec} cannot be built: '
                                  f'{error}. Fix Deploy.transforms.') from error
        compose = Compose(ops)
        # A wrong value (`mean: abc`) fails only on an image: try one before any real image.
        try:
            compose({'img': np.zeros((32, 32, 3), np.float32), 'trans_info': []})
        except Exception as error:  # what the transform raises depends on the value
            raise DeployError(f'{self.path}: Deploy.transforms {self.transforms} fail on an '
                              f'image ({type(error).__name__}: {error}): fix their values, or '
                              'export the model again.') from error
        return compose
