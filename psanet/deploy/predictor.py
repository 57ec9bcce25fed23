"""Creates a Paddle Inference predictor (or an onnxruntime session) for an exported PSANet.

Two things make a predictor for this model differ from PaddleSeg's:

* A graph exported with ``psa_impl='custom'`` holds the ``psa_mask`` custom op,
  whose library must be registered in the process before the predictor is
  created; ``create_predictor`` does so (and never for a pure-Paddle graph).
* On the CPU, Paddle Inference turns oneDNN on unless told otherwise, so
  ``enable_mkldnn=False`` calls ``disable_mkldnn()`` explicitly. The Paddle
  version's predictor bugs (memory reuse, oneDNN's op placement pass with a
  saved ``bilinear_interp``) are worked around by
  ``psanet.compat.configure_inference``, where each names its Paddle issue.
  Paddle inserts no layout reorder in front of a custom op, so ``psa_mask``
  may receive a oneDNN-layout tensor; the op reorders it to NCHW itself.
"""
import os

import numpy as np

from psanet import compat
from psanet.contract import INPUT_NAME
from psanet.errors import DeployError
from psanet.log import get_logger

from .config import DeployConfig, check_params_file

__all__ = ['create_predictor', 'PaddleRunner', 'OnnxRunner', 'load_custom_op']

PRECISIONS = ('fp32', 'fp16', 'int8')


def load_custom_op():
    """Registers the psa_mask op library, or raises DeployError saying how to get it."""
    from psanet.ops.loader import load_library
    try:
        return load_library()
    except Exception as error:  # a failed build or a library Paddle cannot load
        raise DeployError(
            f'the model holds the custom psa_mask op, and its library could not be loaded: '
            f'{error}. Build it (`pip install --no-build-isolation .`, or let psanet.ops '
            f'JIT-build it with a C++ compiler on PATH), or export the model with '
            f'`--psa_impl paddle`, which needs no op library.') from error


def create_predictor(deploy, device='cpu', enable_mkldnn=False, cpu_threads=1,
                     use_trt=False, precision='fp32', print_detail=False):
    """A ``paddle.inference`` predictor for the model ``deploy`` describes.

    Args:
        deploy (DeployConfig|str): The deploy config, or the path of deploy.yaml.
        device (str, optional): 'cpu' or 'gpu'. Default: 'cpu'.
        enable_mkldnn (bool, optional): Run the CPU graph's convolutions in oneDNN
            (see the module docstring). Default: False.
        cpu_threads (int, optional): Math library threads on the CPU. Default: 1.
        use_trt (bool, optional): TensorRT subgraphs on the GPU. Default: False.
        precision (str, optional): 'fp32', or 'fp16'/'int8' with TensorRT. Default: 'fp32'.
        print_detail (bool, optional): Keep Paddle's glog output. Default: False.

    Returns:
        paddle.inference.Predictor
    """
    from paddle import inference
    if not isinstance(deploy, DeployConfig):
        deploy = DeployConfig(deploy)
    if device not in ('cpu', 'gpu'):
        raise DeployError(f"--device must be 'cpu' or 'gpu', got {device!r}.")
    if precision not in PRECISIONS:
        raise DeployError(f'--precision must be one of {PRECISIONS}, got {precision!r}.')
    check_params_file(deploy.params)
    if deploy.holds_custom_op:
        load_custom_op()
    config = inference.Config(deploy.model, deploy.params)
    if not print_detail:
        config.disable_glog_info()
    if device == 'cpu':
        _configure_cpu(config, enable_mkldnn, cpu_threads, use_trt, precision)
    else:
        _configure_gpu(config, deploy, use_trt, precision)
    compat.configure_inference(config)
    try:
        return inference.create_predictor(config)
    except Exception as error:
        raise DeployError(f'creating the Paddle Inference predictor from {deploy.model} and '
                          f'{deploy.params} failed: {_error_summary(error)}. If the files were '
                          f'copied or edited, export the model again with export.py.') from error


def _configure_cpu(config, enable_mkldnn, cpu_threads, use_trt, precision):
    if use_trt:
        raise DeployError('--use_trt needs --device gpu.')
    if precision != 'fp32':
        raise DeployError(f'the CPU predictor runs fp32 only, got --precision {precision}; '
                          f'use --precision fp32 (fp16/int8 need --device gpu --use_trt True).')
    if int(cpu_threads) < 1:
        raise DeployError(f'--cpu_threads must be >= 1, got {cpu_threads}.')
    config.disable_gpu()
    config.set_cpu_math_library_num_threads(int(cpu_threads))
    if enable_mkldnn:
        config.enable_mkldnn()
        # A few input sizes each get their own oneDNN primitives; bound the cache.
        config.set_mkldnn_cache_capacity(10)
        if compat.ONEDNN_PLACEMENT.needed():
            get_logger().info('oneDNN on for the fused convolutions; its op placement pass is '
                              'off (this Paddle cannot run a saved bilinear_interp in oneDNN, '
                              f'{compat.ONEDNN_PLACEMENT.issue}).')
    else:
        config.disable_mkldnn()


