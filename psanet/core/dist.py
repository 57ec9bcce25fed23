"""Process-group helpers: world size, rank, init, and sums across ranks.

Every helper is a no-op in a single process, so the engine has one code path
for one process and for ``paddle.distributed.launch`` / ``spawn`` runs.
"""
import os
import stat

import numpy as np
import paddle
import paddle.distributed as dist

__all__ = ['world_size', 'rank', 'is_main_process', 'init_parallel', 'all_reduce_sum',
           'broadcast_buffers', 'launcher_console']

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
    """Sums a float64 array over all ranks and returns it as numpy.

    Args:
        values (np.ndarray | list): numbers of the same length on every rank.

    Returns:
        np.ndarray: float64, the element-wise sum over ranks.
    """
    values = np.asarray(values, dtype='float64')
    if world_size() == 1:
        return values
    tensor = paddle.to_tensor(values, dtype='float64')
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.numpy()


def broadcast_buffers(model, src=0):
    """Copies the model's state that DataParallel does not sync from rank ``src`` to all ranks.

    DataParallel keeps the trainable parameters equal but not BatchNorm's
    running mean and variance (non-trainable parameters in Paddle) or other
    buffers, which plain BatchNorm (CPU, or ``sync_bn: false``) updates from
    each rank's own images.

    Args:
        model (paddle.nn.Layer): the model (not its DataParallel wrapper).
        src (int, optional): the rank whose values are kept. Default: 0.
    """
    if world_size() == 1:
        return
    tensors = [p for p in model.parameters() if not p.trainable] + list(model.buffers())
    with paddle.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor, src=src)


def launcher_console():
    """The console of the ``paddle.distributed.launch`` that started this process, for one
    line from the first rank of each node; None elsewhere or when it cannot be opened.

    A signalled launcher stops copying rank 0's log to its console (it closes the log
    before it passes the signal on), so what a stopped run says would be only in
    ``log/workerlog.N``. Returns a text file appending to the launcher's stderr: a
    terminal, a pipe, or a file it appends to (into a file it writes at its own
    offset, the launcher's next line would overwrite ours: None then).
    """
    if 'PADDLE_TRAINER_ID' not in os.environ or os.environ.get('PADDLE_LOCAL_RANK', '0') != '0':
        return None
    pid = os.getppid()
    for _ in range(3):  # the launcher, or above a wrapper that forked the trainer
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                command = f.read().split(b'\0')
            if _LAUNCHER in command:
                return _open_shared(pid, 2)
            with open(f'/proc/{pid}/stat', 'rb') as f:
                pid = int(f.read().rsplit(b')', 1)[1].split()[1])
        except (OSError, ValueError, IndexError, StopIteration):
            return None
    return None


def _open_shared(pid, fd):
    path = f'/proc/{pid}/fd/{fd}'
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        with open(f'/proc/{pid}/fdinfo/{fd}') as f:
            flags = next(int(line.split()[1], 8) for line in f if line.startswith('flags:'))
        if not flags & os.O_APPEND:
            return None
    elif not (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return None
    return open(path, 'a')
