"""Ctrl-C and SIGTERM stop a run at its next boundary (psanet.interrupts).

The stress test signals one-process training runs with DataLoader workers in
every phase (start-up, a step, between steps, workers starting, evaluation, a
checkpoint write) under CPU load; the unit tests check the handler on its own.
Launched (two-process) runs: tests/test_preemption.py.
"""
import gc
import json
import re
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, finish, run_process, started_process
from psanet import interrupts
from psanet.cli import run_cli
from psanet.errors import Interrupted

HARNESS = os.path.join(ROOT, 'tests', 'interrupt_harness.py')
TRIALS = int(os.environ.get('PSANET_INTERRUPT_TRIALS', '24'))
BOUND = 20.0  # seconds a run may take to exit after the signal; they take 0.1-0.3 s here


def test_signals_in_every_phase_end_every_run_under_load(tmp_path):
    report = tmp_path / 'report.json'
    seed = int(os.environ.get('PSANET_INTERRUPT_SEED', '0'))
    # Each trial: start-up + at most 20 s waiting for its phase + the bound + 12 s of checks.
    done = run_process([sys.executable, HARNESS, '--trials', str(TRIALS), '--seed', str(seed),
                        '--bound', str(BOUND), '--load', str(os.cpu_count() or 1),
                        '--work_dir', str(tmp_path), '--json', str(report)],
                       timeout=120 + TRIALS * (20 + BOUND + 12), capture_output=True, text=True)
    assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(report.read_text())
    assert len(results) == TRIALS
    failed = [r for r in results if r['problems']]
    assert not failed, '\n\n'.join(f"trial {r['trial']} ({r['signal']} in {r['phase']}):\n"
                                   + '\n'.join(r['problems']) for r in failed)
    assert done.returncode == 0, done.stdout[-3000:]
    assert all(r['seconds'] < BOUND for r in results)
    # The moments reached the phases (a short phase may be over when the signal lands).
    phases = {r['phase'] for r in results}
    assert {'start-up', 'step', 'between-steps', 'workers-start', 'evaluate'} <= phases, phases
    # A signal abandoned an evaluation, and the harness checked that the run stopped after
    # the evaluated step (not one step later).
    assert any(r.get('evaluation_abandoned') for r in results), results


class _SendsInDel:
    """Sends a signal from its __del__, where Python cannot raise."""

    def __init__(self, signum):
        self.signum = signum

    def __del__(self):
        os.kill(os.getpid(), self.signum)
        for _ in range(1000):  # the handler runs between these bytecodes
            pass


def test_the_handler_only_records_the_signal_even_in_del(capfd):
    previous = signal.getsignal(signal.SIGTERM)
    with interrupts.stop_at_boundaries():
        _SendsInDel(signal.SIGTERM)
        gc.collect()
        os.kill(os.getpid(), signal.SIGTERM)  # repeated: the same request
        for _ in range(1000):
            pass
        assert interrupts.requested() == signal.SIGTERM
        with pytest.raises(Interrupted) as stop:
            interrupts.raise_if_requested()
    assert stop.value.exit_code == 143 and str(stop.value) == 'stopped by SIGTERM'
    assert 'Exception ignored' not in capfd.readouterr().err
    # After the block: the record is gone and the previous handler is back.
    assert interrupts.requested() is None and signal.getsignal(signal.SIGTERM) is previous


def test_ctrl_c_puts_the_default_action_back():
    with interrupts.stop_at_boundaries():
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass
        assert interrupts.requested() == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
        assert str(interrupts.stopped(signal.SIGINT)) == 'interrupted (Ctrl-C)'
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_error_after_a_signal_keeps_its_traceback():
    def fails_after_the_signal():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass
        raise SystemError('a bug in clean-up code')

    with pytest.raises(SystemError, match='a bug in clean-up code'):
        run_cli(fails_after_the_signal)


LOOP = textwrap.dedent('''
    import atexit, sys, time
    sys.path.insert(0, {root!r})
    from psanet import interrupts
    from psanet.cli import exit_with, run_cli

    @atexit.register
    def slow_exit():  # as Paddle's exit takes seconds
        print('exiting', flush=True)
        time.sleep(2)

    def work():
        print('working', flush=True)
        for step in range(600):
            time.sleep(0.1)  # a step that does not look at the flag
            if step >= {steps}:
                interrupts.raise_if_requested()

    exit_with(run_cli(work))
''')


