"""Every command line reads its flags before it loads Paddle: ``--help`` and a flag error
come at once, not after the seconds Paddle's import takes (bench: ``time python train.py
--help``). Checked by what the interpreter has imported when argparse exits."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPTS = ['train.py', 'val.py', 'predict.py', 'export.py', 'serve.py', 'deploy/python/infer.py',
           'tools/convert_checkpoint.py', 'tools/visualize_attention.py',
           'tools/evaluate_cityscapes.py', 'tools/make_mini_cityscapes.py',
           'tools/prepare_cityscapes.py']

# Runs a script as ``python <script> <flags>`` does; when it exits (argparse's --help or
# its error), prints which heavy packages were imported by then.
PROBE = r'''
import runpy, sys
path = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(path, run_name='__main__')
finally:
    heavy = sorted(name for name in ('paddle', 'paddleseg', 'cv2', 'onnxruntime', 'openvino')
                   if name in sys.modules)
    print('imported:', ' '.join(heavy) or 'nothing heavy', file=sys.stderr)
'''


def probe(script, *flags):
    return subprocess.run([sys.executable, '-c', PROBE, os.path.join(ROOT, script), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize('script', SCRIPTS)
def test_help_comes_before_paddle_loads(script):
    result = probe(script, '--help')
    assert result.returncode == 0, result.stderr
    assert 'usage:' in result.stdout
    assert 'paddle' not in result.stderr.splitlines()[-1], result.stderr.splitlines()[-1]


@pytest.mark.parametrize('script', SCRIPTS)
def test_an_unknown_flag_is_refused_before_paddle_loads(script):
    result = probe(script, '--no_such_flag', '1')
    assert result.returncode == 2
    assert 'unrecognized arguments: --no_such_flag' in result.stderr or \
        'the following arguments are required' in result.stderr, result.stderr
    assert 'paddle' not in result.stderr.splitlines()[-1], result.stderr.splitlines()[-1]
