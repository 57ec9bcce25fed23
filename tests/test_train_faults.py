"""Training faults a new user meets: a reused or busy --save_dir, a checkpoint of another model,
SIGTERM and Ctrl-C, resuming with another batch_size.

Each ends in one ``error:`` line, a non-zero exit code, and the files already
written as they were.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import paddle
import pytest

import engine_helpers as helpers
from conftest import MINI_CONFIG, ROOT, finish, run_process, started_process
from disk_helpers import digests
from psanet import files
from psanet.cli import run_cli
from psanet.core import checkpoint as ckpt
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.options import TrainOptions
from psanet.core.run_folder import RunFolder
from psanet.core.train import train_from_config
from psanet.core.weights import check_state_fits
from psanet.errors import CheckpointError

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def toy_config(tmp_path):
    root = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=4, num_val=2)
    return helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(root, iters=10))




def _cli(capsys, **kwargs):
    """(exit code, the stderr 'error:' line or None, stdout) of train.py's function in-process."""
    code = run_cli(train_from_config, device='cpu', log_iters=1, **kwargs)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith('error: ')]
    assert 'Traceback' not in err and len(errors) <= 1, err
    return code, (errors[0] if errors else None), out


def _iterations(save_dir):
    return [i for i, _ in ckpt.list_checkpoints(save_dir)]


def _seed_of(path):
    with open(os.path.join(path, ckpt.STATE_FILE)) as f:
        return json.load(f)['seed']


def _small_checkpoint(path, iteration):
    model = paddle.nn.Linear(1, 1)
    return ckpt.save_checkpoint(path, model, paddle.optimizer.SGD(parameters=model.parameters()),
                                {'iteration': iteration})


def _first_run(capsys, config, save_dir):
    code, error, _ = _cli(capsys, config=config, save_dir=save_dir, iters=10, save_interval=2,
                          keep_checkpoint_max=0, seed=0)
    assert code == 0 and error is None
    assert _iterations(save_dir) == [2, 4, 6, 8, 10]


def test_a_new_run_into_another_runs_save_dir_is_refused(tmp_path, capsys, toy_config):
    save_dir = str(tmp_path / 'out')
    _first_run(capsys, toy_config, save_dir)
    before = digests(save_dir)
    for keep in (5, 2):
        code, error, out = _cli(capsys, config=toy_config, save_dir=save_dir, iters=4,
                                save_interval=2, keep_checkpoint_max=keep, seed=5)
        assert code == 2, out
        assert f'--save_dir {save_dir} holds the checkpoints of another run' in error
        for fix in ('new --save_dir', f'--resume_model {os.path.join(save_dir, "iter_10")}',
                    '--overwrite'):
            assert fix in error
        assert digests(save_dir) == before  # train.log included

    # Resuming from a checkpoint of another folder does not make it this run's folder either.
    other = _small_checkpoint(os.path.join(str(tmp_path / 'other'), 'iter_2'), 2)
    code, error, _ = _cli(capsys, config=toy_config, save_dir=save_dir, iters=4,
                          resume_model=other)
    assert code == 2 and 'is not in it' in error and 'holds the checkpoints of another run' in error
    assert digests(save_dir) == before

    # --overwrite deletes the old run's checkpoints after saying so; the new run's are all kept.
    code, error, out = _cli(capsys, config=toy_config, save_dir=save_dir, iters=4,
                            save_interval=2, keep_checkpoint_max=2, seed=5, overwrite=True)
    assert code == 0 and error is None
    said = [line for line in out.splitlines() if '--overwrite: deleting' in line]
    assert len(said) == 1 and 'iter_10' in said[0], out
    assert _iterations(save_dir) == [2, 4]
    assert [_seed_of(path) for _, path in ckpt.list_checkpoints(save_dir)] == [5, 5]
    assert not [n for n in os.listdir(save_dir) if n.startswith('.')]