def _loop(tmp_path, steps):
    script = tmp_path / 'loop.py'
    script.write_text(LOOP.format(root=ROOT, steps=steps))
    return started_process([sys.executable, str(script)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)


def test_a_second_ctrl_c_ends_the_process_at_once(tmp_path):
    with _loop(tmp_path, steps=600) as process:  # never reaches a boundary
        assert process.stdout.readline().strip() == 'working'
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert process.poll() is None  # the first one is only recorded
        process.send_signal(signal.SIGINT)
        _, err = finish(process, 60)
    assert process.returncode == -signal.SIGINT and 'Traceback' not in err


def test_sigterm_again_is_the_same_request_and_the_stopped_process_exits_143(tmp_path):
    with _loop(tmp_path, steps=20) as process:
        assert process.stdout.readline().strip() == 'working'
        for _ in range(3):  # what paddle.distributed.launch sends, 0.2 s apart
            process.send_signal(signal.SIGTERM)
            time.sleep(0.2)
        assert process.stdout.readline().strip() == 'exiting'
        process.send_signal(signal.SIGTERM)  # the launcher's, once another rank has exited
        _, err = finish(process, 60)
    assert process.returncode == 143 and err.strip() == 'error: stopped by SIGTERM'


def _fork(child):
    pid = os.fork()
    if pid == 0:
        try:
            child()
            code = 0
        except BaseException:  # noqa: B902  (report anything as a failed child)
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def _signal_self(*signums):
    for signum in signums:
        os.kill(os.getpid(), signum)
        time.sleep(0.05)


def test_workers_leave_signals_to_the_main_process():
    def worker():
        interrupts.worker_init(0)
        _signal_self(signal.SIGINT, signal.SIGTERM)
    status = _fork(worker)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _status_mask(field):
    with open('/proc/self/status') as f:
        return int(re.search(rf'^{field}:\s*([0-9a-f]+)$', f.read(), re.M).group(1), 16)


def test_a_worker_forked_with_the_signals_blocked_unblocks_them_and_ignores_them():
    """A DataLoader worker is forked with SIGINT and SIGTERM blocked: worker_init unblocks
    them (a child it starts would inherit the block), ignoring them. Read from the kernel's
    /proc/self/status, not from Python's view."""
    bits = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))

    def worker():
        signal.pthread_sigmask(signal.SIG_BLOCK, interrupts.HANDLED)
        assert _status_mask('SigBlk') & bits == bits  # the test's own premise
        interrupts.worker_init(0)
        if _status_mask('SigBlk') & bits or _status_mask('SigIgn') & bits != bits:
            os._exit(5)
    assert os.waitstatus_to_exitcode(_fork(worker)) == 0, \
        'worker_init left SIGINT or SIGTERM blocked (exit 5), or failed (exit 3)'


def test_a_child_forked_before_its_worker_init_only_records():
    with interrupts.stop_at_boundaries():
        assert os.waitstatus_to_exitcode(_fork(
            lambda: _signal_self(signal.SIGTERM, signal.SIGTERM))) == 0
        assert interrupts.requested() is None  # the child's record is its own


GROUP_SIGTERM_AS_WORKERS_START = textwrap.dedent('''
    import json, os, signal, sys
    sys.path.insert(0, {root!r})
    import numpy as np
    import paddle
    from psanet import interrupts
    from psanet.core import data_loader as loader

    class Samples(paddle.io.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            return {{'img': np.zeros([1, 2, 2], 'float32'), 'label': np.zeros([2, 2], 'int64'),
                     'trans_info': [], 'index': index}}

    worker_init = interrupts.worker_init

    def signal_the_group_first(worker_id):
        # After Paddle's own worker set-up, just before worker_init: the window. The sender
        # is a worker, as for a scheduler's or a terminal's signal, not the parent.
        if worker_id == 0:
            os.killpg(0, signal.SIGTERM)
        worker_init(worker_id)

    interrupts.worker_init = signal_the_group_first
    with interrupts.stop_at_boundaries():
        batches = loader._Loader(Samples(), paddle.io.BatchSampler(Samples(), batch_size=2), 2)
        indices = [int(i) for batch in batches for i in batch['index']]
        print(json.dumps({{'indices': indices, 'requested': interrupts.requested()}}))
''')


