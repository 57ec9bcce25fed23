"""A save_dir belongs to one training run: who may write there, a lock while it does, and its end.

:func:`own_save_dir` refuses another run's checkpoints (or, with ``overwrite``,
finds them for its :class:`RunFolder` to delete once the resumed checkpoint has
loaded: :meth:`RunFolder.clear_overwritten`; with ``--resume_model auto``, picks
the newest checkpoint that loads), locks the folder while the run writes, and
at the end, however it ends, removes the temporaries of an interrupted save.
Only rank 0 checks and locks; the other ranks learn the outcome from one
all-reduce. Why: docs/design.md.
"""
import contextlib
import errno
import fcntl
import os
import socket
import time

from psanet.core import checkpoint as ckpt
from psanet.core import dist
from psanet.core.options import RESUME_AUTO
from psanet.errors import ConfigError
from psanet.files import delete_folders, remove_stale_temporaries
from psanet.log import get_logger

__all__ = ['LOCK_FILE', 'BEST_MODEL', 'RunFolder', 'own_save_dir']

LOCK_FILE = '.train.lock'
BEST_MODEL = 'best_model'


class RunFolder:
    """The save_dir a run owns (:func:`own_save_dir` yields it).

    Attributes:
        path (str): the folder.
        in_the_way (list): on rank 0 with ``overwrite``, the checkpoints of the other
            run that :meth:`clear_overwritten` deletes; else empty.
        resume_model (str): the checkpoint the run continues from: the one it was
            given, or for ``auto`` the newest that loads (None: it starts).
        loaded (tuple): on rank 0 for ``auto``, what
            :func:`~psanet.core.checkpoint.load_checkpoint` read from
            ``resume_model`` (so that it is read once); else None.
    """

    def __init__(self, path, in_the_way=(), logger=None, resume_model=None, loaded=None):
        self.path = path
        self.in_the_way = list(in_the_way)
        self._logger = logger
        self.resume_model = resume_model
        self.loaded = loaded

    def clear_overwritten(self):
        """Deletes what ``overwrite`` is to delete; call it once the run has loaded the
        checkpoint it resumes from. Does nothing the second time, on the other ranks or
        without ``overwrite``."""
        if not self.in_the_way:
            return
        (self._logger or get_logger()).warning(
            f'--overwrite: deleting {_names(self.in_the_way)} of the previous run in '
            f'{self.path}.')
        delete_folders(self.in_the_way)
        self.in_the_way = []


@contextlib.contextmanager
def own_save_dir(save_dir, resume_model=None, overwrite=False, logger=None):
    """Makes ``save_dir`` this run's for the duration of the block.

    Args:
        save_dir (str): the run's folder; created when missing.
        resume_model (str, optional): the checkpoint the run continues from; ``'auto'``:
            the newest ``iter_N`` in ``save_dir`` that loads, when there is one (a newer
            one that does not load is named and passed over). Default: None.
        overwrite (bool, optional): delete another run's checkpoints (or, resuming, those
            after ``resume_model``) instead of refusing the folder. Default: False.
        logger (logging.Logger, optional): says what ``overwrite`` deletes. Default: the
            'psanet' logger on stdout.

    Yields:
        RunFolder: the folder, with what ``overwrite`` is to delete.

    Raises:
        ConfigError: on every rank, when the folder holds another run's checkpoints or
            another process trains in it.
        CheckpointError: on every rank, with ``auto`` when no checkpoint of the folder
            loads.
    """
    lock, error, in_the_way, found = None, None, [], None
    auto = resume_model == RESUME_AUTO
    if dist.is_main_process():
        try:
            lock = _SaveDirLock(save_dir, logger)
            remove_stale_temporaries(save_dir)
            if auto:
                found = ckpt.newest_loadable_checkpoint(save_dir, logger)
            if not auto or found is None:
                in_the_way = _refuse_or_clear(save_dir, None if auto else resume_model,
                                              overwrite)
        except Exception as caught:  # the other ranks must hear of it before anyone raises
            error = caught
    try:
        # One all-reduce: whether rank 0 refused, and which iteration auto resumes (0: none).
        failed, resumed = dist.all_reduce_sum([error is not None,
                                               0 if found is None else found[0] + 1])
        if failed > 0:
            if error is not None:
                raise error
            raise ConfigError(f'rank 0 refused --save_dir {save_dir}: its error says why '
                              '(workerlog.0 with paddle.distributed.launch).')
        if auto:
            resume_model = (found[1] if found else
                            os.path.join(save_dir, f'iter_{int(resumed) - 1}') if resumed else
                            None)
        yield RunFolder(save_dir, in_the_way if lock is not None else (), logger,
                        resume_model=resume_model, loaded=found[2] if found else None)
    finally:
        if lock is not None:
            remove_stale_temporaries(save_dir)
            lock.release()


