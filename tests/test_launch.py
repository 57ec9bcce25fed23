"""``python -m psanet.launch``: a launch line that cannot work is one line before anything
starts; what passes reaches Paddle's launcher as it was given; the watcher; the stop note.

Most cases run :func:`psanet.launch.main` in this process with Paddle's ``launch``
replaced by a stand-in that builds Paddle's own ``Context`` (its parser and the
``PADDLE_*`` variables, as the real launcher does) and records it, so no rank starts.
Real launches, their consoles and their stops: tests/test_launched_console.py,
tests/test_multinode.py, tests/test_slurm_script.py, tests/test_elastic.py.
"""
import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from psanet import launch
from psanet.interrupts import STOP_NOTE
from conftest import ROOT

TRAIN_PY = os.path.join(ROOT, 'train.py')
SCRIPT_FLAGS = [TRAIN_PY, '--config', 'c.yml', '--device', 'cpu']


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variable of this environment's; what main() sets is undone after."""
    from paddle.distributed.launch.context.args_envs import env_args_mapping
    for variable in list(env_args_mapping) + list(launch.ETCD_ENVIRONMENT) + [
            'PADDLE_TRAINER_ID', 'PSANET_RENDEZVOUS_TIMEOUT', 'CUDA_VISIBLE_DEVICES', STOP_NOTE]:
        monkeypatch.setenv(variable, '')  # remembers the value (or its absence) to restore
        monkeypatch.delenv(variable)
    monkeypatch.setattr(sys, 'argv', list(sys.argv))


@pytest.fixture
def paddle_launch(monkeypatch, clean_env):
    """Paddle's launch replaced: each call records the launcher's ``Context`` (built as the
    launcher builds it, from ``sys.argv`` and the environment) and what it was given, then
    runs ``then(record)`` (default: exit 0, as the launcher does)."""
    paddle_main = importlib.import_module('paddle.distributed.launch.main')
    from paddle.distributed.launch.context import Context
    from paddle.distributed.launch.context.status import Status
    monkeypatch.setattr(Status, 'fail', Status.fail)  # restored after a restart_own_failure
    calls = []

    def fake_launch():
        context = Context(enable_plugin=False)
        status = Status()
        status.fail()
        record = {'argv': list(sys.argv), 'args': vars(context.args), 'note':
                  os.environ.get(STOP_NOTE), 'fail_restarts': status.is_restarting(),
                  'env': dict(os.environ)}
        calls.append(record)
        fake_launch.then(record)

    def exit_0(record):
        raise SystemExit(0)

    fake_launch.then = exit_0
    monkeypatch.setattr(paddle_main, 'launch', fake_launch)
    yield fake_launch, calls


def _run(argv, capsys):
    """main(argv): (exit code, stdout, the lines on stderr)."""
    try:
        code = launch.main(argv)
    except SystemExit as ended:
        code = ended.code
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.strip()]


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


