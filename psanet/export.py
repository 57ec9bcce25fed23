"""Exports a trained PSANet for deployment: ``model.json`` + ``model.pdiparams`` for Paddle
Inference, optionally ``model.onnx``, and the ``deploy.yaml`` that names them.

The build side of deployment: it imports the models, the engine and the deploy package's
runners to check what it wrote against the dygraph model; in the package only
``Segmenter.from_config`` imports it, when called. Output ops, op forms and PaddleSeg's
contract: docs/deploy.md.
"""
import contextlib
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

import numpy as np
import paddle
import yaml
from paddleseg.deploy.export import WrappedModel

from psanet import interrupts
from psanet.compat import ORT_UNUSED_INITIALIZER, PIR_OUT_TENSOR, keep_forward
from psanet.contract import (DEFAULT_TRANSFORMS, DEPLOY_FILE, DEPLOY_SECTION, DYNAMIC_INPUT_SHAPE,
                             INPUT_NAME, MIN_INPUT_SIZE, ONNX_FILE, OUTPUT_OPS, PALETTES,
                             PARAMS_FILE, PROGRAM_FILE, get_image_list, palette_for)
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.weights import load_model_weights
from psanet.deploy.deploy_config import DeployConfig
from psanet.deploy.attention_memory import ATTENTION_MEMORY, AttentionCost
from psanet.deploy.predictor import PredictorOptions
from psanet.deploy.processing import preprocess
from psanet.deploy.backends import create_runner
from psanet.deploy.quantize import (INT8_FILE, check_calib_images, check_quantize_tools,
                                    quantize_export)
from psanet.errors import ConfigError
from psanet.files import check_save_dir, write_folder
from psanet.log import get_logger, without_stderr_lines
from psanet.models import PSANet
from psanet.ops import psa_impl as use_psa_impl
from psanet.ops.psa_mask import _IMPLS as PSA_IMPLS

__all__ = ['ExportOptions', 'exported_layer', 'export_model', 'export_onnx', 'export_from_config',
           'check_export_dir', 'parse_input_shape', 'compare_with_dygraph',
           'onnx_tools_installed']

ONNX_OPSET = 13


def exported_layer(model, output_op):
    """The layer whose graph is saved: ``model`` (in eval mode: the main logit only) followed by
    the output op, 'argmax' or 'softmax' as PaddleSeg's export.py builds it
    (``paddleseg.deploy.export.WrappedModel``), or 'none' (``model`` itself)."""
    return model if output_op == 'none' else WrappedModel(model, output_op)


def parse_input_shape(input_shape):
    """``--input_shape`` (four ints or strings) -> ``[N, 3, H, W]`` with -1 for a dynamic
    dimension (None, 'None' or -1); None as a whole means ``[-1, 3, -1, -1]``."""
    if input_shape is None:
        return list(DYNAMIC_INPUT_SHAPE)
    shape = []
    for value in input_shape:
        if value is None or str(value).lower() in ('none', '-1'):
            shape.append(-1)
            continue
        try:
            size = int(value)
        except (TypeError, ValueError):
            size = 0
        if size < 1:
            shape = None
            break
        shape.append(size)
    if shape is None or len(shape) != 4 or shape[1] != 3:
        raise ConfigError(f'--input_shape must be N 3 H W, each a positive int or None '
                          f'(dynamic), e.g. `--input_shape 1 3 512 1024`; got {input_shape}.')
    return shape


@dataclass(frozen=True)
class ExportOptions:
    """What an export writes: export.py's flags (their help says what each means) and the
    palette ('cityscapes' or 'default', :func:`psanet.contract.palette_for`), checked once;
    a bad one is a ConfigError naming its flag. ``input_shape`` is kept as the int tuple
    :func:`parse_input_shape` makes of it; ``calib_paths``: with ``quantize``, the first
    ``calib_num`` images of ``calib_images``, listed once here."""
    input_shape: Optional[Sequence] = None
    output_op: str = 'argmax'
    psa_impl: str = 'custom'
    onnx: bool = False
    palette: str = 'default'
    quantize: Optional[str] = None
    calib_images: Optional[str] = None
    calib_num: int = 32
    calib_paths: Tuple[str, ...] = field(init=False, default=())

    def __post_init__(self):
        for name, value, choices in (('--output_op', self.output_op, OUTPUT_OPS),
                                     ('--psa_impl', self.psa_impl, PSA_IMPLS),
                                     ('palette', self.palette, PALETTES)):
            if value not in choices:
                raise ConfigError(f'{name} must be one of {choices}, got {value!r}.')
        if self.onnx and self.psa_impl != 'paddle':
            raise ConfigError('--onnx needs the pure-Paddle op: add --psa_impl paddle '
                              '(paddle2onnx cannot convert custom operators).')
        # The flags' own mistakes before what this environment lacks.
        if self.quantize is None and self.calib_images is not None:
            raise ConfigError('--calib_images calibrates --quantize int8, which is not given: add '
                              '--quantize int8 (with --psa_impl paddle --onnx), or drop '
                              '--calib_images.')
        if self.onnx:
            _check_onnx_tools()
        if self.quantize is not None:
            if self.quantize != 'int8':
                raise ConfigError(f"--quantize must be int8, got {self.quantize!r}.")
            if not self.onnx:
                raise ConfigError('--quantize int8 quantises model.onnx: add --psa_impl paddle '
                                  '--onnx.')
            check_quantize_tools()
            object.__setattr__(self, 'calib_paths',
                               tuple(check_calib_images(self.calib_images, self.calib_num)))
        object.__setattr__(self, 'input_shape', tuple(parse_input_shape(self.input_shape)))


