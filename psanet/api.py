"""The Python API, ``psanet.Segmenter``: a trained PSANet as a function from images to labels.

    from psanet import Segmenter
    seg = Segmenter.from_export('output/inference_model')   # or .from_config(cfg, weights)
    label = seg('image.png')                                 # path, BGR array, or a list

``from_export`` and everything a Segmenter does come from the deploy package's
:class:`psanet.deploy.pipeline.Pipeline`, which loads no model code;
``from_config`` adds the build side (config, models, export), loaded when it is
called: a checkpoint exported and run in a backend, or run as the dygraph model
(``backend='dygraph'``) with predict.py's windows, scales and flips.
"""
import os
import tempfile
from typing import Any, Dict, Optional

from psanet.deploy.backends import EXPORT_BACKENDS
from psanet.deploy.pipeline import Pipeline
from psanet.errors import DeployError

__all__ = ['Segmenter']

# What the dygraph route takes of from_export's options (the rest set up an export's backend).
DYGRAPH_OPTIONS = ('device', 'batch_size')
BACKENDS = ('dygraph',) + EXPORT_BACKENDS


class Segmenter(Pipeline):
    __doc__ = Pipeline.__doc__

    @classmethod
    def from_config(cls, config: str, weights: str, backend: Optional[str] = None,
                    save_dir: Optional[str] = None, inference: Any = None,
                    **options: Any) -> 'Segmenter':
        """A trained checkpoint: exported and run in a backend, or run as the dygraph model.

        Args:
            config (str): The training config.
            weights (str): model.pdparams, a checkpoint folder, or an http(s) URL of either
                a .pdparams or an archive holding one (downloaded once into a cache,
                ``psanet.weights_download``).
            backend (str, optional): 'dygraph' runs the model itself (predict.py's route);
                a runtime's name ('paddle', 'onnxruntime', 'openvino'), or None for the
                fastest installed one, exports the checkpoint (logits out) on the CPU, as
                export.py does, and runs the export: the custom op for 'paddle', else the
                pure-Paddle op with model.onnx when paddle2onnx is installed.
            save_dir (str, optional): Where the export goes. Default: a temporary folder,
                removed with the Segmenter.
            inference (InferenceOptions|dict, optional): With 'dygraph': windows, scales and
                flips (``psanet.core.options.InferenceOptions``, or a dict of its fields over
                the config's test_config). Default: the config's test_config.
            **options: As ``from_export``; with 'dygraph', ``device`` and ``batch_size``
                only, ``device`` ('cpu' or 'gpu') by default the GPU when Paddle sees one, as
                predict.py's (``from_export``'s CPU is infer.py's).
        """
        if backend is not None and backend not in BACKENDS:
            raise DeployError(f'backend must be one of {BACKENDS} (or None: the fastest '
                              f'installed backend), got {backend!r}.')
        if backend == 'dygraph':
            return cls._dygraph(config, weights, save_dir, inference, options)
        if inference is not None:
            raise DeployError('inference= (windows, scales, flips) runs in the dygraph model: '
                              'pass backend="dygraph"; an export runs each image whole, once.')
        from psanet.export import check_export_dir, export_from_config, onnx_tools_installed
        workdir = None
        if save_dir is not None:
            check_export_dir(save_dir, flag='save_dir')
        else:
            workdir = tempfile.TemporaryDirectory(prefix='psanet_segmenter_')
            save_dir = os.path.join(workdir.name, 'export')
        onnx = backend != 'paddle' and onnx_tools_installed()
        path = export_from_config(config, weights, save_dir, output_op='none',
                                  psa_impl='paddle' if onnx else 'custom', onnx=onnx)
        return cls.from_export(path, backend=backend, workdir=workdir, **options)

    @classmethod
    def _dygraph(cls, config: str, weights: str, save_dir: Optional[str], inference: Any,
                 options: Dict[str, Any]) -> 'Segmenter':
        other = sorted(set(options) - set(DYGRAPH_OPTIONS))
        if other or save_dir is not None:
            given = other + (['save_dir'] if save_dir is not None else [])
            raise DeployError(f'{", ".join(given)}: options of an export; backend="dygraph" '
                              f'takes {" and ".join(DYGRAPH_OPTIONS)} (and inference=).')
        from psanet.core.options import DEFAULT_DEVICE
        from psanet.core.predict import dygraph_runner
        runner, transforms = dygraph_runner(config, weights, inference,
                                           options.get('device', DEFAULT_DEVICE))
        return cls(runner, transforms, 'none', options.get('batch_size', 1), 'dygraph')
