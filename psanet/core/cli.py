"""Command-line pieces shared by val.py and predict.py."""
import math

from psanet.core.errors import ConfigError

__all__ = ['add_inference_flags', 'check_inference_flags']


def add_inference_flags(parser, aug_flag):
    """The inference flags val.py and predict.py share (None: use the config's test_config)."""
    parser.add_argument(aug_flag, action='store_true', default=None,
                        help='Average softmax over --scales and flips.')
    parser.add_argument('--scales', nargs='+', type=float, default=None,
                        help=f'Scales for augmentation, e.g. 0.75 1.0 1.25 (with {aug_flag}).')
    parser.add_argument('--flip_horizontal', action='store_true', default=None,
                        help=f'Add horizontally flipped inputs to the augmentation (with '
                        f'{aug_flag}).')
    parser.add_argument('--flip_vertical', action='store_true', default=None,
                        help=f'Add vertically flipped inputs to the augmentation (with '
                        f'{aug_flag}).')
    parser.add_argument('--is_slide', action='store_true', default=None,
                        help='Sliding-window inference.')
    parser.add_argument('--crop_size', nargs=2, type=int, default=None,
                        help='Window width and height (with --is_slide).')
    parser.add_argument('--stride', nargs=2, type=int, default=None,
                        help='Window step width and height (with --is_slide).')


def check_inference_flags(flags, aug_flag, test_config=None):
    """Raises ConfigError for an inference flag that would be ignored or has a bad value.

    ``--scales`` and the flips only act with ``aug_flag``, ``--crop_size`` and
    ``--stride`` only with ``--is_slide``: given without it, each would leave
    the result unchanged without a word. The config's ``test_config`` counts
    as given (its ``aug_eval`` switches on ``aug_flag``); its values are
    checked too.

    Args:
        flags (dict | argparse.Namespace): the command line's values of
            ``aug_eval`` / ``aug_pred`` (``aug_flag`` without dashes), ``scales``,
            ``flip_horizontal``, ``flip_vertical``, ``is_slide``, ``crop_size`` and
            ``stride``; None (or absent) where not given.
        aug_flag (str): '--aug_eval' (val.py) or '--aug_pred' (predict.py).
        test_config (dict, optional): the config's ``test_config``. Default: None.

    Raises:
        ConfigError: naming the flag and the flag it needs, or the bad value.
    """
    flags = flags if isinstance(flags, dict) else vars(flags)
    given = {k: v for k, v in flags.items() if v is not None}
    test_config = test_config or {}
    if not isinstance(test_config, dict):
        raise ConfigError(f'test_config must be a mapping of keys such as aug_eval and scales, '
                          f'got {test_config!r}: fix it in the config.')
    aug_key = aug_flag.lstrip('-')
    aug = given.get(aug_key, test_config.get('aug_eval', False))
    slide = given.get('is_slide', test_config.get('is_slide', False))
    for name, switch, needs in (('scales', aug, aug_flag),
                                ('flip_horizontal', aug, aug_flag),
                                ('flip_vertical', aug, aug_flag),
                                ('crop_size', slide, '--is_slide'),
                                ('stride', slide, '--is_slide')):
        if name in given and not switch:
            raise ConfigError(f'--{name} only acts with {needs}, which is not set (on the command '
                              f'line or in test_config): add {needs} or drop --{name}.')

    def where(name):
        return f'--{name}' if name in given else f'test_config.{name}'

    scales = given.get('scales', test_config.get('scales'))
    if scales is not None:
        values = scales if isinstance(scales, (list, tuple)) else [scales]
        if not values or not all(_positive_number(v) for v in values):
            raise ConfigError(f'{where("scales")} must be positive numbers, e.g. 0.75 1.0 1.25, '
                              f'got {scales!r}.')
    for name in ('crop_size', 'stride'):
        value = given.get(name, test_config.get(name))
        if value is None:
            if slide:
                raise ConfigError(f'--is_slide needs --{name} WIDTH HEIGHT (or '
                                  f'test_config.{name}): add it, e.g. --crop_size 1024 512 '
                                  '--stride 768 384.')
            continue
        if (not isinstance(value, (list, tuple)) or len(value) != 2 or
                not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
            raise ConfigError(f'{where(name)} must be two positive integers (width height), '
                              f'got {value!r}.')


def _positive_number(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and
            math.isfinite(value) and value > 0)
