"""SIGTERM to a launched two-process training: every rank stops after the same step and saves it.

Each trial launches train.py's work on the mini config (64x32 crops, two
DataLoader workers per rank) with ``python -m paddle.distributed.launch
--nproc_per_node 2`` on the CPU and, at a random step, sends SIGTERM to the
launcher, to every process of the job (what a scheduler does; the launcher
starts each rank in a session of its own), or to one rank, with a busy loop
per core beside it. Every process must end within ``BOUND`` seconds (past it,
the test kills them all and names the case), every rank with 143 and the
launcher non-zero, both ranks after the same step, whose checkpoint exists
once and whole. One more launch trains uninterrupted and then resumes from
every trial's checkpoint: each resumed run's per-iteration losses must equal
the uninterrupted ones. ``PSANET_PREEMPTION_TRIALS`` sets the trial count
(10 by default, at least 1).
"""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, read_text as _read, write_mini_train_config

RANK = os.path.join(ROOT, 'tests', 'preemption_rank.py')
TRIALS = max(int(os.environ.get('PSANET_PREEMPTION_TRIALS', '10')), 1)
CASES = ('launcher', 'group', 'rank')
ITERS = 7          # iterations of every run; the signal comes after step 1 to 4
SAVE_INTERVAL = 5  # a checkpoint and an evaluation at 5: some stops land next to them
START = 240        # seconds a launch may take to reach its signalled step, under load
BOUND = 60         # seconds from the signal to the end of every process (the launcher
#                    itself kills its ranks 30 s after forwarding SIGTERM)
SIGNALS = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))


def _flags(config, save_dir, save_interval=SAVE_INTERVAL):
    return ['--config', config, '--device', 'cpu', '--save_dir', save_dir, '--iters',
            str(ITERS), '--batch_size', '1', '--num_workers', '2', '--log_iters', '1',
            '--save_interval', str(save_interval), '--seed', '3', '--keep_checkpoint_max', '2']


