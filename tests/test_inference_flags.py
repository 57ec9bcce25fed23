"""Inference flags that would be ignored, or hold bad values, are refused in one line.

``--scales``, the flips and ``--aug_combine`` act only with ``--aug_eval`` (``--aug_pred``),
``--crop_size`` and ``--stride`` only with ``--is_slide``; the config's
``test_config`` counts as set.
"""
import os
import re
import sys

import pytest

from conftest import MINI_CONFIG, ROOT, run_process
import predict
import val
from psanet.core.options import InferenceOptions
from psanet.errors import ConfigError

# (flags on the command line, the one that does nothing, the flag it needs)
NEEDS = [
    (['--scales', '0.5'], '--scales', '--aug_eval'),
    (['--scales', '0.75', '1.25'], '--scales', '--aug_eval'),
    (['--flip_horizontal'], '--flip_horizontal', '--aug_eval'),
    (['--flip_vertical'], '--flip_vertical', '--aug_eval'),
    (['--aug_combine', 'softmax'], '--aug_combine', '--aug_eval'),
    (['--crop_size', '64', '32'], '--crop_size', '--is_slide'),
    (['--stride', '32', '16'], '--stride', '--is_slide'),
    (['--is_slide', '--crop_size', '64', '32', '--stride', '32', '16', '--flip_horizontal'],
     '--flip_horizontal', '--aug_eval'),
    (['--aug_eval', '--crop_size', '64', '32'], '--crop_size', '--is_slide'),
]


INFERENCE_FLAGS = ('aug_eval', 'scales', 'flip_horizontal', 'flip_vertical', 'aug_combine',
                   'is_slide', 'crop_size', 'stride', 'precision', 'amp_level')


def flags(argv):
    """val.py's inference flags as it parses them."""
    args = vars(val.parse_args(['--config', 'c.yml', '--model_path', 'm.pdparams'] + argv))
    return {name: args[name] for name in INFERENCE_FLAGS}


def options_from(given, aug_flag, test_config=None):
    return InferenceOptions.from_flags(given, test_config, aug_flag)


@pytest.mark.parametrize('argv, lonely, needed', NEEDS)
def test_a_flag_without_the_flag_it_needs(argv, lonely, needed):
    with pytest.raises(ConfigError) as error:
        options_from(flags(argv), '--aug_eval')
    message = str(error.value)
    assert message.startswith(f'{lonely} only acts with {needed}'), message
    assert f'add {needed} or drop {lonely}' in message


@pytest.mark.parametrize('argv', [
    [],
    ['--aug_eval'],
    ['--aug_eval', '--scales', '0.75', '1.0', '1.25', '--flip_horizontal', '--flip_vertical'],
    ['--aug_eval', '--aug_combine', 'logits'],
    ['--aug_eval', '--flip_horizontal', '--aug_combine', 'softmax'],
    ['--is_slide', '--crop_size', '64', '32', '--stride', '32', '16'],
    ['--aug_eval', '--flip_horizontal', '--is_slide', '--crop_size', '64', '32', '--stride',
     '64', '32'],
])
def test_flags_that_act_pass(argv):
    options_from(flags(argv), '--aug_eval')


def test_test_config_switches_count():
    options_from(flags(['--scales', '0.5', '2.0']), '--aug_eval', {'aug_eval': True})
    options_from(flags(['--crop_size', '64', '32']), '--aug_eval',
                          {'is_slide': True, 'stride': [32, 16]})
    with pytest.raises(ConfigError, match='--flip_vertical only acts with --aug_eval'):
        options_from(flags(['--flip_vertical']), '--aug_eval', {'scales': [1.0]})


@pytest.mark.parametrize('argv, test_config, named', [
    (['--aug_eval', '--scales', '-0.5'], None, '--scales must be positive numbers'),
    (['--aug_eval', '--scales', '1.0', '0'], None, '--scales must be positive numbers'),
    (['--aug_eval'], {'scales': -1}, 'test_config.scales must be positive numbers'),
    (['--aug_eval', '--aug_combine', 'mean'], None,
     "--aug_combine must be one of logits or softmax, got 'mean'"),
    (['--aug_eval'], {'aug_combine': 'probs'},
     "test_config.aug_combine must be one of logits or softmax, got 'probs'"),
    (['--is_slide', '--crop_size', '0', '32', '--stride', '16', '16'], None,
     '--crop_size must be two positive integers'),
    (['--is_slide', '--crop_size', '64', '32', '--stride', '16', '-1'], None,
     '--stride must be two positive integers'),
    (['--is_slide', '--stride', '16', '16'], None, '--is_slide needs --crop_size'),
    (['--is_slide', '--crop_size', '64', '32'], None, '--is_slide needs --stride'),
])
def test_bad_values(argv, test_config, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        options_from(flags(argv), '--aug_eval', test_config)


def test_aug_combine_from_test_config_or_the_command_line():
    def merged(test_config, **given):
        return InferenceOptions.from_flags(given, test_config)
    assert merged({}).aug_combine == 'logits'  # paddleseg 2.8's
    assert merged({'aug_eval': True, 'aug_combine': 'softmax'}).aug_combine == 'softmax'
    assert merged({'aug_eval': True, 'aug_combine': 'softmax'},
                  aug_combine='logits').aug_combine == 'logits'
    assert merged({'aug_eval': True, 'aug_combine': 'softmax'},
                  aug_combine=None).aug_combine == 'softmax'
    options_from(flags(['--aug_combine', 'softmax']), '--aug_eval', {'aug_eval': True})


def test_predict_names_its_own_flag():
    """predict.py parses --aug_pred straight into the options' aug_eval field; the messages
    still name --aug_pred."""
    args = vars(predict.parse_args(['--config', 'c.yml', '--model_path', 'm.pdparams',
                                    '--image_path', 'x.png', '--aug_pred', '--scales', '0.5']))
    assert 'aug_pred' not in args
    given = {name: args[name] for name in INFERENCE_FLAGS if name in args}
    assert options_from(given, '--aug_pred').aug_eval is True
    with pytest.raises(ConfigError, match='--scales only acts with --aug_pred'):
        options_from(dict(given, aug_eval=None), '--aug_pred')
    # the config spells the switch aug_eval for both command lines
    options_from({'scales': [0.5]}, '--aug_pred', {'aug_eval': True})
    with pytest.raises(TypeError, match=r"not inference flags: \['aug_pred'\]"):
        options_from({'aug_pred': True}, '--aug_pred')


def test_val_py_refuses_scales_without_aug_eval(tmp_path):
    weights = tmp_path / 'model.pdparams'
    weights.write_bytes(b'never read: the flags are checked first')
    done = run_process([sys.executable, os.path.join(ROOT, 'val.py'), '--config', MINI_CONFIG,
                        '--model_path', str(weights), '--device', 'cpu', '--scales', '-0.5'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith('error: --scales only acts with --aug_eval'), done.stderr
