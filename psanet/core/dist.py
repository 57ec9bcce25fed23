"""Process-group helpers: world size, rank, init, and sums across ranks.

Every helper is a no-op in a single process, so the engine has one code path
for one process and for ``paddle.distributed.launch`` / ``spawn`` runs.
"""
import numpy as np
import paddle
import paddle.distributed as dist

__all__ = ['world_size', 'rank', 'is_main_process', 'init_parallel', 'all_reduce_sum',
           'broadcast_buffers']


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