ONNX_INSTALL = 'pip install paddle2onnx onnxruntime'


def onnx_tools_installed():
    """True when paddle2onnx and onnxruntime can be imported (looked up, not imported)."""
    import importlib.util
    return all(importlib.util.find_spec(name) is not None
               for name in ('paddle2onnx', 'onnxruntime'))


def _check_onnx_tools():
    """--onnx needs paddle2onnx (and onnxruntime for the check): refused before any work."""
    import importlib.util
    missing = [name for name in ('paddle2onnx', 'onnxruntime')
               if importlib.util.find_spec(name) is None]
    if missing:
        verb = 'is' if len(missing) == 1 else 'are'
        raise ConfigError(f'--onnx needs {" and ".join(missing)}, which {verb} not installed: '
                          f'{ONNX_INSTALL} (paddle2onnx has no wheels for Python 3.13 yet), '
                          'or export without --onnx.')
    try:
        import paddle2onnx  # noqa: F401  (installed is not enough: it must import)
    except Exception as error:  # a broken install raises anything
        raise ConfigError(f'--onnx needs paddle2onnx, which is installed but fails to import '
                          f'({type(error).__name__}: {error}): pip install --force-reinstall '
                          'paddle2onnx, or export without --onnx.') from None


def export_model(model, val_transforms, save_dir, options=None, num_classes=None):
    """Saves ``model`` for deployment as ``options`` say; returns the path of ``deploy.yaml``.

    The files are written into a hidden folder beside ``save_dir`` that replaces it once
    complete, so a failed export leaves the previous one whole. Every entry of the old folder
    that is not an export file stays (hidden ones and folders included); its old export files
    go, so the folder holds what deploy.yaml names.
    """
    options = options or ExportOptions()
    check_export_dir(save_dir)
    write_folder(save_dir, lambda folder: _write_export(
        model, val_transforms, folder, options, num_classes),
        carry_over=lambda name: name not in EXPORT_FILES)
    return os.path.join(save_dir, DEPLOY_FILE)


EXPORT_FILES = (PROGRAM_FILE, PARAMS_FILE, ONNX_FILE, INT8_FILE, DEPLOY_FILE)


def check_export_dir(save_dir, flag='--save_dir'):
    """Raises ConfigError unless ``save_dir`` can be an export folder: one this process can
    write, and one that can be renamed, as the swap of a finished export does (not the
    current folder nor a mount point, such as a Docker volume), and one whose files of an
    export's names belong to an export (a deploy.yaml with a ``Deploy:`` section naming
    model and params): the user's own deploy.yaml is never replaced. Nothing is created."""
    check_save_dir(save_dir, flag)
    path = os.path.abspath(save_dir)
    if os.path.isdir(path):
        taken = [name for name in EXPORT_FILES if os.path.lexists(os.path.join(path, name))]
        if taken and not _is_export_deploy_file(os.path.join(path, DEPLOY_FILE)):
            raise ConfigError(f'{flag} {save_dir} holds {", ".join(taken)} of no export '
                              f'(no {DEPLOY_FILE} with a `{DEPLOY_SECTION}:` section naming model '
                              'and params): an export would replace them; pass a new or empty '
                              'folder, or move those files away.')
    if os.path.isdir(path) and (os.path.ismount(path) or path == os.getcwd()):
        what = 'the current folder' if path == os.getcwd() else 'a mount point'
        raise ConfigError(f'--save_dir {save_dir} is {what}, which cannot be renamed: an export '
                          'is written beside its folder and swapped in whole; pass a folder '
                          f'below it, e.g. {os.path.join(save_dir, "inference_model")}.')


def _is_export_deploy_file(path):
    """True when ``path`` is a deploy.yaml an export wrote: YAML whose ``Deploy:`` section
    names the model and its parameters."""
    try:
        with open(path, 'rb') as f:
            dic = yaml.safe_load(f.read().decode('utf-8'))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    section = dic.get(DEPLOY_SECTION) if isinstance(dic, dict) else None
    return isinstance(section, dict) and 'model' in section and 'params' in section