def _launch(work, name, args):
    out = os.path.join(work, name)
    os.makedirs(out)
    log = open(os.path.join(out, 'launcher.log'), 'w')
    launcher = subprocess.Popen(
        [sys.executable, '-m', 'paddle.distributed.launch', '--log_dir',
         os.path.join(out, 'log'), '--nproc_per_node', '2', RANK, out] + args,
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return launcher, out


def _children(pid):
    try:
        with open(f'/proc/{pid}/task/{pid}/children') as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _tree(pid):
    found = [pid]
    for child in _children(pid):
        found += _tree(child)
    return found


def _kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _trainers(out):
    pids = [_read(os.path.join(out, f'pid.{rank}')).strip() for rank in (0, 1)]
    return [int(p) for p in pids] if all(pids) else None


def _reached(out, step):
    return re.search(rf'iter: {step}/{ITERS}', _read(os.path.join(out, 'log', 'workerlog.0')))


def _worker_masks(trainers):
    """SigIgn of the DataLoader workers (children) of each trainer that live 0.3 s apart,
    so that each has run its worker_init_fn by the second look."""
    before = {trainer: set(_children(trainer)) for trainer in trainers}
    time.sleep(0.3)
    masks = {}
    for trainer in trainers:
        for worker in before[trainer] & set(_children(trainer)):
            status = _read(f'/proc/{worker}/status')
            found = re.search(r'^SigIgn:\s*([0-9a-f]+)$', status, re.M)
            if found:
                masks.setdefault(trainer, []).append(int(found.group(1), 16))
    return masks


def _busy_loops():
    return [subprocess.Popen([sys.executable, '-c', 'while True: pass'], start_new_session=True)
            for _ in range(os.cpu_count() or 1)]


def _trial(work, number, case, step, delay, rng, config):
    save_dir = os.path.join(work, f'run{number}')
    launcher, out = _launch(work, f'trial{number}', _flags(config, save_dir) + ['--do_eval'])
    result = {'trial': number, 'case': case, 'step': step, 'problems': []}
    everyone, busy = [launcher.pid], []
    try:
        give_up = time.monotonic() + START
        for reach in (1, step):  # the load from the first step on, the start-up without it
            while not (_trainers(out) and _reached(out, reach)) and \
                    time.monotonic() < give_up and launcher.poll() is None:
                time.sleep(0.05)
            if not busy:
                busy = _busy_loops()
                masks = {}
                for _ in range(5):  # an epoch's workers may be starting: look again
                    masks = _worker_masks(_trainers(out) or [])
                    if len(masks) == 2:
                        break
                result['worker_masks'] = {str(t): m for t, m in masks.items()}
        trainers = _trainers(out)
        if launcher.poll() is not None or not _reached(out, step):
            result['problems'].append(f'step {step} not reached in {START} s (launcher '
                                      f'{launcher.poll()})')
            return result, out
        time.sleep(rng.uniform(0, delay))  # anywhere in the next step
        everyone = _tree(launcher.pid)
        sent = time.monotonic()
        if case == 'launcher':
            os.kill(launcher.pid, signal.SIGTERM)
        elif case == 'group':  # every process: the launcher's group and each rank's session
            for group in {os.getpgid(pid) for pid in [launcher.pid] + trainers}:
                os.killpg(group, signal.SIGTERM)
        else:
            result['rank'] = rng.randrange(2)
            os.kill(trainers[result['rank']], signal.SIGTERM)
        deadline = sent + BOUND
        while time.monotonic() < deadline and (launcher.poll() is None or
                                               any(os.path.exists(f'/proc/{p}') and
                                                   _read(f'/proc/{p}/stat').split()[2:3] != ['Z']
                                                   for p in everyone)):
            time.sleep(0.05)
        result['seconds'] = round(time.monotonic() - sent, 2)
        alive = [p for p in everyone if os.path.exists(f'/proc/{p}')
                 and _read(f'/proc/{p}/stat').split()[2:3] != ['Z']]
        if alive or launcher.poll() is None:
            result['problems'].append(f'still running {BOUND} s after the signal ({case} case, '
                                      f'at step {step}): pids {alive}; killed')
        result['launcher'] = launcher.poll()
        result['ranks'] = [_read(os.path.join(out, f'exit.{rank}')).strip() for rank in (0, 1)]
    finally:
        _kill_all(everyone + _tree(launcher.pid))
        launcher.wait()
        for process in busy:
            process.kill()
            process.wait()
    return result, out


GLOG_LINE = re.compile(r'[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ')

def _check_trial(result, out, save_dir):
    """What is wrong with how a trial ended; appends to result['problems']."""
    problems = result['problems']
    if problems:
        return
    if result['ranks'] != ['143', '143']:
        problems.append(f'rank exit codes {result["ranks"]}, want 143 for both')
    if result['launcher'] == 0:
        problems.append('the launcher exited 0')
    stops = []
    for rank in (0, 1):
        log = _read(os.path.join(out, 'log', f'workerlog.{rank}'))
        # Paddle 3.0's C++ side logs its store's shutdown (glog) after the error line.
        lines = [line for line in log.splitlines() if line.strip() and not GLOG_LINE.match(line)]
        found = re.search(r'^error: training stopped by SIGTERM after iteration (\d+); its '
                          r'checkpoint is (\S+)$', lines[-1] if lines else '')
        if not found or 'Traceback' in log:
            problems.append(f'rank {rank} ends with {lines[-1:]} (or shows a traceback)')
            continue
        stops.append((int(found.group(1)), found.group(2)))
    if len(stops) < 2:
        return
    if stops[0] != stops[1]:
        problems.append(f'the ranks stopped after different steps: {stops}')
        return
    iteration, path = stops[0]
    result['stop'] = iteration
    if path != os.path.join(save_dir, f'iter_{iteration}') or not iteration >= result['step']:
        problems.append(f'stopped at {path} after the signal at step {result["step"]}')
    resume = ('resume with: python -m paddle.distributed.launch --nproc_per_node 2 train.py '
              '--config ')
    log0 = _read(os.path.join(out, 'log', 'workerlog.0'))
    if resume not in log0 or not re.search(rf'--resume_model {re.escape(path)}$', log0, re.M):
        problems.append('rank 0 logs no "resume with: ..." line naming the checkpoint')
    entries = os.listdir(save_dir)
    hidden = [name for name in entries if name.startswith('.')]
    if hidden:
        problems.append(f'hidden files left in {save_dir}: {hidden}')
    from psanet.core.checkpoint import load_checkpoint
    try:
        _, optimizer_state, state = load_checkpoint(path)
    except Exception as error:  # noqa: B902  (whatever fails to load is the problem)
        problems.append(f'{path} does not load: {error}')
        return
    if state['iteration'] != iteration or not optimizer_state:
        problems.append(f'{path} holds iteration {state["iteration"]} or no optimizer state')
    saves = _read(os.path.join(save_dir, 'train.log')).count(f'Saved checkpoint {path}\n')
    if saves != 1:
        problems.append(f'{path} was saved {saves} times')
    for name in entries:  # the resumes need only the stop's checkpoint: 124 MB each
        if name != os.path.basename(path) and os.path.isdir(os.path.join(save_dir, name)):
            shutil.rmtree(os.path.join(save_dir, name))


@pytest.fixture(scope='module')
def preempted(tmp_path_factory):
    """The trials, then one launch: the uninterrupted run, then a resume from each stop."""
    from psanet.data import generate_mini_cityscapes
    work = str(tmp_path_factory.mktemp('preemption'))
    root = os.path.join(work, 'mini')
    generate_mini_cityscapes(root, num_train=8, num_val=2, size=(64, 32), seed=0)
    config = write_mini_train_config(tmp_path_factory.mktemp('config') / 'mini_64x32.yml', root)
    rng = random.Random(int(os.environ.get('PSANET_PREEMPTION_SEED', '0')))
    trials = []
    started = time.monotonic()
    for number in range(TRIALS):
        case = CASES[number % len(CASES)]
        if case == 'rank':  # alternately before the evaluation and in its step
            step, delay = (SAVE_INTERVAL - 1, 0.5) if number // 3 % 2 else (1, 0.0)
        else:
            step, delay = rng.randint(1, SAVE_INTERVAL - 1), 0.5
        result, out = _trial(work, number, case, step, delay, rng, config)
        _check_trial(result, out, os.path.join(work, f'run{number}'))
        trials.append(result)
    trials_seconds = time.monotonic() - started
    stopped = [t for t in trials if 'stop' in t and t['stop'] < ITERS]
    checkpoints = [os.path.join(work, f'run{t["trial"]}', f'iter_{t["stop"]}') for t in stopped]
    # The uninterrupted run is resume 0: from scratch (the rank script's 'none'). Without
    # --do_eval and with one checkpoint at the end: an evaluation or a checkpoint changes no
    # training state, and these runs only compare losses.
    launcher, out = _launch(work, 'resumes', ['--resume_each', 'none'] + checkpoints + ['--']
                            + _flags(config, os.path.join(work, 'resumed'), ITERS))
    try:
        launcher.wait(START + 60 * len(checkpoints))
    finally:
        _kill_all(_tree(launcher.pid))
        launcher.wait()
        for name in os.listdir(work):
            if name.startswith(('run', 'resumed')):
                shutil.rmtree(os.path.join(work, name))
    resumed = {}
    for i, trial in enumerate([None] + stopped):
        path = os.path.join(out, f'losses.0.{i}.json')
        resumed[trial['trial'] if trial else 'uninterrupted'] = \
            json.loads(_read(path)) if os.path.exists(path) else None
    return {'trials': trials, 'resumed': resumed, 'out': out, 'launcher': launcher.returncode,
            'seconds': (round(trials_seconds, 1), round(time.monotonic() - started, 1))}


def _report(trials):
    return '\n\n'.join(f'trial {t["trial"]} (SIGTERM to the {t["case"]} after step '
                       f'{t["step"]}):\n' + '\n'.join(t['problems']) for t in trials)


def test_every_rank_stops_after_the_same_step_with_its_checkpoint(preempted):
    trials = preempted['trials']
    print(json.dumps(trials, indent=1), preempted['seconds'])
    failed = [t for t in trials if t['problems']]
    assert not failed, _report(failed)
    assert len(trials) == TRIALS and {t['case'] for t in trials} == set(CASES[:TRIALS])
    assert all(t['seconds'] < BOUND for t in trials)
    # A rank signalled alone: both stops happened, after a plain step (the loss's all-reduce
    # carries the stop) and in an evaluation's step (the evaluation's sum carries it too).
    at_evaluation = {t['stop'] % SAVE_INTERVAL == 0 for t in trials if t['case'] == 'rank'}
    assert at_evaluation == ({False, True} if TRIALS >= 6 else {False}), trials


def test_dataloader_workers_leave_signals_to_their_rank(preempted):
    for trial in preempted['trials']:
        masks = trial.get('worker_masks', {})
        assert len(masks) == 2, f'trial {trial["trial"]}: workers of both ranks not seen {masks}'
        for trainer, values in masks.items():
            assert all(value & SIGNALS == SIGNALS for value in values), \
                f'trial {trial["trial"]}: a worker of {trainer} does not ignore SIGINT and ' \
                f'SIGTERM: SigIgn {[hex(v) for v in values]}'


def test_resuming_each_stop_gives_the_uninterrupted_losses(preempted):
    resumed = preempted['resumed']
    baseline = resumed.pop('uninterrupted')
    assert preempted['launcher'] == 0 and baseline is not None, \
        _read(os.path.join(preempted['out'], 'log', 'workerlog.0'))[-3000:]
    assert len(baseline['losses']) == ITERS and baseline['start_iter'] == 0
    stops = {t['trial']: t['stop'] for t in preempted['trials'] if 'stop' in t}
    assert len(resumed) == len(stops) >= TRIALS - sum(s >= ITERS for s in stops.values())
    for trial, run in resumed.items():
        assert run is not None and run['start_iter'] == stops[trial]
        # Identical on one machine: the same data order, seeds, weights and optimizer state.
        assert run['losses'] == baseline['losses'][stops[trial]:], trial


def test_the_launcher_exits_as_docs_reliability_says(preempted):
    # paddle.distributed.launch exits with the signal's number when it is signalled
    # (sys.exit(15)), and with the first failed rank's code when a rank ends first.
    codes = {}
    for trial in preempted['trials']:
        codes.setdefault(trial['case'], set()).add(trial.get('launcher'))
    want = {'launcher': {15}, 'group': {15}, 'rank': {143}}
    assert codes == {case: want[case] for case in codes}, codes


SLOW_SAVE = 4  # seconds rank 0's stop checkpoint takes: far longer than a rank takes to exit


def test_no_rank_exits_before_rank_0_has_written_the_stop_checkpoint(tmp_path, monkeypatch):
    """The launcher ends every rank once one exits: a rank that stopped must wait for rank 0
    to write the stop's checkpoint. With rank 0's save made slow, rank 1 (the one signalled)
    must end after the save ended, both with 143, the checkpoint whole."""
    from psanet.core.checkpoint import load_checkpoint
    from psanet.data import generate_mini_cityscapes
    root = str(tmp_path / 'mini')
    generate_mini_cityscapes(root, num_train=4, num_val=2, size=(64, 32), seed=0)
    config = write_mini_train_config(tmp_path / 'mini_64x32.yml', root)
    save_dir = str(tmp_path / 'run')
    monkeypatch.setenv('PSANET_TEST_SLOW_SAVE', str(SLOW_SAVE))
    launcher, out = _launch(str(tmp_path), 'slow_save', _flags(config, save_dir))
    everyone = [launcher.pid]
    try:
        give_up = time.monotonic() + START
        while not (_trainers(out) and _reached(out, 2)) and time.monotonic() < give_up and \
                launcher.poll() is None:
            time.sleep(0.05)
        assert _reached(out, 2) and launcher.poll() is None, \
            _read(os.path.join(out, 'log', 'workerlog.0'))[-3000:]
        everyone = _tree(launcher.pid)
        os.kill(_trainers(out)[1], signal.SIGTERM)
        launcher.wait(BOUND + SLOW_SAVE)
    finally:
        _kill_all(everyone + _tree(launcher.pid))
        launcher.wait()
    logs = '\n'.join(_read(os.path.join(out, 'log', f'workerlog.{rank}'))[-1500:]
                     for rank in (0, 1))
    saved = _read(os.path.join(out, 'saved.0')).split()
    assert saved, f'rank 0 never finished its stop checkpoint:\n{logs}'
    rank1_exit = float(_read(os.path.join(out, 'exit_time.1')) or 'nan')
    assert rank1_exit >= float(saved[-1]), \
        f'rank 1 exited {float(saved[-1]) - rank1_exit:.2f} s before rank 0 had written ' \
        f'its stop checkpoint (no barrier):\n{logs}'
    assert [_read(os.path.join(out, f'exit.{rank}')).strip() for rank in (0, 1)] == \
        ['143', '143'], logs
    stop = re.search(r'after iteration (\d+); its checkpoint is (\S+)$',
                     _read(os.path.join(out, 'log', 'workerlog.0')), re.M)
    assert stop, logs
    _, optimizer_state, state = load_checkpoint(stop.group(2))
    assert state['iteration'] == int(stop.group(1)) and optimizer_state