def _names(paths):
    names = [os.path.basename(os.path.normpath(p)) for p in paths]
    if len(names) <= 5:
        return ', '.join(names)
    return f'{", ".join(names[:2])}, ..., {", ".join(names[-2:])} ({len(names)} folders)'


def _refuse_or_clear(save_dir, resume_model, overwrite):
    """Refuses the checkpoints a new run would mix with its own, or with ``overwrite``
    returns them for :meth:`RunFolder.clear_overwritten`."""
    if resume_model is not None and not os.path.isdir(resume_model):
        return []  # load_checkpoint says what is wrong with it
    checkpoints = ckpt.list_checkpoints(save_dir)
    best = os.path.join(save_dir, BEST_MODEL)
    best = best if os.path.isdir(best) else None
    if not checkpoints and best is None:
        return []
    parent = os.path.dirname(os.path.abspath(os.path.normpath(resume_model or '.')))
    if resume_model is not None and os.path.realpath(parent) == os.path.realpath(save_dir):
        start = ckpt.checkpoint_iteration(resume_model)
        in_the_way = [path for iteration, path in checkpoints
                      if start is not None and iteration > start]
        best_iteration = ckpt.checkpoint_iteration(best) if best else None
        if start is not None and best_iteration is not None and best_iteration > start:
            in_the_way.append(best)
        if not in_the_way:
            return []
        if not overwrite:
            raise ConfigError(
                f'--resume_model {resume_model} is not the latest checkpoint in --save_dir '
                f'{save_dir}: continuing from it would overwrite {_names(in_the_way)}. Resume '
                f'from {checkpoints[-1][1]}, write this run to a new --save_dir, or pass '
                '--overwrite to delete them.')
    else:
        in_the_way = [path for _, path in checkpoints] + ([best] if best else [])
        if not overwrite:
            elsewhere = (f' (--resume_model {resume_model} is not in it)'
                         if resume_model is not None else '')
            latest = (f', continue that run with --resume_model {checkpoints[-1][1]}'
                      if checkpoints else '')
            raise ConfigError(
                f'--save_dir {save_dir} holds the checkpoints of another run '
                f'({_names(in_the_way)}){elsewhere}: a new run there would overwrite some of '
                f'them and mix with the others. Pick a new --save_dir{latest}, or pass '
                '--overwrite to delete them and start over.')
    return in_the_way


class _SaveDirLock:
    """An exclusive ``flock`` on ``<save_dir>/.train.lock``, which names the holder."""

    def __init__(self, save_dir, logger=None):
        try:
            os.makedirs(save_dir, exist_ok=True)
        except OSError as error:
            raise ConfigError(f'--save_dir {save_dir} cannot be created ({error}): pick a '
                              'folder you can write to.') from error
        self.path = os.path.join(save_dir, LOCK_FILE)
        self.fd = None
        while self.fd is None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except PermissionError as error:
                raise ConfigError(f'--save_dir {save_dir} is not writable ({error}): pick a '
                                  'folder you can write to.') from error
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors='replace').strip()
                os.close(fd)
                raise ConfigError(
                    f'--save_dir {save_dir} is in use by another training '
                    f'({holder or "pid unknown"}): two runs in one folder would mix their '
                    'checkpoints and train.log; wait for it to end or pick another '
                    '--save_dir.') from None
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                (logger or get_logger()).warning(
                    f'--save_dir {save_dir} cannot be locked on this file system ({error}): '
                    'a second run started in it at once would not be refused.')
                return
            # A holder deletes the file before unlocking it: hold the file that is there now.
            try:
                current = os.stat(self.path)
            except FileNotFoundError:
                current = None
            if current is not None and os.path.samestat(os.fstat(fd), current):
                self.fd = fd
            else:
                os.close(fd)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f'pid {os.getpid()} on {socket.gethostname()}, started '
                          f'{time.strftime("%Y-%m-%d %H:%M:%S")}\n'.encode())

    def release(self):
        """Deletes the lock file, then unlocks it."""
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)
        os.close(self.fd)
        self.fd = None
