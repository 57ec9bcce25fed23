"""psanet.core.checkpoint and psanet.core.weights: checkpoint folders written whole, pruned and
loaded for a resume, and weights that do not fit the model."""
import json
import os

import numpy as np
import paddle
import pytest

from engine_helpers import TinySegNet
from psanet.core import checkpoint as ckpt
from psanet.core.weights import load_model_weights
from psanet.errors import CheckpointError
from psanet.files import remove_stale_temporaries


def _model_and_optimizer(num_classes=3, seed=0):
    paddle.seed(seed)
    model = TinySegNet(num_classes)
    scheduler = paddle.optimizer.lr.PolynomialDecay(0.1, decay_steps=10, end_lr=0.0)
    optimizer = paddle.optimizer.Momentum(scheduler, momentum=0.9,
                                          parameters=model.parameters())
    # One step so that the optimizer has momentum accumulators to save.
    model(paddle.randn([1, 3, 16, 16]))[0].mean().backward()
    optimizer.step()
    scheduler.step()
    optimizer.clear_grad()
    return model, optimizer, scheduler


def _arrays(state):
    """Numpy copies of a state dict's tensors: saving and loading copies bytes, so the
    tests compare them exactly."""
    return {k: np.array(v.numpy() if hasattr(v, 'numpy') else v) for k, v in state.items()
            if hasattr(v, 'shape')}


def test_save_then_load_round_trip(tmp_path):
    model, optimizer, scheduler = _model_and_optimizer()
    state = {'iteration': 7, 'seed': 3, 'lr_scheduler': scheduler.state_dict()}
    path = ckpt.save_checkpoint(str(tmp_path / 'iter_7'), model, optimizer, state)
    assert sorted(os.listdir(path)) == sorted([ckpt.WEIGHTS_FILE, ckpt.OPTIMIZER_FILE,
                                               ckpt.STATE_FILE])
    model_state, optimizer_state, loaded = ckpt.load_checkpoint(path)
    expected = _arrays(model.state_dict())
    got = _arrays(model_state)
    assert expected.keys() == got.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])
    expected_opt = _arrays(optimizer.state_dict())
    assert expected_opt and expected_opt.keys() <= _arrays(optimizer_state).keys()
    assert loaded['iteration'] == 7 and loaded['seed'] == 3
    assert loaded['lr_scheduler']['last_epoch'] == scheduler.state_dict()['last_epoch']
    assert not [n for n in os.listdir(tmp_path) if n.startswith('.')]


def test_train_state_numbers_of_numpy_and_paddle_are_written_as_plain_json(tmp_path):
    # LR scheduler states may hold numpy scalars, arrays or tensors: JSON gets plain values.
    model, _, _ = _model_and_optimizer()
    state = {'iteration': np.int64(4), 'lr': np.float32(0.5), 'flag': np.bool_(True),
             'nested': {'steps': (np.arange(3), paddle.to_tensor([1.5, 2.0]))}}
    path = ckpt.save_checkpoint(str(tmp_path / 'iter_4'), model, state=state)
    with open(os.path.join(path, ckpt.STATE_FILE)) as f:
        assert json.load(f) == {'iteration': 4, 'lr': 0.5, 'flag': True,
                                'nested': {'steps': [[0, 1, 2], [1.5, 2.0]]}}


def _failing_save(monkeypatch, fail_on_call):
    real_save = paddle.save
    calls = {'n': 0}

    def save(obj, path, *args, **kwargs):
        calls['n'] += 1
        if calls['n'] == fail_on_call:
            # Half a file, then the crash.
            with open(path, 'wb') as f:
                f.write(b'\x80\x04partial')
            raise OSError('disk full (simulated)')
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(paddle, 'save', save)


