"""A segmentation model as a function from images to label maps: the deploy half of the API.

:class:`Pipeline` reads images (paths or BGR arrays), applies the val
transforms, runs a runner (anything with ``run(batch) -> output``) on batches of
one size, and maps the output back to each image (:mod:`.processing`).
``Pipeline.from_export`` runs an export in Paddle Inference, onnxruntime or
OpenVINO (:mod:`.backends`); the build side plugs the dygraph model into the
same class (``psanet.core.predict.DygraphRunner``, and ``psanet.Segmenter``,
whose ``from_config`` takes a checkpoint). predict.py, deploy/python/infer.py
and the API all run these stages.
"""
import os
import tempfile
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from psanet.errors import DeployError, is_integer

from .deploy_config import DeployConfig
from .attention_memory import check_batch_memory
from .predictor import (API_ENABLE_MKLDNN, DEFAULT_CPU_THREADS, DEFAULT_DEVICE, PredictorOptions,
                        default_cpu_threads)
from .processing import (check_image_file, check_input_size, image_names, postprocess,
                         preprocess, restore_logits)
from .backend_choice import default_runner
from .backends import create_runner

__all__ = ['Pipeline']

Image = Union[str, 'os.PathLike[str]', np.ndarray]  # a path, or a BGR uint8 H x W x 3 array
Images = Union[Image, Sequence[Image]]
Info = Tuple[Any, Tuple[int, int]]  # what postprocess needs of an image: transforms, size


def _as_list(images: Any) -> Tuple[List[Image], bool]:  # what it checks, as given
    """``(list of images, whether one image was given)``; each a path or a BGR array."""
    if images is None:
        raise DeployError('expected an image path, a BGR numpy array or a list of them, got '
                          'None (cv2.imread returns None for a file it cannot read: check '
                          'the path).')
    single = isinstance(images, (str, os.PathLike, np.ndarray))
    if not single and not hasattr(images, '__iter__'):
        raise DeployError(f'expected an image path, a BGR numpy array or a list of them, got '
                          f'{type(images).__name__}.')
    items = [images] if single else list(images)
    for i, item in enumerate(items):
        if isinstance(item, os.PathLike):
            items[i] = os.fspath(item)
        if isinstance(items[i], str):
            check_image_file(items[i])  # every path, before the first image runs
        elif isinstance(item, np.ndarray):
            _check_array(i, item)
        elif item is None:
            raise DeployError(f'image {i}: got None (cv2.imread returns None for a file it '
                              'cannot read: check the path).')
        elif not isinstance(item, str):
            raise DeployError(f'image {i}: expected a path or a BGR numpy array, got '
                              f'{type(item).__name__}.')
    return items, single


def _check_array(i: int, image: np.ndarray) -> None:
    """A BGR array as cv2.imread reads it: uint8 H x W x 3, not empty. Another dtype would be
    taken as 0-255 values and give other classes without a word."""
    if image.ndim != 3 or image.shape[2] != 3:
        raise DeployError(f'image {i}: a BGR array must be H x W x 3, got shape '
                          f'{list(image.shape)}; read images with cv2.imread(path), '
                          'or convert a grey one with cv2.cvtColor(image, '
                          'cv2.COLOR_GRAY2BGR).')
    if image.dtype != np.uint8:
        if np.issubdtype(image.dtype, np.floating):
            fix = ('a float image in [0, 1] becomes one with '
                   '(image * 255).round().astype(np.uint8)')
        elif image.dtype == np.uint16:
            fix = ('read 8 bits with cv2.imread(path) (not IMREAD_UNCHANGED), or convert with '
                   '(image // 257).astype(np.uint8)')
        else:
            fix = 'read images with cv2.imread(path)'
        raise DeployError(f'image {i}: a BGR array must be uint8 (0 to 255, as cv2.imread '
                          f'reads it), got {image.dtype}; {fix}.')
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise DeployError(f'image {i}: the array is empty (shape {list(image.shape)}); pass '
                          'an image of at least 1 x 1 pixels.')


def _checked_batch_size(batch_size: Any) -> int:
    if not is_integer(batch_size, 1):
        raise DeployError(f'batch_size must be an integer >= 1 (images per run), got '
                          f'{batch_size!r}: pass a whole number such as 1.')
    return int(batch_size)