# (launcher flags, variables, what the one line says): each line names what was given
# (a flag or the variable that overrides it) and the fix.
REFUSED = [
    (['--nnodes', '0'], {}, '--nnodes 0 is not a number of nodes: give a whole number from 1'),
    (['--nnodes', '-2'], {}, '--nnodes -2 is not a number of nodes'),
    (['--nnodes', 'two'], {}, '--nnodes two is not a number of nodes'),
    (['--nnodes', '3:2', '--master', 'etcd://127.0.0.1:2379'], {}, '--nnodes 3:2 is not a '
     'number of nodes: give a whole number from 1 (or MIN:MAX, 1 <= MIN <= MAX'),
    (['--nnodes', '2', '--master', '10.0.0.1'], {},
     '--master 10.0.0.1 has no port: give HOST:PORT, e.g. 10.0.0.1:49178.'),
    (['--nnodes', '2', '--master', '10.0.0.1:eighty'], {}, "--master 10.0.0.1:eighty: its "
     "port 'eighty' is not a number from 1 to 65535"),
    (['--nnodes', '2', '--master', '10.0.0.1:0'], {}, "its port '0' is not a number from 1 "
     'to 65535'),
    (['--nnodes', '2', '--master', '10.0.0.1:65536'], {}, "its port '65536' is not a number"),
    (['--nnodes', '2', '--master', '::1:4000'], {}, '--master ::1:4000: ::1 is not an IPv4 '
     'address or a host name'),
    (['--master', 'etcd://127.0.0.1'], {}, '--master etcd://127.0.0.1 has no port: give '
     'etcd://HOST:PORT, e.g. etcd://127.0.0.1:2379.'),
    (['--nnodes', '2', '--rank', '2', '--master', '10.0.0.1:4000'], {},
     '--rank 2 is not a node of --nnodes 2: give each node its own --rank from 0 to 1'),
    (['--nnodes', '2', '--rank', '-2', '--master', '10.0.0.1:4000'], {},
     '--rank -2 is not a node of --nnodes 2'),
    (['--nproc_per_node', '0'], {}, '--nproc_per_node 0 starts no process: give 1 or more.'),
    (['--nprocs', '2'], {}, 'unrecognized launcher flag --nprocs: python -m psanet.launch '
     '--help lists the launcher\'s flags; train.py\'s flags go after the training script.'),
    (['--rank', 'one'], {}, "argument --rank: invalid int value: 'one': python -m "
     'psanet.launch --help lists the launcher\'s flags'),
    ([], {'PSANET_RENDEZVOUS_TIMEOUT': '0'}, "PSANET_RENDEZVOUS_TIMEOUT='0' is not a whole "
     'number of seconds above 0: give one (the default is 300) or unset it.'),
    ([], {'PSANET_RENDEZVOUS_TIMEOUT': '-5'}, "PSANET_RENDEZVOUS_TIMEOUT='-5' is not"),
    ([], {'PSANET_RENDEZVOUS_TIMEOUT': '5m'}, "PSANET_RENDEZVOUS_TIMEOUT='5m' is not"),
    # The variables Kubeflow's operator sets override the flags, as in Paddle's Context.
    (['--nnodes', '2', '--master', '10.0.0.1:4000'], {'PADDLE_NNODES': '0'},
     'PADDLE_NNODES=0 (it overrides --nnodes) is not a number of nodes'),
    (['--nnodes', '2', '--master', '10.0.0.1:4000', '--rank', '1'], {'PADDLE_RANK': '5'},
     'PADDLE_RANK=5 (it overrides --rank) is not a node of --nnodes 2'),
    (['--nnodes', '2', '--master', '10.0.0.1:4000'], {'PADDLE_MASTER': '10.0.0.1'},
     'PADDLE_MASTER=10.0.0.1 (it overrides --master) has no port'),
    (['--nnodes', '2', '--master', '10.0.0.1:4000'], {'PADDLE_RANK': 'x'},
     "PADDLE_RANK='x' (it sets --rank) is not a int: fix or unset it."),
]


@pytest.mark.parametrize('flags, env, said', REFUSED, ids=[
    ' '.join(flags + [f'{k}={v}' for k, v in env.items()]) for flags, env, _ in REFUSED])
def test_a_launch_line_that_cannot_work_is_one_line_and_starts_nothing(
        paddle_launch, capsys, monkeypatch, flags, env, said):
    _, calls = paddle_launch
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, err = _run(flags + SCRIPT_FLAGS, capsys)
    assert (code, len(err), calls) == (2, 1, []), err
    assert err[0].startswith('error: ') and said in err[0], err[0]