def test_resume_continues_only_from_the_latest_checkpoint_of_its_folder(tmp_path, capsys,
                                                                      toy_config):
    save_dir = str(tmp_path / 'out')
    _first_run(capsys, toy_config, save_dir)
    # A folder a killed save left behind is deleted when the next run starts.
    os.makedirs(os.path.join(save_dir, '.iter_12.tmp-killed'))
    code, error, _ = _cli(capsys, config=toy_config, save_dir=save_dir, iters=12,
                          save_interval=2, keep_checkpoint_max=0,
                          resume_model=os.path.join(save_dir, 'iter_10'))
    assert code == 0 and error is None
    assert _iterations(save_dir) == [2, 4, 6, 8, 10, 12]
    assert not [n for n in os.listdir(save_dir) if n.startswith('.')]

    before = digests(save_dir)
    older = os.path.join(save_dir, 'iter_4')
    code, error, _ = _cli(capsys, config=toy_config, save_dir=save_dir, iters=6,
                          save_interval=2, resume_model=older)
    assert code == 2
    assert f'--resume_model {older} is not the latest checkpoint' in error
    assert 'iter_6' in error and 'iter_12' in error and '--overwrite' in error
    assert digests(save_dir) == before

    # --overwrite deletes only the checkpoints after the one resumed from.
    code, error, _ = _cli(capsys, config=toy_config, save_dir=save_dir, iters=6,
                          save_interval=2, keep_checkpoint_max=0, resume_model=older,
                          overwrite=True)
    assert code == 0 and error is None
    assert _iterations(save_dir) == [2, 4, 6]
    for name in ('iter_2', 'iter_4'):
        assert all(v == before[k] for k, v in digests(save_dir).items() if k.startswith(name))


def _checkpoint_files(save_dir):
    """The snapshot without train.log, which every run appends to."""
    return {k: v for k, v in digests(save_dir).items() if k != 'train.log'}


def test_overwrite_deletes_nothing_when_the_resume_cannot_go_on(tmp_path, capsys, toy_config):
    save_dir = str(tmp_path / 'out')
    _first_run(capsys, toy_config, save_dir)
    older = os.path.join(save_dir, 'iter_4')
    # iters no larger than the checkpoint's iteration: refused after loading it.
    before = _checkpoint_files(save_dir)
    code, error, out = _cli(capsys, config=toy_config, save_dir=save_dir, iters=4,
                            save_interval=2, resume_model=older, overwrite=True)
    assert code == 2 and 'raise --iters' in error
    assert '--overwrite: deleting' not in out
    assert _checkpoint_files(save_dir) == before
    # A checkpoint that does not load (its optimizer file lost): nothing deleted either.
    os.remove(os.path.join(older, ckpt.OPTIMIZER_FILE))
    before = _checkpoint_files(save_dir)
    code, error, out = _cli(capsys, config=toy_config, save_dir=save_dir, iters=6,
                            save_interval=2, resume_model=older, overwrite=True)
    assert code == 2 and older in error
    assert _checkpoint_files(save_dir) == before


def test_a_best_model_deleted_by_overwrite_is_not_counted_as_best(tmp_path, capsys,
                                                                toy_config):
    save_dir = str(tmp_path / 'out')
    code, error, _ = _cli(capsys, config=toy_config, save_dir=save_dir, iters=6,
                          save_interval=2, keep_checkpoint_max=0, seed=0, do_eval=True)
    assert code == 0 and error is None
    with open(os.path.join(save_dir, 'best_model', ckpt.STATE_FILE)) as f:
        best_iteration = json.load(f)['iteration']
    if best_iteration <= 2:  # make best_model later than the checkpoint resumed from
        with open(os.path.join(save_dir, 'best_model', ckpt.STATE_FILE), 'w') as f:
            json.dump({'iteration': 6, 'miou': 1.0}, f)
    code, error, out = _cli(capsys, config=toy_config, save_dir=save_dir, iters=4,
                            save_interval=2, keep_checkpoint_max=0, do_eval=True,
                            resume_model=os.path.join(save_dir, 'iter_2'), overwrite=True)
    assert code == 0 and error is None
    # The resumed best (iter_2's record) had its best_model/ deleted: this run keeps its own.
    assert 'is not kept; this run saves its own best model' in out
    with open(os.path.join(save_dir, 'best_model', ckpt.STATE_FILE)) as f:
        assert json.load(f)['iteration'] == 4


