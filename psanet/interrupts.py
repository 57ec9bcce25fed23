"""Ctrl-C and SIGTERM end a run within seconds, from any moment, in the main process only.

:func:`signals_raise` (what :func:`psanet.cli.run_cli` runs the work in) makes
SIGINT and SIGTERM raise :class:`~psanet.errors.Interrupted` in the main
thread, and records the signal first. Python swallows an exception raised
inside an at-fork hook, a ``__del__`` or a weakref callback; the record
survives, and the loops call :func:`raise_if_interrupted` at every step,
batch and image, so the run ends at the next one. While DataLoader workers
fork (:func:`deferred`) the handler only records: the fork's hooks run
uninterrupted and the signal is raised once they are done.

DataLoader workers (:func:`worker_init`) ignore Ctrl-C and SIGTERM, which a
terminal or a scheduler sends to the whole process group: the main process
decides and ends them. A second signal while the first one's clean-up runs
exits at once.
"""
import contextlib
import os
import signal
import sys
import threading

from psanet.errors import Interrupted

__all__ = ['signals_raise', 'deferred', 'raise_if_interrupted', 'pending', 'worker_init',
           'interrupted_error']

HANDLED = (signal.SIGINT, signal.SIGTERM)


class _State:
    owner = None      # the pid whose handler raises; forked children do not
    signum = None     # the first signal of this run
    raised = False    # Interrupted was raised for it at a safe point or by the handler
    defer = 0         # depth of deferred() blocks


_state = _State()


def interrupted_error(signum):
    """The :class:`Interrupted` for a signal: 'interrupted (Ctrl-C)' or 'stopped by SIGTERM'."""
    if signum == signal.SIGINT:
        return Interrupted('interrupted (Ctrl-C)', signum)
    return Interrupted(f'stopped by {signal.Signals(signum).name}', signum)


def pending():
    """The signal number this run received (within :func:`signals_raise`), or None."""
    return _state.signum if _state.owner == os.getpid() else None


def raise_if_interrupted():
    """A safe point: raises :class:`Interrupted` when a signal came and was not raised yet
    (it was swallowed where Python cannot raise, or deferred)."""
    if _state.signum is not None and _state.owner == os.getpid() and _state.defer == 0:
        _state.raised = True
        raise interrupted_error(_state.signum)


def _handler(signum, frame):
    if os.getpid() != _state.owner:
        # A forked child that has not reset its handlers yet (a starting worker).
        if signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_IGN)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _state.signum is not None:
        if _state.raised:
            print(f'error: {signal.Signals(signum).name} again while cleaning up after '
                  f'{signal.Signals(_state.signum).name}: exiting at once.', file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        return  # the first one is still to be raised
    _state.signum = signum
    # Paddle's SIGCHLD handler raises when a worker ends by a signal, which is no error
    # once the run is ending. A no-op rather than SIG_DFL: a SIGCHLD already received
    # would then print "Signal 17 ignored due to race condition".
    if callable(signal.getsignal(signal.SIGCHLD)):
        signal.signal(signal.SIGCHLD, _ignore)
    if _state.defer == 0:
        _state.raised = True
        raise interrupted_error(signum)


def _ignore(signum, frame):
    pass


def _unraisable(hook):
    """sys.unraisablehook that stays silent about our own swallowed Interrupted."""
    def unraisable(info):
        if isinstance(info.exc_value, KeyboardInterrupt) and _state.signum is not None:
            _state.raised = False  # raise it again at the next safe point
            return
        hook(info)
    return unraisable


@contextlib.contextmanager
def signals_raise():
    """Within the block SIGINT and SIGTERM raise :class:`Interrupted` in the main thread.

    Without it Paddle's handler prints a C++ stack and ``FatalError: Termination
    signal`` for SIGTERM, and no ``finally`` or ``except`` runs. Outside the
    main thread (or nested) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread() or \
            _state.owner == os.getpid():
        yield
        return
    _state.owner, _state.signum, _state.raised, _state.defer = os.getpid(), None, False, 0
    previous = {signum: signal.signal(signum, _handler) for signum in HANDLED}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _unraisable(previous_hook)
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        _state.owner, _state.signum, _state.raised, _state.defer = None, None, False, 0


@contextlib.contextmanager
def deferred():
    """Within the block a signal is only recorded; the next :func:`raise_if_interrupted`
    raises it. For code that must not be interrupted half-way, e.g. forking workers."""
    _state.defer += 1
    try:
        yield
    finally:
        _state.defer -= 1


def worker_init(worker_id=None):
    """A DataLoader worker ignores Ctrl-C and SIGTERM: the main process ends it, once the
    batch it is making is done (which frees its shared memory), so that a signal sent to
    the whole group (a terminal's Ctrl-C, a scheduler) neither leaves the main process
    waiting for a batch that never comes nor leaves files in /dev/shm. Pass it as
    ``worker_init_fn``."""
    for signum in HANDLED:
        signal.signal(signum, signal.SIG_IGN)
