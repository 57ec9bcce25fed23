"""Time of the dataset check before training: every label read (cold), then remembered (warm).

    python bench/bench_dataset_check.py [--num_train 40] [--size 256 128] [--rounds 3]

Generates a mini Cityscapes in a temporary folder and times, in one run,
validate_dataset with an empty cache (every image header and label read) and
again with the cache it wrote (nothing read; the files are dated an hour
back, as a downloaded dataset's are), and, for comparison, a check that reads
only the first and last 8 labels. Prints medians over --rounds and the ratios.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddleseg.datasets import Cityscapes  # noqa: E402
from paddleseg.transforms import Normalize  # noqa: E402

from psanet.data import generate_mini_cityscapes  # noqa: E402
from psanet.data.validate import CHECK_CACHE_NAME, validate_dataset  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--num_train', type=int, default=40)
    parser.add_argument('--size', type=int, nargs=2, default=(256, 128), metavar=('W', 'H'))
    parser.add_argument('--rounds', type=int, default=3)
    return parser.parse_args()


def main():
    args = parse_args()
    work = tempfile.mkdtemp(prefix='bench_dataset_check_')
    try:
        root = os.path.join(work, 'mini')
        generate_mini_cityscapes(root, args.num_train, 2, tuple(args.size), seed=0)
        # Files changed in the last seconds are never remembered (timestamps too coarse):
        # date them back, as a downloaded dataset is.
        an_hour_ago = time.time() - 3600
        for parent, _, files in os.walk(root):
            for name in files:
                os.utime(os.path.join(parent, name), (an_hour_ago, an_hour_ago))
        dataset = Cityscapes(transforms=[Normalize()], dataset_root=root, mode='train')
        cache = os.path.join(root, CHECK_CACHE_NAME)
        times = {'all, cold': [], 'all, warm': [], 'sample (first and last 8)': []}
        for _ in range(args.rounds):
            if os.path.exists(cache):
                os.remove(cache)
            for name, kwargs in (('all, cold', {}), ('all, warm', {}),
                                 ('sample (first and last 8)', {'check_labels': 'sample',
                                                                'cache': False})):
                start = time.perf_counter()
                validate_dataset(dataset, 19, **kwargs)
                times[name].append((time.perf_counter() - start) * 1000)
        cold = statistics.median(times['all, cold'])
        print(f'{args.num_train} train images of {args.size[0]}x{args.size[1]}, '
              f'median of {args.rounds} rounds')
        print('| check | ms | / cold |')
        print('|---|---|---|')
        for name, values in times.items():
            ms = statistics.median(values)
            print(f'| {name} | {ms:.1f} | {ms / cold:.2f} |')
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
    main()
