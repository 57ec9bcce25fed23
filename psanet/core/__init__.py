"""The training / evaluation / prediction engine, built on paddleseg 2.8.0's components.

``train.py``, ``val.py`` and ``predict.py`` at the repository root parse
PaddleSeg's flags and call :func:`train_from_config`,
:func:`evaluate_from_config` and :func:`predict_from_config`; the loops
themselves (:func:`train`, :func:`evaluate`, :func:`predict`) take built
components and can be called from Python.
"""
from psanet.core.errors import CheckpointError, ConfigError, TrainingError, UserError, run_cli
from psanet.core.predict import predict, predict_from_config
from psanet.core.train import train, train_from_config
from psanet.core.val import evaluate, evaluate_from_config

__all__ = ['train', 'train_from_config', 'evaluate', 'evaluate_from_config', 'predict',
           'predict_from_config', 'run_cli', 'UserError', 'ConfigError', 'CheckpointError',
           'TrainingError']
