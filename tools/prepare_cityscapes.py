"""Makes the *_gtFine_labelTrainIds.png files of a Cityscapes download, for training.

    python tools/prepare_cityscapes.py --root data/cityscapes [--num_workers 8] [--overwrite]

The root must hold leftImg8bit/ and gtFine/ from leftImg8bit_trainvaltest.zip and
gtFine_trainvaltest.zip (https://www.cityscapes-dataset.com).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from psanet.data.prepare_cityscapes import format_summary, prepare_cityscapes  # noqa: E402
from psanet.errors import DatasetError  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--root', default='data/cityscapes', help='the Cityscapes folder')
    parser.add_argument('--num_workers', type=int, default=1, help='processes drawing labels')
    parser.add_argument('--overwrite', action='store_true', help='remake labels already made')
    return parser.parse_args(argv)


if __name__ == '__main__':
    args = parse_args()
    try:
        summary = prepare_cityscapes(args.root, args.num_workers, args.overwrite)
    except (DatasetError, ValueError) as error:
        print(f'error: {error}', file=sys.stderr)
        sys.exit(2)  # as the other command lines exit on a user error
    print(format_summary(summary))
