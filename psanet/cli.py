"""What the command lines share: running their work with one ``error:`` line, and flags.

The top-level scripts parse flags and call their work through :func:`run_cli`: it
configures the logger once; a :class:`~psanet.errors.UserError`, or an op library that
cannot be built here, becomes one ``error: ...`` line on stderr and exit code 2; any other
exception is a bug and keeps its traceback. Ctrl-C and SIGTERM stop the work at its next
step, batch or image (:mod:`psanet.interrupts`): one line and exit code 130 or 143.
"""
import signal
import sys

# compat first: it filters Paddle's "No ccache found" notice before paddle is imported.
from psanet import compat  # noqa: F401
from psanet import interrupts
from psanet.errors import Interrupted, UserError
from psanet.log import line_cut, setup_logging

__all__ = ['exit_with', 'run_cli', 'add_model_flags', 'add_inference_flags']


def run_cli(function, *args, **kwargs):
    """Calls ``function``; returns 0, or an exit code after printing one ``error:`` line.

    2 for a user error; for Ctrl-C and SIGTERM, which ``function``'s loops stop
    at their next boundary (:mod:`psanet.interrupts`), 130 and 143.

    Args:
        function (callable): the work of a command line, e.g. ``train_from_config``.
        *args, **kwargs: passed to ``function``.

    Returns:
        int: the process exit code.
    """
    # Here, not at the top: a script parses its flags before anything loads Paddle.
    from psanet.ops.library import OpLibraryError
    setup_logging()
    with interrupts.stop_at_boundaries():
        try:
            function(*args, **kwargs)
        except (UserError, OpLibraryError) as error:
            print(f'error: {error}', file=sys.stderr, flush=True)
            return 2
        except Interrupted as stop:
            if line_cut():  # a progress bar left half-way: the error goes on a line of its own
                print(file=sys.stdout, flush=True)
            print(f'error: {stop}', file=sys.stderr, flush=True)
            return stop.exit_code
    return 0


def exit_with(code):
    """Ends the process with ``code``, the command lines' last call.

    After a stop (130, 143) SIGTERM is ignored while the process exits: the run
    has saved, and ``paddle.distributed.launch`` sends SIGTERM to the ranks
    still exiting once one has exited, which would turn their 143 into a kill.
    """
    if code in (130, 143):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(code)


def add_model_flags(parser):
    """--config and --model_path, as val.py, predict.py and the attention tool take them."""
    parser.add_argument('--config', required=True, help='The config file.')
    parser.add_argument('--model_path', required=True,
                        help='model.pdparams, a checkpoint folder such as output/best_model, or an '
                        'http(s) URL of a .pdparams or of a .zip/.tar.gz holding one '
                        '(downloaded once into $PSANET_WEIGHTS_CACHE; #sha256=<hex> at its '
                        'end checks it).')


def add_inference_flags(parser, aug_flag):
    """The inference flags val.py and predict.py share (None: use the config's test_config).

    Each is parsed into the field of ``psanet.core.options.InferenceOptions`` of its
    name; the switch, ``aug_flag`` ('--aug_eval' or '--aug_pred'), into ``aug_eval``.
    ``InferenceOptions.from_flags(flags, test_config, aug_flag)`` checks them.
    """
    parser.add_argument(aug_flag, dest='aug_eval', action='store_true', default=None,
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
