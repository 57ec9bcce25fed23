"""Config mistakes a new user makes end in one line naming the key or file and the fix.

A ``_base_`` loop names its files; a PSANet argument of the wrong type or
out of range names ``model.<argument>`` and what it accepts, whether it
comes from the YAML or from ``--opts``.
"""
import os
import re

import paddle.nn as nn
import pytest

from conftest import MINI_CONFIG
from psanet.cli import run_cli
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.train import train_from_config
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
    ('psa_type', 3, '0 (collect), 1 (distribute) or 2 (bi-directional)'),
    ('psa_type', 'collect', '0 (collect), 1 (distribute) or 2 (bi-directional)'),
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
        _ = ComponentBuilder(cfg).model
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
    assert 'model.psa_type must be 0 (collect), 1 (distribute) or 2 (bi-directional), got 5' \
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


def test_a_folder_as_config_says_it_is_a_folder(capsys):
    folder = os.path.dirname(MINI_CONFIG)
    line = one_error_line(capsys, load_config, folder)
    assert line.startswith(f'error: config {folder} is a folder: pass one of its .yml files, '
                           f'e.g. {folder}/psanet_'), line


def test_a_compact_mask_that_does_not_fit_the_map_names_the_keys(tmp_path, capsys):
    root = str(tmp_path / 'mini')
    generate_mini_cityscapes(root, num_train=2, num_val=1, size=(64, 32), seed=0)
    # The mini config's 128x64 crops give a 16x8 map at stride 8, 8x4 once shrunk by 2:
    # its mask 7x15 does not fit.
    line = one_error_line(capsys, train_from_config, MINI_CONFIG, device='cpu',
                          save_dir=str(tmp_path / 'out'), iters=1, batch_size=1,
                          opts=[f'train_dataset.dataset_root={root}',
                                f'val_dataset.dataset_root={root}', 'model.compact=True'])
    assert 'model.compact: true needs model.mask_h x model.mask_w equal to the shrunk feature ' \
        'map of every input, but a 4x8 map met mask 7x15' in line
    assert 'set model.mask_h: 4 and model.mask_w: 8' in line and 'model.compact: false' in line


def test_a_failed_download_of_pretrained_weights_says_how_to_go_on(monkeypatch):
    import requests
    from paddleseg.utils import utils as paddleseg_utils

    def no_network(url, *args, **kwargs):
        raise requests.exceptions.ConnectionError(f"HTTPSConnectionPool: {url} (simulated)")

    monkeypatch.setattr(paddleseg_utils, 'download_file_and_uncompress', no_network)
    url = 'https://example.invalid/weights/resnet18_vd.tar.gz'
    message = _model_error(MINI_CONFIG, opts=[f'model.backbone.pretrained={url}'])
    assert message.startswith(f'config {MINI_CONFIG}: cannot download model.backbone.pretrained '
                              f'{url} (')
    assert '(simulated)' in message
    assert '--opts model.backbone.pretrained=/path/to/model.pdparams' in message
    assert '--opts model.backbone.pretrained=None' in message
    # The advice works: with it after the URL, the model builds from random weights, offline.
    advice = message.rsplit('--opts ', 1)[1].rstrip('.')
    cfg = load_config(MINI_CONFIG, opts=[f'model.backbone.pretrained={url}', advice])
    assert ComponentBuilder(cfg).model is not None


@pytest.mark.parametrize('flag, value, zero', [('num_workers', -1, 'load in the main process'),
                                               ('keep_checkpoint_max', -2,
                                                'keep every checkpoint')])
def test_negative_counts_are_refused(tmp_path, capsys, flag, value, zero):
    root = str(tmp_path / 'mini')
    generate_mini_cityscapes(root, num_train=2, num_val=1, size=(64, 32), seed=0)
    line = one_error_line(capsys, train_from_config, MINI_CONFIG, device='cpu',
                          save_dir=str(tmp_path / 'out'), iters=1,
                          opts=[f'train_dataset.dataset_root={root}',
                                f'val_dataset.dataset_root={root}'], **{flag: value})
    assert line == f'error: --{flag} must be 0 ({zero}) or a positive integer, got {value}.'


def test_optimizer_state_as_model_path_names_the_weights_beside_it(tmp_path, capsys):
    checkpoint = tmp_path / 'iter_4'
    checkpoint.mkdir()
    (checkpoint / 'model.pdopt').write_bytes(b'optimizer state')
    (checkpoint / 'model.pdparams').write_bytes(b'weights')
    line = one_error_line(capsys, evaluate_from_config, MINI_CONFIG,
                          str(checkpoint / 'model.pdopt'), device='cpu')
    assert line == (f'error: --model_path {checkpoint}/model.pdopt is the optimizer state of a '
                    f'checkpoint, not its weights: pass {checkpoint}/model.pdparams beside it '
                    '(or the checkpoint folder).')


def test_val_with_weights_does_not_announce_training_from_scratch(tmp_path, capsys):
    import paddle
    from engine_helpers import mini_psanet_for_eval
    root = str(tmp_path / 'mini')
    generate_mini_cityscapes(root, num_train=1, num_val=1, size=(64, 32), seed=0)
    weights = str(tmp_path / 'model.pdparams')
    paddle.save(mini_psanet_for_eval(seed=0).state_dict(), weights)
    capsys.readouterr()
    assert run_cli(evaluate_from_config, MINI_CONFIG, weights, device='cpu',
                   opts=[f'val_dataset.dataset_root={root}',
                         f'train_dataset.dataset_root={root}']) == 0
    out = capsys.readouterr().out
    assert 'Loaded weights' in out and '[EVAL]' in out
    assert 'trained from scratch' not in out and 'pretrained' not in out.lower(), out


