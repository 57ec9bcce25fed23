"""psanet.core.options: every count is refused at 0 and below, from Python and from train.py's
command line, in one line naming the flag, before anything is built or written."""
import pytest

import engine_helpers as helpers
import train as train_script
from psanet.cli import run_cli
from psanet.core.options import InferenceOptions, TrainOptions
from psanet.core.train import train_from_config
from psanet.errors import ConfigError

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
