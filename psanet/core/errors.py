"""Errors a user can fix, and the command-line wrapper that prints them as one line.

The top-level scripts run their work through :func:`run_cli`: a
:class:`UserError` (or ``psanet.data.DatasetError``) becomes one readable
``error: ...`` line on stderr and exit code 2, without a traceback; any other
exception is a bug and keeps its traceback.
"""
import sys

from psanet.data.validate import DatasetError

__all__ = ['UserError', 'ConfigError', 'CheckpointError', 'TrainingError', 'DatasetError',
           'USER_ERRORS', 'run_cli']


class UserError(Exception):
    """An error in the user's input; the message names the file and the fix."""


class ConfigError(UserError, ValueError):
    """A config file, a config key, a component type or a command-line flag that cannot work."""


class CheckpointError(UserError, ValueError):
    """A checkpoint or weights file that is missing, unreadable or does not fit the model."""


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (a NaN or Inf loss); the message names the last good checkpoint."""


USER_ERRORS = (UserError, DatasetError)


def run_cli(function, *args, **kwargs):
    """Calls ``function``; returns 0, or 2 after printing a user error as one line.

    Args:
        function (callable): the work of a command line, e.g. ``train_from_config``.
        *args, **kwargs: passed to ``function``.

    Returns:
        int: the process exit code.
    """
    try:
        function(*args, **kwargs)
    except USER_ERRORS as error:
        print(f'error: {error}', file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print('error: interrupted; resume training from the last iter_N folder with '
              '--resume_model', file=sys.stderr, flush=True)
        return 130
    return 0