HOLDER = r'''
import sys
sys.path[:0] = [{tests!r}, {repo!r}]
from psanet.core.options import TrainOptions
from psanet.core.run_folder import RunFolder
with RunFolder(TrainOptions(iters=1, batch_size=1, save_dir=sys.argv[1])):
    print('holding', flush=True)
    sys.stdin.read()
'''


def test_a_second_run_at_once_is_refused_naming_the_first(tmp_path, capsys, toy_config):
    save_dir = str(tmp_path / 'out')
    script = tmp_path / 'holder.py'
    script.write_text(HOLDER.format(tests=TESTS, repo=ROOT))
    with started_process([sys.executable, str(script), save_dir], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=ROOT) as holder:
        assert holder.stdout.readline().strip() == 'holding'
        before = digests(save_dir)
        code, error, _ = _cli(capsys, config=toy_config, save_dir=save_dir, iters=2,
                              save_interval=2)
        assert code == 2
        assert f'--save_dir {save_dir} is in use by another training (pid {holder.pid} on ' \
            in error and 'another --save_dir' in error
        assert digests(save_dir) == before  # no train.log, no checkpoint
        holder.kill()  # SIGKILL: no clean-up runs, the lock file stays
        holder.wait()
    assert os.listdir(save_dir) == ['.train.lock']
    code, error, _ = _cli(capsys, config=toy_config, save_dir=save_dir, iters=2, save_interval=2)
    assert code == 0 and error is None
    assert sorted(os.listdir(save_dir)) == ['iter_2', 'train.log']


WORKER = r'''
import json, os, sys
sys.path[:0] = [{tests!r}, {repo!r}]
import paddle
import engine_helpers  # noqa: F401  (registers TinySegNet)
from psanet.core import dist
from psanet.core.config import ComponentBuilder, load_config
from psanet.errors import ConfigError
from psanet.core.options import TrainOptions
from psanet.core.run_folder import RunFolder
from psanet.core.train import train

out, config, save_dir = sys.argv[1:4]
paddle.set_device('cpu')
dist.init_parallel()
builder = ComponentBuilder(load_config(config))
try:
    with RunFolder(TrainOptions(iters=2, batch_size=1, save_dir=save_dir,
                                save_interval=2)) as folder:
        train(builder.model, builder.dataset('train'), builder.optimizer, builder.losses, folder)
    error = None
except ConfigError as caught:
    error = str(caught)
with open(os.path.join(out, 'rank_%d.json' % dist.rank()), 'w') as f:
    json.dump({{'error': error}}, f)
'''


