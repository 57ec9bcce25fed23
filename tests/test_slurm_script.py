"""scripts/slurm_train.sh: its per-node part, run as srun runs it on each node, trains two
nodes on one machine, stops them together on SIGTERM and continues when requeued; a node
that never comes is a clear error within the timeout; the master comes from the node list.

The per-node part (``slurm_train.sh --node TRAIN_PY_FLAGS``) is run twice with the
variables Slurm sets in a job step (SLURM_NODEID 0 and 1, SLURM_NNODES,
SLURM_JOB_NODELIST, SLURM_JOB_ID), on the CPU (``PSANET_GPUS=cpu``), in a folder
whose train.py is the tests' (multinode_helpers: TinySegNet, losses written). A
requeue is the same two lines again with SLURM_RESTART_COUNT=1. The batch part runs
once with stand-ins for srun (the per-node command once per node, with SLURM_NODEID
set) and scontrol (which records a requeue); real Slurm and the Kubeflow manifest are
not run here; the manifest's command is checked against the script's.
"""
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import time

import yaml

import multinode_helpers as mn
from conftest import ROOT, run_process

SCRIPT = os.path.join(ROOT, 'scripts', 'slurm_train.sh')
MANIFEST = os.path.join(ROOT, 'scripts', 'kubeflow_paddlejob.yaml')
ITERS = 10
PAUSE = 0.15
SIGNAL_STEP = 3
START = 180
BOUND = 60


def _job_id():
    """A job id whose rendezvous port (10000 + id % 20000, the script's) is free now."""
    for _ in range(100):
        job_id = random.randrange(20000)
        with socket.socket() as s:
            try:
                s.bind(('127.0.0.1', 10000 + job_id))
            except OSError:
                continue
        return job_id
    raise AssertionError('no free port in 10000-29999')


def _node_env(node, job_id, log_dir, out, restart=0, nodelist='localhost', **extra):
    env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURM_LOCALID='0',
               SLURM_NNODES='2', SLURM_NTASKS='2', SLURM_JOB_NUM_NODES='2',
               SLURM_JOB_NODELIST=nodelist, SLURM_JOB_ID=str(job_id),
               SLURM_RESTART_COUNT=str(restart), PSANET_GPUS='cpu', PSANET_LOG_DIR=log_dir,
               PSANET_TEST_LOSSES=out, PSANET_RENDEZVOUS_TIMEOUT='60')
    env.update(extra)
    return env


def _nodes(work, name, flags, job_id, restart=0, nodes=(0, 1), **extra):
    """Runs the per-node part once per node, as srun does; returns (tasks, out folder)."""
    out = os.path.join(work, name)
    os.makedirs(out)
    tasks = [mn.start(['bash', SCRIPT, '--node'] + flags,
                      os.path.join(out, f'task{node}.log'),
                      _node_env(node, job_id, os.path.join(work, 'log'), out, restart,
                                **extra),
                      cwd=os.path.join(work, 'bin'))
             for node in nodes]
    return tasks, out


def _worker_log(work, job_id, restart, node):
    return os.path.join(work, 'log', f'slurm-{job_id}.{restart}', f'node{node}', 'workerlog.0')


def _logs(work, out, job_id, restart=0):
    names = [os.path.join(out, f'task{n}.log') for n in (0, 1)] + \
        [_worker_log(work, job_id, restart, n) for n in (0, 1)]
    return '\n'.join(f'--- {name}\n' + mn.read(name)[-2500:] for name in names)


def _finish(tasks, timeout):
    try:
        return mn.wait_all(tasks, timeout)
    finally:
        mn.kill_all(tasks)


def _setup(tmp_path):
    work = str(tmp_path)
    config = mn.toy_setup(work, ITERS, pause=PAUSE)
    mn.write_train_py(os.path.join(work, 'bin'))
    return work, config