@pytest.mark.parametrize('fail_on_call', [1, 2])
def test_interrupted_write_keeps_previous_checkpoint(tmp_path, monkeypatch, fail_on_call):
    model, optimizer, _ = _model_and_optimizer()
    ckpt.save_checkpoint(str(tmp_path / 'iter_1'), model, optimizer, {'iteration': 1})
    before = _arrays(model.state_dict())
    # Change the weights so that a half-written iter_2 could not pass for iter_1.
    for p in model.parameters():
        p.set_value(p.numpy() + 1)
    _failing_save(monkeypatch, fail_on_call)
    with pytest.raises(OSError, match='simulated'):
        ckpt.save_checkpoint(str(tmp_path / 'iter_2'), model, optimizer, {'iteration': 2})
    monkeypatch.undo()
    assert not (tmp_path / 'iter_2').exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith('.')]
    assert [i for i, _ in ckpt.list_checkpoints(str(tmp_path))] == [1]
    model_state, _, state = ckpt.load_checkpoint(str(tmp_path / 'iter_1'))
    assert state['iteration'] == 1
    for key, value in _arrays(model_state).items():
        np.testing.assert_array_equal(value, before[key])


def test_interrupted_replace_keeps_previous_best_model(tmp_path, monkeypatch):
    model, _, _ = _model_and_optimizer()
    ckpt.save_checkpoint(str(tmp_path / 'best_model'), model, state={'miou': 0.5})
    _failing_save(monkeypatch, 1)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(str(tmp_path / 'best_model'), model, state={'miou': 0.9})
    monkeypatch.undo()
    with open(tmp_path / 'best_model' / ckpt.STATE_FILE) as f:
        assert json.load(f)['miou'] == 0.5
    # A successful replace swaps the folder and leaves nothing behind.
    ckpt.save_checkpoint(str(tmp_path / 'best_model'), model, state={'miou': 0.9})
    with open(tmp_path / 'best_model' / ckpt.STATE_FILE) as f:
        assert json.load(f)['miou'] == 0.9
    assert os.listdir(tmp_path) == ['best_model']


def test_crash_between_the_two_renames_is_recovered(tmp_path, monkeypatch):
    model, _, _ = _model_and_optimizer()
    ckpt.save_checkpoint(str(tmp_path / 'best_model'), model, state={'miou': 0.5})
    before = _arrays(model.state_dict())
    for p in model.parameters():
        p.set_value(p.numpy() + 1)
    real_replace = os.replace
    calls = {'n': 0}

    def replace(source, target):
        calls['n'] += 1
        if calls['n'] == 2:  # the old folder is aside, the new one not yet in place
            raise KeyboardInterrupt('killed (simulated)')
        return real_replace(source, target)

    monkeypatch.setattr(os, 'replace', replace)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(str(tmp_path / 'best_model'), model, state={'miou': 0.9})
    monkeypatch.undo()
    assert calls['n'] == 2 and not (tmp_path / 'best_model').exists()
    remove_stale_temporaries(str(tmp_path))
    assert os.listdir(tmp_path) == ['best_model']
    with open(tmp_path / 'best_model' / ckpt.STATE_FILE) as f:
        assert json.load(f)['miou'] == 0.5
    fresh = TinySegNet(3)
    load_model_weights(fresh, str(tmp_path / 'best_model'))
    for key, value in _arrays(fresh.state_dict()).items():
        np.testing.assert_array_equal(value, before[key])
    # With best_model present, a leftover old copy is only deleted.
    os.makedirs(tmp_path / '.best_model.old.tmp-xyz' / 'previous')
    remove_stale_temporaries(str(tmp_path))
    assert os.listdir(tmp_path) == ['best_model']


def test_prune_list_and_stale_temporaries(tmp_path):
    model, optimizer, _ = _model_and_optimizer()
    for iteration in (2, 4, 6, 8):
        ckpt.save_checkpoint(str(tmp_path / f'iter_{iteration}'), model, optimizer,
                             {'iteration': iteration})
    os.makedirs(tmp_path / '.iter_10.tmp-abc')          # left by a killed process
    os.makedirs(tmp_path / 'iter_12')                    # no model.pdparams: not a checkpoint
    assert [i for i, _ in ckpt.list_checkpoints(str(tmp_path))] == [2, 4, 6, 8]
    removed = ckpt.prune_checkpoints(str(tmp_path), 2)
    assert sorted(os.path.basename(p) for p in removed) == ['iter_2', 'iter_4']
    assert [i for i, _ in ckpt.list_checkpoints(str(tmp_path))] == [6, 8]
    assert ckpt.prune_checkpoints(str(tmp_path), 0) == []
    remove_stale_temporaries(str(tmp_path))
    assert not (tmp_path / '.iter_10.tmp-abc').exists()


