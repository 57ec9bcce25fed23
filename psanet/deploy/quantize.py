"""INT8 post-training quantisation of an export's ``model.onnx`` for the CPU.

onnxruntime's static quantisation (QDQ format, int8 weights per output channel,
uint8 activations with min/max ranges from calibration images run through the val
transforms: the U8S8 pairing, which onnxruntime runs fastest on x86) writes
``model_int8.onnx`` next to ``model.onnx`` and names it in deploy.yaml
(``onnx_int8``). Only the operator types in ``QUANTIZED_OPS`` are quantised: the
convolutions of the backbone and the head; the PSA attention
(the mask gather, softmax and the (HW) x (HW) aggregation), the resizes and the
output stay float. onnxruntime and OpenVINO both run the QDQ model in INT8.
Why this path and its figures: docs/deploy.md ("INT8 on the CPU").
"""
import importlib.util
import os

import yaml

from psanet import interrupts
from psanet.compat import parse_version
from psanet.contract import DEPLOY_SECTION, get_image_list
from psanet.errors import ConfigError
from psanet.files import write_file_whole
from psanet.log import get_logger

from .processing import preprocess

__all__ = ['INT8_FILE', 'QUANTIZED_OPS', 'QUANTIZE_INSTALL', 'check_quantize_tools',
           'check_calib_images', 'quantize_export']

INT8_FILE = 'model_int8.onnx'
QUANTIZED_OPS = ('Conv',)
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
    if int(calib_num) < 1:
        raise ConfigError(f'--calib_num must be >= 1, got {calib_num}.')
    if not calib_images or not os.path.exists(calib_images):
        raise ConfigError(f'--quantize int8 needs calibration images: --calib_images '
                          f'{calib_images} does not exist; pass a folder of images like the '
                          'ones the model will see (e.g. the val images).')
    images = get_image_list(calib_images, flag='--calib_images')
    return [path for path, _ in images][:int(calib_num)]


class _CalibrationReader:
    """Feeds onnxruntime's calibrator one preprocessed image at a time."""

    def __init__(self, paths, transforms, input_name):
        self._batches = (preprocess([path], transforms)[0] for path in paths)
        self._input_name = input_name

    def get_next(self):
        interrupts.raise_if_requested()  # a boundary: one calibration image
        batch = next(self._batches, None)
        return None if batch is None else {self._input_name: batch}


def quantize_export(deploy, calib_images, calib_paths, logger=None):
    """Writes ``model_int8.onnx`` for the export ``deploy`` and names it in its deploy.yaml.

    Args:
        deploy (DeployConfig): An export made with ``--psa_impl paddle --onnx``.
        calib_images (str): Where the calibration images are (a folder, an image or a list
            file), for the log.
        calib_paths (list[str]): The calibration images, as :func:`check_calib_images`
            lists them.
        logger (logging.Logger, optional): Default: the 'psanet' logger.

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
    logger.info(f'Quantising {os.path.basename(deploy.onnx)} to INT8 '
                f'({", ".join(QUANTIZED_OPS)}) with '
                f'{len(calib_paths)} calibration images from {calib_images} ...')

    def quantize(partial):
        quantize_static(folded, partial,
                        _CalibrationReader(calib_paths, deploy.build_transforms(), input_name),
                        quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        op_types_to_quantize=list(QUANTIZED_OPS),
                        calibrate_method=CalibrationMethod.MinMax)
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
                                                       'ops': list(QUANTIZED_OPS)}})
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
