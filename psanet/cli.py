"""What the command lines share: running their work with one ``error:`` line, and flags.

The top-level scripts (train.py, val.py, predict.py, export.py,
deploy/python/infer.py) parse flags and call their work through
:func:`run_cli`: it configures the logger once (:func:`psanet.log.setup_logging`);
a :class:`~psanet.errors.UserError` becomes one readable ``error: ...`` line
on stderr and exit code 2, without a traceback; any other exception is a bug
and keeps its traceback. Ctrl-C and SIGTERM (what job schedulers send) become
:class:`~psanet.errors.Interrupted`, one line and exit code 130 or 143.
The inputs themselves are checked by the library functions the scripts call.
"""
import contextlib
import logging
import os
import signal
import sys
import threading

from psanet.errors import Interrupted, UserError
from psanet.log import setup_logging

__all__ = ['exit_with', 'run_cli', 'sigterm_raises', 'add_inference_flags']


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
    setup_logging()
    try:
        with sigterm_raises():
            function(*args, **kwargs)
    except UserError as error:
        print(f'error: {error}', file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as stop:
        message = stop if isinstance(stop, Interrupted) else 'interrupted (Ctrl-C)'
        print(f'error: {message}', file=sys.stderr, flush=True)
        return getattr(stop, 'exit_code', 130)
    return 0


def exit_with(code):
    """Ends the process with ``code``, the command lines' last call.

    After Ctrl-C or SIGTERM (130, 143) the process ends at once, once its output
    is flushed: the training's ``finally`` blocks have run (checkpoints whole,
    temporaries gone), but Paddle's C++ teardown of a process stopped mid-step
    can abort ("terminate called without an active exception"), which would
    turn exit 143 into a SIGABRT. Worker processes are ended first, as a normal
    exit would. Any other code exits normally.
    """
    if code in (130, 143):
        import multiprocessing
        for child in multiprocessing.active_children():  # DataLoader workers
            child.terminate()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def add_inference_flags(parser, aug_flag):
    """The inference flags val.py and predict.py share (None: use the config's test_config).

    ``psanet.core.val.check_inference_flags`` checks what they are given.
    """
    parser.add_argument(aug_flag, action='store_true', default=None,
                        help='Average over --scales and flips (see --aug_combine).')
    parser.add_argument('--scales', nargs='+', type=float, default=None,
                        help=f'Scales for augmentation, e.g. 0.75 1.0 1.25 (with {aug_flag}).')
    parser.add_argument('--flip_horizontal', action='store_true', default=None,
                        help=f'Add horizontally flipped inputs to the augmentation (with '
                        f'{aug_flag}).')
    parser.add_argument('--flip_vertical', action='store_true', default=None,
                        help=f'Add vertically flipped inputs to the augmentation (with '
                        f'{aug_flag}).')
    parser.add_argument('--aug_combine', default=None, metavar='{logits,softmax}',
                        help=f'With {aug_flag}: average the logits (paddleseg 2.8\'s '
                        'aug_inference) or their softmax. Default: test_config.aug_combine, '
                        'else logits.')
    parser.add_argument('--is_slide', action='store_true', default=None,
                        help='Sliding-window inference.')
    parser.add_argument('--crop_size', nargs=2, type=int, default=None,
                        help='Window width and height (with --is_slide).')
    parser.add_argument('--stride', nargs=2, type=int, default=None,
                        help='Window step width and height (with --is_slide).')
