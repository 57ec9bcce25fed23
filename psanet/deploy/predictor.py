"""Paddle Inference predictors (and onnxruntime sessions) for an exported PSANet.

``PredictorOptions`` holds deploy/python/infer.py's predictor flags, checked once, and
this module the defaults infer.py and ``psanet.Segmenter.from_export`` share;
``create_predictor`` registers the psa_mask op library first when the graph holds
the custom op, and sets oneDNN on or off explicitly; the runners run a batch and
check it against the export's input shape. Why, and the Paddle workarounds
(``psanet.compat.configure_inference``): docs/deploy.md.
"""
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from psanet import compat
from psanet.contract import INPUT_NAME
from psanet.errors import DeployError, is_integer
from psanet.log import get_logger

from .deploy_config import check_params_file

__all__ = ['PredictorOptions', 'create_predictor', 'PaddleRunner', 'OnnxRunner', 'load_custom_op',
           'PRECISIONS', 'DEFAULT_DEVICE', 'DEFAULT_CPU_THREADS', 'INFER_ENABLE_MKLDNN',
           'API_ENABLE_MKLDNN', 'usable_cpus', 'default_cpu_threads']

# fp16 and int8 run in TensorRT on the GPU, int8 also as an export's INT8 ONNX model; the
# dygraph model runs the first two (psanet.core.options.DYGRAPH_PRECISIONS).
PRECISIONS = ('fp32', 'fp16', 'int8')
# The defaults of infer.py's flags and of the API's from_export: one place for both.
DEFAULT_DEVICE = 'cpu'
# PaddleSeg's --cpu_threads, cut to the CPUs this process may use (default_cpu_threads).
DEFAULT_CPU_THREADS = 10
# oneDNN: infer.py keeps PaddleSeg's --enable_mkldnn False, so that a PaddleSeg command line
# runs the same; the API, which has no PaddleSeg counterpart, runs it (1.6x faster on the CPU,
# docs/deploy.md).
INFER_ENABLE_MKLDNN = False
API_ENABLE_MKLDNN = True


def usable_cpus():
    """The CPUs this process may run on."""
    if hasattr(os, 'sched_getaffinity'):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_cpu_threads():
    """``cpu_threads`` when not given: PaddleSeg's 10, or the usable CPUs when fewer."""
    return min(DEFAULT_CPU_THREADS, usable_cpus())


def load_custom_op():
    """Registers the psa_mask op library, or raises DeployError saying how to get it."""
    from psanet.ops.library import load_library
    try:
        return load_library()
    except Exception as error:  # a failed build or a library Paddle cannot load
        raise DeployError(
            f'the model holds the custom psa_mask op, and its library could not be loaded: '
            f'{error}. Build it (`pip install --no-build-isolation .`, or let psanet.ops '
            f'JIT-build it with a C++ compiler on PATH), or export the model with '
            f'`--psa_impl paddle`, which needs no op library.') from error


@dataclass(frozen=True)
class PredictorOptions:
    """How a predictor runs: deploy/python/infer.py's predictor flags, checked once.

    Args:
        device (str): 'cpu' or 'gpu'. Default: 'cpu' (``DEFAULT_DEVICE``).
        use_trt (bool): TensorRT subgraphs on the GPU. Default: False.
        precision (str): 'fp32', or 'fp16' with TensorRT on the GPU ('int8' is refused:
            an export is fp32; its INT8 model runs in an ONNX backend). Default: 'fp32'.
        enable_mkldnn (bool): run the CPU graph's convolutions in oneDNN; False turns it
            off explicitly (Paddle Inference's CPU default is on). Default: False
            (``INFER_ENABLE_MKLDNN``, infer.py's).
        cpu_threads (int): math library threads on the CPU (onnxruntime's intra-op
            threads), at most the cores this process may use (more are cut down, with a
            warning); None: :func:`default_cpu_threads`. Default: None.
        print_detail (bool): keep Paddle's glog output. Default: False.

    Raises:
        DeployError: for a value, or a combination, that cannot work, naming the flag.
    """
    device: str = DEFAULT_DEVICE
    use_trt: bool = False
    precision: str = 'fp32'
    enable_mkldnn: bool = INFER_ENABLE_MKLDNN
    cpu_threads: Optional[int] = None
    print_detail: bool = False

    def __post_init__(self):
        if self.cpu_threads is None:
            object.__setattr__(self, 'cpu_threads', default_cpu_threads())
        if self.device not in ('cpu', 'gpu'):
            raise DeployError(f"--device must be 'cpu' or 'gpu', got {self.device!r}.")
        if self.precision not in PRECISIONS:
            raise DeployError(f'--precision must be one of {PRECISIONS}, got '
                              f'{self.precision!r}.')
        if self.device == 'cpu':
            if self.use_trt:
                raise DeployError('--use_trt needs --device gpu.')
            if self.precision != 'fp32':
                raise DeployError(f'the CPU predictor runs fp32 only, got --precision '
                                  f'{self.precision}; use --precision fp32 (fp16 needs '
                                  '--device gpu --use_trt True; the INT8 model runs with '
                                  '--backend onnxruntime or openvino).')
            if not is_integer(self.cpu_threads, 1):
                raise DeployError(f'--cpu_threads must be an integer >= 1, got '
                                  f'{self.cpu_threads!r}.')
            cores = usable_cpus()
            if int(self.cpu_threads) > cores:
                # More threads than cores only slows the math library; far more aborts OpenMP.
                get_logger().warning(f'--cpu_threads {self.cpu_threads} is more than the '
                                     f'{cores} cores this process may use: using {cores}.')
                object.__setattr__(self, 'cpu_threads', cores)
        else:
            if not self.use_trt and self.precision != 'fp32':
                raise DeployError(f'--precision {self.precision} on the GPU needs --use_trt '
                                  'True.')
            if self.precision == 'int8':
                raise DeployError('--precision int8 needs a quantised model; this export is '
                                  'fp32.')
        object.__setattr__(self, 'cpu_threads', int(self.cpu_threads))


