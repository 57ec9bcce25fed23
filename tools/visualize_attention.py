"""Draws PSANet's collect and distribute attention of chosen pixels over an image.

    python tools/visualize_attention.py \
        --config configs/psanet/psanet_resnet18_os8_mini_cityscapes_128x64_100.yml \
        --model_path output/best_model/model.pdparams \
        --image_path data/mini_cityscapes/leftImg8bit/val/frankfurt/frankfurt_000000_000019_leftImg8bit.png \
        --points 40,100 128,64 200,30 --save_dir output/attention

For each point (x,y in image pixels): the image with the point marked, the map
each PSA branch predicts at the point (collect: where it gathers from;
distribute: where it sends to) as a heat map over the image, and the predicted
classes; one PNG per point and a sheet of all (psanet/core/visualize_attention.py).
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from psanet.cli import add_model_flags, exit_with, run_cli  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(parser)
    parser.add_argument('--image_path', required=True, help='One image.')
    parser.add_argument('--points', required=True, nargs='+', metavar='X,Y',
                        help='Pixels of the image, each as x,y, e.g. 120,40 300,200.')
    parser.add_argument('--save_dir', default='output/attention',
                        help='One PNG per point and <image>_attention_sheet.png go here.')
    parser.add_argument('--device', choices=['cpu', 'gpu'], default=None,
                        help='Default: gpu when Paddle sees one, else cpu.')
    parser.add_argument('--psa_impl', choices=['custom', 'paddle'], default=None,
                        help='The PSA mask op: the C++/CUDA one (default) or pure Paddle.')
    parser.add_argument('--opts', nargs='+', default=None, help='key=value config overrides.')
    return parser.parse_args(argv)


def main(argv=None):
    options = vars(parse_args(argv))
    # Imported after the flags are parsed: --help and flag errors come before Paddle loads.
    from psanet.core.visualize_attention import visualize_attention_from_config
    return run_cli(visualize_attention_from_config, **options)


if __name__ == '__main__':
    exit_with(main())
