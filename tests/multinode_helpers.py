"""Launched multi-node trainings on one machine for tests/test_multinode.py and
tests/test_slurm_script.py: the toy data and config, a train.py that knows TinySegNet,
launchers standing for nodes, and what their runs left behind.

Each launcher is one ``python -m psanet.launch --nnodes N`` (Paddle's launcher after
psanet's checks) (or one
``--nproc_per_node N`` launch to compare with), started in a session of its own
with its own ``--log_dir``, as on a machine of its own; they meet at a
``--master 127.0.0.1:<port>``.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import engine_helpers as helpers
from conftest import ROOT, read_text as read  # noqa: F401 (mn.read)

TESTS = os.path.join(ROOT, 'tests')

# train.py itself, with TinySegNet and Pause registered (register_test_parts) and each
# rank's per-iteration losses written to $PSANET_TEST_LOSSES/losses.<rank>.json when
# training completes. Named train.py in a folder of its own, so the "resume with:
# python train.py ..." line is the real one.
TRAIN_PY = '''"""train.py for the multi-node tests: TinySegNet registered, losses dumped."""
import importlib.util
import json
import os
import sys

sys.path[:0] = [{tests!r}, {root!r}]
import multinode_helpers  # noqa: E402
from psanet.cli import exit_with, run_cli  # noqa: E402
from psanet.core.train import train_from_config  # noqa: E402

multinode_helpers.register_test_parts()
spec = importlib.util.spec_from_file_location('real_train', os.path.join({root!r}, 'train.py'))
real = importlib.util.module_from_spec(spec)
spec.loader.exec_module(real)
result = {{}}


def work(**flags):
    result.update(train_from_config(**flags))


code = run_cli(work, **vars(real.parse_args()))
out = os.environ.get('PSANET_TEST_LOSSES')
if result and out:
    with open(os.path.join(out, 'losses.%s.json' % os.environ.get('PADDLE_TRAINER_ID', '0')),
              'w') as f:
        json.dump({{'start_iter': result['start_iter'], 'losses': result['losses']}}, f)
exit_with(code)
'''


class Pause:
    """A train transform that sleeps: a toy step as long as a real model's, so that a
    signal lands in the middle of a run."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __call__(self, data):
        time.sleep(self.seconds)
        return data


def register_test_parts():
    """In the tests' train.py: TinySegNet (engine_helpers registers it on import) and the
    Pause transform; with $PSANET_TEST_SAVE_SECONDS, every iter_N checkpoint takes that
    much longer to write (a large model's write, so that a rank leaving before it
    ends is seen)."""
    from paddleseg.cvlibs import manager
    from psanet.core import checkpoint
    if 'Pause' not in manager.TRANSFORMS.components_dict:
        manager.TRANSFORMS.add_component(Pause)
    delay = float(os.environ.get('PSANET_TEST_SAVE_SECONDS', '0'))
    save = checkpoint.save_checkpoint

    def slow_save(directory, *args, **kwargs):
        if os.path.basename(os.path.normpath(directory)).startswith('iter_'):
            time.sleep(delay)
        return save(directory, *args, **kwargs)

    if delay:
        checkpoint.save_checkpoint = slow_save


def write_train_py(folder):
    """Writes the tests' train.py into ``folder`` (created) and returns its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, 'train.py')
    with open(path, 'w') as f:
        f.write(TRAIN_PY.format(tests=TESTS, root=ROOT))
    return path


def toy_setup(work, iters, pause=0.0):
    """The toy dataset and a TinySegNet config under ``work`` (``pause`` seconds per
    training image read); returns the config path."""
    root = helpers.write_toy_dataset(os.path.join(work, 'toy'), num_train=8, num_val=2)
    transforms = [{'type': 'RandomHorizontalFlip'}, {'type': 'Normalize'}]
    if pause:
        transforms.insert(0, {'type': 'Pause', 'seconds': pause})
    return helpers.write_config(os.path.join(work, 'toy.yml'),
                                helpers.toy_config(root, iters, train_transforms=transforms))


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def train_flags(config, save_dir, iters, save_interval=None):
    return ['--config', config, '--device', 'cpu', '--save_dir', save_dir, '--iters',
            str(iters), '--batch_size', '2', '--num_workers', '0', '--log_iters', '1',
            '--save_interval', str(save_interval or iters), '--seed', '3']


def start(args, log_path, env=None, cwd=ROOT):
    """Popen in a session of its own (a machine of its own), stdout and stderr to a file."""
    with open(log_path, 'w') as log:
        return subprocess.Popen(args, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)


def launch_args(log_dir, script, flags, nnodes=1, nproc=1, master=None, rank=None):
    args = [sys.executable, '-m', 'psanet.launch', '--log_dir', log_dir,
            '--nproc_per_node', str(nproc)]
    if nnodes > 1:
        args += ['--master', master, '--nnodes', str(nnodes)]
    if rank is not None:
        args += ['--rank', str(rank)]
    return args + [script] + flags


def children(pid):
    try:
        with open(f'/proc/{pid}/task/{pid}/children') as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def tree(pid):
    found = [pid]
    for child in children(pid):
        found += tree(child)
    return found


def running(pid):
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().split()[2] != 'Z'
    except OSError:
        return False


def kill_all(processes):
    """SIGKILL to every process under each Popen (ranks live in sessions of their own)."""
    pids = [p for process in processes for p in tree(process.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for process in processes:
        process.wait()


def wait_all(processes, timeout):
    """Waits until every process and all its descendants have ended; False past timeout."""
    everyone = [p for process in processes for p in tree(process.pid)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in processes:
            process.poll()
            everyone += [p for p in tree(process.pid) if p not in everyone]
        if all(process.returncode is not None for process in processes) and \
                not any(running(p) for p in everyone):
            return True
        time.sleep(0.05)
    return False


def reached(log_path, step, iters):
    return re.search(rf'iter: {step}/{iters}\b', read(log_path)) is not None


def losses(out, world_size=2):
    """Each rank's {'start_iter', 'losses'} from its losses.<rank>.json (None: missing)."""
    found = []
    for rank in range(world_size):
        path = os.path.join(out, f'losses.{rank}.json')
        found.append(json.loads(read(path)) if os.path.exists(path) else None)
    return found


# Paddle's C++ side logs (glog) after the error line at exit.
GLOG_LINE = re.compile(r'[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ')
STOP_LINE = re.compile(r'^error: training stopped by SIGTERM after iteration (\d+); its '
                       r'checkpoint is (\S+)$')
TRAIN_LINE = re.compile(r'\[TRAIN\] epoch: \d+, iter: (\d+)/\d+, (loss: .*?), lr: ')


def stop_lines(console):
    """The ``psanet:`` lines of a launcher's console."""
    return [line for line in console.splitlines() if line.startswith('psanet: ')]


def said_stop(step, path, save_dir, resume):
    """What a launcher's console says when the run stopped after ``step``."""
    return [f'psanet: training stopped after iteration {step} on every rank (the launcher '
            f'passes a Ctrl-C or SIGTERM on as SIGTERM); its checkpoint is {path}; the log: '
            f'{os.path.join(save_dir, "train.log")}.', f'psanet: resume with: {resume}']


def logged_losses(log_path):
    """(iteration, 'loss: ..., loss_0: ..., loss_1: ...') of every [TRAIN] line of a log."""
    return [(int(i), loss) for i, loss in TRAIN_LINE.findall(read(log_path))]


def file_bytes(folder):
    """{name: bytes} of every file in a checkpoint folder."""
    return {name: open(os.path.join(folder, name), 'rb').read()
            for name in sorted(os.listdir(folder))}
