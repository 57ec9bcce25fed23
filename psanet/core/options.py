"""The options of a job, each built and checked once where flags and config meet, then passed whole.

``InferenceOptions``: how an image is inferred (whole, sliding windows,
scales and flips, precision), for evaluation and prediction alike.
``TrainOptions``: the training loop's settings, with the ``InferenceOptions``
of its evaluations.
"""
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

from psanet.errors import ConfigError

__all__ = ['InferenceOptions', 'TrainOptions', 'AUG_COMBINES', 'PRECISIONS', 'AMP_LEVELS',
           'check_slide_args']

# How aug_eval combines scales and flips: the mean of the logits (paddleseg 2.8's
# aug_inference), or the mean of their softmax.
AUG_COMBINES = ('logits', 'softmax')
PRECISIONS = ('fp32', 'fp16')
AMP_LEVELS = ('O1', 'O2')


def check_slide_args(crop_size, stride):
    """Validates ``(w, h)`` pairs for sliding-window inference and returns them as int tuples."""
    pairs = []
    for name, value in (('crop_size', crop_size), ('stride', stride)):
        if value is None or len(value) != 2 or any(int(v) <= 0 for v in value):
            raise ConfigError(f'sliding-window inference needs --{name} as two positive ints '
                              f'(width height), got {value!r}.')
        pairs.append((int(value[0]), int(value[1])))
    (crop_w, crop_h), (stride_w, stride_h) = pairs
    if stride_w > crop_w or stride_h > crop_h:
        raise ConfigError(f'--stride {stride_w} {stride_h} is larger than --crop_size {crop_w} '
                          f'{crop_h}: windows would leave pixels unpredicted; use a stride no '
                          'larger than the crop.')
    return pairs[0], pairs[1]


@dataclass(frozen=True)
class InferenceOptions:
    """How each image is inferred; field names are test_config's keys and the flags'.

    Args:
        aug_eval (bool): average over ``scales`` and flips (val.py's --aug_eval,
            predict.py's --aug_pred). Default: False.
        scales (tuple): input scales with aug_eval. Default: (1.0,).
        flip_horizontal (bool): add horizontally flipped inputs with aug_eval. Default: False.
        flip_vertical (bool): add vertically flipped inputs with aug_eval. Default: False.
        aug_combine (str): with aug_eval, average the 'logits' (paddleseg 2.8's
            aug_inference) or their 'softmax'. Default: 'logits'.
        is_slide (bool): sliding-window inference. Default: False.
        crop_size (tuple): (w, h) of a window, with is_slide. Default: None.
        stride (tuple): (w, h) between windows, with is_slide. Default: None.
        precision (str): 'fp32', or 'fp16' autocast (GPU only). Default: 'fp32'.
        amp_level (str): 'O1' or 'O2'. Default: 'O1'.

    Raises:
        ConfigError: for a bad value, naming its flag.
    """
    aug_eval: bool = False
    scales: Tuple[float, ...] = (1.0, )
    flip_horizontal: bool = False
    flip_vertical: bool = False
    aug_combine: str = 'logits'
    is_slide: bool = False
    crop_size: Optional[Tuple[int, int]] = None
    stride: Optional[Tuple[int, int]] = None
    precision: str = 'fp32'
    amp_level: str = 'O1'

    # The keys of the config's test_config (paddleseg's, and aug_combine).
    TEST_CONFIG_KEYS = ('aug_eval', 'scales', 'flip_horizontal', 'flip_vertical', 'aug_combine',
                        'is_slide', 'crop_size', 'stride')

    def __post_init__(self):
        _check_values(dataclasses.asdict(self), lambda name: f'--{name}')
        scales = self.scales if isinstance(self.scales, (list, tuple)) else [self.scales]
        object.__setattr__(self, 'scales', tuple(float(s) for s in scales))
        for name in ('crop_size', 'stride'):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(int(v) for v in value))
        if self.is_slide:
            check_slide_args(self.crop_size, self.stride)

    @classmethod
    def from_flags(cls, flags, test_config=None, aug_flag='--aug_eval'):
        """Command-line flags over the config's test_config over the defaults, checked.

        Args:
            flags (dict): the inference flags given: ``aug_flag`` without dashes,
                ``scales``, ``flip_horizontal``, ``flip_vertical``, ``aug_combine``,
                ``is_slide``, ``crop_size``, ``stride``, ``precision``, ``amp_level``;
                None where not given.
            test_config (dict, optional): the config's ``test_config``. Default: None.
            aug_flag (str, optional): '--aug_eval' (val.py) or '--aug_pred' (predict.py),
                the switch's name in ``flags`` and in messages. Default: '--aug_eval'.

        Raises:
            ConfigError: for a flag that would do nothing without the flag it needs
                (``--scales`` without ``aug_flag``, ``--crop_size`` without
                ``--is_slide``; test_config's switches count), or a bad value,
                naming the flag or the test_config key.
            TypeError: for a key that is no inference flag.
        """
        test_config = {} if test_config is None else test_config
        if not isinstance(test_config, dict):
            raise ConfigError(f'test_config must be a mapping of keys such as aug_eval and '
                              f'scales, got {test_config!r}: fix it in the config.')
        unknown = [k for k in test_config if k not in cls.TEST_CONFIG_KEYS]
        if unknown:
            raise ConfigError(f'test_config has unknown keys {unknown}: known are '
                              f'{list(cls.TEST_CONFIG_KEYS)}.')
        aug_key = aug_flag.lstrip('-')
        names = {f.name for f in dataclasses.fields(cls)} - {'aug_eval'} | {aug_key}
        extra = sorted(set(flags) - names)
        if extra:
            raise TypeError(f'not inference flags: {extra}; known are {sorted(names)}.')
        given = {('aug_eval' if k == aug_key else k): v for k, v in flags.items()
                 if v is not None}
        _check_switches(given, test_config, aug_flag)
        merged = {**test_config, **given}

        def where(name):
            if name in given:
                return aug_flag if name == 'aug_eval' else f'--{name}'
            return f'test_config.{name}'

        _check_values(merged, where)
        return cls(**merged)

    def with_precision(self, precision, amp_level):
        """These options in another precision (a training run's evaluations)."""
        return dataclasses.replace(self, precision=precision, amp_level=amp_level)