class Pipeline:
    """A model as a function: ``seg(images)`` -> label maps, ``seg.logits(images)`` -> scores.

    Args:
        runner: Runs a float32 ``[N, 3, H, W]`` batch: ``runner.run(batch)`` returns the
            model output for it (an export's runner, :mod:`psanet.deploy.backends`, or
            the dygraph model's, ``psanet.core.predict.DygraphRunner``).
        transforms (paddleseg.transforms.Compose): The val transforms.
        output_op (str, optional): What ``run`` returns: 'none' (logits) or 'softmax'
            (probabilities), float ``[N, C, H, W]``, or 'argmax' (class ids ``[N, H, W]``).
            Default: 'none'.
        batch_size (int, optional): Images per run; consecutive images of one size after
            the transforms share a run. Default: 1.
        backend (str, optional): What runs the model, for ``repr``: a backend's name, or
            'dygraph'. Default: None.
        deploy (DeployConfig, optional): The export the runner runs, if any; an input
            smaller than its ``min_input_size`` is refused as it is preprocessed.
            Default: None.
        attention_cost (AttentionCost, optional): What the export's attention maps take,
            checked against the host's free memory before each run. Default: None (not
            checked).
        workdir (tempfile.TemporaryDirectory, optional): A folder removed with the pipeline
            (``psanet.Segmenter.from_config``'s temporary export). Default: None.
    """

    def __init__(self, runner: Any, transforms: Any, output_op: str = 'none',
                 batch_size: int = 1, backend: Optional[str] = None,
                 deploy: Optional[DeployConfig] = None, attention_cost: Any = None,
                 workdir: Optional[tempfile.TemporaryDirectory] = None) -> None:
        self.runner, self.transforms, self.output_op = runner, transforms, output_op
        self.batch_size = _checked_batch_size(batch_size)
        self.backend, self.deploy = backend, deploy
        self._attention, self._workdir = attention_cost, workdir
        self._min_input_size = deploy.min_input_size if deploy is not None else None

    @classmethod
    def from_export(cls, path: str, backend: Optional[str] = None, device: str = DEFAULT_DEVICE,
                    cpu_threads: Optional[int] = None, batch_size: int = 1,
                    enable_mkldnn: bool = API_ENABLE_MKLDNN, int8: bool = False,
                    workdir: Optional[tempfile.TemporaryDirectory] = None) -> Any:
        """The export in ``path`` (deploy.yaml or its folder) in one backend.

        Args:
            path (str): deploy.yaml or the folder holding it.
            backend (str, optional): The runtime: 'paddle' (Paddle Inference), 'onnxruntime'
                or 'openvino'. Default: the fastest installed one that runs the export on
                ``device``: on the CPU each candidate is timed once on a random batch (the
                export's input size, else 1024x512; this batch size and thread count), the
                fastest is logged and remembered in ``~/.cache/psanet/backend_choice.json``
                (``$PSANET_CACHE_DIR``), so that the next load of the same export, size,
                batch, threads, backend versions and CPU times nothing (measured here on
                PSANet R50-D8 at 512x256, 2 threads: onnxruntime 6.5 s, OpenVINO 6.6 s,
                Paddle Inference 7.7 s a run; the first load 85 s, the next 4.0 s, as
                long as one naming onnxruntime); with the
                environment variable PSANET_TIME_BACKENDS=0, the first installed of the
                fixed order (onnxruntime, OpenVINO, Paddle Inference; OpenVINO first for
                INT8), untimed; on the GPU, Paddle Inference
                (:mod:`psanet.deploy.backend_choice`, docs/deploy.md "Which backend by
                default").
            device (str, optional): 'cpu' or 'gpu'. Default: 'cpu', as infer.py's --device.
            cpu_threads (int, optional): Threads of the backend on the CPU. Default: as
                infer.py's --cpu_threads, PaddleSeg's 10, or the CPUs this process may use
                when fewer.
            batch_size (int, optional): As ``Segmenter``. Default: 1.
            enable_mkldnn (bool, optional): oneDNN in Paddle Inference on the CPU.
                Default: True, where infer.py's --enable_mkldnn keeps PaddleSeg's False (so
                that a PaddleSeg command line runs the same); oneDNN is 1.6x faster.
            int8 (bool, optional): Run the INT8 model the export holds (``export.py
                --quantize int8``) on the CPU. Default: False.
            workdir (tempfile.TemporaryDirectory, optional): As ``Pipeline``.
        """
        if int8 and device != 'cpu':
            raise DeployError('the INT8 model runs on the CPU; use device="cpu".')
        if cpu_threads is not None and not is_integer(cpu_threads, 1):
            raise DeployError(f'cpu_threads must be an integer >= 1 (or None: PaddleSeg\'s '
                              f'{DEFAULT_CPU_THREADS}, or the CPUs this process may use when '
                              f'fewer, {default_cpu_threads()} here), got {cpu_threads!r}.')
        deploy = DeployConfig(path)
        options = PredictorOptions(device=device, enable_mkldnn=bool(enable_mkldnn),
                                   cpu_threads=cpu_threads)
        return cls.from_deploy(deploy, backend, options, bool(int8), batch_size, workdir)

    @classmethod
    def from_deploy(cls, deploy: DeployConfig, backend: Optional[str] = None,
                    options: Optional[PredictorOptions] = None, int8: bool = False,
                    batch_size: int = 1,
                    workdir: Optional[tempfile.TemporaryDirectory] = None) -> Any:
        """The export ``deploy`` in ``backend`` with every predictor option
        (:class:`psanet.deploy.predictor.PredictorOptions`: TensorRT, precision, ...), as
        deploy/python/infer.py runs it; ``backend`` None picks as ``from_export`` does."""
        options = options or PredictorOptions()
        batch_size = _checked_batch_size(batch_size)  # before a runner is made
        transforms = deploy.build_transforms()
        attention = deploy.attention_cost
        if backend is None:
            backend, runner = default_runner(deploy, options, int8, batch_size)
        else:
            runner = create_runner(deploy, backend, options, int8)
        # The host's memory is checked; a GPU's free memory needs Paddle's CUDA calls.
        return cls(runner, transforms, deploy.output_op, batch_size, backend, deploy,
                   attention if options.device == 'cpu' else None, workdir)

    def __repr__(self) -> str:
        source = self.deploy.dir if self.deploy is not None else type(self.runner).__name__
        return (f'{type(self).__name__}({source!r}, backend={self.backend!r}, output_op='
                f'{self.output_op!r}, batch_size={self.batch_size})')

    def __call__(self, images: Images) -> Union[np.ndarray, List[np.ndarray]]:
        """Label maps: one uint8 ``[H, W]`` array at each image's size (a list for a list).

        Args:
            images (str|np.ndarray|list): An image path, a BGR ``[H, W, 3]`` array, or a
                list of them.
        """
        items, single = _as_list(images)
        labels = []
        for output, infos in self._outputs(items):
            labels.extend(self.postprocess(output, infos))
        return labels[0] if single else labels

    def logits(self, images: Images) -> Union[np.ndarray, List[np.ndarray]]:
        """Scores: one float32 ``[C, H, W]`` array at each image's size (a list for a list):
        logits, or probabilities where the model ends in softmax."""
        if self.output_op == 'argmax':
            what = self.deploy.path if self.deploy is not None else 'this model'
            raise DeployError(f'{what} ends in argmax (class ids only); export with '
                              '`--output_op none` for logits, or use Segmenter.from_config.')
        items, single = _as_list(images)
        scores = []
        for output, infos in self._outputs(items):
            scores.extend(self.restore(output, infos))
        return scores[0] if single else scores

    # The three stages, which infer.py times one by one.

    def preprocess(self, images: Sequence[Image], names: Optional[Sequence[str]] = None
                   ) -> Tuple[np.ndarray, List[Info]]:
        """``(batch, infos)`` of images (paths or BGR arrays) of one size after the
        transforms: the float32 ``[N, 3, H, W]`` batch, and per image what
        ``postprocess`` needs to map the output back to it. A batch smaller than the
        export runs on is refused."""
        batch, trans_infos, read = preprocess(images, self.transforms, names)
        check_input_size(batch, image_names(images, names), self._min_input_size)
        return batch, [(info, image.shape[:2]) for info, image in zip(trans_infos, read)]

    def run(self, batch: np.ndarray) -> np.ndarray:
        """The runner's output for a preprocessed batch."""
        if self._attention is not None:
            check_batch_memory(self._attention, batch.shape)
        output = self.runner.run(batch)
        if len(output) != len(batch):
            raise DeployError(f'{self.backend or type(self.runner).__name__} returned '
                              f'{len(output)} outputs for a batch of {len(batch)} (shape '
                              f'{list(batch.shape)}): the backend cannot run this input; try '
                              'another backend, or images of another size.')
        return output

    def postprocess(self, output: np.ndarray, infos: Sequence[Info]) -> List[np.ndarray]:
        """One uint8 label map per image at its size, from ``run``'s output."""
        trans_infos, sizes = zip(*infos)
        return postprocess(output, self.output_op, list(trans_infos), list(sizes))

    def restore(self, output: np.ndarray, infos: Sequence[Info]) -> List[np.ndarray]:
        """One float32 ``[C, H, W]`` score map per image at its size, from ``run``'s output."""
        return [restore_logits(score, info, size) for score, (info, size) in zip(output, infos)]

    def _outputs(self, items: List[Image]) -> Iterator[Tuple[np.ndarray, List[Info]]]:
        """``(output, infos)`` per run: consecutive images of one size, batch_size a run."""
        names = image_names(items)
        group: List[np.ndarray] = []
        infos: List[Info] = []
        for item, name in zip(items, names):
            batch, info = self.preprocess([item], [name])
            if group and (len(group) == self.batch_size or group[0].shape != batch.shape):
                yield self.run(np.concatenate(group)), infos
                group, infos = [], []
            group.append(batch)
            infos.extend(info)
        if group:
            yield self.run(np.concatenate(group)), infos
