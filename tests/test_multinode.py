"""Two nodes on one machine: two launchers (``--nnodes 2 --nproc_per_node 1``) train as one
``--nproc_per_node 2`` launch does, stop together on SIGTERM or Ctrl-C to either (both
consoles saying so), and survive a lost node.

Each launcher stands for a machine: a session of its own, its own ``--log_dir``,
its output a file (the console of that machine's user),
the README's two-machine line with ``--master 127.0.0.1:<port>`` and ``--rank``
(without ``--rank`` the launcher that starts the rendezvous server first becomes
node 0, at random on one machine). The toy model (TinySegNet) trains on the CPU
with gloo; a ``Pause`` transform makes a step last about 0.3 s so that a signal
lands mid-run, and ``PSANET_TEST_SAVE_SECONDS`` makes rank 0's checkpoint write
last 2 s, so that a rank leaving before it ends is seen. Expected values come
from a run of the same config, never from numbers written here.
"""
import os
import signal
import time

import pytest

import multinode_helpers as mn
from psanet.core.checkpoint import load_checkpoint

ITERS = 10
PAUSE = 0.15      # seconds per training image read: a step of two images ~0.3 s
SIGNAL_STEP = 3   # the signal comes once node 0 has logged this step
SAVE_SECONDS = 2  # rank 0's checkpoint write, stretched
START = 180       # seconds a launch may take to reach the signalled step, under load
BOUND = 60        # seconds from the signal (or the lost node) to the end of every process


@pytest.fixture(scope='module')
def toy(tmp_path_factory):
    work = str(tmp_path_factory.mktemp('multinode'))
    config = mn.toy_setup(work, ITERS, pause=PAUSE)
    return {'work': work, 'config': config,
            'train_py': mn.write_train_py(os.path.join(work, 'bin'))}


def _env(out, save_seconds=0):
    env = dict(os.environ, PSANET_TEST_LOSSES=out)
    env.pop('PSANET_TEST_SAVE_SECONDS', None)
    if save_seconds:
        env['PSANET_TEST_SAVE_SECONDS'] = str(save_seconds)
    return env


def _two_nodes(toy, name, extra=(), save_seconds=0, save_interval=None, save_dir=None):
    """Starts node 0 and node 1 (the README's line on each); returns (launchers, run)."""
    run = os.path.join(toy['work'], name)
    os.makedirs(run)
    flags = mn.train_flags(toy['config'], save_dir or os.path.join(run, 'save'), ITERS,
                           save_interval)
    master = f'127.0.0.1:{mn.free_port()}'
    launchers = [mn.start(mn.launch_args(os.path.join(run, f'node{node}'), toy['train_py'],
                                         flags + list(extra), nnodes=2, master=master,
                                         rank=node),
                          os.path.join(run, f'launcher{node}.log'), _env(run, save_seconds))
                 for node in (0, 1)]
    return launchers, run


def _finish(launchers, timeout):
    try:
        assert mn.wait_all(launchers, timeout), f'still running after {timeout} s'
    finally:
        mn.kill_all(launchers)


def _logs(run, names=('launcher0.log', 'launcher1.log', 'node0/workerlog.0',
                      'node1/workerlog.0')):
    return '\n'.join(f'--- {name}\n' + mn.read(os.path.join(run, name))[-2500:] for name in names)


@pytest.fixture(scope='module')
def one_launch(toy):
    """The reference: one ``--nproc_per_node 2`` launch of the same config."""
    run = os.path.join(toy['work'], 'one_launch')
    os.makedirs(run)
    launcher = mn.start(mn.launch_args(os.path.join(run, 'log'), toy['train_py'],
                                       mn.train_flags(toy['config'], os.path.join(run, 'save'),
                                                      ITERS), nproc=2),
                        os.path.join(run, 'launcher.log'), _env(run))
    _finish([launcher], START)
    assert launcher.returncode == 0, mn.read(os.path.join(run, 'log', 'workerlog.0'))[-3000:]
    return {'run': run, 'losses': mn.losses(run)}


def test_two_nodes_train_as_one_launch_of_two_processes(toy, one_launch):
    launchers, run = _two_nodes(toy, 'two_nodes')
    _finish(launchers, START)
    assert [p.returncode for p in launchers] == [0, 0], _logs(run)
    want = one_launch['losses']
    assert want[0] is not None and len(want[0]['losses']) == ITERS
    # Every rank's per-iteration losses (all-reduced means, as float64), bit for bit.
    assert mn.losses(run) == want
    # What rank 0 logs, line by line; node 1's rank logs no [TRAIN] line.
    logged = mn.logged_losses(os.path.join(run, 'node0', 'workerlog.0'))
    assert len(logged) == ITERS
    assert logged == mn.logged_losses(os.path.join(one_launch['run'], 'log', 'workerlog.0'))
    assert mn.logged_losses(os.path.join(run, 'node1', 'workerlog.0')) == []
    # The final checkpoint, byte for byte: weights, optimizer state and train_state.json.
    got = mn.file_bytes(os.path.join(run, 'save', f'iter_{ITERS}'))
    assert sorted(got) == ['model.pdopt', 'model.pdparams', 'train_state.json']
    assert got == mn.file_bytes(os.path.join(one_launch['run'], 'save', f'iter_{ITERS}'))


