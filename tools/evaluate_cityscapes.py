"""Runs cityscapesScripts' official pixel-level evaluator, also on numpy >= 2.4.

    CITYSCAPES_DATASET=data/cityscapes CITYSCAPES_RESULTS=output/results \
        python tools/evaluate_cityscapes.py

The same as cityscapesScripts' ``csEvalPixelLevelSemanticLabeling`` (same
environment variables, same output), with numpy's ``in1d``, which numpy 2.4
removed and the evaluator still calls, given back in this process
(psanet/compat.py, workaround 11).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from psanet.compat import cityscapes_evaluator_fix  # noqa: E402

if __name__ == '__main__':
    cityscapes_evaluator_fix()
    from cityscapesscripts.evaluation.evalPixelLevelSemanticLabeling import main
    sys.exit(main())
