"""One rank of tests/test_elastic.py's launched trainings: train.py with the toy model registered.

    python -m paddle.distributed.launch --master etcd://127.0.0.1:PORT ... tests/elastic_rank.py \
        TRAIN_PY_FLAGS...

Exactly train.py's ``exit_with(run_cli(train_from_config, **vars(parse_args())))``, after
``engine_helpers`` has registered ``TinySegNet`` (train.py knows only the package's models).
"""
import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]

import engine_helpers  # noqa: E402,F401  (registers TinySegNet)
import train  # noqa: E402  (train.py)
from psanet.cli import exit_with, run_cli  # noqa: E402
from psanet.core.train import train_from_config  # noqa: E402

if __name__ == '__main__':
    exit_with(run_cli(train_from_config, **vars(train.parse_args())))