def _write_export(model, val_transforms, save_dir, options, num_classes):
    was_training = model.training
    wrapped = exported_layer(model, options.output_op)
    wrapped.eval()
    spec = [paddle.static.InputSpec([None if s < 0 else s for s in options.input_shape],
                                    'float32', INPUT_NAME)]
    try:
        with use_psa_impl(options.psa_impl), keep_forward(model), \
                without_stderr_lines(PIR_OUT_TENSOR), _zero_bias_on_lone_convolutions(model):
            # paddle.jit.save names its files <prefix>.json and <prefix>.pdiparams.
            paddle.jit.save(wrapped, os.path.join(save_dir, os.path.splitext(PROGRAM_FILE)[0]),
                            input_spec=spec)
    finally:
        if was_training:
            model.train()
    for name in (PROGRAM_FILE, PARAMS_FILE):
        if not os.path.isfile(os.path.join(save_dir, name)):
            raise RuntimeError(f'paddle.jit.save did not write {name} in {save_dir}; '
                               f'found {sorted(os.listdir(save_dir))}.')
    deploy = {
        'model': PROGRAM_FILE,
        'params': PARAMS_FILE,
        'transforms': [dict(t) for t in val_transforms],
        'input_shape': list(options.input_shape),
        'output_op': options.output_op,
        'output_dtype': 'int32' if options.output_op == 'argmax' else 'float32',
        'psa_impl': options.psa_impl,
        'palette': options.palette,
    }
    if num_classes is not None:
        deploy['num_classes'] = int(num_classes)
    plan = model.attention_memory(64, 64) if isinstance(model, PSANet) else None
    if plan is not None:  # Pipeline.run checks each input against the memory before it runs
        deploy[ATTENTION_MEMORY] = {key: int(value) for key, value in
                                    AttentionCost.of(plan)._asdict().items()}
    smallest = model.min_input_size() if isinstance(model, PSANet) else None
    if smallest is not None:  # Pipeline.preprocess refuses a smaller input in every backend
        deploy[MIN_INPUT_SIZE] = int(smallest)
    if options.onnx:
        export_onnx(save_dir)
        deploy['onnx'] = ONNX_FILE
    interrupts.raise_if_requested()  # before deploy.yaml: the old export stays whole
    with open(os.path.join(save_dir, DEPLOY_FILE), 'w') as f:
        yaml.safe_dump({DEPLOY_SECTION: deploy}, f, sort_keys=False)
    if options.quantize:
        with without_stderr_lines(ORT_UNUSED_INITIALIZER):
            quantize_export(DeployConfig(save_dir), options.calib_images,
                            list(options.calib_paths))


BATCH_NORMS = (paddle.nn.BatchNorm, paddle.nn.BatchNorm2D, paddle.nn.SyncBatchNorm)


@contextlib.contextmanager
def _zero_bias_on_lone_convolutions(model):
    """Gives each bias-free convolution that no batch norm follows a zero bias while the model
    is saved (the weights file then holds it), and takes it away after.

    Paddle Inference with oneDNN runs a convolution in oneDNN only where one of its fusion
    passes rewrites it (its placement pass stays off, psanet.compat's ONEDNN_PLACEMENT);
    a convolution with neither a bias nor a batch norm after it (PSA's attention
    convolution, 512 -> 59 x 59 channels in R50) matches none and ran in Paddle's plain
    CPU kernel, 5% of the R50 model's time at 512x256 (docs/deploy.md). With a bias,
    ``conv2d_bias_fuse_pass`` takes it. Adding 0.0 changes no value. A convolution
    counts as followed by a batch norm when the next layer of its parent is one, as in
    every conv-BN block of paddleseg's layers and backbones.
    """
    added = []
    for parent in model.sublayers(include_self=True):
        children = list(parent.children())
        for conv, after in zip(children, children[1:] + [None]):
            if isinstance(conv, paddle.nn.Conv2D) and conv.bias is None and \
                    not isinstance(after, BATCH_NORMS):
                conv.bias = conv.create_parameter(
                    [conv.weight.shape[0]], is_bias=True,
                    default_initializer=paddle.nn.initializer.Constant(0.0))
                added.append(conv)
    try:
        yield
    finally:
        for conv in added:
            conv.bias = None