def test_the_per_node_part_trains_two_nodes_stops_on_sigterm_and_continues_requeued(tmp_path):
    work, config = _setup(tmp_path)
    job_id = _job_id()

    # Uninterrupted: the reference losses.
    flags = mn.train_flags(config, os.path.join(work, 'whole'), ITERS)
    tasks, whole = _nodes(work, 'whole', flags, job_id)
    assert _finish(tasks, START), _logs(work, whole, job_id)
    assert [t.returncode for t in tasks] == [0, 0], _logs(work, whole, job_id)
    want = mn.losses(whole)
    assert want[0] is not None and len(want[0]['losses']) == ITERS and want[0] == want[1]
    # The launchers met at the first node's address and the job's port, node 0 as rank 0.
    launcher_log = mn.read(os.path.join(whole, 'task0.log'))
    assert f'master: 127.0.0.1:{10000 + job_id % 20000}' in launcher_log, launcher_log[-3000:]
    assert len(mn.logged_losses(_worker_log(work, job_id, 0, 0))) == ITERS
    assert mn.logged_losses(_worker_log(work, job_id, 0, 1)) == []

    # SIGTERM to every process of both nodes, as Slurm does at TERM@<grace>.
    job_id = _job_id()
    save = os.path.join(work, 'save')
    flags = mn.train_flags(config, save, ITERS)
    tasks, out = _nodes(work, 'stopped', flags, job_id)
    try:
        give_up = time.monotonic() + START
        while not mn.reached(_worker_log(work, job_id, 0, 0), SIGNAL_STEP, ITERS) and \
                time.monotonic() < give_up and all(t.poll() is None for t in tasks):
            time.sleep(0.05)
        assert mn.reached(_worker_log(work, job_id, 0, 0), SIGNAL_STEP, ITERS), \
            _logs(work, out, job_id)
        everyone = [p for task in tasks for p in mn.tree(task.pid)]
        sent = time.monotonic()
        for pid in everyone:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        assert mn.wait_all(tasks, BOUND), f'running {BOUND} s after SIGTERM\n' + \
            _logs(work, out, job_id)
        stop_seconds = time.monotonic() - sent
    finally:
        mn.kill_all(tasks)
    # The tasks are the launchers (exec'd), signalled: 15, which the batch part requeues.
    assert [t.returncode for t in tasks] == [15, 15], _logs(work, out, job_id)
    stops = set()
    for node in (0, 1):
        lines = [line for line in mn.read(_worker_log(work, job_id, 0, node)).splitlines()
                 if line.strip() and not mn.GLOG_LINE.match(line)]
        found = mn.STOP_LINE.match(lines[-1] if lines else '')
        assert found, _logs(work, out, job_id)
        stops.add((int(found.group(1)), found.group(2)))
    assert len(stops) == 1, stops
    (step, path), = stops
    assert SIGNAL_STEP <= step < ITERS and path == os.path.join(save, f'iter_{step}')
    assert sorted(os.listdir(save)) == [f'iter_{step}', 'train.log']
    # Each task's output (slurm-<job>.out) ends with the stop and the resume line.
    resume = [line.split('resume with: ', 1)[1] for line in
              mn.read(_worker_log(work, job_id, 0, 0)).splitlines() if 'resume with: ' in line]
    assert len(resume) == 1 and resume[0].endswith('--resume_model auto')
    for node in (0, 1):
        console = mn.read(os.path.join(out, f'task{node}.log'))
        assert mn.stop_lines(console) == mn.said_stop(step, path, save, resume[0]), \
            console[-3000:]

    # The requeued job: the same lines, the next restart count; --resume_model auto.
    started = time.monotonic()
    tasks, again = _nodes(work, 'requeued', flags, job_id, restart=1)
    first_step = None
    while first_step is None and time.monotonic() < started + START and \
            all(t.poll() is None for t in tasks):
        if mn.reached(_worker_log(work, job_id, 1, 0), step + 1, ITERS):
            first_step = time.monotonic() - started
        time.sleep(0.05)
    assert _finish(tasks, START), _logs(work, again, job_id, 1)
    print(f'SIGTERM to every process after step {SIGNAL_STEP}: stopped after step {step} '
          f'in {stop_seconds:.2f} s; the requeued nodes logged step {step + 1} '
          f'{first_step and round(first_step, 1)} s after their start')
    assert [t.returncode for t in tasks] == [0, 0], _logs(work, again, job_id, 1)
    resumed = mn.losses(again)
    assert [r['start_iter'] for r in resumed] == [step, step]
    assert [r['losses'] for r in resumed] == [r['losses'][step:] for r in want]
    assert 'resuming from' in mn.read(_worker_log(work, job_id, 1, 0))


def test_a_node_that_never_comes_is_one_error_within_the_timeout(tmp_path):
    work, config = _setup(tmp_path)
    flags = mn.train_flags(config, os.path.join(work, 'save'), ITERS)
    for node in (0, 1):  # node 0 waits for its peer; node 1 for a master nobody starts
        job_id = _job_id()
        started = time.monotonic()
        tasks, out = _nodes(work, f'alone{node}', flags, job_id, nodes=(node,),
                            PSANET_RENDEZVOUS_TIMEOUT='8')
        ended = _finish(tasks, 60)
        seconds = time.monotonic() - started
        log = mn.read(os.path.join(out, f'task{node}.log'))
        assert ended and tasks[0].returncode == -signal.SIGKILL, log[-3000:]
        assert 8 <= seconds < 20, seconds
        master = f'127.0.0.1:{10000 + job_id % 20000}'
        assert f'error: node {node} of 2: not all 2 nodes reached the master {master} ' \
               f'within 8 s (PSANET_RENDEZVOUS_TIMEOUT)' in log, log[-3000:]
        assert not os.path.exists(os.path.join(work, 'save', 'train.log'))


