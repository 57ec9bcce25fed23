"""``--resume_model auto``: the same command run again continues the run in --save_dir.

Every resumed run is compared with an uninterrupted run of the same command in
another folder: its per-iteration losses and its final weights must be the
same. A stop is stood in by deleting the checkpoints after it (what a run
stopped there leaves); launched stops and restarts: test_preemption.py,
test_elastic.py, test_multinode.py.
"""
import json
import os
import shutil

import numpy as np
import paddle
import pytest

import engine_helpers as helpers
from disk_helpers import digests
from psanet.cli import run_cli
from psanet.core import checkpoint as ckpt
from psanet.core.options import recipe_changes
from psanet.core.train import resume_command, train_from_config

ITERS = 10
INTERVAL = 3  # checkpoints at 3, 6, 9 and 10


@pytest.fixture
def toy(tmp_path):
    root = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=4, num_val=2)
    return root, helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(root))


def _run(capsys, config, save_dir, **flags):
    """(exit code, the 'error:' line or None, stdout, train()'s result) of train.py's work."""
    results = []

    def work(**kwargs):
        results.append(train_from_config(**kwargs))
        return results[-1]

    options = dict(config=config, save_dir=save_dir, iters=ITERS, save_interval=INTERVAL,
                   keep_checkpoint_max=0, seed=4, log_iters=1, device='cpu',
                   resume_model='auto')
    code = run_cli(work, **{**options, **flags})
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith('error: ')]
    assert 'Traceback' not in err and len(errors) <= 1, err
    return code, (errors[0] if errors else None), out, (results[0] if results else None)


def _weights(path):
    return {k: np.asarray(v) for k, v in paddle.load(os.path.join(path, ckpt.WEIGHTS_FILE)).items()}


def _assert_same_weights(path, reference):
    got, want = _weights(path), _weights(reference)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.fixture
def uninterrupted(tmp_path, capsys, toy):
    save_dir = str(tmp_path / 'uninterrupted')
    code, error, out, result = _run(capsys, toy[1], save_dir)
    assert code == 0 and error is None
    assert '--resume_model auto: no checkpoint in' in out and 'starting at iteration 0' in out
    return save_dir, result['losses']


def _stopped_at(reference, save_dir, iteration):
    """save_dir as a run of the same command stopped after ``iteration`` leaves it."""
    shutil.copytree(reference, save_dir)
    for found, path in ckpt.list_checkpoints(save_dir):
        if found > iteration:
            shutil.rmtree(path)


def _said(out, text):
    return [line for line in out.splitlines() if text in line]


def test_the_same_command_again_continues_exactly(tmp_path, capsys, toy, uninterrupted):
    reference, losses = uninterrupted
    save_dir = str(tmp_path / 'stopped')
    _stopped_at(reference, save_dir, 6)
    code, error, out, result = _run(capsys, toy[1], save_dir)
    assert code == 0 and error is None
    assert _said(out, f'--resume_model auto: resuming from {os.path.join(save_dir, "iter_6")}')
    assert result['start_iter'] == 6 and result['losses'] == losses[6:]
    _assert_same_weights(os.path.join(save_dir, 'iter_10'), os.path.join(reference, 'iter_10'))

    # Once more after the end: nothing to train, nothing written but the log.
    before = {k: v for k, v in digests(save_dir).items() if k != 'train.log'}
    code, error, out, result = _run(capsys, toy[1], save_dir)
    assert code == 0 and error is None and result['losses'] == []
    assert _said(out, 'is the last of 10 iterations: the run is done')
    assert {k: v for k, v in digests(save_dir).items() if k != 'train.log'} == before


@pytest.mark.parametrize('damage', ['truncated weights', 'no optimizer state',
                                    'no train_state.json', 'empty train_state.json'])
