"""The Python API: a trained PSANet as a function from images to label maps.

    from psanet import Segmenter
    seg = Segmenter.from_export('output/inference_model')   # or .from_config(cfg, weights)
    label = seg('image.png')                                 # path, BGR array, or a list

It runs an export in Paddle Inference, onnxruntime or OpenVINO
(:mod:`psanet.deploy.runtimes`) with the one preprocessing and postprocessing of
:mod:`psanet.deploy.processing`; ``deploy/python/infer.py`` and ``predict.py``
run the same code.
"""
import importlib
import os
import tempfile

import numpy as np

from psanet.errors import DeployError

from .config import DeployConfig
from .predictor import PredictorOptions
from .processing import postprocess, preprocess, restore_logits
from .runtimes import create_runner, default_runtime

__all__ = ['Segmenter']


def _as_list(images):
    """``(list of images, whether one image was given)``; each a path or a BGR array."""
    single = isinstance(images, (str, os.PathLike, np.ndarray))
    items = [images] if single else list(images)
    for i, item in enumerate(items):
        if isinstance(item, os.PathLike):
            items[i] = os.fspath(item)
        elif isinstance(item, np.ndarray):
            if item.ndim != 3 or item.shape[2] != 3:
                raise DeployError(f'image {i}: a BGR array must be H x W x 3, got shape '
                                  f'{list(item.shape)}; read images with cv2.imread(path), '
                                  'or convert a grey one with cv2.cvtColor(image, '
                                  'cv2.COLOR_GRAY2BGR).')
        elif not isinstance(item, str):
            raise DeployError(f'image {i}: expected a path or a BGR numpy array, got '
                              f'{type(item).__name__}.')
    return items, single


def _usable_cpus():
    if hasattr(os, 'sched_getaffinity'):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Segmenter:
    """An exported PSANet in one runtime: ``seg(images)`` -> label maps, ``seg.logits(images)``.

    Args:
        deploy (DeployConfig|str): The export (its deploy.yaml or folder).
        backend (str, optional): The runtime: 'paddle' (Paddle Inference), 'onnxruntime' or
            'openvino'. Default: the
            fastest installed one that runs the export on ``device``
            (:func:`psanet.deploy.runtimes.default_runtime`).
        device (str, optional): 'cpu' or 'gpu'. Default: 'cpu'.
        cpu_threads (int, optional): Threads of the runtime on the CPU. Default: the
            CPUs this process may use.
        batch_size (int, optional): Images per run; consecutive images of one size after
            the transforms share a run. Default: 1.
        enable_mkldnn (bool, optional): oneDNN in Paddle Inference on the CPU. Default: True.
        int8 (bool, optional): Run the INT8 model the export holds (``export.py --quantize
            int8``) on the CPU. Default: False.
    """

    def __init__(self, deploy, backend=None, device='cpu', cpu_threads=None, batch_size=1,
                 enable_mkldnn=True, int8=False):
        self.deploy = deploy if isinstance(deploy, DeployConfig) else DeployConfig(deploy)
        if int(batch_size) < 1:
            raise DeployError(f'batch_size must be >= 1, got {batch_size}.')
        self.batch_size = int(batch_size)
        self.options = PredictorOptions(device=device, enable_mkldnn=bool(enable_mkldnn),
                                        cpu_threads=cpu_threads or _usable_cpus())
        if int8 and device != 'cpu':
            raise DeployError('the INT8 model runs on the CPU; use device="cpu".')
        self.int8 = bool(int8)
        self.backend = backend or default_runtime(self.deploy, device, self.int8)
        self.runner = create_runner(self.deploy, self.backend, self.options, self.int8)
        self.transforms = self.deploy.build_transforms()
        self._workdir = None

    @classmethod
    def from_export(cls, path, **options):
        """The export in ``path`` (deploy.yaml or its folder); ``options`` as ``Segmenter``."""
        return cls(path, **options)

    @classmethod
    def from_config(cls, config, weights, save_dir=None, **options):
        """A trained checkpoint: exports it (logits out), then runs the export.

        The export runs on the CPU, as export.py does (``paddle.set_device('cpu')``).

        Args:
            config (str): The training config.
            weights (str): model.pdparams or a checkpoint folder.
            save_dir (str, optional): Where the export goes. Default: a temporary folder,
                removed with the Segmenter.
            **options: As ``Segmenter``. ``backend='paddle'`` exports the custom op (the
                fastest in Paddle Inference); otherwise the pure-Paddle op with model.onnx
                when paddle2onnx is installed.
        """
        # The build side (config, model, export) loads here only, so that importing the
        # runtime never loads it (tests/test_imports.py): looked up by name, not imported.
        export = importlib.import_module('psanet.export')
        workdir = None
        if save_dir is None:
            workdir = tempfile.TemporaryDirectory(prefix='psanet_segmenter_')
            save_dir = os.path.join(workdir.name, 'export')
        onnx = options.get('backend') != 'paddle' and export.onnx_tools_installed()
        path = export.export_from_config(config, weights, save_dir, output_op='none',
                                         psa_impl='paddle' if onnx else 'custom', onnx=onnx)
        segmenter = cls(path, **options)
        segmenter._workdir = workdir
        return segmenter

    def __repr__(self):
        return (f'Segmenter({self.deploy.dir!r}, backend={self.backend!r}, '
                f'device={self.options.device!r}, cpu_threads={self.options.cpu_threads}, '
                f'batch_size={self.batch_size}, int8={self.int8})')

    def __call__(self, images):
        """Label maps: one uint8 ``[H, W]`` array at each image's size (a list for a list).

        Args:
            images (str|np.ndarray|list): An image path, a BGR ``[H, W, 3]`` array, or a
                list of them.
        """
        items, single = _as_list(images)
        labels = []
        for output, info in self._outputs(items):
            labels.extend(postprocess(output, self.deploy.output_op, info))
        return labels[0] if single else labels

    def logits(self, images):
        """Scores: one float32 ``[C, H, W]`` array at each image's size (a list for a list):
        logits for an export with ``--output_op none``, probabilities with ``softmax``."""
        if self.deploy.output_op == 'argmax':
            raise DeployError(f'{self.deploy.path} ends in argmax (class ids only); export with '
                              '`--output_op none` for logits, or use Segmenter.from_config.')
        items, single = _as_list(images)
        scores = []
        for output, infos in self._outputs(items):
            scores.extend(restore_logits(score, info) for score, info in zip(output, infos))
        return scores[0] if single else scores

    def _outputs(self, items):
        """``(output, trans_infos)`` per run: consecutive images of one size, batch_size a run."""
        names = [item if isinstance(item, str) else f'image {i}' for i, item in enumerate(items)]
        group, infos = [], []
        for item, name in zip(items, names):
            batch, info, _ = preprocess([item], self.transforms, [name])
            if group and (len(group) == self.batch_size or group[0].shape != batch.shape):
                yield self.runner.run(np.concatenate(group)), infos
                group, infos = [], []
            group.append(batch)
            infos.extend(info)
        if group:
            yield self.runner.run(np.concatenate(group)), infos
