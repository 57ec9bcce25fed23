"""What a stopped launched run says on the launcher's console.

A signalled launcher stops copying rank 0's log before the ranks have saved
their stop checkpoint. Under ``python -m psanet.launch`` the first rank of the
node leaves the stop and the resume line in a note that psanet.launch prints
when Paddle's launcher returns, whatever its stderr is. Under ``python -m
paddle.distributed.launch`` the rank writes them to the launcher's stderr
itself, when that is a pipe, a terminal or a file opened for appending (into a
file the launcher writes at its own offset, its next line would overwrite ours:
nothing is written there). Two nodes: tests/test_multinode.py and
tests/test_slurm_script.py read both launchers' consoles.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import multinode_helpers as mn
from conftest import ROOT, finish, started_process, write_mini_train_config

START = 240  # seconds a launch may take to reach its second step, under load


def _stop_a_launch(tmp_path, mini_cityscapes, stderr, launcher='paddle.distributed.launch',
                   signum=signal.SIGINT):
    """Launches 2 ranks, sends ``signum`` (SIGINT: a Ctrl-C) to the launcher after step 2
    and waits.

    Returns:
        tuple: (launcher exit code, rank 0's log, save_dir).
    """
    config = write_mini_train_config(tmp_path / 'mini.yml', mini_cityscapes)
    save_dir, log_dir = str(tmp_path / 'out'), str(tmp_path / 'log')
    command = [sys.executable, '-m', launcher, '--nproc_per_node', '2',
               '--log_dir', log_dir, os.path.join(ROOT, 'train.py'), '--config', config,
               '--device', 'cpu', '--save_dir', save_dir, '--iters', '50', '--batch_size', '1',
               '--save_interval', '100', '--log_iters', '1', '--seed', '3']
    workerlog = os.path.join(log_dir, 'workerlog.0')
    with started_process(command, cwd=str(tmp_path), stdout=subprocess.DEVNULL,
                         stderr=stderr) as process:
        deadline = time.time() + START
        while time.time() < deadline and process.poll() is None:
            if os.path.exists(workerlog) and 'iter: 2/50' in open(workerlog).read():
                break
            time.sleep(0.2)
        else:
            pytest.fail(f'the launch did not reach step 2 in {START} s')
        process.send_signal(signum)
        finish(process, 120)
    with open(workerlog) as f:
        return process.returncode, f.read(), save_dir


def _stop_lines(text, rank_log, save_dir):
    """The psanet: lines of a console, checked against the one checkpoint and the resume
    line of rank 0's log."""
    checkpoints = [name for name in os.listdir(save_dir) if re.fullmatch(r'iter_\d+', name)]
    assert len(checkpoints) == 1, os.listdir(save_dir)
    iteration = int(checkpoints[0][5:])
    path = os.path.join(save_dir, checkpoints[0])
    said = mn.stop_lines(text)
    resume = [line.split('resume with: ', 1)[1] for line in rank_log.splitlines()
              if 'resume with: ' in line]
    assert len(resume) == 1 and resume[0].endswith(f'--resume_model {path}')
    assert said == mn.said_stop(iteration, path, save_dir, resume[0]), text
    return said


@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM], ids=['ctrl-c', 'sigterm'])
def test_the_stop_and_the_resume_line_reach_the_launchers_console(tmp_path, mini_cityscapes,
                                                                  signum):
    with open(tmp_path / 'console', 'w') as console:  # stands in for the terminal
        pipe = subprocess.Popen(['cat'], stdin=subprocess.PIPE, stdout=console)
        try:
            code, rank_log, save_dir = _stop_a_launch(tmp_path, mini_cityscapes, pipe.stdin,
                                                      signum=signum)
        finally:
            pipe.stdin.close()
            pipe.wait(30)
    text = (tmp_path / 'console').read_text()
    assert code == signum
    _stop_lines(text, rank_log, save_dir)
    assert f'Terminating with signal {signum}' in text  # the launcher's own lines are whole


def test_psanet_launch_prints_the_stop_last_whatever_its_console(tmp_path, mini_cityscapes):
    """A Ctrl-C to psanet.launch, whose console is a file it writes at its own offset
    (``>``): the stop lines come after the launcher's last one. (SIGTERM: the two-node
    tests.)"""
    with open(tmp_path / 'console', 'w') as console:
        code, rank_log, save_dir = _stop_a_launch(tmp_path, mini_cityscapes, console,
                                                  'psanet.launch')
    text = (tmp_path / 'console').read_text()
    assert code == signal.SIGINT, text[-3000:]
    said = _stop_lines(text, rank_log, save_dir)
    assert ' -m paddle.distributed.launch ' not in said[-1], said[-1]  # psanet.launch's own
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[-2:] == said
    assert lines[-3].startswith('LAUNCH INFO') and 'Exit with signal 2' in lines[-3]


def test_a_console_file_the_launcher_writes_at_its_offset_is_left_alone(tmp_path,
                                                                     mini_cityscapes):
    with open(tmp_path / 'console', 'w') as console:
        code, rank_log, _ = _stop_a_launch(tmp_path, mini_cityscapes, console)
    text = (tmp_path / 'console').read_text()
    assert code != 0 and 'resume with: ' in rank_log
    assert 'psanet: ' not in text
    lines = text.splitlines()
    assert lines[-2].startswith('LAUNCH INFO') and 'Terminating with signal 2' in lines[-2]
    assert lines[-1].startswith('LAUNCH INFO') and 'Exit with signal 2' in lines[-1]
