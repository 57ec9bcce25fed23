"""Runs cityscapesScripts' official pixel-level evaluator, also on numpy >= 2.4.

    CITYSCAPES_DATASET=data/cityscapes CITYSCAPES_RESULTS=output/results \
        python tools/evaluate_cityscapes.py

The same as cityscapesScripts' ``csEvalPixelLevelSemanticLabeling`` (same
environment variables, same output), with numpy's ``in1d``, which numpy 2.4
removed and the evaluator still calls, given back in this process
(psanet.compat.NUMPY_IN1D). Without ground truth or predictions to pair
it exits 2 naming the two variables, where the evaluator would report NaNs.
"""
import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from psanet.compat import cityscapes_evaluator_fix  # noqa: E402

VARIABLES = ('set CITYSCAPES_DATASET to the dataset root (it holds gtFine/val/<city>/) and '
             'CITYSCAPES_RESULTS to the folder `val.py --save_dir` wrote the *_labelIds.png to')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        epilog='The official evaluator reads two environment variables. ' +
        VARIABLES.replace('set', 'Set', 1) + '.',
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('files', nargs='*', help="Optional: the evaluator's explicit form, "
                        'prediction and ground-truth files (at least 4 paths).')
    return parser.parse_args(argv)


def pairs_error(files):
    """The line to exit with when there is nothing to evaluate, else None."""
    if files:
        return None if len(files) > 3 else (
            f'{len(files)} file(s) given: the explicit form takes prediction and ground-truth '
            f'files, at least 4 in all; or pass none and {VARIABLES}.')
    root = os.environ.get('CITYSCAPES_DATASET')
    if not root:
        return f'CITYSCAPES_DATASET is not set: {VARIABLES}.'
    search = os.path.join(root, 'gtFine', 'val', '*', '*_gtFine_labelIds.png')
    if not glob.glob(search):
        return f'no ground truth {search} (CITYSCAPES_DATASET={root}): {VARIABLES}.'
    results = os.environ.get('CITYSCAPES_RESULTS') or os.path.join(root, 'results')
    if not glob.glob(os.path.join(results, '**', '*.png'), recursive=True):
        return f'no predictions (*.png) in {results}: {VARIABLES}.'
    return None


if __name__ == '__main__':
    args = parse_args()
    error = pairs_error(args.files)
    if error:
        print(f'error: {error}', file=sys.stderr)
        sys.exit(2)
    cityscapes_evaluator_fix()
    from cityscapesscripts.evaluation.evalPixelLevelSemanticLabeling import main
    sys.exit(main())
