"""Process-group helpers: world size, rank, init, and sums across ranks.

Every helper is a no-op in a single process, so the engine has one code path
for one process and for ``paddle.distributed.launch`` / ``spawn`` runs.
"""
import contextlib
import os
import stat

import numpy as np
import paddle
import paddle.distributed as dist

from psanet.interrupts import STOP_NOTE

__all__ = ['world_size', 'rank', 'is_main_process', 'init_parallel', 'all_reduce_sum',
           'broadcast_buffers', 'tell_launcher']

_LAUNCHER = b'paddle.distributed.launch'


def world_size():
    """Number of training processes (1 without launch/spawn)."""
    return dist.get_world_size()


def rank():
    """Global rank of this process (0 without launch/spawn)."""
    return dist.get_rank()


def is_main_process():
    """True on rank 0, the only rank that writes logs, VisualDL files and checkpoints."""
    return rank() == 0


def init_parallel():
    """Initialises the process group once when more than one process runs."""
    if world_size() > 1 and not dist.is_initialized():
        dist.init_parallel_env()


def all_reduce_sum(values):
    """The element-wise float64 sum over all ranks of ``values`` (the same length on each)."""
    values = np.asarray(values, dtype='float64')
    if world_size() == 1:
        return values
    tensor = paddle.to_tensor(values, dtype='float64')
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.numpy()


def broadcast_buffers(model, src=0):
    """Copies what DataParallel does not sync from rank ``src`` to all ranks: BatchNorm's running
    mean and variance and other buffers, which plain BatchNorm (CPU, or ``sync_bn: false``)
    updates from each rank's own images."""
    if world_size() == 1:
        return
    tensors = [p for p in model.parameters() if not p.trainable] + list(model.buffers())
    with paddle.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor, src=src)


def tell_launcher(text):
    """Gives ``text`` (whole lines) to the console of the launcher that started this
    process, from the first rank of each node; elsewhere nothing.

    A signalled launcher stops copying rank 0's log to its console (it closes the log
    before it passes the signal on), so what a stopped run says would be only in
    ``log/workerlog.N``. Under ``python -m psanet.launch`` the text goes to the file
    ``$PSANET_STOP_NOTE`` names, which the launcher prints when it returns. Under
    ``python -m paddle.distributed.launch`` (this process's parent) it is appended to the
    launcher's stderr when that is a terminal, a pipe or a file it appends to (into a
    file it writes at its own offset, the launcher's next line would overwrite ours:
    nothing is written there).
    """
    if 'PADDLE_TRAINER_ID' not in os.environ or os.environ.get('PADDLE_LOCAL_RANK', '0') != '0':
        return
    with contextlib.suppress(OSError):  # a console that is gone: the text is in the log
        note = os.environ.get(STOP_NOTE)
        console = open(note, 'w') if note else _paddle_launcher_console()
        if console is not None:
            with console:
                console.write(text)


def _paddle_launcher_console():
    parent = os.getppid()
    with open(f'/proc/{parent}/cmdline', 'rb') as f:
        if _LAUNCHER not in f.read().split(b'\0'):
            return None
    path = f'/proc/{parent}/fd/2'
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        with open(f'/proc/{parent}/fdinfo/2') as f:
            flags = next((int(line.split()[1], 8) for line in f if line.startswith('flags:')), 0)
        if not flags & os.O_APPEND:
            return None
    elif not (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return None
    return open(path, 'a')