def test_two_processes_into_a_taken_save_dir_both_refuse(tmp_path, toy_config):
    save_dir = str(tmp_path / 'out')
    _small_checkpoint(os.path.join(save_dir, 'iter_4'), 4)
    before = digests(save_dir)
    worker = tmp_path / 'worker.py'
    worker.write_text(WORKER.format(tests=TESTS, repo=ROOT))
    done = run_process(
        [sys.executable, '-m', 'paddle.distributed.launch', '--nproc_per_node', '2',
         '--log_dir', str(tmp_path / 'log'), str(worker), str(tmp_path), toy_config, save_dir],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    logs = ''.join(open(path).read()[-3000:] for path in glob.glob(str(tmp_path / 'log' / '*')))
    assert done.returncode == 0, logs
    errors = [json.load(open(tmp_path / f'rank_{r}.json'))['error'] for r in range(2)]
    assert f'--save_dir {save_dir} holds the checkpoints of another run (iter_4)' in errors[0]
    assert errors[1].startswith(f'rank 0 refused --save_dir {save_dir}')
    assert digests(save_dir) == before


def _components(config, seed=0, **model):
    paddle.seed(seed)
    cfg = load_config(config)
    cfg.dic['model'].update(model)
    builder = ComponentBuilder(cfg)
    return builder.model, builder.dataset('train'), builder.optimizer, builder.losses


def _first_shape_mismatch(expected, loaded):
    for key, value in expected.items():
        if key in loaded and list(value.shape) != list(loaded[key].shape):
            return f'{key} (file {list(loaded[key].shape)}, model {list(value.shape)})'
    return None


def test_resume_from_another_model_is_refused_before_training(tmp_path, toy_config):
    save_dir = str(tmp_path / 'out')
    model, dataset, optimizer, losses = _components(toy_config, channels=8)
    helpers.train_in_folder(model, dataset, optimizer, losses, TrainOptions(
        iters=2, batch_size=2, save_dir=save_dir, save_interval=2, seed=0))
    before = digests(save_dir)
    with open(os.path.join(save_dir, 'train.log')) as f:
        log_before = f.read()
    model, dataset, optimizer, losses = _components(toy_config, channels=6)
    weights = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    expected = _first_shape_mismatch(model.state_dict(), ckpt.load_checkpoint(
        os.path.join(save_dir, 'iter_2'))[0])
    assert expected is not None
    with pytest.raises(CheckpointError) as info:
        helpers.train_in_folder(model, dataset, optimizer, losses, TrainOptions(
            iters=4, batch_size=2, save_dir=save_dir, save_interval=2,
            resume_model=os.path.join(save_dir, 'iter_2')))
    assert expected in str(info.value), str(info.value)
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), weights[key], err_msg=key)
    assert {k: v for k, v in digests(save_dir).items() if k != 'train.log'} == \
        {k: v for k, v in before.items() if k != 'train.log'}
    with open(os.path.join(save_dir, 'train.log')) as f:
        log = f.read()
    assert log.startswith(log_before) and 'Resumed from' not in log[len(log_before):]


def test_psanet_mask_8_checkpoint_into_a_mask_7_config(tmp_path, capsys):
    """The issue's case: train.py resuming PSANet with mask_h 7 from a mask_h 8 checkpoint."""
    from psanet.data import generate_mini_cityscapes
    root = str(tmp_path / 'mini')
    generate_mini_cityscapes(root, num_train=2, num_val=1, size=(64, 32), seed=0)
    base = {'_base_': MINI_CONFIG, 'batch_size': 1,
            'train_dataset': {'dataset_root': root, 'transforms': [{'type': 'Normalize'}]},
            'val_dataset': {'dataset_root': root}}
    mask7 = helpers.write_config(tmp_path / 'mask7.yml', base)
    mask8 = helpers.write_config(tmp_path / 'mask8.yml', dict(base, model={'mask_h': 8}))
    model8, _, optimizer8, _ = _components(mask8)
    save_dir = str(tmp_path / 'out')
    ckpt.save_checkpoint(os.path.join(save_dir, 'iter_4'), model8, optimizer8, {'iteration': 4})
    model7 = _components(mask7)[0]
    expected = _first_shape_mismatch(model7.state_dict(), model8.state_dict())
    assert expected is not None
    code, error, out = _cli(capsys, config=mask7, save_dir=save_dir, iters=8,
                            resume_model=os.path.join(save_dir, 'iter_4'))
    assert code == 2
    assert error.startswith(f'error: the weights of --resume_model {save_dir}')
    assert expected in error, error
    assert 'Resumed from' not in out and '[TRAIN]' not in out
    assert _iterations(save_dir) == [4]


