"""Every error type of the package, the one integer check of every option, and the one
wording of an image that cannot be read.

A :class:`UserError` is an input the user can fix; its message names the file
or flag and the fix, and :func:`psanet.cli.run_cli` prints it as one
``error: ...`` line with exit code 2. Any other exception is a bug and keeps
its traceback. This module imports nothing of ours, so every layer (models,
engine, export, the deploy package, data tools) raises the same types.
"""
import numbers
import signal

__all__ = ['UserError', 'ConfigError', 'CheckpointError', 'TrainingError', 'DatasetError',
           'UnreadableImagesError', 'InferenceMemoryError', 'DeployError', 'DiskFullError',
           'ArgumentError',
           'Interrupted', 'few', 'is_integer', 'unreadable_image']


class UserError(Exception):
    """An error in the user's input; the message names the file and the fix."""


class ConfigError(UserError, ValueError):
    """A config file, a config key, a component type or a command-line flag that cannot work."""


class CheckpointError(UserError, ValueError):
    """A checkpoint or weights file that is missing, unreadable or does not fit the model."""


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (a NaN or Inf loss); the message names the last good checkpoint."""


class DatasetError(UserError, ValueError):
    """A dataset or image on disk that cannot be used; the message names the file and the fix."""


class InferenceMemoryError(UserError, MemoryError):
    """A network input too large for the memory there is; the message names a size that fits."""


class DeployError(UserError, RuntimeError):
    """A deployment step failed for a reason the message names, with the fix."""


class DiskFullError(UserError, OSError):
    """A write failed for lack of space; the message names the folder and its free space."""


class ArgumentError(ValueError):
    """A model constructor argument of the wrong type or out of range.

    ``argument`` is its name (the key in the config's ``model`` section),
    ``requirement`` says what it accepts, ``value`` is what was given; the
    config builder turns it into a :class:`ConfigError` naming ``model.<argument>``.
    """

    def __init__(self, argument, requirement, value):
        self.argument, self.requirement, self.value = argument, requirement, value
        super().__init__(f'{argument} must be {requirement}, got {value!r}.')


def is_integer(value, minimum=None):
    """Whether ``value`` is an int or a numpy integer, at least ``minimum`` when given.

    The one integer check of every option: a bool (1 to Python, never a count
    here) and a float (2.7 or 2.0) are not integers, nor is a string.
    """
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool) and
            (minimum is None or bool(value >= minimum)))


def few(names, shown=5):
    """``a, b, c, d, e and 3 more``: the first names of a list, for a one-line message."""
    names = list(names)
    text = ', '.join(str(name) for name in names[:shown])
    return text + (f' and {len(names) - shown} more' if len(names) > shown else '')


def unreadable_image(path, fix):
    """The message for an image file OpenCV cannot decode, ending with ``fix``."""
    return f'image {path} cannot be read (corrupt or not an image): {fix}'


class UnreadableImagesError(DatasetError):
    """Some input images could not be read (``unreadable``); every other one was predicted and
    written (``written``)."""

    def __init__(self, unreadable, total, written, save_dir):
        self.unreadable, self.written = list(unreadable), list(written)
        done = f'{len(self.written)} of {total} images written to {save_dir}'
        if len(self.unreadable) == 1:
            what = unreadable_image(self.unreadable[0],
                                    'replace it or leave it out of --image_path.')
        else:
            names = ', '.join(self.unreadable[:3])
            if len(self.unreadable) > 3:
                names += f' and {len(self.unreadable) - 3} more (listed above)'
            what = (f'{len(self.unreadable)} images cannot be read (corrupt or not images): '
                    f'{names}; replace them or leave them out of --image_path.')
        super().__init__(f'{done}; {what}')


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM; the message says what to do next. A KeyboardInterrupt, so that no
    ``except Exception`` on the way swallows it."""

    def __init__(self, message, signum=signal.SIGINT):
        super().__init__(message)
        self.signum = int(signum)

    @property
    def exit_code(self):
        """128 + the signal number, as a shell reports a process the signal ended."""
        return 128 + self.signum
