"""Ctrl-C and SIGTERM end a run within seconds from any moment (psanet.interrupts).

The stress test signals training runs with DataLoader workers in every phase
(start-up, a step, between steps, workers starting, evaluation, a checkpoint
write) under CPU load; the unit tests check each mechanism on its own.
"""
import gc
import json
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


class _SendsInDel:
    """Sends a signal from its __del__, where Python cannot raise."""

    def __init__(self, signum):
        self.signum = signum

    def __del__(self):
        os.kill(os.getpid(), self.signum)
        for _ in range(1000):  # the handler runs between these bytecodes
            pass


def test_a_signal_swallowed_in_del_is_raised_at_the_next_safe_point(capfd):
    with interrupts.signals_raise():
        _SendsInDel(signal.SIGTERM)
        gc.collect()
        assert interrupts.pending() == signal.SIGTERM
        with pytest.raises(Interrupted) as stop:
            interrupts.raise_if_interrupted()
    assert stop.value.exit_code == 143 and str(stop.value) == 'stopped by SIGTERM'
    # Python's "Exception ignored in ... __del__" report stays out of the user's output.
    assert 'Exception ignored' not in capfd.readouterr().err
    assert interrupts.pending() is None  # the next run starts afresh


def test_a_signal_while_deferred_is_raised_after_the_block():
    with interrupts.signals_raise():
        with interrupts.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
            reached = True
        assert reached and interrupts.pending() == signal.SIGINT
        with pytest.raises(Interrupted) as stop:
            interrupts.raise_if_interrupted()
    assert str(stop.value) == 'interrupted (Ctrl-C)' and stop.value.exit_code == 130


def test_run_cli_reports_an_error_a_signal_caused_as_the_signal(capsys):
    def broken_by_the_signal():
        os.kill(os.getpid(), signal.SIGTERM)
        with interrupts.deferred():
            for _ in range(1000):
                pass
        # e.g. Paddle's SystemError for a worker the signal ended, raised first
        raise SystemError('DataLoader process exited is killed by signal: Terminated')

    assert run_cli(broken_by_the_signal) == 143
    err = capsys.readouterr().err
    assert err.strip() == 'error: stopped by SIGTERM' and 'Traceback' not in err


SECOND_SIGNAL = textwrap.dedent('''
    import sys, time
    sys.path.insert(0, {root!r})
    from psanet.cli import exit_with, run_cli

    def work():
        try:
            print('working', flush=True)
            time.sleep(600)
        finally:
            print('cleaning up', flush=True)
            time.sleep(600)  # a clean-up that hangs

    exit_with(run_cli(work))
''')


def test_a_second_signal_during_the_clean_up_exits_at_once(tmp_path):
    script = tmp_path / 'second.py'
    script.write_text(SECOND_SIGNAL.format(root=ROOT))
    with started_process([sys.executable, str(script)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True) as process:
        assert process.stdout.readline().strip() == 'working'
        process.send_signal(signal.SIGTERM)
        assert process.stdout.readline().strip() == 'cleaning up'
        process.send_signal(signal.SIGINT)
        start = time.monotonic()
        _, err = finish(process, 60)
    assert time.monotonic() - start < 10  # a guard, not a measurement
    assert process.returncode == 130
    assert err.strip().splitlines()[-1] == ('error: SIGINT again while cleaning up after '
                                            'SIGTERM: exiting at once.')


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


def test_a_child_forked_before_its_worker_init_never_raises_into_paddle():
    with interrupts.signals_raise():
        # Ctrl-C reaches the whole group: a starting worker ignores it.
        assert os.waitstatus_to_exitcode(_fork(lambda: _signal_self(signal.SIGINT))) == 0
        # SIGTERM ends it, as no handler would.
        status = _fork(lambda: _signal_self(signal.SIGTERM))
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        assert interrupts.pending() is None