def test_load_checkpoint_errors(tmp_path):
    model, optimizer, _ = _model_and_optimizer()
    with pytest.raises(CheckpointError, match='is not a folder'):
        ckpt.load_checkpoint(str(tmp_path / 'iter_5'))
    ckpt.save_checkpoint(str(tmp_path / 'iter_5'), model, optimizer)
    os.remove(tmp_path / 'iter_5' / ckpt.OPTIMIZER_FILE)
    with pytest.raises(CheckpointError, match='has no model.pdopt'):
        ckpt.load_checkpoint(str(tmp_path / 'iter_5'))
    # Without train_state.json (deleted, or paddleseg's) the seed and data order are unknown.
    ckpt.save_checkpoint(str(tmp_path / 'iter_5'), model, optimizer)
    with pytest.raises(CheckpointError, match='has no train_state.json'):
        ckpt.load_checkpoint(str(tmp_path / 'iter_5'))
    ckpt.save_checkpoint(str(tmp_path / 'iter_5'), model, optimizer, {'iteration': 5})
    assert ckpt.load_checkpoint(str(tmp_path / 'iter_5'))[2] == {'iteration': 5}
    with open(tmp_path / 'iter_5' / ckpt.WEIGHTS_FILE, 'wb') as f:
        f.write(b'not a pickle')
    with pytest.raises(CheckpointError, match='cannot be read'):
        ckpt.load_checkpoint(str(tmp_path / 'iter_5'))


def test_load_model_weights_accepts_file_or_folder(tmp_path):
    model, _, _ = _model_and_optimizer(seed=1)
    ckpt.save_checkpoint(str(tmp_path / 'best_model'), model)
    other, _, _ = _model_and_optimizer(seed=2)
    for path in (tmp_path / 'best_model', tmp_path / 'best_model' / ckpt.WEIGHTS_FILE):
        assert load_model_weights(other, str(path)).endswith(ckpt.WEIGHTS_FILE)
        for key, value in _arrays(model.state_dict()).items():
            np.testing.assert_array_equal(_arrays(other.state_dict())[key], value)


def test_load_model_weights_names_mismatching_parameters(tmp_path):
    model, _, _ = _model_and_optimizer(num_classes=3)
    ckpt.save_checkpoint(str(tmp_path / 'best_model'), model)
    wrong_classes = TinySegNet(5)
    with pytest.raises(CheckpointError) as info:
        load_model_weights(wrong_classes, str(tmp_path / 'best_model'))
    message = str(info.value)
    assert 'classifier.weight (file [3, 8, 1, 1], model [5, 8, 1, 1])' in message
    assert 'aux.bias' in message and 'TinySegNet' in message
    without_aux = TinySegNet(3, enable_auxiliary_loss=False)
    with pytest.raises(CheckpointError, match=r'2 not in the model: aux\.weight, aux\.bias'):
        load_model_weights(without_aux, str(tmp_path / 'best_model'))


@pytest.mark.parametrize('make', ['missing', 'empty_folder'])
def test_load_model_weights_missing_path(tmp_path, make):
    path = tmp_path / 'nothing'
    if make == 'empty_folder':
        os.makedirs(path)
    with pytest.raises(CheckpointError, match='--model_path'):
        load_model_weights(TinySegNet(3), str(path))


@pytest.mark.parametrize('iteration', ['two', -3, 2.5, None])
def test_a_training_state_with_a_bad_iteration_is_one_line(tmp_path, capsys, iteration):
    from psanet.cli import run_cli
    model, optimizer, _ = _model_and_optimizer()
    path = str(tmp_path / 'iter_2')
    ckpt.save_checkpoint(path, model, optimizer, {'iteration': iteration, 'epoch': 1})
    code = run_cli(ckpt.load_checkpoint, path)
    err = capsys.readouterr().err
    assert code == 2 and 'Traceback' not in err
    state = os.path.join(path, ckpt.STATE_FILE)
    assert err.strip().splitlines() == [
        f'error: training state {state}: "iteration" must be a non-negative integer, got '
        f'{iteration!r}: pass another iter_N folder of the same save_dir to --resume_model.']