# srun as it runs a step of --ntasks-per-node=1: the command once per node, each with its
# SLURM_NODEID and SLURM_PROCID; its exit code is the largest of theirs. Like srun it stays
# for its tasks when signalled (Slurm signals them itself).
FAKE_SRUN = r'''#!/bin/bash
trap '' TERM
while [[ $1 == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$SRUN_LOGS/task$node.log" 2>&1 &
    pids+=($!)
done
code=0
for pid in "${pids[@]}"; do
    while :; do wait "$pid"; c=$?; kill -0 "$pid" 2>/dev/null || break; done
    ((c > code)) && code=$c
done
exit $code
'''
FAKE_SCONTROL = r'''#!/bin/bash
case "$1 $2" in
    "show hostnames") echo localhost ;;
    "show job") echo "JobId=$3 JobName=psanet JobState=RUNNING" ;;
    "requeue $SLURM_JOB_ID") echo "$2" >> "$SRUN_LOGS/requeued" ;;
    *) exit 1 ;;
esac
'''


def test_the_batch_part_runs_a_task_per_node_and_requeues_after_a_signal(tmp_path):
    work, config = _setup(tmp_path)
    submit = os.path.join(work, 'bin')  # train.py (the tests') and scripts/, as in the repo
    os.symlink(os.path.join(ROOT, 'scripts'), os.path.join(submit, 'scripts'))
    fakes = tmp_path / 'fakes'
    fakes.mkdir()
    for name, text in (('srun', FAKE_SRUN), ('scontrol', FAKE_SCONTROL)):
        (fakes / name).write_text(text)
        (fakes / name).chmod(0o755)
    job_id = _job_id()
    save = os.path.join(work, 'save')
    flags = mn.train_flags(config, save, ITERS)

    def batch(name, restart):
        out = os.path.join(work, name)
        os.makedirs(out)
        env = _node_env(0, job_id, os.path.join(work, 'log'), out, restart,
                        SLURM_SUBMIT_DIR=submit, SRUN_LOGS=out,
                        PATH=f'{fakes}:{os.environ["PATH"]}')
        del env['SLURM_NODEID'], env['SLURM_PROCID']  # the batch shell has none
        return mn.start(['bash', SCRIPT] + flags, os.path.join(out, 'batch.log'), env,
                        cwd=tmp_path), out

    job, out = batch('first', 0)
    try:
        give_up = time.monotonic() + START
        while not mn.reached(_worker_log(work, job_id, 0, 0), SIGNAL_STEP, ITERS) and \
                time.monotonic() < give_up and job.poll() is None:
            time.sleep(0.05)
        assert mn.reached(_worker_log(work, job_id, 0, 0), SIGNAL_STEP, ITERS), \
            mn.read(os.path.join(out, 'batch.log')) + _logs(work, out, job_id)
        for pid in mn.tree(job.pid):  # preemption: every process, the batch shell too
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        assert mn.wait_all([job], BOUND), _logs(work, out, job_id)
    finally:
        mn.kill_all([job])
    batch_log = mn.read(os.path.join(out, 'batch.log'))
    assert job.returncode == 15, batch_log + _logs(work, out, job_id)
    assert mn.read(os.path.join(out, 'requeued')) == f'{job_id}\n', batch_log
    stops = {re.search(r'^error: training stopped by SIGTERM after iteration (\d+);',
                       mn.read(_worker_log(work, job_id, 0, node)), re.M) for node in (0, 1)}
    assert None not in stops, _logs(work, out, job_id)
    step, = {int(found.group(1)) for found in stops}
    assert sorted(os.listdir(save)) == [f'iter_{step}', 'train.log']

    job, again = batch('requeued', 1)
    assert _finish([job], START), _logs(work, again, job_id, 1)
    assert job.returncode == 0, mn.read(os.path.join(again, 'batch.log')) + \
        _logs(work, again, job_id, 1)
    assert not os.path.exists(os.path.join(again, 'requeued'))
    assert [r['start_iter'] for r in mn.losses(again)] == [step, step]
    assert 'iter_10' in os.listdir(save)


