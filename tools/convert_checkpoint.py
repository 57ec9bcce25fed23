"""Converts the PaddlePaddle reproduction's released PSANet checkpoint into this project's layout.

    python tools/convert_checkpoint.py --src psanet_r50_reproduction.pdparams \
        --dst output/reproduction/model.pdparams
    python val.py --config configs/psanet/psanet_resnet50_os8_cityscapes_1024x512_80k.yml \
        --model_path output/reproduction/model.pdparams

The tensors are renamed and the projection's input channels reordered
(psanet/models/reproduction.py); the result must fill the model built from
--config exactly, or nothing is written and the first tensor that does not
fit is named. val.py, predict.py, export.py and model.pretrained also take
the reproduction's file as it is, converting it in memory.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from psanet.cli import exit_with, run_cli  # noqa: E402
from psanet.log import get_logger  # noqa: E402

RELEASED_CONFIG = 'configs/psanet/psanet_resnet50_os8_cityscapes_1024x512_80k.yml'


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--src', required=True, help="the reproduction's model.pdparams")
    parser.add_argument('--dst', required=True, help='the model.pdparams to write')
    parser.add_argument('--config', default=os.path.join(ROOT, RELEASED_CONFIG),
                        help="the config the weights are for. Default: the released "
                        f"checkpoint's, {RELEASED_CONFIG} of this repository")
    return parser.parse_args(argv)


def convert(src, dst, config):
    # Imported here: --help and flag errors come before Paddle loads.
    from psanet.core.weights import convert_reproduction_file
    count = convert_reproduction_file(src, dst, config)
    get_logger().info(f'Converted {count} tensors of {src} to {dst} (for {config}).')


if __name__ == '__main__':
    exit_with(run_cli(convert, **vars(parse_args())))