def _configure_gpu(config, deploy, use_trt, precision):
    import paddle
    from paddle.inference import PrecisionType
    if not paddle.is_compiled_with_cuda():
        raise DeployError('--device gpu needs paddlepaddle-gpu; this Paddle is a CPU build. '
                          'Use --device cpu or install paddlepaddle-gpu.')
    if not use_trt and precision != 'fp32':
        raise DeployError(f'--precision {precision} on the GPU needs --use_trt True.')
    if precision == 'int8':
        raise DeployError('--precision int8 needs a quantised model; this export is fp32.')
    config.enable_use_gpu(256, 0)
    if use_trt:
        mode = PrecisionType.Half if precision == 'fp16' else PrecisionType.Float32
        config.enable_tensorrt_engine(workspace_size=1 << 30, max_batch_size=1,
                                      min_subgraph_size=3, precision_mode=mode,
                                      use_static=False, use_calib_mode=False)
        n, c, h, w = deploy.input_shape
        if min(n, h, w) < 0:
            # TensorRT needs a range for each dynamic dimension: up to 2048x2048,
            # tuned for Cityscapes' 1024x512 halves.
            def shape(height, width):
                return {INPUT_NAME: [n if n > 0 else 1, c, h if h > 0 else height,
                                     w if w > 0 else width]}
            config.set_trt_dynamic_shape_info(shape(64, 64), shape(2048, 2048),
                                              shape(512, 1024))


def _error_summary(error):
    """The line of a Paddle error that says what went wrong, without the C++ trace."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if line.startswith('(') or 'Error:' in line:
            return line
    return lines[0] if lines else repr(error)


def _check_batch(batch, input_shape, where):
    if batch.ndim != 4:
        raise DeployError(f'the model takes a 4-D batch [N, 3, H, W], got {list(batch.shape)}.')
    for axis, (want, got) in enumerate(zip(input_shape, batch.shape)):
        if want > 0 and want != got:
            dim = 'NCHW'[axis]
            fix = ('--batch_size ' + str(want)) if axis == 0 else \
                'images of that size after the val transforms, or a dynamic export ' \
                '(export.py without --input_shape)'
            raise DeployError(f'{where} was exported for input shape {input_shape}, got a batch '
                              f'of shape {list(batch.shape)} ({dim} differs); use {fix}.')


class PaddleRunner:
    """An exported model in Paddle Inference: ``run(batch) -> output``.

    Args:
        deploy (DeployConfig|str): The deploy config or its path.
        **options: ``create_predictor`` options (device, enable_mkldnn, cpu_threads, ...).
    """

    def __init__(self, deploy, **options):
        self.deploy = deploy if isinstance(deploy, DeployConfig) else DeployConfig(deploy)
        self.predictor = create_predictor(self.deploy, **options)
        self._input = self.predictor.get_input_handle(self.predictor.get_input_names()[0])
        self._output = self.predictor.get_output_handle(self.predictor.get_output_names()[0])

    def run(self, batch):
        """float32 ``[N, 3, H, W]`` -> the graph's output as a numpy array."""
        _check_batch(batch, self.deploy.input_shape, self.deploy.model)
        self._input.reshape(list(batch.shape))
        self._input.copy_from_cpu(np.ascontiguousarray(batch, dtype='float32'))
        try:
            self.predictor.run()
        except Exception as error:
            raise DeployError(f'running the predictor failed: {_error_summary(error)}') from error
        return self._output.copy_to_cpu()


class OnnxRunner:
    """An exported model's ``model.onnx`` in onnxruntime on the CPU: ``run(batch) -> output``.

    Args:
        deploy (DeployConfig|str): The deploy config or its path; the export must have
            been made with ``--psa_impl paddle --onnx``.
        cpu_threads (int, optional): onnxruntime intra-op threads. Default: 1.
    """

    def __init__(self, deploy, cpu_threads=1):
        self.deploy = deploy if isinstance(deploy, DeployConfig) else DeployConfig(deploy)
        path = self.deploy.onnx
        if path is None or not os.path.isfile(path):
            raise DeployError(f'{self.deploy.path} names no model.onnx; export with '
                              f'`--psa_impl paddle --onnx`.')
        try:
            import onnxruntime
        except ImportError as error:
            raise DeployError('running model.onnx needs onnxruntime: '
                              'pip install onnxruntime') from error
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = int(cpu_threads)
        options.inter_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(path, options,
                                                    providers=['CPUExecutionProvider'])
        self._input_name = self.session.get_inputs()[0].name

    def run(self, batch):
        _check_batch(batch, self.deploy.input_shape, self.deploy.onnx)
        batch = np.ascontiguousarray(batch, dtype='float32')
        return self.session.run(None, {self._input_name: batch})[0]
