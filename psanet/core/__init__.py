"""The training / evaluation / prediction engine, built on paddleseg 2.8.0's components.

``train.py``, ``val.py`` and ``predict.py`` at the repository root parse
PaddleSeg's flags and call ``psanet.core.train.train_from_config``,
``psanet.core.val.evaluate_from_config`` and
``psanet.core.predict.predict_from_config``; the loops themselves
(``train``, ``evaluate``, ``predict`` in the same modules) take built
components and can be called from Python. Importing this package loads
none of them, nor paddle: only ``psanet.compat``, whose warning filters must
come before the engine's modules import paddle.
"""
from psanet import compat  # noqa: F401
