"""psanet.core.options: every count is refused at 0 and below, from Python and from train.py's
command line, in one line naming the flag, before anything is built or written; every options
class is frozen, and none is copied with changes."""
import ast
import dataclasses
import importlib
import os

import pytest

import engine_helpers as helpers
import train as train_script
from psanet.cli import run_cli
from psanet.core.options import InferenceOptions, TrainOptions
from psanet.core.train import train_from_config
from psanet.deploy.predictor import PredictorOptions
from psanet.errors import ConfigError
from psanet.export import ExportOptions

COUNTS = ('iters', 'batch_size', 'save_interval', 'log_iters')
BAD = (-1, 0, -5)


@pytest.mark.parametrize('value', BAD)
@pytest.mark.parametrize('name', COUNTS)
def test_train_options_refuse_counts_below_one(name, value):
    given = dict(iters=4, batch_size=2, save_interval=2, log_iters=1)
    given[name] = value
    with pytest.raises(ConfigError) as info:
        TrainOptions(**given)
    assert str(info.value) == f'--{name} must be a positive integer, got {value}.'


@pytest.mark.parametrize('name', COUNTS)
def test_train_options_take_one(name):
    given = dict(iters=4, batch_size=2, save_interval=2, log_iters=1)
    given[name] = 1
    assert getattr(TrainOptions(**given), name) == 1


@pytest.mark.parametrize('value', (-1, 0))
@pytest.mark.parametrize('name', COUNTS)
def test_train_py_refuses_counts_below_one_before_writing(tmp_path, capsys, name, value):
    root = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=2, num_val=1)
    config = helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(root, iters=2))
    save_dir = tmp_path / 'out'
    argv = ['--config', config, '--device', 'cpu', '--save_dir', str(save_dir),
            f'--{name}', str(value)]
    code = run_cli(train_from_config, **vars(train_script.parse_args(argv)))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and lines == [f'error: --{name} must be a positive integer, got '
                                   f'{value}.'], err
    assert not save_dir.exists()


# The inference options' counts: window sizes and strides (two ints each), and scales.
@pytest.mark.parametrize('value', (-1, 0))
@pytest.mark.parametrize('name, axis', [('crop_size', 0), ('crop_size', 1), ('stride', 0),
                                        ('stride', 1)])
def test_inference_options_refuse_window_counts_below_one(name, axis, value):
    given = {'crop_size': [64, 32], 'stride': [32, 16]}
    given[name][axis] = value
    with pytest.raises(ConfigError) as info:
        InferenceOptions(is_slide=True, crop_size=given['crop_size'], stride=given['stride'])
    assert str(info.value) == (f'--{name} must be two positive integers (width height), got '
                               f'{given[name]!r}.')
    with pytest.raises(ConfigError, match=f'test_config.{name} must be two positive integers'):
        InferenceOptions.from_flags({}, {'is_slide': True, 'crop_size': given['crop_size'],
                                         'stride': given['stride']})


@pytest.mark.parametrize('scales', [(-1.0,), (0,), (1.0, -0.5), (1.0, 0.0)])
def test_inference_options_refuse_scales_at_zero_and_below(scales):
    with pytest.raises(ConfigError, match='--scales must be positive numbers'):
        InferenceOptions(aug_eval=True, scales=scales)


@pytest.mark.parametrize('seed, ok', [(0, True), (2 ** 32 - 1, True), (2 ** 32, False),
                                      (-1, False), (True, False), (1.0, False)])
def test_the_seed_is_what_numpy_and_paddle_accept(seed, ok):
    """numpy's seeds end at 2**32 - 1: np.random.seed says so itself."""
    import numpy as np
    try:
        np.random.RandomState(seed)
        numpy_takes = not isinstance(seed, (bool, float))
    except (ValueError, TypeError):
        numpy_takes = False
    assert numpy_takes == ok
    if ok:
        assert TrainOptions(iters=4, batch_size=2, seed=seed).seed == seed
    else:
        with pytest.raises(ConfigError) as info:
            TrainOptions(iters=4, batch_size=2, seed=seed)
        assert str(info.value) == ('--seed must be an integer from 0 to 4294967295 (what numpy '
                                   f'and Paddle accept), got {seed!r}.')


@pytest.mark.parametrize('value', [True, False, 2.0, '2'])
@pytest.mark.parametrize('name', ['num_workers', 'keep_checkpoint_max'])
def test_a_bool_or_a_non_integer_is_no_count(name, value):
    """True is an int to Python (1): taken, `num_workers: true` in a config would start one
    worker without a word."""
    from psanet.core.options import EvalOptions
    with pytest.raises(ConfigError, match=rf'^--{name} must be 0 \(.*\) or a positive integer, '
                       rf'got {value!r}\.$'):
        if name == 'num_workers':
            EvalOptions(num_workers=value)
        else:
            TrainOptions(iters=4, batch_size=2, keep_checkpoint_max=value)
    for name_ in COUNTS:
        with pytest.raises(ConfigError, match=f'--{name_} must be a positive integer, got True'):
            TrainOptions(**dict(dict(iters=4, batch_size=2), **{name_: True}))


# Every options class, and the checked config: built once at the edge, then only read.
FROZEN = ('psanet.core.options.InferenceOptions', 'psanet.core.options.EvalOptions',
          'psanet.core.options.TrainOptions', 'psanet.export.ExportOptions',
          'psanet.deploy.predictor.PredictorOptions', 'psanet.core.config.LoadedConfig',
          'psanet.serve.startup.ServeOptions')
PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'psanet')


def _trees():
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith('.py'):
                path = os.path.join(folder, name)
                with open(path) as f:
                    yield os.path.relpath(path, PACKAGE), ast.parse(f.read(), path)


@pytest.mark.parametrize('name', FROZEN)
def test_each_options_class_is_a_frozen_dataclass(name):
    module, _, attribute = name.rpartition('.')
    cls = getattr(importlib.import_module(module), attribute)
    assert dataclasses.is_dataclass(cls) and dataclasses.fields(cls)
    assert cls.__dataclass_params__.frozen, f'{name} is not @dataclass(frozen=True)'


def test_every_options_class_of_the_package_is_in_the_frozen_list():
    found = {f'psanet.{path[:-3].replace(os.sep, ".")}.{node.name}'
             for path, tree in _trees() for node in ast.walk(tree)
             if isinstance(node, ast.ClassDef) and node.name.endswith('Options')}
    assert found <= set(FROZEN), found - set(FROZEN)


def test_options_are_never_copied_with_changes_nor_set_after_post_init():
    """No dataclasses.replace anywhere (it re-runs every check and hides which field a command
    changes); object.__setattr__ only in __post_init__, to normalise a value."""
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == 'dataclasses' and \
                    'replace' in [alias.name for alias in node.names]:
                found.append(f'{path}:{node.lineno} imports dataclasses.replace')
            if isinstance(node, ast.Attribute) and node.attr == 'replace' and \
                    isinstance(node.value, ast.Name) and node.value.id == 'dataclasses':
                found.append(f'{path}:{node.lineno} dataclasses.replace')
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.name != '__post_init__':
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Attribute) and inner.attr == '__setattr__' and \
                            isinstance(inner.value, ast.Name) and inner.value.id == 'object':
                        found.append(f'{path}:{inner.lineno} object.__setattr__ in {node.name}')
    assert not found, found


def test_a_built_options_object_refuses_a_change():
    for options in (InferenceOptions(), TrainOptions(), PredictorOptions(), ExportOptions()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(options, dataclasses.fields(options)[0].name, None)