def test_no_script_or_a_missing_one_is_one_line(paddle_launch, capsys, tmp_path, monkeypatch):
    _, calls = paddle_launch
    monkeypatch.chdir(tmp_path)
    assert _run(['--nproc_per_node', '2'], capsys)[::2] == (2, [
        'error: no training script: give it after the launcher\'s flags, e.g. python -m '
        'psanet.launch --nproc_per_node 2 train.py --config CONFIG --device cpu'])
    assert _run(['train.py', '--config', 'c.yml'], capsys)[::2] == (2, [
        f'error: the training script train.py does not exist (in {tmp_path}): run from the '
        'repository root or give its path.'])
    assert _run(['no-such-command'], capsys)[::2] == (2, [
        f'error: the training script no-such-command does not exist (in {tmp_path}): run '
        'from the repository root or give its path.'])
    assert calls == []


def test_the_flags_reach_paddles_launcher_as_given_with_the_variables_over_them(
        paddle_launch, capsys, monkeypatch):
    """What psanet.launch checked is what Paddle's launcher runs: the same argv, and the
    Context Paddle builds from it agrees with the flags psanet.launch read, the
    ``PADDLE_*`` variables over them."""
    _, calls = paddle_launch
    monkeypatch.setenv('PADDLE_NPROC_PER_NODE', '3')
    monkeypatch.setenv('PADDLE_JOB_ID', 'kube')
    argv = ['--nproc_per_node', '2', '--log_dir', 'somewhere', '--job_id', 'mine'] + \
        SCRIPT_FLAGS
    checked = launch.check(argv)
    assert _run(argv, capsys)[0] == 0
    (call,) = calls
    assert call['argv'][1:] == argv
    assert call['args'] == vars(checked.args)
    assert (checked.args.nproc_per_node, checked.args.job_id, checked.args.log_dir) == \
        (3, 'kube', 'somewhere')
    assert checked.args.training_script_args == SCRIPT_FLAGS[1:]


@pytest.mark.parametrize('level', [-1, 0, 1, 2])
def test_an_etcd_master_gets_its_variables_and_the_own_failure_restart_from_level_1(
        paddle_launch, capsys, monkeypatch, level):
    from psanet import compat
    _, calls = paddle_launch
    monkeypatch.setattr(launch, 'check_etcd', lambda master: None)  # one that answers
    argv = ['--master', 'etcd://127.0.0.1:2379', '--elastic_level', str(level)] + SCRIPT_FLAGS
    assert _run(argv, capsys)[0] == 0
    (call,) = calls
    assert call['args']['master'] == 'etcd://127.0.0.1:2379'
    assert {name: call['env'].get(name) for name in launch.ETCD_ENVIRONMENT} == \
        launch.ETCD_ENVIRONMENT
    # With --elastic_level 1 or more the launcher restarts after its own failure (where
    # Paddle needs the change); below, a failure stays a failure.
    assert call['fail_restarts'] == (level >= 1 and compat.ELASTIC_OWN_FAILURE.needed())


def test_the_launchers_stop_note_is_printed_when_it_returns(paddle_launch, capsys):
    """What a stopped rank leaves in $PSANET_STOP_NOTE comes out on this launcher's
    stderr after the launcher's own lines, with the launcher's exit code; the note is
    removed, and a stale one of an earlier launcher of the same process id is not
    printed."""
    fake, calls = paddle_launch
    stale = os.path.join(tempfile.gettempdir(), f'psanet-launch-{os.getpid()}.stop')
    with open(stale, 'w') as f:
        f.write('psanet: an earlier launch\n')
    said = 'psanet: training stopped after iteration 3 ...\npsanet: resume with: python x\n'

    def stop(record):
        print('LAUNCH INFO Exit with signal 15', file=sys.stderr)
        with open(record['note'], 'w') as f:
            f.write(said)
        raise SystemExit(15)

    fake.then = stop
    code, _, err = _run(SCRIPT_FLAGS, capsys)
    assert code == 15 and calls[0]['note'] == stale
    assert err == ['LAUNCH INFO Exit with signal 15'] + said.splitlines()
    assert not os.path.exists(stale)
    # A launch that was not stopped prints nothing more, not even a stale note.
    with open(stale, 'w') as f:
        f.write('psanet: an earlier launch\n')
    fake.then = lambda record: None
    assert _run(SCRIPT_FLAGS, capsys) == (0, '', [])
    assert not os.path.exists(stale)


