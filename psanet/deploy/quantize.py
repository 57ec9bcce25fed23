"""INT8 post-training quantisation of an export's ``model.onnx`` for the CPU.

onnxruntime's static quantisation (QDQ format, int8 weights, uint8 activations whose
ranges come from calibration images run through the val transforms: the U8S8
pairing, which onnxruntime runs fastest on x86) writes ``model_int8.onnx`` next to
``model.onnx`` and names it in deploy.yaml (``onnx_int8``, and the recipe under
``int8_calibration``). An :class:`Int8Recipe` says what is quantised and how;
``DEFAULT_RECIPE`` is the choice bench/bench_int8.py measured best. onnxruntime and
OpenVINO both run the QDQ model in INT8. Why this path and its figures:
docs/deploy.md ("INT8 on the CPU").
"""
import importlib.util
import os
from dataclasses import dataclass
from typing import Tuple

import yaml

from psanet import interrupts
from psanet.compat import parse_version
from psanet.contract import DEPLOY_SECTION, get_image_list
from psanet.errors import ConfigError, is_integer
from psanet.files import write_file_whole
from psanet.log import get_logger

from .processing import preprocess

__all__ = ['INT8_FILE', 'Int8Recipe', 'DEFAULT_RECIPE', 'QUANTIZE_INSTALL',
           'check_quantize_tools', 'check_calib_images', 'classifier_nodes', 'stem_nodes',
           'quantize_export']

INT8_FILE = 'model_int8.onnx'
CALIBRATIONS = ('minmax', 'entropy', 'percentile')


@dataclass(frozen=True)
class Int8Recipe:
    """What ``model_int8.onnx`` quantises, and how.

    Args:
        calibration (str, optional): How an activation's range is set from the calibration
            images: 'minmax' (the smallest and largest value seen), 'entropy' (the range
            whose 8-bit histogram keeps the most information, KL divergence) or
            'percentile' (the 99.999th percentile of the magnitudes). Default: 'minmax'.
        per_channel (bool, optional): One weight scale per output channel, else one per
            tensor. Default: True.
        op_types (tuple, optional): The ONNX operator types quantised; the others stay
            float. 'Conv' alone keeps the PSA attention (the mask op's Gather, the
            Softmax, the aggregation MatMul), the resizes and the additions float.
            Default: ('Conv',).
        float_classifier (bool, optional): The classifier (the convolutions that reach the
            output through no other convolution) stays float. Default: False.
        float_stem (bool, optional): The first convolutions (those the input reaches through
            no other convolution) stay float. Default: False.
        reduce_range (bool, optional): 7-bit weights: no int16 overflow in the U8S8
            multiply-adds of CPUs without VNNI, at half the weight resolution.
            Default: False.
    """
    calibration: str = 'minmax'
    per_channel: bool = True
    op_types: Tuple[str, ...] = ('Conv',)
    float_classifier: bool = False
    float_stem: bool = False
    reduce_range: bool = False

    def __post_init__(self):
        if self.calibration not in CALIBRATIONS:
            raise ConfigError(f'the INT8 calibration must be one of {CALIBRATIONS}, got '
                              f'{self.calibration!r}.')
        object.__setattr__(self, 'op_types', tuple(self.op_types))
        if not self.op_types:
            raise ConfigError('an INT8 recipe quantises at least one operator type, got none.')

    def describe(self):
        """One line: e.g. 'Conv INT8, per-channel weights, minmax calibration'."""
        floats = [name for name, on in (('the first conv', self.float_stem),
                                        ('the classifier', self.float_classifier)) if on]
        return (f'{"+".join(self.op_types)} INT8'
                + (f' but {" and ".join(floats)}' if floats else '') +
                f', per-{"channel" if self.per_channel else "tensor"} '
                f'{"7" if self.reduce_range else "8"}-bit weights, {self.calibration} '
                'calibration')

    def as_dict(self):
        """What deploy.yaml records under ``int8_calibration`` (with the image count)."""
        return {'ops': list(self.op_types), 'calibration': self.calibration,
                'per_channel': self.per_channel, 'float_classifier': self.float_classifier,
                'float_stem': self.float_stem, 'reduce_range': self.reduce_range}


# The best measured on the trained mini model (docs/deploy.md, "INT8 on the CPU").
DEFAULT_RECIPE = Int8Recipe(float_stem=True, float_classifier=True)
QUANTIZE_INSTALL = 'pip install onnxruntime onnx ml_dtypes'
MIN_ONNXRUNTIME = (1, 32)  # the quantiser tested here


def quantiser_too_old():
    """'onnxruntime <version>' when the installed onnxruntime is older than the quantiser
    tested here, else None: 1.19 cannot calibrate PSANet's graph ("Only an existing tensor
    can be modified"), and 1.23's INT8 model gave different pixels in two sessions."""
    from importlib import metadata
    try:
        version = metadata.version('onnxruntime')
    except metadata.PackageNotFoundError:
        return None
    return f'onnxruntime {version}' if parse_version(version) < MIN_ONNXRUNTIME else None


def check_quantize_tools():
    """Raises ConfigError naming what to install when onnxruntime's quantiser cannot load."""
    missing = [name for name in ('onnxruntime', 'onnx', 'ml_dtypes')
               if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f'--quantize int8 needs {", ".join(missing)}, not installed: '
                          f'{QUANTIZE_INSTALL}')
    old = quantiser_too_old()
    if old is not None:
        raise ConfigError(f'--quantize int8 needs onnxruntime>='
                          f'{".".join(map(str, MIN_ONNXRUNTIME))} (Python 3.11 or newer), '
                          f'found {old}: pip install -U onnxruntime')


