"""Writes mini Cityscapes, a small synthetic dataset in the Cityscapes layout.

    python tools/make_mini_cityscapes.py --out data/mini_cityscapes --num_train 40 --num_val 10 --size 256 128 --seed 0
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from psanet.data.mini_cityscapes import format_summary, generate  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', default='data/mini_cityscapes', help='output folder')
    parser.add_argument('--num_train', type=int, default=40, help='train images')
    parser.add_argument('--num_val', type=int, default=10, help='val images')
    parser.add_argument('--size', type=int, nargs=2, default=(256, 128), metavar=('WIDTH', 'HEIGHT'),
                        help='image width and height')
    parser.add_argument('--seed', type=int, default=0, help='same seed, same files')
    return parser.parse_args(argv)


if __name__ == '__main__':
    args = parse_args()
    try:
        for flag, count in (('--num_train', args.num_train), ('--num_val', args.num_val)):
            if count < 1:  # a dataset the Quick start can train and evaluate on
                raise ValueError(f'{flag} must be a positive int (training and evaluation need '
                                 f'an image each), got {count}')
        summary = generate(args.out, args.num_train, args.num_val, tuple(args.size), args.seed)
    except (ValueError, OSError) as error:  # OSError: --out is a file, or not writable
        print(f'error: {error}', file=sys.stderr)
        sys.exit(2)  # as the other command lines exit on a user error
    except KeyboardInterrupt:
        print(f'error: interrupted (Ctrl-C); {args.out} is as it was before this run.',
              file=sys.stderr)
        sys.exit(130)
    print(format_summary(summary))