def create_predictor(deploy, options=None):
    """A ``paddle.inference`` predictor for the model ``deploy`` describes.

    Args:
        deploy (DeployConfig): The export.
        options (PredictorOptions, optional): Default: ``PredictorOptions()`` (CPU, oneDNN
            off, :func:`default_cpu_threads`).

    Returns:
        paddle.inference.Predictor
    """
    from paddle import inference
    options = options or PredictorOptions()
    check_params_file(deploy.params, deploy.model)
    if deploy.holds_custom_op:
        load_custom_op()
    config = inference.Config(deploy.model, deploy.params)
    if not options.print_detail:
        config.disable_glog_info()
    if options.device == 'cpu':
        _configure_cpu(config, options)
    else:
        _configure_gpu(config, deploy, options)
    compat.configure_inference(config)
    try:
        return inference.create_predictor(config)
    except Exception as error:
        raise DeployError(f'creating the Paddle Inference predictor from {deploy.model} and '
                          f'{deploy.params} failed: {_error_summary(error)}. If the files were '
                          f'copied or edited, export the model again with export.py.') from error


def _configure_cpu(config, options):
    config.disable_gpu()
    config.set_cpu_math_library_num_threads(options.cpu_threads)
    if options.enable_mkldnn:
        config.enable_mkldnn()
        # A few input sizes each get their own oneDNN primitives; bound the cache.
        config.set_mkldnn_cache_capacity(10)
        if compat.ONEDNN_PLACEMENT.needed():
            get_logger().info('oneDNN on for the fused convolutions; its op placement pass is '
                              'off (this Paddle cannot run a saved bilinear_interp in oneDNN, '
                              f'{compat.ONEDNN_PLACEMENT.issue}).')
    else:
        config.disable_mkldnn()


def _configure_gpu(config, deploy, options):
    import paddle
    from paddle.inference import PrecisionType
    if not paddle.is_compiled_with_cuda():
        raise DeployError('--device gpu needs paddlepaddle-gpu; this Paddle is a CPU build. '
                          'Use --device cpu or install paddlepaddle-gpu.')
    config.enable_use_gpu(256, 0)
    if options.use_trt:
        mode = PrecisionType.Half if options.precision == 'fp16' else PrecisionType.Float32
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
        deploy (DeployConfig): The export.
        options (PredictorOptions, optional): Default: ``PredictorOptions()``.
    """

    def __init__(self, deploy, options=None):
        self.deploy = deploy
        self.predictor = create_predictor(deploy, options)
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
        deploy (DeployConfig): The export, made with ``--psa_impl paddle --onnx``.
        options (PredictorOptions, optional): Its ``cpu_threads`` are onnxruntime's
            intra-op threads; the rest is Paddle Inference's. Default: ``PredictorOptions()``.
    """

    def __init__(self, deploy, options=None):
        options = options or PredictorOptions()
        self.deploy = deploy
        path = deploy.onnx
        if path is None or not os.path.isfile(path):
            raise DeployError(f'{self.deploy.path} names no model.onnx; export with '
                              f'`--psa_impl paddle --onnx`.')
        try:
            import onnxruntime
        except ImportError as error:
            raise DeployError('running model.onnx needs onnxruntime: '
                              'pip install onnxruntime') from error
        session_options = onnxruntime.SessionOptions()
        session_options.intra_op_num_threads = options.cpu_threads
        session_options.inter_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(path, session_options,
                                                    providers=['CPUExecutionProvider'])
        self._input_name = self.session.get_inputs()[0].name

    def run(self, batch):
        _check_batch(batch, self.deploy.input_shape, self.deploy.onnx)
        batch = np.ascontiguousarray(batch, dtype='float32')
        return self.session.run(None, {self._input_name: batch})[0]
