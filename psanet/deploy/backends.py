"""The backends an export runs in, by name, and which one the API picks by default.

``EXPORT_BACKENDS`` names them: 'paddle' (Paddle Inference on ``model.json``),
'onnxruntime' and 'openvino' (on ``model.onnx``, or on the INT8 ``model_int8.onnx``
that :mod:`psanet.deploy.quantize` writes). ``create_runner`` returns an object
with ``run(batch) -> output``; an optional backend that is not installed is named
in one line with the package to install. ``cpu_candidates`` lists the backends
that can run an export on the CPU in the fixed order ``CPU_ORDER`` (``INT8_ORDER``
for the INT8 model), whose first ``default_backend`` returns;
:mod:`psanet.deploy.backend_choice` times the candidates instead (docs/deploy.md,
"Which backend by default").
"""
import importlib.util
import os

import numpy as np

from psanet.errors import DeployError

from .predictor import PaddleRunner, PredictorOptions
from .predictor import _check_batch as check_batch

__all__ = ['EXPORT_BACKENDS', 'PACKAGES', 'CPU_ORDER', 'INT8_ORDER', 'installed',
           'cpu_candidates', 'default_backend', 'create_runner', 'OnnxRuntimeRunner',
           'OpenVinoRunner', 'unreadable_onnx']

EXPORT_BACKENDS = ('paddle', 'onnxruntime', 'openvino')
# The pip package of each optional backend (Paddle Inference comes with paddlepaddle).
PACKAGES = {'onnxruntime': 'onnxruntime', 'openvino': 'openvino'}
# The order without a timing (PSANET_TIME_BACKENDS=0), fastest first as bench/bench_deploy.py
# measured it on the CPU at R50 512x256 (docs/deploy.md): the float model, and the INT8 one.
CPU_ORDER = ('onnxruntime', 'openvino', 'paddle')
INT8_ORDER = ('openvino', 'onnxruntime')


def installed(backend):
    """True when the backend's Python package can be imported (looked up, not imported)."""
    if backend == 'paddle':
        return True
    return importlib.util.find_spec(PACKAGES[backend]) is not None


def _needs_package(backend, what):
    return DeployError(f'{what} needs {backend}, which is not installed: '
                       f'pip install {PACKAGES[backend]}')


def cpu_candidates(deploy, int8=False):
    """The installed backends that can run ``deploy`` on the CPU, in the order ``CPU_ORDER``
    (``INT8_ORDER`` for its INT8 model, with ``int8``): the ONNX backends need
    ``model.onnx`` (or ``model_int8.onnx``); Paddle Inference runs every float export."""
    if int8:
        return [backend for backend in INT8_ORDER
                if deploy.onnx_int8 is not None and installed(backend)]
    return [backend for backend in CPU_ORDER
            if backend == 'paddle' or deploy.onnx is not None and installed(backend)]


def default_backend(deploy, device='cpu', int8=False):
    """The backend an export runs in when none is named and none is timed.

    On the CPU the first of :func:`cpu_candidates`; on the GPU, Paddle Inference.
    """
    if device != 'cpu':
        return 'paddle'
    found = cpu_candidates(deploy, int8)
    if found:
        return found[0]
    if (deploy.onnx_int8 if int8 else deploy.onnx) is None:
        raise DeployError(f'{deploy.path} names no INT8 model; quantise the export first: '
                          'export.py ... --psa_impl paddle --onnx --quantize int8 '
                          '--calib_images <folder>.')
    raise _needs_package('onnxruntime', 'the INT8 model')


def create_runner(deploy, backend, options=None, int8=False):
    """A runner of ``deploy`` in ``backend`` ('paddle', 'onnxruntime' or 'openvino').

    Args:
        deploy (DeployConfig): The export.
        backend (str): One of ``EXPORT_BACKENDS``.
        options (PredictorOptions, optional): device, threads, oneDNN (Paddle Inference).
            Default: ``PredictorOptions()``.
        int8 (bool, optional): Run the quantised ``model_int8.onnx`` (CPU, ONNX backends).
            Default: False.
    """
    options = options or PredictorOptions()
    if backend not in EXPORT_BACKENDS:
        raise DeployError(f'the backend must be one of {EXPORT_BACKENDS}, got {backend!r}.')
    if backend == 'paddle':
        if int8:
            raise DeployError('the INT8 model is an ONNX model: run it with onnxruntime or '
                              'openvino (backend onnxruntime).')
        return PaddleRunner(deploy, options)
    if backend == 'openvino' and options.device != 'cpu':
        raise DeployError('the openvino backend runs on the CPU here; use device="cpu", or '
                          'backend="paddle" on the GPU.')
    if not installed(backend):
        raise _needs_package(backend, f'backend {backend!r}')
    path = deploy.onnx_int8 if int8 else deploy.onnx
    fix = ('quantise it: export.py ... --psa_impl paddle --onnx --quantize int8 '
           '--calib_images <folder>' if int8 else
           'export with `--psa_impl paddle --onnx`')
    if path is None:
        raise DeployError(f'{deploy.path} names no {"INT8 " if int8 else ""}'
                          f'ONNX model, which {backend} runs; {fix}.')
    if not os.path.isfile(path):
        raise DeployError(f'{deploy.path} names {os.path.basename(path)}, which is missing '
                          f'({path}); copy the whole export folder, or {fix} again.')
    cls = OnnxRuntimeRunner if backend == 'onnxruntime' else OpenVinoRunner
    return cls(path, deploy.input_shape, options)