def test_use_vdl_without_visualdl_names_the_install(tmp_path, capsys, monkeypatch):
    import sys
    root = str(tmp_path / 'mini')
    generate_mini_cityscapes(root, num_train=2, num_val=1, size=(64, 32), seed=0)
    monkeypatch.setitem(sys.modules, 'visualdl', None)  # as if it were not installed
    line = one_error_line(capsys, train_from_config, MINI_CONFIG, device='cpu',
                          save_dir=str(tmp_path / 'out'), iters=1, use_vdl=True,
                          opts=[f'train_dataset.dataset_root={root}',
                                f'val_dataset.dataset_root={root}'])
    assert line == ('error: --use_vdl needs VisualDL, which is not installed: pip install '
                    'visualdl (or train without --use_vdl).')
    assert not os.path.exists(tmp_path / 'out' / 'iter_1')


def _mini_opts(tmp_path):
    root = str(tmp_path / 'mini')
    generate_mini_cityscapes(root, num_train=2, num_val=1, size=(64, 32), seed=0)
    return [f'train_dataset.dataset_root={root}', f'val_dataset.dataset_root={root}']


@pytest.mark.parametrize('stride', [7, 4, 32, 'eight'])
def test_an_output_stride_resnet_does_not_build_is_refused(tmp_path, capsys, stride):
    # paddleseg's ResNet_vd dilates for 8 and 16 only; any other value silently gave 32.
    line = one_error_line(capsys, train_from_config, MINI_CONFIG, device='cpu',
                          save_dir=str(tmp_path / 'out'), iters=1,
                          opts=[f'model.backbone.output_stride={stride}'])
    assert line.startswith(f'error: config {MINI_CONFIG}: model.backbone.output_stride must be '
                           f'one of 8, 16 for ResNet18_vd, got {stride!r}'), line
    assert not (tmp_path / 'out').exists()


def test_the_output_strides_resnet_builds_pass():
    for stride in (8, 16):
        cfg = load_config(MINI_CONFIG, opts=[f'model.backbone.output_stride={stride}'])
        assert cfg.dic['model']['backbone']['output_stride'] == stride


def test_a_section_that_is_not_a_mapping_is_named(tmp_path, capsys):
    config = write(tmp_path / 'five.yml', f'_base_: {MINI_CONFIG}\nmodel: 5\n')
    line = one_error_line(capsys, load_config, config)
    assert line == (f'error: config {config}: model must be a mapping of keys (such as '
                    '`model: {type: ...}`), got 5: fix the config or the --opts item that sets '
                    'it.')


def test_a_config_that_is_not_utf8_is_named(tmp_path, capsys):
    config = tmp_path / 'latin1.yml'
    data = 'batch_size: 2\n# Stra\xdfe\n'.encode('latin-1')
    config.write_bytes(data)
    line = one_error_line(capsys, load_config, str(config))
    byte = data.index(b'\xdf')
    assert line == f'error: config {config} is not UTF-8 text (byte {byte}): save it as UTF-8.'


@pytest.mark.parametrize('seed', [-1, 2 ** 80])
def test_a_seed_numpy_cannot_take_is_refused(tmp_path, capsys, seed):
    line = one_error_line(capsys, train_from_config, MINI_CONFIG, device='cpu',
                          save_dir=str(tmp_path / 'out'), iters=1, seed=seed)
    assert line == (f'error: --seed must be an integer from 0 to {2 ** 32 - 1} (what numpy and '
                    f'Paddle accept), got {seed}.')


@pytest.mark.parametrize('rate', [float('nan'), float('inf'), -0.1])
def test_a_learning_rate_that_is_not_finite_and_positive_is_refused(tmp_path, capsys, rate):
    line = one_error_line(capsys, train_from_config, MINI_CONFIG, device='cpu',
                          save_dir=str(tmp_path / 'out'), iters=1, learning_rate=rate)
    assert line == f'error: --learning_rate must be a positive finite number, got {rate}.'
    assert not (tmp_path / 'out').exists()


def test_val_refuses_negative_workers(tmp_path, capsys):
    line = one_error_line(capsys, evaluate_from_config, MINI_CONFIG,
                          str(tmp_path / 'unread.pdparams'), device='cpu', num_workers=-1)
    assert line == ('error: --num_workers must be 0 (load in the main process) or a positive '
                    'integer, got -1.')


def test_weights_holding_nan_or_inf_are_refused_naming_the_tensors(tmp_path, capsys):
    import numpy as np
    import paddle
    from engine_helpers import mini_psanet_for_eval
    state = mini_psanet_for_eval(seed=0).state_dict()
    key = 'head.conv_bn_relu.' if any(k.startswith('head.conv_bn_relu.') for k in state) else ''
    names = sorted(k for k in state if k.startswith(key) and state[k].dtype == paddle.float32)
    poisoned, infinite = names[0], names[1]
    values = state[poisoned].numpy().copy()
    values.flat[[0, 3]] = np.nan
    state[poisoned] = paddle.to_tensor(values)
    values = state[infinite].numpy().copy()
    values.flat[1] = -np.inf
    state[infinite] = paddle.to_tensor(values)
    weights = str(tmp_path / 'diverged.pdparams')
    paddle.save(state, weights)
    line = one_error_line(capsys, evaluate_from_config, MINI_CONFIG, weights, device='cpu',
                          opts=_mini_opts(tmp_path))
    assert line.startswith(f'error: weights {weights} hold non-finite values in 2 tensors: '), line
    assert f'{poisoned} (2 NaN, 0 Inf)' in line and f'{infinite} (0 NaN, 1 Inf)' in line
    assert 'earlier checkpoint' in line