def _check_switches(given, test_config, aug_flag):
    """A flag that only acts with a switch that is off would be ignored: refused."""
    aug = given.get('aug_eval', test_config.get('aug_eval', False))
    slide = given.get('is_slide', test_config.get('is_slide', False))
    for name, switch, needs in (('scales', aug, aug_flag),
                                ('flip_horizontal', aug, aug_flag),
                                ('flip_vertical', aug, aug_flag),
                                ('aug_combine', aug, aug_flag),
                                ('crop_size', slide, '--is_slide'),
                                ('stride', slide, '--is_slide')):
        if name in given and not switch:
            raise ConfigError(f'--{name} only acts with {needs}, which is not set (on the command '
                              f'line or in test_config): add {needs} or drop --{name}.')


def _check_values(values, where):
    """Raises ConfigError for a bad value in ``values``, named by ``where(name)``."""
    combine = values.get('aug_combine')
    if combine is not None and combine not in AUG_COMBINES:
        raise ConfigError(f'{where("aug_combine")} must be one of '
                          f'{" or ".join(AUG_COMBINES)}, got {combine!r}.')
    scales = values.get('scales')
    if scales is not None:
        items = scales if isinstance(scales, (list, tuple)) else [scales]
        if not items or not all(_positive_number(v) for v in items):
            raise ConfigError(f'{where("scales")} must be positive numbers, e.g. 0.75 1.0 1.25, '
                              f'got {scales!r}.')
    for name in ('crop_size', 'stride'):
        value = values.get(name)
        if value is None:
            if values.get('is_slide'):
                raise ConfigError(f'--is_slide needs --{name} WIDTH HEIGHT (or '
                                  f'test_config.{name}): add it, e.g. --crop_size 1024 512 '
                                  '--stride 768 384.')
            continue
        if (not isinstance(value, (list, tuple)) or len(value) != 2 or
                not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
            raise ConfigError(f'{where(name)} must be two positive integers (width height), '
                              f'got {value!r}.')
    for name, choices in (('precision', PRECISIONS), ('amp_level', AMP_LEVELS)):
        if name in values and values[name] not in choices:
            raise ConfigError(f'{where(name)} must be one of {" or ".join(choices)}, got '
                              f'{values[name]!r}.')


def _positive_number(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and
            math.isfinite(value) and value > 0)


# numpy's seeds are below 2**32.
SEED_LIMIT = 2 ** 32


@dataclass(frozen=True)
class TrainOptions:
    """The training loop's settings: train.py's flags, the config's schedule filled in.

    Args:
        iters (int): the total number of iterations (the config's when built from it).
        batch_size (int): images per process and iteration.
        save_dir (str): checkpoints, train.log and VisualDL logs. Default: 'output'.
        save_interval (int): iterations between checkpoints (and evaluations). Default: 1000.
        log_iters (int): iterations between log lines. Default: 10.
        keep_checkpoint_max (int): iter_N folders kept (0: all). Default: 5.
        num_workers (int): DataLoader workers per process. Default: 0.
        use_vdl (bool): write VisualDL scalars and evaluation figures to save_dir.
            Default: False.
        resume_model (str): an iter_N folder to continue from. Default: None.
        seed (int): base seed of augmentation and Dropout; None draws one (a resumed
            run takes the checkpoint's). Default: None.
        precision (str): 'fp32', or 'fp16' (autocast + GradScaler, GPU only). Default: 'fp32'.
        amp_level (str): 'O1' or 'O2'. Default: 'O1'.
        overwrite (bool): delete the checkpoints of another run in save_dir (or,
            resuming, those after resume_model) instead of refusing it. Default: False.
        sync_bn (bool): SyncBatchNorm when training on more than one GPU. Default: True.
        recipe_batch_size (int): images per step of the config's recipe (its batch_size
            on one card); with more than one process the start-of-training log line
            says which batch_size gives it. Default: None.
        evaluation (InferenceOptions): how the evaluations infer (the config's
            test_config, in ``precision``). Default: ``InferenceOptions()`` in ``precision``.

    Raises:
        ConfigError: for a value out of range, naming its flag.
    """
    iters: Optional[int] = None
    batch_size: Optional[int] = None
    save_dir: str = 'output'
    save_interval: int = 1000
    log_iters: int = 10
    keep_checkpoint_max: int = 5
    num_workers: int = 0
    use_vdl: bool = False
    resume_model: Optional[str] = None
    seed: Optional[int] = None
    precision: str = 'fp32'
    amp_level: str = 'O1'
    overwrite: bool = False
    sync_bn: bool = True
    recipe_batch_size: Optional[int] = None
    evaluation: Optional[InferenceOptions] = field(default=None)

    def __post_init__(self):
        schedule = {name: getattr(self, name) for name in ('iters', 'batch_size')
                    if getattr(self, name) is not None}
        _check_positive(**schedule, save_interval=self.save_interval, log_iters=self.log_iters)
        check_not_negative(num_workers=(self.num_workers, 'load in the main process'),
                            keep_checkpoint_max=(self.keep_checkpoint_max,
                                                 'keep every checkpoint'))
        if self.seed is not None and (not isinstance(self.seed, int) or
                                      isinstance(self.seed, bool) or
                                      not 0 <= self.seed < SEED_LIMIT):
            raise ConfigError(f'--seed must be an integer from 0 to {SEED_LIMIT - 1} (what numpy '
                              f'and Paddle accept), got {self.seed!r}.')
        evaluation = self.evaluation or InferenceOptions()
        object.__setattr__(self, 'evaluation',
                           evaluation.with_precision(self.precision, self.amp_level))

    def check_schedule(self):
        """Raises ConfigError unless iters and batch_size are set."""
        missing = [name for name in ('iters', 'batch_size') if getattr(self, name) is None]
        if missing:
            raise ConfigError(f'training needs {" and ".join(missing)}: set them in the config '
                              f'or with --{" --".join(missing)}.')


def _check_positive(**values):
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f'--{name} must be a positive integer, got {value!r}.')


def check_not_negative(**values):
    """Raises ConfigError unless each ``name=(value, what 0 means)`` is an int >= 0."""
    for name, (value, zero) in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f'--{name} must be 0 ({zero}) or a positive integer, got '
                              f'{value!r}.')