def unreadable_onnx(path, backend, error):
    """The DeployError of an ONNX file ``backend`` cannot read: empty, cut short, or not ONNX."""
    size = os.path.getsize(path)
    what = 'is empty' if size == 0 else f'({size} bytes) cannot be read as an ONNX model'
    reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else \
        type(error).__name__
    return DeployError(f'{path} {what} by {backend} ({reason}): it was cut short (an '
                       'interrupted copy, download or export, or a full disk) or is another '
                       'file; export the model again (export.py ... --psa_impl paddle --onnx'
                       f'{" --quantize int8 ..." if "int8" in os.path.basename(path) else ""}), '
                       'or copy the whole file again.')


class OnnxRuntimeRunner:
    """An ONNX file in onnxruntime (CPU, or CUDA with onnxruntime-gpu): ``run(batch)``.

    Args:
        path (str): The .onnx file.
        input_shape (list): ``[N, C, H, W]`` of the export, -1 for dynamic.
        options (PredictorOptions): ``cpu_threads`` are the intra-op threads.
    """

    def __init__(self, path, input_shape, options):
        import onnxruntime
        self.path, self.input_shape = path, input_shape
        session_options = onnxruntime.SessionOptions()
        session_options.intra_op_num_threads = options.cpu_threads
        session_options.inter_op_num_threads = 1
        session_options.log_severity_level = 3  # errors only: not paddle2onnx's unused constants
        providers = ['CPUExecutionProvider']
        if options.device == 'gpu':
            if 'CUDAExecutionProvider' not in onnxruntime.get_available_providers():
                raise DeployError('onnxruntime on the GPU needs onnxruntime-gpu: pip install '
                                  'onnxruntime-gpu, or use backend paddle.')
            providers.insert(0, 'CUDAExecutionProvider')
        try:
            self.session = onnxruntime.InferenceSession(path, session_options,
                                                        providers=providers)
        except Exception as error:  # onnxruntime's errors have no common base
            raise unreadable_onnx(path, 'onnxruntime', error) from None
        self._input_name = self.session.get_inputs()[0].name

    def run(self, batch):
        check_batch(batch, self.input_shape, self.path)
        batch = np.ascontiguousarray(batch, dtype='float32')
        return self.session.run(None, {self._input_name: batch})[0]


class OpenVinoRunner:
    """An ONNX file in OpenVINO on the CPU: ``run(batch)``.

    Args:
        path (str): The .onnx file (an INT8 QDQ model runs in INT8).
        input_shape (list): ``[N, C, H, W]`` of the export, -1 for dynamic.
        options (PredictorOptions): ``cpu_threads`` are OpenVINO's inference threads.
    """

    def __init__(self, path, input_shape, options):
        import openvino
        self.path, self.input_shape = path, input_shape
        core = openvino.Core()
        # f32 explicitly: on a CPU with bfloat16 instructions OpenVINO runs in bf16 unless
        # told otherwise, and the classes then move off the trained model's.
        try:
            model = core.read_model(path)
        except Exception as error:  # RuntimeError, or a protobuf error of the reader
            raise unreadable_onnx(path, 'OpenVINO', error) from None
        self.compiled = core.compile_model(model, 'CPU', {
            'INFERENCE_NUM_THREADS': options.cpu_threads, 'PERFORMANCE_HINT': 'LATENCY',
            'INFERENCE_PRECISION_HINT': 'f32'})
        self.request = self.compiled.create_infer_request()

    def run(self, batch):
        check_batch(batch, self.input_shape, self.path)
        batch = np.ascontiguousarray(batch, dtype='float32')
        # The request's output tensor is reused by the next run: copy it out.
        output = np.array(self.request.infer([batch])[0], copy=True)
        if output.shape[:1] != batch.shape[:1] or output.shape[-2:] != batch.shape[-2:]:
            # An input a few pixels high or wide gives no output, or the previous run's.
            raise DeployError(f'OpenVINO gave an output of shape {list(output.shape)} for the '
                              f'input {list(batch.shape)} (N, 3, H, W after the transforms), not '
                              'one of its size: it cannot run an input this small; use larger '
                              'images, or backend "onnxruntime" or "paddle", which run it.')
        return output