def test_devices_this_machine_lacks_are_one_line(paddle_launch, capsys, monkeypatch):
    from paddle.base import core
    _, calls = paddle_launch
    if not core.is_compiled_with_cuda():
        # README's one-machine line on a CPU machine (Paddle's own: "substring not found").
        code, _, err = _run(['--gpus', '0,1,2,3'] + SCRIPT_FLAGS, capsys)
        assert (code, err) == (2, [
            'error: --gpus/--devices 0,1,2,3 asks for GPUs, and this Paddle is built for the '
            'CPU: on the CPU give --nproc_per_node N instead of it (N processes, gloo).'])
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '0')  # one visible device, as Paddle sees it
    code, _, err = _run(['--gpus', '0,1,2,3'] + SCRIPT_FLAGS, capsys)
    assert (code, err) == (2, [
        'error: --gpus/--devices 0,1,2,3 names 1,2,3, which this machine does not have: its '
        'visible gpu devices are 0.'])
    assert calls == []


@pytest.mark.parametrize('master, said', [
    ('localhost', 'localhost is this machine, but Paddle starts the rendezvous server only '
     'when --master is 127.0.0.1 or '),
    ('127.0.0.2', '127.0.0.2 is this machine, but Paddle starts the rendezvous server'),
    ('no-such-host.invalid', 'the host name no-such-host.invalid has no address here: give '
     'the first node\'s IP address.'),
])
def test_a_master_no_node_would_start_is_refused_at_once(paddle_launch, capsys, master, said):
    _, calls = paddle_launch
    port = _free_port()
    code, _, err = _run(['--nnodes', '2', '--master', f'{master}:{port}'] + SCRIPT_FLAGS,
                        capsys)
    assert (code, len(err), calls) == (2, 1, []), err
    assert err[0].startswith(f'error: --master {master}:{port}: {said}'), err[0]


def test_a_master_port_another_program_holds_is_refused_a_rendezvous_servers_is_not(
        paddle_launch, capsys, monkeypatch):
    from paddle.distributed.launch.utils.kv_server import KVServer
    fake, calls = paddle_launch
    watched = []
    monkeypatch.setattr(launch, 'watch_rendezvous', lambda *args: watched.append(args))
    with socket.socket() as other:  # listens, answers nothing
        other.bind(('127.0.0.1', 0))
        other.listen(4)
        port = other.getsockname()[1]
        code, _, err = _run(['--nnodes', '2', '--master', f'127.0.0.1:{port}'] + SCRIPT_FLAGS,
                            capsys)
    assert (code, calls, watched) == (2, [], [])
    assert err == [f'error: --master 127.0.0.1:{port}: port {port} on this machine is taken by '
                   'a program that is not a rendezvous server: give a free port.']
    # Another node's launcher on this machine started the server first: a launch to join.
    port = _free_port()
    server = KVServer(port)
    server.start()
    try:
        argv = ['--nnodes', '2', '--rank', '0', '--master', f'127.0.0.1:{port}'] + SCRIPT_FLAGS
        assert _run(argv, capsys)[0] == 0
    finally:
        server.stop()
    assert len(calls) == 1 and calls[0]['args']['master'] == f'127.0.0.1:{port}'
    assert [(timeout, args.master) for _, args, timeout in watched] == \
        [(300, f'127.0.0.1:{port}')]
    # Another machine's address: its node starts the server (TEST-NET-1 is no one's here).
    argv = ['--nnodes', '2', '--rank', '1', '--master', '192.0.2.1:49178'] + SCRIPT_FLAGS
    assert _run(argv, capsys)[0] == 0 and len(calls) == 2