def test_resume_warnings_name_their_real_cause(tmp_path, capsys):
    root = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=8)
    config = helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(root))
    first = str(tmp_path / 'first')
    assert _cli(capsys, config=config, save_dir=first, iters=2, batch_size=2,
                save_interval=2)[0] == 0
    resume = os.path.join(first, 'iter_2')

    def warnings(save_dir, **kwargs):
        code, error, out = _cli(capsys, config=config, save_dir=str(tmp_path / save_dir),
                                iters=3, save_interval=3, resume_model=resume, **kwargs)
        assert code == 0, error
        said = [line for line in out.splitlines() if '[WARNING]' in line]
        # iters 2 -> 3 in each: that warning (test_resume_auto.py) is not the subject here.
        schedule = [line for line in said if 'with another config or schedule' in line
                    or 'changes the LR schedule' in line]
        assert len(schedule) == 2 and 'iters: 2 -> 3' in schedule[0], said
        return [line for line in said if line not in schedule]

    assert warnings('same', batch_size=2) == []
    said = warnings('batch', batch_size=4)
    # 8 images: 4 iterations per epoch with batch 2, 2 with batch 4.
    assert len(said) == 1, said
    assert 'batch_size 4 x 1 process(es) instead of 2 x 1' in said[0]
    assert '(2 iterations per epoch instead of 4)' in said[0]
    assert 'training set changed' not in said[0]

    with open(os.path.join(root, 'train.txt')) as f:
        lines = f.read().splitlines()
    with open(os.path.join(root, 'train.txt'), 'w') as f:
        f.write('\n'.join(lines[:6]) + '\n')
    said = warnings('fewer', batch_size=2)
    assert len(said) == 1 and '6 training images instead of 8' in said[0], said
    assert 'training set changed' in said[0]
    # A checkpoint that did not record its number of images (older or paddleseg's).
    state_path = os.path.join(resume, ckpt.STATE_FILE)
    with open(state_path) as f:
        state = json.load(f)
    del state['num_images']
    with open(state_path, 'w') as f:
        json.dump(state, f)
    said = warnings('older', batch_size=2)
    assert len(said) == 1 and '3 iterations per epoch instead of 4' in said[0], said
    assert 'training set changed' in said[0]


@pytest.mark.parametrize('where', ['writing', 'pruning'])
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_saving_leaves_whole_checkpoints(tmp_path, capsys, monkeypatch,
                                                       toy_config, where, signum):
    save_dir = str(tmp_path / 'out')
    real_save, real_rmtree = paddle.save, files.shutil.rmtree
    calls = {'save': 0}

    def send():
        # Without a Python handler SIGTERM would end pytest itself (Paddle's fatal handler).
        assert callable(signal.getsignal(signum)), 'no handler for the signal'
        os.kill(os.getpid(), signum)

    def save(obj, path, *args, **kwargs):
        calls['save'] += 1
        if where == 'writing' and calls['save'] == 4:  # iter_4's model.pdopt
            with open(path, 'wb') as f:
                f.write(b'\x80\x04partial')
            send()
        return real_save(obj, path, *args, **kwargs)

    def rmtree(path, *args, **kwargs):
        # Once: the clean-up at the end deletes this folder through rmtree again.
        if where == 'pruning' and os.path.basename(path).startswith('.deleted') \
                and 'pruned' not in calls:
            calls['pruned'] = path
            send()
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(paddle, 'save', save)
    monkeypatch.setattr(files.shutil, 'rmtree', rmtree)
    code, error, _ = _cli(capsys, config=toy_config, save_dir=save_dir, iters=8, save_interval=2,
                          keep_checkpoint_max=1, seed=0)
    monkeypatch.undo()
    assert code == 128 + signum
    # The signal came after step 4's all-reduce: step 5 runs, and its checkpoint is saved.
    last = os.path.join(save_dir, 'iter_5')
    what = 'stopped by SIGTERM' if signum == signal.SIGTERM else 'interrupted (Ctrl-C)'
    assert error == f'error: training {what} after iteration 5; its checkpoint is {last}'
    assert sorted(os.listdir(save_dir)) == [os.path.basename(last), 'train.log']
    model, _, _, _ = _components(toy_config)
    check_state_fits(model, ckpt.load_checkpoint(last)[0], last, '')


TRAIN_PY = r'''
import runpy, sys
sys.path[:0] = [{tests!r}, {repo!r}]
import engine_helpers  # noqa: F401  (registers TinySegNet)
sys.argv = ['train.py'] + sys.argv[1:]
runpy.run_path({train!r}, run_name='__main__')
'''


