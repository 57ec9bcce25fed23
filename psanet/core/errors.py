"""Errors a user can fix, and the command-line wrapper that prints them as one line.

The top-level scripts run their work through :func:`run_cli`: a
:class:`UserError` (or ``psanet.data.DatasetError``) becomes one readable
``error: ...`` line on stderr and exit code 2, without a traceback; any other
exception is a bug and keeps its traceback. Ctrl-C and SIGTERM (what job
schedulers send) become :class:`Interrupted`, one line and exit code 130 or 143.
"""
import contextlib
import os
import signal
import sys
import threading

from psanet.data.validate import DatasetError

__all__ = ['UserError', 'ConfigError', 'CheckpointError', 'TrainingError', 'DatasetError',
           'Interrupted', 'USER_ERRORS', 'run_cli']


class UserError(Exception):
    """An error in the user's input; the message names the file and the fix."""


class ConfigError(UserError, ValueError):
    """A config file, a config key, a component type or a command-line flag that cannot work."""


class CheckpointError(UserError, ValueError):
    """A checkpoint or weights file that is missing, unreadable or does not fit the model."""


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (a NaN or Inf loss); the message names the last good checkpoint."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM; the message says what to do next.

    A KeyboardInterrupt, so that no ``except Exception`` on the way swallows it.

    Args:
        message (str): the line to print.
        signum (int, optional): the signal. Default: SIGINT.
    """

    def __init__(self, message, signum=signal.SIGINT):
        super().__init__(message)
        self.signum = int(signum)

    @property
    def exit_code(self):
        """128 + the signal number, as a shell reports a process the signal ended."""
        return 128 + self.signum


USER_ERRORS = (UserError, DatasetError)


@contextlib.contextmanager
def sigterm_raises():
    """Within the block SIGTERM raises :class:`Interrupted` in the main thread, as Ctrl-C does.

    Without it Paddle's handler prints a C++ stack and ``FatalError: Termination
    signal``, and no ``finally`` or ``except`` runs. A forked child (a DataLoader
    worker) inherits the handler; the signal ends it as if there were none.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Interrupted(f'stopped by {signal.Signals(signum).name}', signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def run_cli(function, *args, **kwargs):
    """Calls ``function``; returns 0, or an exit code after printing one ``error:`` line.

    2 for a user error, 130 for Ctrl-C, 143 for SIGTERM (raised as Ctrl-C is
    while ``function`` runs).

    Args:
        function (callable): the work of a command line, e.g. ``train_from_config``.
        *args, **kwargs: passed to ``function``.

    Returns:
        int: the process exit code.
    """
    try:
        with sigterm_raises():
            function(*args, **kwargs)
    except USER_ERRORS as error:
        print(f'error: {error}', file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as stop:
        message = stop if isinstance(stop, Interrupted) else 'interrupted (Ctrl-C)'
        print(f'error: {message}', file=sys.stderr, flush=True)
        return getattr(stop, 'exit_code', 130)
    return 0