@pytest.mark.skipif(os.geteuid() == 0, reason='root may take a port below 1024')
def test_a_master_port_below_1024_is_refused_without_root(paddle_launch, capsys):
    code, _, err = _run(['--nnodes', '2', '--master', '127.0.0.1:80'] + SCRIPT_FLAGS, capsys)
    assert (code, err) == (2, ['error: --master 127.0.0.1:80: port 80 needs root on this '
                               'machine (ports below 1024): give one from 1024 to 65535.'])


def test_ranks_started_reads_only_this_launchs_worker_logs(tmp_path):
    old = tmp_path / 'workerlog.0'
    old.write_text('a run of yesterday\n')
    os.utime(old, (time.time() - 3600,) * 2)
    now = time.time()
    assert not launch.ranks_started(str(tmp_path), now)
    assert not launch.ranks_started(str(tmp_path / 'not-yet'), now)
    (tmp_path / 'workerlog.1').write_text('')
    assert launch.ranks_started(str(tmp_path), now)


WATCH = '''
import argparse, sys
from psanet.launch import watch_rendezvous
args = argparse.Namespace(log_dir=sys.argv[2], rank=1, nnodes='2', master='10.0.0.1:4000')
watch_rendezvous(int(sys.argv[1]), args, 3)
'''


@pytest.mark.parametrize('ranks', ['none', 'old', 'new'])
def test_the_watcher_kills_a_launcher_whose_ranks_never_start(tmp_path, ranks):
    """A reused --log_dir's old worker logs are not this launch's ranks: the watcher still
    ends the launcher (a sleep stands for it) after its timeout (3 s), in one line; a
    worker log written after the start stops the watcher."""
    log_dir = tmp_path / 'log'
    log_dir.mkdir()
    if ranks == 'old':
        (log_dir / 'workerlog.0').write_text('an earlier launch\n')
        os.utime(log_dir / 'workerlog.0', (time.time() - 3600,) * 2)
    sleeper = subprocess.Popen(['sleep', '60'])
    try:
        with open(tmp_path / 'console', 'w') as console:  # the watcher's inherited stderr
            starter = subprocess.run([sys.executable, '-c', WATCH, str(sleeper.pid),
                                      str(log_dir)], stdout=console, stderr=console, cwd=ROOT,
                                     env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
        assert starter.returncode == 0, (tmp_path / 'console').read_text()
        if ranks == 'new':  # the launcher's first rank starts
            (log_dir / 'workerlog.0').write_text('this launch\n')
        try:
            code = sleeper.wait(7)
        except subprocess.TimeoutExpired:
            code = None
    finally:
        sleeper.kill()
        sleeper.wait()
    said = [line for line in (tmp_path / 'console').read_text().splitlines() if line.strip()]
    if ranks == 'new':
        assert (code, said) == (None, [])
    else:
        assert code == -signal.SIGKILL
        assert said == [
            'error: node 1 of 2: not all 2 nodes reached the master 10.0.0.1:4000 within 3 s '
            '(PSANET_RENDEZVOUS_TIMEOUT); this node\'s launcher is killed (SIGKILL). Check that '
            'every node runs the same launch line with its own --rank, that --master is an '
            'address of the first node that the others reach, and that its port is free there.']


def test_a_stop_note_is_not_written_outside_the_first_rank_of_a_node(tmp_path, monkeypatch):
    from psanet.core import dist
    note = tmp_path / 'note'
    monkeypatch.setenv(STOP_NOTE, str(note))
    monkeypatch.delenv('PADDLE_TRAINER_ID', raising=False)
    dist.tell_launcher('psanet: x\n')  # not launched
    assert not note.exists()
    monkeypatch.setenv('PADDLE_TRAINER_ID', '3')
    monkeypatch.setenv('PADDLE_LOCAL_RANK', '1')
    dist.tell_launcher('psanet: x\n')
    assert not note.exists()
    monkeypatch.setenv('PADDLE_LOCAL_RANK', '0')
    dist.tell_launcher('psanet: x\n')
    assert note.read_text() == 'psanet: x\n'