def check_calib_images(calib_images, calib_num):
    """The first ``calib_num`` image paths of ``calib_images`` (a folder, image or list)."""
    if not is_integer(calib_num, 1):
        raise ConfigError(f'--calib_num must be an integer >= 1, got {calib_num!r}.')
    if not calib_images or not os.path.exists(calib_images):
        raise ConfigError(f'--quantize int8 needs calibration images: --calib_images '
                          f'{calib_images} does not exist; pass a folder of images like the '
                          'ones the model will see (e.g. the val images).')
    images = get_image_list(calib_images, flag='--calib_images')
    return [path for path, _ in images][:calib_num]


class _CalibrationReader:
    """Feeds onnxruntime's calibrator one preprocessed image at a time."""

    def __init__(self, paths, transforms, input_name):
        self._batches = (preprocess([path], transforms)[0] for path in paths)
        self._input_name = input_name

    def get_next(self):
        interrupts.raise_if_requested()  # a boundary: one calibration image
        batch = next(self._batches, None)
        return None if batch is None else {self._input_name: batch}


def classifier_nodes(graph):
    """Names of the Conv nodes of an ONNX graph from which an output is reached through no
    other Conv: the classifier (the head's last 1x1 convolution, in PSANet)."""
    producers = {out: node for node in graph.node for out in node.output}
    return _nearest_convs([output.name for output in graph.output],
                          lambda name: [producers[name]] if name in producers else [],
                          lambda node: node.input)


def stem_nodes(graph):
    """Names of the Conv nodes of an ONNX graph that an input reaches through no other Conv:
    the first convolution of the backbone."""
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return _nearest_convs([value.name for value in graph.input],
                          lambda name: consumers.get(name, []), lambda node: node.output)


def _nearest_convs(start, nodes_of, onward):
    """The Conv nodes met first walking from the tensors ``start``: ``nodes_of(tensor)`` are
    the nodes one step on, ``onward(node)`` the tensors after a node that is not a Conv."""
    found, seen = [], set()
    stack = list(start)
    while stack:
        for node in nodes_of(stack.pop()):
            if node.name in seen:
                continue
            seen.add(node.name)
            if node.op_type == 'Conv':
                found.append(node.name)
            else:
                stack.extend(onward(node))
    return sorted(found)


def quantize_export(deploy, calib_images, calib_paths, logger=None, recipe=DEFAULT_RECIPE):
    """Writes ``model_int8.onnx`` for the export ``deploy`` and names it in its deploy.yaml.

    Args:
        deploy (DeployConfig): An export made with ``--psa_impl paddle --onnx``.
        calib_images (str): Where the calibration images are (a folder, an image or a list
            file), for the log.
        calib_paths (list[str]): The calibration images, as :func:`check_calib_images`
            lists them.
        logger (logging.Logger, optional): Default: the 'psanet' logger.
        recipe (Int8Recipe, optional): What is quantised and how. Default: DEFAULT_RECIPE.

    Returns:
        str: the path of the INT8 model.
    """
    logger = logger or get_logger()
    check_quantize_tools()
    if deploy.onnx is None:
        raise ConfigError('--quantize int8 quantises model.onnx: add --psa_impl paddle --onnx.')
    import onnx
    from onnxruntime.quantization import (CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process
    target = os.path.join(deploy.dir, INT8_FILE)
    folded = target + '.folded'
    input_name = onnx.load(deploy.onnx, load_external_data=False).graph.input[0].name
    logger.info(f'Quantising {os.path.basename(deploy.onnx)} to INT8 ({recipe.describe()}) '
                f'with {len(calib_paths)} calibration images from {calib_images} ...')
    method = {'minmax': CalibrationMethod.MinMax, 'entropy': CalibrationMethod.Entropy,
              'percentile': CalibrationMethod.Percentile}[recipe.calibration]

    def quantize(partial):
        graph = onnx.load(folded, load_external_data=False).graph
        excluded = ((classifier_nodes(graph) if recipe.float_classifier else []) +
                    (stem_nodes(graph) if recipe.float_stem else []))
        quantize_static(folded, partial,
                        _CalibrationReader(calib_paths, deploy.build_transforms(), input_name),
                        quant_format=QuantFormat.QDQ, per_channel=recipe.per_channel,
                        reduce_range=recipe.reduce_range,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        op_types_to_quantize=list(recipe.op_types), nodes_to_exclude=excluded,
                        calibrate_method=method)
        interrupts.raise_if_requested()  # before the INT8 model is named: the export stays

    try:
        # paddle2onnx writes the weights as Constant nodes and BatchNorm apart from each
        # convolution; onnxruntime's optimiser folds both, so that the quantiser sees each
        # convolution's own weight (quantised per channel, not per tensor at run time).
        quant_pre_process(deploy.onnx, folded, skip_symbolic_shape=True)
        write_file_whole(target, quantize)
    finally:
        if os.path.exists(folded):
            os.remove(folded)
    _name_in_deploy_yaml(deploy, {'onnx_int8': INT8_FILE,
                                  'int8_calibration': {'images': len(calib_paths),
                                                       **recipe.as_dict()}})
    logger.info(f'Wrote {INT8_FILE}.')
    return target


def _name_in_deploy_yaml(deploy, entries):
    with open(deploy.path) as f:
        dic = yaml.safe_load(f)
    dic[DEPLOY_SECTION].update(entries)

    def write(partial):
        with open(partial, 'w') as f:
            yaml.safe_dump(dic, f, sort_keys=False)

    write_file_whole(deploy.path, write)
