"""What a stopped ``paddle.distributed.launch`` run says on the launcher's console.

A signalled launcher stops copying rank 0's log before the ranks have saved
their stop checkpoint; the first rank of the node writes the stop and the
resume line to the launcher's stderr itself, when that is a pipe, a terminal
or a file opened for appending (into a file the launcher writes at its own
offset, its next line would overwrite ours: nothing is written there).
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, finish, started_process, write_mini_train_config

START = 240  # seconds a launch may take to reach its second step, under load


def _stop_a_launch(tmp_path, mini_cityscapes, stderr):
    """Launches 2 ranks, sends SIGINT (a Ctrl-C) to the launcher after step 2 and waits.

    Returns:
        tuple: (launcher exit code, rank 0's log, save_dir).
    """
    config = write_mini_train_config(tmp_path / 'mini.yml', mini_cityscapes)
    save_dir, log_dir = str(tmp_path / 'out'), str(tmp_path / 'log')
    command = [sys.executable, '-m', 'paddle.distributed.launch', '--nproc_per_node', '2',
               '--log_dir', log_dir, os.path.join(ROOT, 'train.py'), '--config', config,
               '--device', 'cpu', '--save_dir', save_dir, '--iters', '50', '--batch_size', '1',
               '--save_interval', '100', '--log_iters', '1', '--seed', '3']
    workerlog = os.path.join(log_dir, 'workerlog.0')
    with started_process(command, cwd=str(tmp_path), stdout=subprocess.DEVNULL,
                         stderr=stderr) as launcher:
        deadline = time.time() + START
        while time.time() < deadline and launcher.poll() is None:
            if os.path.exists(workerlog) and 'iter: 2/50' in open(workerlog).read():
                break
            time.sleep(0.2)
        else:
            pytest.fail(f'the launch did not reach step 2 in {START} s')
        launcher.send_signal(signal.SIGINT)
        finish(launcher, 120)
    with open(workerlog) as f:
        return launcher.returncode, f.read(), save_dir


def test_the_stop_and_the_resume_line_reach_the_launchers_console(tmp_path, mini_cityscapes):
    with open(tmp_path / 'console', 'w') as console:  # stands in for the terminal
        pipe = subprocess.Popen(['cat'], stdin=subprocess.PIPE, stdout=console)
        try:
            code, rank_log, save_dir = _stop_a_launch(tmp_path, mini_cityscapes, pipe.stdin)
        finally:
            pipe.stdin.close()
            pipe.wait(30)
    text = (tmp_path / 'console').read_text()
    assert code != 0
    checkpoints = [name for name in os.listdir(save_dir) if re.fullmatch(r'iter_\d+', name)]
    assert len(checkpoints) == 1, os.listdir(save_dir)
    iteration = int(checkpoints[0][5:])
    path = os.path.join(save_dir, checkpoints[0])
    said = [line for line in text.splitlines() if line.startswith('psanet: ')]
    assert said[0] == (
        f'psanet: training stopped after iteration {iteration} on every rank (the launcher '
        f'passes a Ctrl-C or SIGTERM on as SIGTERM); its checkpoint is {path}; the log: '
        f'{os.path.join(save_dir, "train.log")}.'), text
    resume = [line for line in rank_log.splitlines() if 'resume with: ' in line]
    assert len(resume) == 1 and len(said) == 2
    assert said[1] == 'psanet: resume with: ' + resume[0].split('resume with: ', 1)[1]
    assert said[1].endswith(f'--resume_model {path}')
    assert 'Terminating with signal 2' in text  # the launcher's own lines are whole


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