def _master(nodelist, path, job_id='12345'):
    env = dict(os.environ, SLURM_JOB_NODELIST=nodelist, SLURM_JOB_ID=job_id, PATH=path)
    done = run_process(['bash', SCRIPT, '--print-master'], env=env, capture_output=True,
                       text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_master_is_the_first_node_of_the_list_with_or_without_scontrol(tmp_path):
    python = os.path.dirname(mn.sys.executable)
    bare = f'{python}:/usr/bin:/bin'
    assert subprocess.run(['bash', '-c', 'command -v scontrol'], env={'PATH': bare},
                          capture_output=True).returncode != 0, 'scontrol is installed here'
    port = 10000 + 12345 % 20000
    for nodelist in ('localhost', 'localhost,node2', '127.0.0.[1-4,7]', '127.0.0.[1-2],node9',
                     '127.0.0.1'):
        assert _master(nodelist, bare) == f'127.0.0.1:{port}', nodelist
    # With scontrol, its expansion: a fake one that answers what the real one would.
    fake = tmp_path / 'scontrol'
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && '
                    'printf "localhost\\nnode02\\n"\n')
    fake.chmod(0o755)
    assert _master('weird[list]', f'{tmp_path}:{bare}') == f'127.0.0.1:{port}'


def test_a_port_or_a_node_that_cannot_work_is_refused_before_the_launcher(tmp_path):
    """A text, zero or too large PSANET_MASTER_PORT (--print-master and each node), a
    SLURM_NODEID beyond SLURM_NNODES: one line at once, no launcher started (no log)."""
    log_dir = tmp_path / 'log'
    for port in ('eighty', '0', '65536', '8o80'):
        for part in ('--print-master', '--node'):
            env = dict(os.environ, SLURM_NODEID='0', SLURM_NNODES='2',
                       SLURM_JOB_NODELIST='localhost', SLURM_JOB_ID='12345',
                       PSANET_MASTER_PORT=port, PSANET_LOG_DIR=str(log_dir))
            done = run_process(['bash', SCRIPT, part, '--config', 'x.yml'], env=env,
                               capture_output=True, text=True, timeout=60, cwd=tmp_path)
            assert (done.returncode, done.stdout, done.stderr.splitlines()) == (
                1 if part == '--print-master' else 2, '',
                [f'error: PSANET_MASTER_PORT={port} is not a port number (1 to 65535): give '
                 'one that is free on the first node, or unset it (10000 + job id % 20000)'])
    for node, nnodes in (('2', '2'), ('5', '2'), ('x', '2'), ('0', 'two')):
        env = dict(os.environ, SLURM_NODEID=node, SLURM_NNODES=nnodes,
                   SLURM_JOB_NODELIST='localhost', SLURM_JOB_ID='12345',
                   PSANET_LOG_DIR=str(log_dir))
        done = run_process(['bash', SCRIPT, '--node', '--config', 'x.yml'], env=env,
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert (done.returncode, done.stderr.splitlines()) == (2, [
            f'error: SLURM_NODEID={node} is not a node of SLURM_NNODES={nnodes}: run this part '
            'through srun in a job (sbatch scripts/slurm_train.sh ...)'])
    assert not log_dir.exists()


def test_the_kubeflow_manifest_runs_the_scripts_training_command():
    with open(MANIFEST) as f:
        job = yaml.safe_load(f)
    assert job['kind'] == 'PaddleJob'
    worker = job['spec']['paddleReplicaSpecs']['Worker']
    container, = worker['template']['spec']['containers']
    command = container['command']
    assert command[:3] == ['python', '-m', 'psanet.launch']
    assert 'exec python -m psanet.launch ' in open(SCRIPT).read()
    train = command[command.index('train.py'):]
    # The script's: train.py, the flags of its sbatch example, --resume_model auto.
    script = open(SCRIPT).read()
    example = re.search(r'^#   sbatch .*? scripts/slurm_train.sh \\\n((?:#.*\\\n)*#.*)$', script,
                        re.M)
    flags = shlex.split(re.sub(r'\\\n#', ' ', example.group(1)).lstrip('#'))
    assert 'train.py "$@" --resume_model auto' in script
    assert train == ['train.py'] + flags + ['--resume_model', 'auto']
    assert worker['replicas'] == 2 and worker['restartPolicy'] == 'OnFailure'
    # SIGTERM's grace: the same as the script's TERM@<seconds>.
    grace = int(re.search(r'^#SBATCH --signal=TERM@(\d+)$', script, re.M).group(1))
    assert worker['template']['spec']['terminationGracePeriodSeconds'] == grace