def export_onnx(save_dir):
    """Converts the saved pure-Paddle model in ``save_dir`` to ``model.onnx``."""
    _check_onnx_tools()
    import paddle2onnx
    target = os.path.join(save_dir, ONNX_FILE)
    # Returned rather than saved: paddle2onnx would log the path inside the hidden folder
    # the export is written in before it is renamed into place.
    model = paddle2onnx.export(os.path.join(save_dir, PROGRAM_FILE),
                               os.path.join(save_dir, PARAMS_FILE), save_file=None,
                               opset_version=ONNX_OPSET, enable_onnx_checker=True,
                               optimize_tool='None')
    if not model:
        raise RuntimeError(f'paddle2onnx returned no model for {save_dir}.')
    with open(target, 'wb') as f:
        f.write(model)
    return target


def export_from_config(config, model_path, save_dir='output/inference_model',
                       check_image_path=None, opts=None, **flags):
    """export.py (its flags by name; the palette follows the config's val dataset): builds the
    model, loads ``model_path`` (None: the initial weights, with a warning, as PaddleSeg's
    export.py) and exports it; ``check_image_path`` images also run through the dygraph model
    and the export, logging how far they agree. Returns the path of deploy.yaml."""
    logger = get_logger()
    cfg = load_config(config, opts=opts)
    builder = ComponentBuilder(cfg, weights_follow=bool(model_path))
    val_class = builder.val_dataset_class if cfg.dic.get('val_dataset') else None
    # Checked before the model is built and loaded.
    options = ExportOptions(**flags, palette=palette_for(val_class))
    check_export_dir(save_dir)
    if check_image_path:
        get_image_list(check_image_path, flag='--check_image_path')
    paddle.set_device('cpu')
    model = builder.model
    if model_path:
        logger.info(f'Loaded weights {load_model_weights(model, model_path)}')
    else:
        logger.warning('No --model_path: exporting the initial (untrained) weights.')
    val_transforms = (cfg.dic.get('val_dataset') or {}).get('transforms') or \
        DEFAULT_TRANSFORMS
    path = export_model(model, val_transforms, save_dir, options,
                        getattr(model, 'num_classes', None))
    logger.info(f'Exported the model ({options.psa_impl} psa_mask, input '
                f'{list(options.input_shape)}, output {options.output_op}) to {save_dir}; '
                f'deploy config {path}.')
    if check_image_path:
        _check_export(model, path, check_image_path, logger)
    return path


def _check_export(model, deploy_path, image_path, logger):
    images = [path for path, _ in get_image_list(image_path, flag='--check_image_path')]
    checks = [('Paddle Inference, CPU, oneDNN off', 'paddle', False, False),
              ('Paddle Inference, CPU, oneDNN on', 'paddle', True, False)]
    deploy = DeployConfig(deploy_path)
    if deploy.onnx:
        checks.append(('onnxruntime, CPU', 'onnxruntime', False, False))
    if deploy.onnx_int8:
        checks.append(('INT8, onnxruntime, CPU', 'onnxruntime', False, True))
    for name, backend, enable_mkldnn, int8 in checks:
        result = compare_with_dygraph(model, deploy, images,
                                      PredictorOptions(enable_mkldnn=enable_mkldnn), backend, int8)
        diff = '' if result['max_abs_diff'] is None else \
            f', max |output - dygraph| {result["max_abs_diff"]:.1e}'
        logger.info(f'Exported model ({name}) vs dygraph on {result["images"]} images: '
                    f'{result["pixel_agreement"] * 100:.3f}% of pixels agree{diff}.')


def compare_with_dygraph(model, deploy, image_paths, options=None, backend='paddle', int8=False):
    """Runs ``image_paths`` (preprocessed with the export's transforms) through ``model`` and the
    export ``deploy`` describes, on ``backend`` ('paddle', 'onnxruntime' or 'openvino').

    Returns:
        dict: ``images``; ``pixel_agreement``, the fraction of pixels whose class is the same;
        ``max_abs_diff``, the largest difference of the exported output from the dygraph logits
        (or their softmax), None for an argmax export.
    """
    runner = create_runner(deploy, backend, options, int8=int8)
    transforms = deploy.build_transforms()
    was_training = model.training
    model.eval()
    agree, total, max_diff = 0, 0, 0.0
    try:
        for path in image_paths:
            batch, _, _ = preprocess([path], transforms)
            with paddle.no_grad():
                logit = model(paddle.to_tensor(batch))[0].numpy()
            exported = runner.run(batch)
            if deploy.output_op == 'argmax':
                labels = exported
            else:
                labels = exported.argmax(1)
                want = logit
                if deploy.output_op == 'softmax':
                    e = np.exp(logit - logit.max(1, keepdims=True))
                    want = e / e.sum(1, keepdims=True)
                max_diff = max(max_diff, float(np.abs(exported - want).max()))
            agree += int((labels == logit.argmax(1)).sum())
            total += labels.size
    finally:
        if was_training:
            model.train()
    return {'images': len(image_paths), 'pixel_agreement': agree / max(total, 1),
            'max_abs_diff': None if deploy.output_op == 'argmax' else max_diff}