def _last_line(log):
    lines = [line for line in log.splitlines()
             if line.strip() and not mn.GLOG_LINE.match(line)]
    return lines[-1] if lines else ''


def _rank_pid(launcher, toy_train_py, give_up):
    """The rank process the launcher started: its child running train.py (the launcher
    also runs short shell commands of its own, ldd and cat /proc/cpuinfo)."""
    while time.monotonic() < give_up and launcher.poll() is None:
        for pid in mn.children(launcher.pid):
            argv = mn.read(f'/proc/{pid}/cmdline').split('\0')
            if argv[1:2] == ['-u'] and argv[2:3] == [toy_train_py] and mn.running(pid):
                return pid
        time.sleep(0.05)
    return None


@pytest.mark.parametrize('signalled, signum', [(1, signal.SIGTERM), (0, signal.SIGINT)],
                         ids=['sigterm_node1_launcher', 'ctrl-c_node0_launcher'])
def test_a_signal_to_one_node_stops_both_after_the_same_step_with_one_checkpoint(
        toy, one_launch, signalled, signum):
    launchers, run = _two_nodes(toy, f'sigterm_node{signalled}', save_seconds=SAVE_SECONDS)
    save = os.path.join(run, 'save')
    try:
        give_up = time.monotonic() + START
        rank1 = _rank_pid(launchers[1], toy['train_py'], give_up)
        while not mn.reached(os.path.join(run, 'node0', 'workerlog.0'), SIGNAL_STEP, ITERS) and \
                time.monotonic() < give_up and all(p.poll() is None for p in launchers):
            time.sleep(0.05)
        assert rank1 and mn.reached(os.path.join(run, 'node0', 'workerlog.0'), SIGNAL_STEP,
                                    ITERS), _logs(run)
        sent = time.monotonic()
        os.kill(launchers[signalled].pid, signum)
        checkpoint_at = rank1_end = None
        everyone = [p for launcher in launchers for p in mn.tree(launcher.pid)]
        while time.monotonic() < sent + BOUND:
            now = time.monotonic()
            if checkpoint_at is None and any(n.startswith('iter_') for n in os.listdir(save)):
                checkpoint_at = now
            if rank1_end is None and not mn.running(rank1):
                rank1_end = now
            if all(p.poll() is not None for p in launchers) and \
                    not any(mn.running(p) for p in everyone):
                break
            time.sleep(0.02)
        seconds = round(time.monotonic() - sent, 2)
        assert all(p.poll() is not None for p in launchers) and \
            not any(mn.running(p) for p in everyone), \
            f'still running {BOUND} s after {signum!r} to node {signalled}\n' + _logs(run)
    finally:
        mn.kill_all(launchers)
    print(f'{signum!r} to node {signalled}\'s launcher: every process ended in {seconds} s, '
          f'rank 1 {rank1_end - checkpoint_at:.2f} s after the checkpoint appeared')

    # Both ranks stop after the same step, saying so and naming the one checkpoint.
    stops = set()
    for node in (0, 1):
        log = mn.read(os.path.join(run, f'node{node}', 'workerlog.0'))
        found = mn.STOP_LINE.match(_last_line(log))
        assert found and 'Traceback' not in log, _logs(run)
        stops.add((int(found.group(1)), found.group(2)))
    assert len(stops) == 1, stops
    (step, path), = stops
    assert SIGNAL_STEP <= step < ITERS and path == os.path.join(save, f'iter_{step}')
    assert sorted(os.listdir(save)) == [f'iter_{step}', 'train.log']
    assert mn.read(os.path.join(save, 'train.log')).count(f'Saved checkpoint {path}\n') == 1
    _, optimizer_state, state = load_checkpoint(path)
    assert state['iteration'] == step and optimizer_state
    # Node 1's rank left only once rank 0 had written it (the ranks meet after the write).
    assert checkpoint_at is not None and rank1_end is not None and rank1_end > checkpoint_at, \
        (checkpoint_at, rank1_end)
    # The signalled launcher exits with its signal's number; the other with its rank's 143.
    codes = [p.returncode for p in launchers]
    assert codes[signalled] == signum and codes[1 - signalled] == 143, codes
    # Each node's console (its launcher's output) ends the run with the stop and the resume
    # line, which rank 0 logged.
    resume = [line.split('resume with: ', 1)[1] for line in
              mn.read(os.path.join(run, 'node0', 'workerlog.0')).splitlines()
              if 'resume with: ' in line]
    assert len(resume) == 1 and resume[0].endswith(f'--resume_model {path}')
    for node in (0, 1):
        console = mn.read(os.path.join(run, f'launcher{node}.log'))
        assert mn.stop_lines(console) == mn.said_stop(step, path, save, resume[0]), \
            f'node {node}\'s console:\n{console[-3000:]}'

    # The same two lines again, with --resume_model auto: the uninterrupted losses.
    launchers, run2 = _two_nodes(toy, f'resume_node{signalled}', ['--resume_model', 'auto'],
                                 save_dir=save)
    _finish(launchers, START)
    assert [p.returncode for p in launchers] == [0, 0], _logs(run2)
    resumed = mn.losses(run2)
    assert all(r['start_iter'] == step for r in resumed)
    assert [r['losses'] for r in resumed] == \
        [r['losses'][step:] for r in one_launch['losses']]