def _processes_mentioning(text):
    """Pids of live processes whose command line holds ``text`` (Linux /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize('num_workers', [0, 2])
def test_sigterm_ends_train_py_with_one_line_and_whole_checkpoints(tmp_path, capsys,
                                                                  toy_config, num_workers):
    save_dir = str(tmp_path / 'out')
    script = tmp_path / 'train_tiny.py'
    script.write_text(TRAIN_PY.format(tests=TESTS, repo=ROOT,
                                      train=os.path.join(ROOT, 'train.py')))
    with started_process(
            [sys.executable, str(script), '--config', toy_config, '--device', 'cpu', '--save_dir',
             save_dir, '--iters', '1000000', '--save_interval', '2', '--keep_checkpoint_max', '3',
             '--log_iters', '1000', '--seed', '0', '--num_workers', str(num_workers)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        deadline = time.monotonic() + 300  # a guard against hanging, not a measurement
        while not ckpt.list_checkpoints(save_dir) and process.poll() is None:
            assert time.monotonic() < deadline, 'no checkpoint appeared'
            time.sleep(0.05)
        assert process.poll() is None, process.communicate()
        process.send_signal(signal.SIGTERM)
        out, err = finish(process, 60)
    assert process.returncode == 143, err[-3000:]
    assert 'Traceback' not in err and 'FatalError' not in err, err[-3000:]
    # No DataLoader worker outlives the run (they are forks: their command line is its).
    deadline = time.monotonic() + 30  # a guard against hanging, not a measurement
    while _processes_mentioning(save_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_mentioning(save_dir)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith('error: training stopped by SIGTERM after iteration ')
    last = lines[-1].split('; its checkpoint is ')[1]
    checkpoints = ckpt.list_checkpoints(save_dir)
    assert checkpoints and last == checkpoints[-1][1]
    assert not [n for n in os.listdir(save_dir) if n.startswith('.')]
    model, _, _, _ = _components(toy_config)
    for _, path in checkpoints:
        check_state_fits(model, ckpt.load_checkpoint(path)[0], path, '')
    # The line's advice works.
    iteration = ckpt.checkpoint_iteration(last)
    code, error, _ = _cli(capsys, config=toy_config, save_dir=save_dir, iters=iteration + 2,
                          save_interval=2, resume_model=last)
    assert code == 0 and error is None
    assert _iterations(save_dir)[-1] == iteration + 2


def test_two_open_folders_each_delete_only_what_overwrite_replaces_in_it(tmp_path):
    """A RunFolder holds what --overwrite is to delete until it has resumed: two folders
    open at once in one process keep theirs apart."""
    layer = paddle.nn.Linear(2, 2)
    optimizer = paddle.optimizer.SGD(parameters=layer.parameters())
    folders = [tmp_path / 'a', tmp_path / 'b']
    for folder, iteration in zip(folders, (2, 3)):
        ckpt.save_checkpoint(str(folder / f'iter_{iteration}'), layer,
                             state={'iteration': iteration})
    with RunFolder(TrainOptions(iters=4, batch_size=1, save_dir=str(folders[0]),
                                overwrite=True)) as first, \
            RunFolder(TrainOptions(iters=4, batch_size=1, save_dir=str(folders[1]),
                                   overwrite=True)) as second:
        assert (first.path, second.path) == (str(folders[0]), str(folders[1]))
        assert os.path.isdir(folders[0] / 'iter_2') and os.path.isdir(folders[1] / 'iter_3')
        second.resume(layer, optimizer, None)
        assert os.path.isdir(folders[0] / 'iter_2') and not os.path.exists(folders[1] / 'iter_3')
        first.resume(layer, optimizer, None)
        assert not os.path.exists(folders[0] / 'iter_2')
    assert sorted(os.listdir(folders[0])) == sorted(os.listdir(folders[1])) == []


def test_a_folder_not_opened_is_refused_before_it_resumes(tmp_path):
    folder = RunFolder(TrainOptions(iters=4, batch_size=1, save_dir=str(tmp_path / 'out')))
    with pytest.raises(RuntimeError, match=r'with RunFolder\(options\) as folder'):
        folder.resume(paddle.nn.Linear(1, 1), None, None)
    assert not os.path.exists(tmp_path / 'out')  # neither locked nor made