def test_a_newest_checkpoint_that_does_not_load_is_named_and_passed_over(
        tmp_path, capsys, toy, uninterrupted, damage):
    reference, losses = uninterrupted
    save_dir = str(tmp_path / 'stopped')
    _stopped_at(reference, save_dir, 9)
    newest = os.path.join(save_dir, 'iter_9')
    if damage == 'truncated weights':
        path = os.path.join(newest, ckpt.WEIGHTS_FILE)
        with open(path, 'rb') as f:
            data = f.read()
        with open(path, 'wb') as f:
            f.write(data[:len(data) // 2])
        named = 'model weights'
    elif damage == 'no optimizer state':
        os.remove(os.path.join(newest, ckpt.OPTIMIZER_FILE))
        named = 'has no model.pdopt'
    elif damage == 'no train_state.json':
        os.remove(os.path.join(newest, ckpt.STATE_FILE))
        named = 'has no train_state.json'
    else:
        open(os.path.join(newest, ckpt.STATE_FILE), 'w').close()
        named = 'cannot be read'
    code, error, out, result = _run(capsys, toy[1], save_dir)
    assert code == 0 and error is None
    warned = _said(out, f'--resume_model auto: {newest} does not load')
    assert len(warned) == 1 and named in warned[0], out
    assert result['start_iter'] == 6 and result['losses'] == losses[6:]
    for iteration in (9, 10):  # iter_9 is whole again: this run saved it
        _assert_same_weights(os.path.join(save_dir, f'iter_{iteration}'),
                             os.path.join(reference, f'iter_{iteration}'))
        ckpt.load_checkpoint(os.path.join(save_dir, f'iter_{iteration}'))


def test_no_checkpoint_that_loads_is_one_line_and_deletes_nothing(tmp_path, capsys, toy,
                                                                  uninterrupted):
    save_dir = str(tmp_path / 'broken')
    _stopped_at(uninterrupted[0], save_dir, 6)
    for iteration in (3, 6):
        os.remove(os.path.join(save_dir, f'iter_{iteration}', ckpt.OPTIMIZER_FILE))
    before = digests(save_dir)
    code, error, _, _ = _run(capsys, toy[1], save_dir)
    assert code == 2
    assert error.startswith(f'error: --resume_model auto: no checkpoint in --save_dir {save_dir} '
                            'loads (iter_6: has no model.pdopt, iter_3: has no model.pdopt)')
    assert 'nothing was deleted' in error
    assert digests(save_dir) == before


@pytest.mark.parametrize('change', ['iters', 'learning rate', 'batch_size', 'crop', 'model'])
def test_a_checkpoint_of_another_recipe_is_refused_naming_the_keys(tmp_path, capsys, toy,
                                                                   uninterrupted, change):
    root, config = toy
    save_dir = str(tmp_path / 'stopped')
    _stopped_at(uninterrupted[0], save_dir, 6)
    flags, differs = {}, None
    if change == 'iters':
        flags, differs = {'iters': 12}, 'iters: 10 -> 12'
    elif change == 'learning rate':
        flags, differs = {'learning_rate': 0.05}, 'lr_scheduler.learning_rate: 0.1 -> 0.05'
    elif change == 'batch_size':
        flags, differs = {'batch_size': 1}, 'batch_size: 2 -> 1'
    elif change == 'crop':
        other = helpers.toy_config(root, train_transforms=[
            {'type': 'RandomPaddingCrop', 'crop_size': [32, 32]}, {'type': 'Normalize'}])
        config = helpers.write_config(tmp_path / 'crop.yml', other)
        differs = 'train_dataset.transforms[0].type: RandomHorizontalFlip -> RandomPaddingCrop'
    else:
        config = helpers.write_config(tmp_path / 'model.yml',
                                      helpers.toy_config(root, aux=False))
        differs = 'model.enable_auxiliary_loss: True -> False'
    before = digests(save_dir)
    code, error, _, _ = _run(capsys, config, save_dir, **flags)
    assert code == 2, error
    checkpoint = os.path.join(save_dir, 'iter_6')
    assert error.startswith(f'error: --resume_model auto: the newest checkpoint in --save_dir '
                            f'{save_dir}, {checkpoint}, was trained with another config or '
                            'schedule (')
    assert differs in error and f'pass --resume_model {checkpoint} to continue' in error
    assert digests(save_dir) == before  # train.log included


def test_a_moved_dataset_resumes(tmp_path, capsys, toy, uninterrupted):
    root, _ = toy
    moved = str(tmp_path / 'moved')
    shutil.copytree(root, moved)
    config = helpers.write_config(tmp_path / 'moved.yml', helpers.toy_config(moved))
    save_dir = str(tmp_path / 'stopped')
    _stopped_at(uninterrupted[0], save_dir, 6)
    code, error, _, result = _run(capsys, config, save_dir)
    assert code == 0 and error is None and result['losses'] == uninterrupted[1][6:]


def test_auto_with_overwrite_is_refused(tmp_path, capsys, toy):
    code, error, _, _ = _run(capsys, toy[1], str(tmp_path / 'out'), overwrite=True)
    assert code == 2 and '--resume_model auto continues the run' in error
    assert 'Drop --overwrite' in error and not os.path.exists(tmp_path / 'out')


def test_a_given_checkpoint_of_another_schedule_warns_with_the_learning_rate(
        tmp_path, capsys, toy, uninterrupted):
    reference, _ = uninterrupted
    save_dir = str(tmp_path / 'longer')
    _stopped_at(reference, save_dir, 10)
    checkpoint = os.path.join(save_dir, 'iter_10')
    code, error, out, result = _run(capsys, toy[1], save_dir, iters=20,
                                    resume_model=checkpoint)
    assert code == 0 and error is None and result['start_iter'] == 10
    changed = _said(out, f'resuming {checkpoint} with another config or schedule')
    assert len(changed) == 1 and 'iters: 10 -> 20' in changed[0]
    # paddleseg's PolynomialDecay: (lr - end_lr) * (1 - step / iters) ** power + end_lr.
    config = helpers.toy_config('unused')['lr_scheduler']
    base, end, power = config['learning_rate'], config.get('end_lr', 0.0), config['power']

    def lr(step, iters):
        return (base - end) * (1 - min(step, iters) / iters) ** power + end

    lines = _said(out, 'iters 10 -> 20 changes the LR schedule')
    assert len(lines) == 1, out
    assert f'the learning rate at iteration 10 is {lr(10, 20):.6g}' in lines[0]
    assert f'the saved run was at {lr(10, 10):.6g}' in lines[0]


def test_a_checkpoint_without_train_state_is_refused_naming_it(tmp_path, capsys, toy,
                                                               uninterrupted):
    save_dir = str(tmp_path / 'stopped')
    _stopped_at(uninterrupted[0], save_dir, 6)
    checkpoint = os.path.join(save_dir, 'iter_6')
    os.remove(os.path.join(checkpoint, ckpt.STATE_FILE))
    before = digests(save_dir)
    code, error, _, _ = _run(capsys, toy[1], save_dir, resume_model=checkpoint)
    assert code == 2
    assert error.startswith(f'error: --resume_model {checkpoint} has no train_state.json')
    assert f'write {{"iteration": 6}} into {os.path.join(checkpoint, ckpt.STATE_FILE)}' in error
    del before['train.log']  # which says why the run stopped
    assert {k: v for k, v in digests(save_dir).items() if k != 'train.log'} == before


def _small_checkpoint(path, iteration):
    """A checkpoint folder that loads (of a one-layer model: refused before any is built)."""
    layer = paddle.nn.Linear(1, 1)
    return ckpt.save_checkpoint(path, layer, paddle.optimizer.SGD(parameters=layer.parameters()),
                                {'iteration': iteration})


@pytest.mark.parametrize('resume', ['auto', 'named'])
def test_a_checkpoint_whose_name_and_state_disagree_is_refused(tmp_path, capsys, toy, resume):
    # iter_4 holding iteration 2 (copied or renamed) would resume "from iter_4 at iteration 2".
    save_dir = str(tmp_path / 'out')
    checkpoint = _small_checkpoint(os.path.join(save_dir, 'iter_4'), 2)
    before = digests(save_dir)
    code, error, out, _ = _run(capsys, toy[1], save_dir,
                               resume_model='auto' if resume == 'auto' else checkpoint)
    assert code == 2 and 'Resumed' not in out and 'resuming' not in out
    flag = '--resume_model auto:' if resume == 'auto' else '--resume_model'
    assert error == (
        f'error: {flag} {checkpoint} holds iteration 2 by its train_state.json but iteration 4 '
        'by its name (copied or renamed?): rename the folder iter_2 or correct "iteration" in '
        'its train_state.json, so that the two agree.')
    assert digests(save_dir) == before  # no train.log either


def test_auto_over_another_runs_best_model_alone_is_refused(tmp_path, capsys, toy):
    save_dir = str(tmp_path / 'out')
    _small_checkpoint(os.path.join(save_dir, 'best_model'), 9)
    before = digests(save_dir)
    code, error, _, _ = _run(capsys, toy[1], save_dir)
    assert code == 2 and error == (
        f'error: --save_dir {save_dir} holds the checkpoints of another run (best_model): a new '
        'run there would overwrite some of them and mix with the others. Pick a new --save_dir, '
        'or delete them to start over (--overwrite does not go with --resume_model auto).')
    assert digests(save_dir) == before


def _best_model(save_dir):
    with open(os.path.join(save_dir, 'best_model', ckpt.STATE_FILE)) as f:
        return json.load(f)


@pytest.mark.parametrize('best_model', ['gone', 'newer'])
def test_the_best_to_beat_is_the_best_model_in_the_folder(tmp_path, capsys, toy, uninterrupted,
                                                         best_model):
    """'gone': the resumed checkpoint's best (a perfect mIoU at iter 6) has no best_model/
    here: it starts over, so that this run keeps one. 'newer': auto passed over iter_9, and
    the best_model/ of iter 9 stays the one to beat."""
    save_dir = str(tmp_path / 'stopped')
    _stopped_at(uninterrupted[0], save_dir, 9)
    newest = os.path.join(save_dir, 'iter_9')
    if best_model == 'gone':
        shutil.rmtree(newest)
        with open(os.path.join(save_dir, 'iter_6', ckpt.STATE_FILE)) as f:
            state = json.load(f)
        with open(os.path.join(save_dir, 'iter_6', ckpt.STATE_FILE), 'w') as f:
            json.dump(dict(state, best_miou=1.0, best_iter=6), f)
    else:
        shutil.copytree(newest, os.path.join(save_dir, 'best_model'))
        with open(os.path.join(save_dir, 'best_model', ckpt.STATE_FILE), 'w') as f:
            json.dump({'iteration': 9, 'miou': 1.0}, f)
        os.remove(os.path.join(newest, ckpt.OPTIMIZER_FILE))
    code, error, out, result = _run(capsys, toy[1], save_dir, do_eval=True)
    assert code == 0 and error is None and result['start_iter'] == 6
    evals = {iteration: evaluated['miou'] for iteration, evaluated in result['evals']}
    assert sorted(evals) == [9, 10] and max(evals.values()) < 1.0
    if best_model == 'gone':
        assert _said(out, 'is not kept; this run saves its own best model')
        best = max(evals, key=evals.get)
        assert _best_model(save_dir) == {'iteration': best, 'miou': evals[best]}
        assert (result['best_iter'], result['best_miou']) == (best, evals[best])
    else:
        assert _said(out, 'is newer than the resumed checkpoint: it stays the best to beat')
        assert _best_model(save_dir) == {'iteration': 9, 'miou': 1.0}
        assert (result['best_iter'], result['best_miou']) == (9, 1.0)


def test_recipe_changes_names_each_key():
    saved = {'iters': 10, 'model': {'type': 'A', 'backbone': {'depth': 50}},
             'train_dataset': {'transforms': [{'type': 'Flip'}, {'type': 'Crop', 'size': [2, 2]}]}}
    current = {'iters': 10, 'model': {'type': 'A', 'backbone': {'depth': 101}, 'extra': 1},
               'train_dataset': {'transforms': [{'type': 'Flip'}]}}
    assert recipe_changes(saved, saved) == []
    assert recipe_changes(saved, current) == [
        'model.backbone.depth: 50 -> 101', 'model.extra: (none) -> 1',
        'train_dataset.transforms.length: 2 -> 1',
        'train_dataset.transforms[1].size: [2, 2] -> (none)',
        'train_dataset.transforms[1].type: Crop -> (none)']


def test_the_resume_line_of_an_auto_run_is_the_same_command(monkeypatch):
    class Options:
        resume_model = 'auto'

    argv = ['train.py', '--config', 'c.yml', '--resume_model', 'auto', '--save_dir', 'out']
    monkeypatch.setattr('sys.argv', argv)
    assert resume_command('out/iter_5', 1, Options()) == \
        'python train.py --config c.yml --save_dir out --resume_model auto'
    Options.resume_model = 'out/iter_2'
    assert resume_command('out/iter_5', 2, Options()) == (
        'python -m paddle.distributed.launch --nproc_per_node 2 train.py --config c.yml '
        '--save_dir out --resume_model out/iter_5')
    # Under psanet.launch (which names its stop note in the ranks' environment): its line.
    monkeypatch.setenv('PSANET_STOP_NOTE', '/tmp/note')
    assert resume_command('out/iter_5', 2, Options()) == (
        'python -m psanet.launch --nproc_per_node 2 train.py --config c.yml '
        '--save_dir out --resume_model out/iter_5')
    # On two nodes each has its own launch line (--master, --rank): train.py's part only.
    monkeypatch.setenv('PADDLE_NNODES', '2')
    assert resume_command('out/iter_5', 2, Options()) == (
        'the launch line of each of the 2 nodes, with train.py --config c.yml --save_dir out '
        '--resume_model out/iter_5')


def test_a_rank_that_does_not_see_the_checkpoint_of_rank_0_says_why(tmp_path, monkeypatch):
    # Rank 1 of a run whose --save_dir is not shared: rank 0 picked iter_6, which is not here.
    from psanet.core import dist
    from psanet.core.options import TrainOptions
    from psanet.core.run_folder import RunFolder
    from psanet.errors import CheckpointError
    monkeypatch.setattr(dist, 'rank', lambda: 1)
    monkeypatch.setattr(dist, 'all_reduce_sum', lambda values: np.array([0.0, 6 + 1.0]))
    save_dir = str(tmp_path / 'out')
    options = TrainOptions(iters=10, batch_size=2, save_dir=save_dir, resume_model='auto')
    with pytest.raises(CheckpointError) as info, RunFolder(options):
        pass
    state = os.path.join(save_dir, 'iter_6', ckpt.STATE_FILE)
    assert str(info.value) == (
        f'--resume_model auto: rank 1 does not see {state}, which rank 0 resumes from: '
        '--save_dir must be a folder every node shares (a network file system), or the nodes '
        'resume different checkpoints.')
    assert not os.path.exists(save_dir)  # only rank 0 makes and locks it