def test_a_lost_node_ends_the_other_and_auto_resumes_from_the_last_checkpoint(toy, one_launch):
    """A machine that dies (SIGKILL to node 1's launcher and rank): node 0's rank fails in
    its next all-reduce instead of waiting, and the relaunch loses the steps since the last
    --save_interval checkpoint."""
    launchers, run = _two_nodes(toy, 'lost_node', save_interval=2)
    save = os.path.join(run, 'save')
    lose_after = SIGNAL_STEP + 2  # iter_2 and iter_4 saved by then: auto takes the newest
    try:
        give_up = time.monotonic() + START
        while not mn.reached(os.path.join(run, 'node0', 'workerlog.0'), lose_after, ITERS) and \
                time.monotonic() < give_up and all(p.poll() is None for p in launchers):
            time.sleep(0.05)
        assert mn.reached(os.path.join(run, 'node0', 'workerlog.0'), lose_after, ITERS), \
            _logs(run)
        lost = time.monotonic()
        mn.kill_all([launchers[1]])
        assert mn.wait_all([launchers[0]], BOUND), \
            f'node 0 still running {BOUND} s after node 1 was lost\n' + _logs(run)
        seconds = round(time.monotonic() - lost, 2)
    finally:
        mn.kill_all(launchers)
    reached = max(i for i, _ in mn.logged_losses(os.path.join(run, 'node0', 'workerlog.0')))
    last = max(int(n[len('iter_'):]) for n in os.listdir(save) if n.startswith('iter_'))
    print(f'node 1 lost after step {reached}: node 0 ended in {seconds} s with '
          f'{launchers[0].returncode}; last checkpoint iter_{last}')
    assert launchers[0].returncode not in (0, None)
    assert reached - 2 < last <= reached and last >= 4

    launchers, run2 = _two_nodes(toy, 'lost_node_resume', ['--resume_model', 'auto'],
                                 save_interval=2, save_dir=save)
    _finish(launchers, START)
    assert [p.returncode for p in launchers] == [0, 0], _logs(run2)
    resumed = mn.losses(run2)
    assert all(r['start_iter'] == last for r in resumed)
    assert [r['losses'] for r in resumed] == \
        [r['losses'][last:] for r in one_launch['losses']]


@pytest.mark.parametrize('node', [0, 1])
def test_a_node_that_never_comes_ends_the_launch_line_in_one_line(toy, node):
    """node 0 alone waits for its peer; node 1 alone, for a master nobody starts: Paddle's
    rendezvous has no timeout, psanet.launch's watcher ends it (SIGKILL, one line)."""
    run = os.path.join(toy['work'], f'alone{node}')
    os.makedirs(run)
    master = f'127.0.0.1:{mn.free_port()}'
    flags = mn.train_flags(toy['config'], os.path.join(run, 'save'), ITERS)
    env = dict(_env(run), PSANET_RENDEZVOUS_TIMEOUT='6')
    started = time.monotonic()
    launcher = mn.start(mn.launch_args(os.path.join(run, 'log'), toy['train_py'], flags,
                                       nnodes=2, master=master, rank=node),
                        os.path.join(run, 'launcher.log'), env)
    try:
        assert mn.wait_all([launcher], 60), 'the lone launcher still runs after 60 s'
    finally:
        mn.kill_all([launcher])
    seconds = time.monotonic() - started
    log = mn.read(os.path.join(run, 'launcher.log'))
    errors = [line for line in log.splitlines() if line.startswith('error: ')]
    assert launcher.returncode == -signal.SIGKILL and 6 <= seconds < 30, (seconds, log[-2000:])
    assert errors == [
        f'error: node {node} of 2: not all 2 nodes reached the master {master} within 6 s '
        '(PSANET_RENDEZVOUS_TIMEOUT); this node\'s launcher is killed (SIGKILL). Check that '
        'every node runs the same launch line with its own --rank, that --master is an address '
        'of the first node that the others reach, and that its port is free there.']
    assert not os.path.exists(os.path.join(run, 'save'))