def test_a_group_sigterm_before_worker_init_leaves_the_workers_to_the_main_process(tmp_path):
    script = tmp_path / 'group_sigterm.py'
    script.write_text(GROUP_SIGTERM_AS_WORKERS_START.format(root=ROOT))
    done = run_process([sys.executable, str(script)], timeout=120, capture_output=True,
                       text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    # Every worker lived to read its batches; the main process recorded the signal.
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        'indices': list(range(8)), 'requested': signal.SIGTERM}


def test_the_signal_module_is_a_small_leaf():
    with open(interrupts.__file__) as f:
        source = f.read()
    assert len(source.splitlines()) < 80
    for mechanism in ('unraisablehook', 'getpid', 'SIGCHLD', 'atexit', 'pending'):
        assert mechanism not in source, mechanism
    assert re.findall(r'^from psanet[.\w]* import (\w+)', source, re.M) == ['Interrupted']


def _tree_bytes(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_sigterm_during_export_keeps_the_old_export_and_exits_143(tmp_path):
    from conftest import MINI_CONFIG
    save_dir = tmp_path / 'export'
    command = [sys.executable, 'export.py', '--config', MINI_CONFIG, '--save_dir', str(save_dir)]
    run_process(command, cwd=ROOT, timeout=600, check=True, capture_output=True)
    (save_dir / 'notes.txt').write_text('the user\'s own file')
    before = _tree_bytes(save_dir)
    with started_process(command + ['--input_shape', '1', '3', '64', '128'], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        for line in process.stdout:  # the export (dy2static's trace) starts after this line
            if 'exporting the initial (untrained) weights' in line:
                break
        process.send_signal(signal.SIGTERM)
        out, _ = finish(process, 300)
    assert process.returncode == 143, out
    assert out.strip().splitlines()[-1] == 'error: stopped by SIGTERM', out
    assert 'Traceback' not in out and 'In transformed code' not in out, out
    assert _tree_bytes(save_dir) == before  # the old export, whole, with the user's file
    assert sorted(os.listdir(tmp_path)) == ['export']  # no temporary left beside it


@pytest.mark.parametrize('signum, signal_at, stop', [
    (signal.SIGTERM, 6, 7),  # after step 6's all-reduce: step 7 runs and is saved
    (signal.SIGINT, 3, 4),   # step 4 sees it: its evaluation is abandoned, its checkpoint kept
])
def test_a_stopped_run_saves_its_step_once_and_resumes_with_the_uninterrupted_losses(
        tmp_path, capsys, monkeypatch, signum, signal_at, stop):
    import engine_helpers as helpers  # registers TinySegNet
    from psanet.core import checkpoint, train
    root = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=4, num_val=2)
    config = helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(root, iters=10))
    flags = dict(config=config, device='cpu', iters=9, save_interval=4, log_iters=1, seed=0,
                 num_workers=2, do_eval=True)
    whole = {}
    assert run_cli(lambda **f: whole.update(train.train_from_config(**f)),
                   save_dir=str(tmp_path / 'whole'), **flags) == 0
    log_interval = train.log_interval

    def send_signal(run, iteration, *args):
        log_interval(run, iteration, *args)
        if iteration == signal_at:
            os.kill(os.getpid(), signum)
    monkeypatch.setattr(train, 'log_interval', send_signal)
    save_dir = tmp_path / 'stopped'
    capsys.readouterr()
    assert run_cli(train.train_from_config, save_dir=str(save_dir), **flags) == 128 + signum
    monkeypatch.undo()
    out, err = capsys.readouterr()
    path = save_dir / f'iter_{stop}'
    what = 'stopped by SIGTERM' if signum == signal.SIGTERM else 'interrupted (Ctrl-C)'
    assert err.strip().splitlines()[-1] == \
        f'error: training {what} after iteration {stop}; its checkpoint is {path}'
    assert f"resume with: the same call with resume_model='{path}'" in out
    assert checkpoint.checkpoint_iteration(str(path)) == stop
    assert (save_dir / 'train.log').read_text().count(f'Saved checkpoint {path}\n') == 1
    kept = ['best_model', 'iter_4', 'iter_7'] if stop == 7 else ['iter_4']
    assert sorted(os.listdir(save_dir)) == kept + ['train.log']
    assert ('Evaluation at iter 4 abandoned for the stop.' in out) == (stop == 4)
    resumed = {}
    assert run_cli(lambda **f: resumed.update(train.train_from_config(**f)),
                   save_dir=str(save_dir), resume_model=str(path), **flags) == 0
    assert resumed['start_iter'] == stop and resumed['losses'] == whole['losses'][stop:]
