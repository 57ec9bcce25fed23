"""Config mistakes a new user makes end in one line naming the key or file and the fix.

A ``_base_`` loop names its files; a PSANet argument of the wrong type or
out of range names ``model.<argument>`` and what it accepts, whether it
comes from the YAML or from ``--opts``.
"""
import re

import paddle.nn as nn
import pytest

from conftest import MINI_CONFIG
from psanet.cli import run_cli
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.val import evaluate_from_config
from psanet.data import generate_mini_cityscapes
from psanet.errors import ArgumentError, ConfigError
from psanet.models import PSANet


def write(path, text):
    path.write_text(text)
    return str(path)


def one_error_line(capsys, function, *args, **kwargs):
    code = run_cli(function, *args, **kwargs)
    err = capsys.readouterr().err
    assert code == 2 and 'Traceback' not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith('error: '), err
    return lines[0]


def test_two_files_naming_each_other(tmp_path, capsys):
    a = write(tmp_path / 'a.yml', '_base_: b.yml\nbatch_size: 2\n')
    b = write(tmp_path / 'b.yml', '_base_: ./a.yml\niters: 10\n')
    line = one_error_line(capsys, load_config, a)
    assert f'{a} -> {b} -> {a}' in line and 'loop' in line
    assert f'remove _base_: ./a.yml from {b}' in line


def test_a_file_naming_itself(tmp_path):
    path = write(tmp_path / 'self.yml', '_base_: [self.yml]\n')
    with pytest.raises(ConfigError, match=re.escape(f'{path} -> {path}: remove _base_: self.yml')):
        load_config(path)


def test_a_loop_below_the_top_file(tmp_path):
    (tmp_path / 'sub').mkdir()
    top = write(tmp_path / 'top.yml', '_base_: sub/a.yml\n')
    a = write(tmp_path / 'sub' / 'a.yml', '_base_: ../b.yml\n')
    b = write(tmp_path / 'b.yml', '_base_: sub/a.yml\n')
    with pytest.raises(ConfigError) as error:
        load_config(top)
    message = str(error.value)
    assert message.startswith(f'config {top}:')
    assert f'{a} -> {b} -> {a}' in message


def test_two_files_sharing_a_base_are_not_a_loop(tmp_path):
    write(tmp_path / 'x.yml', f'_base_: {MINI_CONFIG}\nbatch_size: 3\n')
    write(tmp_path / 'y.yml', f'_base_: {MINI_CONFIG}\niters: 7\n')
    top = write(tmp_path / 'top.yml', '_base_: [x.yml, y.yml]\n')
    cfg = load_config(top)
    assert cfg.dic['model']['type'] == 'PSANet'


class FourOutputs(nn.Layer):
    """Stands in for a backbone: PSANet reads only ``feat_channels`` when it is built."""
    feat_channels = [4, 8, 8, 16]


GOOD = dict(num_classes=3, psa_type=2, mask_h=5, mask_w=7, psa_channels=8, shrink_factor=2,
            normalization_factor=1.0)


@pytest.mark.parametrize('argument, value, accepts', [
    ('mask_h', 'abc', 'a positive integer'),
    ('mask_h', -3, 'a positive integer'),
    ('mask_w', 0, 'a positive integer'),
    ('mask_w', 7.5, 'a positive integer'),
    ('mask_w', True, 'a positive integer'),
    ('psa_channels', '64', 'a positive integer'),
    ('shrink_factor', 0, 'a positive integer'),
    ('num_classes', 0, 'a positive integer'),
    ('psa_type', 3, '0 (collect), 1 (distribute) or 2 (bi-direction)'),
    ('psa_type', 'collect', '0 (collect), 1 (distribute) or 2 (bi-direction)'),
    ('normalization_factor', 0, 'a positive number, or null for mask_h*mask_w'),
    ('normalization_factor', float('nan'), 'a positive number, or null for mask_h*mask_w'),
    ('normalization_factor', 'one', 'a positive number, or null for mask_h*mask_w'),
    ('compact', 'yes', 'true or false'),
    ('use_psa', 1, 'true or false'),
    ('psa_softmax', None, 'true or false'),
    ('enable_auxiliary_loss', 'false', 'true or false'),
    ('align_corners', 0, 'true or false'),
    ('backbone_indices', (2, 4), "2 indices (auxiliary, main) of the backbone's 4 outputs"),
    ('backbone_indices', (3, ), "2 indices (auxiliary, main) of the backbone's 4 outputs"),
    ('pretrained', 5, 'a path or URL of weights, or null'),
])
def test_bad_model_arguments_name_the_argument(argument, value, accepts):
    kwargs = dict(GOOD, **{argument: value})
    with pytest.raises(ValueError) as error:
        PSANet(backbone=FourOutputs(), **kwargs)
    assert isinstance(error.value, ArgumentError)
    assert str(error.value) == f'{argument} must be {accepts}, got {value!r}.'


def test_good_model_arguments_build():
    model = PSANet(backbone=FourOutputs(), normalization_factor=None, **{
        k: v for k, v in GOOD.items() if k != 'normalization_factor'})
    assert model.head.branches[0].scale == pytest.approx(1 / 35)


def _model_error(path, opts=None):
    cfg = load_config(path, opts=opts)
    with pytest.raises(ConfigError) as error:
        ComponentBuilder(cfg).model
    return str(error.value)


def test_a_wrong_type_in_the_yaml_names_the_config_key(tmp_path):
    path = write(tmp_path / 'wrong.yml', f'_base_: {MINI_CONFIG}\nmodel:\n  mask_h: "abc"\n')
    message = _model_error(path)
    assert message.startswith(f"config {path}: model.mask_h must be a positive integer, "
                              "got 'abc'")
    path = write(tmp_path / 'negative.yml', f'_base_: {MINI_CONFIG}\nmodel:\n  mask_h: -3\n')
    assert 'model.mask_h must be a positive integer, got -3' in _model_error(path)


def test_a_wrong_type_from_opts_names_the_config_key():
    # paddleseg's --opts keeps a value that is no Python literal as a string
    message = _model_error(MINI_CONFIG, opts=['model.mask_w=abc'])
    assert "model.mask_w must be a positive integer, got 'abc'" in message
    message = _model_error(MINI_CONFIG, opts=['model.psa_type=5'])
    assert 'model.psa_type must be 0 (collect), 1 (distribute) or 2 (bi-direction), got 5' \
        in message


def test_val_prints_the_model_argument_error_as_one_line(tmp_path, capsys):
    root = str(tmp_path / 'mini')
    generate_mini_cityscapes(root, num_train=1, num_val=1, size=(64, 32), seed=0)
    weights = tmp_path / 'model.pdparams'
    weights.write_bytes(b'never read: the model fails to build first')
    line = one_error_line(capsys, evaluate_from_config, MINI_CONFIG, str(weights), device='cpu',
                          opts=[f'val_dataset.dataset_root={root}',
                                f'train_dataset.dataset_root={root}', 'model.mask_w=abc'])
    assert "model.mask_w must be a positive integer, got 'abc'" in line
