"""Ctrl-C and SIGTERM stop a run at its next boundary: the handler only records the signal.

Within :func:`stop_at_boundaries` (what :func:`psanet.cli.run_cli` runs the
work in) the handler records the first signal and does nothing else, so it is
safe wherever it lands (an at-fork hook, a ``__del__``, a C++ call). The loops
look at the record at their boundaries (a training step, an evaluation batch,
an image) and stop there: :func:`requested`, or :func:`raise_if_requested`
where stopping is raising :class:`~psanet.errors.Interrupted`. A second Ctrl-C
ends the process at once (SIGINT's default action is put back); a repeated
SIGTERM is the same request (``paddle.distributed.launch`` forwards it three
times). DataLoader workers (:func:`worker_init`) ignore both: the main process ends them.
"""
import contextlib
import signal
import threading

from psanet.errors import Interrupted

__all__ = ['stop_at_boundaries', 'requested', 'raise_if_requested', 'stopped', 'worker_init', 'STOP_NOTE']

STOP_NOTE = 'PSANET_STOP_NOTE'  # names the file psanet.launch prints a launched stop from
HANDLED = (signal.SIGINT, signal.SIGTERM)
_received = []  # the signals recorded within stop_at_boundaries, first first


def _record(signum, frame):
    _received.append(signum)
    if signum == signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def stop_at_boundaries():
    """Within the block SIGINT and SIGTERM are recorded for the loops to stop at.

    Outside the main thread, or nested, it does nothing. The previous handlers
    (Paddle's, Python's) are back after the block.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is _record:
        yield
        return
    del _received[:]
    previous = {signum: signal.signal(signum, _record) for signum in HANDLED}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        del _received[:]


def requested():
    """The first signal recorded (``signal.SIGINT`` or ``SIGTERM``), or None."""
    return _received[0] if _received else None


def stopped(signum, message=None):
    """The :class:`Interrupted` for ``signum``: ``message``, else 'interrupted (Ctrl-C)' or
    'stopped by SIGTERM'."""
    if message is None:
        message = ('interrupted (Ctrl-C)' if signum == signal.SIGINT
                   else f'stopped by {signal.Signals(signum).name}')
    return Interrupted(message, signum)


def raise_if_requested():
    """A boundary: raises :class:`Interrupted` once a signal was recorded."""
    if _received:
        raise stopped(_received[0])


def worker_init(worker_id=None):
    """``worker_init_fn`` of the engine's DataLoaders: a worker ignores Ctrl-C and SIGTERM,
    which a terminal, a scheduler or the launcher send to its process group (the main process
    ends it), then unblocks them (it forks with them blocked: one sent meanwhile is dropped)."""
    for signum in HANDLED:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)
