"""The options of a job, each built and checked once where flags and config meet, then passed whole.

``InferenceOptions`` (how an image is inferred, for evaluation and prediction),
``EvalOptions`` (val.py), ``TrainOptions`` (train.py, with the ``EvalOptions`` of its
evaluations). Each checks its values in ``__post_init__``, naming a bad one by its flag
or config key; the flags' help says what each field means.
"""
import math
from dataclasses import InitVar, dataclass, fields
from typing import Callable, Optional, Tuple

from psanet.deploy.predictor import PRECISIONS
from psanet.errors import ConfigError, is_integer

__all__ = ['InferenceOptions', 'EvalOptions', 'TrainOptions', 'RESUME_AUTO', 'training_recipe',
           'recipe_changes', 'AUG_COMBINES', 'DYGRAPH_PRECISIONS', 'AMP_LEVELS', 'DEFAULT_DEVICE']

AUG_COMBINES = ('logits', 'softmax')  # 'logits': paddleseg 2.8's aug_inference
DYGRAPH_PRECISIONS = tuple(p for p in PRECISIONS if p != 'int8')  # int8 needs an export
AMP_LEVELS = ('O1', 'O2')
# None: the GPU when Paddle sees one, else the CPU, as PaddleSeg's (core.device.set_device).
DEFAULT_DEVICE = None
SEED_LIMIT = 2 ** 32  # numpy's seeds are below it
RESUME_AUTO = 'auto'  # --resume_model auto: the newest checkpoint of --save_dir that loads
# Keys that name where files are, not what is trained: a moved dataset resumes.
_WHERE_KEYS = ('dataset_root', 'train_path', 'val_path', 'pretrained')


_flag = '--{}'.format


@dataclass(frozen=True)
class InferenceOptions:
    """How each image is inferred: the flags of :func:`psanet.cli.add_inference_flags` (and
    test_config's keys), precision and amp_level. ``named_by``: field -> name in messages."""
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
    named_by: InitVar[Optional[Callable]] = None

    TEST_CONFIG_KEYS = ('aug_eval', 'scales', 'flip_horizontal', 'flip_vertical', 'aug_combine',
                        'is_slide', 'crop_size', 'stride')

    def __post_init__(self, named_by):
        _check_inference(self, named_by or _flag)
        scales = self.scales if isinstance(self.scales, (list, tuple)) else [self.scales]
        object.__setattr__(self, 'scales', tuple(float(s) for s in scales))
        for name in ('crop_size', 'stride'):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @classmethod
    def from_flags(cls, flags, test_config=None, aug_flag='--aug_eval'):
        """The flags given (by field name, None where not given) over the config's
        test_config over the defaults. ``aug_flag`` is how the command line spells the
        aug_eval switch. A flag that needs a switch that is off is refused."""
        test_config = {} if test_config is None else test_config
        if not isinstance(test_config, dict):
            raise ConfigError(f'test_config must be a mapping of keys such as aug_eval and '
                              f'scales, got {test_config!r}: fix it in the config.')
        unknown = [k for k in test_config if k not in cls.TEST_CONFIG_KEYS]
        if unknown:
            raise ConfigError(f'test_config has unknown keys {unknown}: known are '
                              f'{list(cls.TEST_CONFIG_KEYS)}.')
        names = {f.name for f in fields(cls)}
        extra = sorted(set(flags) - names)
        if extra:
            raise TypeError(f'not inference flags: {extra}; known are {sorted(names)}.')
        given = {k: v for k, v in flags.items() if v is not None}
        aug = given.get('aug_eval', test_config.get('aug_eval', False))
        slide = given.get('is_slide', test_config.get('is_slide', False))
        for name in ('scales', 'flip_horizontal', 'flip_vertical', 'aug_combine', 'crop_size',
                     'stride'):
            switch, needs = (slide, '--is_slide') if name in ('crop_size', 'stride') else \
                (aug, aug_flag)
            if name in given and not switch:
                raise ConfigError(f'--{name} only acts with {needs}, which is not set (on the '
                                  f'command line or in test_config): add {needs} or drop '
                                  f'--{name}.')

        def named_by(name):
            if name in given:
                return aug_flag if name == 'aug_eval' else f'--{name}'
            return f'test_config.{name}'

        return cls(**{**test_config, **given}, named_by=named_by)


def _check_inference(options, where):
    _check_choices(where, aug_combine=(options.aug_combine, AUG_COMBINES))
    scales = options.scales
    items = scales if isinstance(scales, (list, tuple)) else [scales]
    if not items or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and
                            math.isfinite(v) and v > 0 for v in items):
        raise ConfigError(f'{where("scales")} must be positive numbers, e.g. 0.75 1.0 1.25, '
                          f'got {scales!r}.')
    for name in ('crop_size', 'stride'):
        value = getattr(options, name)
        if value is None:
            if options.is_slide:
                raise ConfigError(f'--is_slide needs --{name} WIDTH HEIGHT (or '
                                  f'test_config.{name}): add it, e.g. --crop_size 1024 512 '
                                  '--stride 768 384.')
        elif (not isinstance(value, (list, tuple)) or len(value) != 2 or
                not all(is_integer(v, 1) for v in value)):
            raise ConfigError(f'{where(name)} must be two positive integers (width height), '
                              f'got {value!r}.')
    if options.is_slide and any(s > c for s, c in zip(options.stride, options.crop_size)):
        raise ConfigError(f'{where("stride")} {options.stride[0]} {options.stride[1]} is larger '
                          f'than {where("crop_size")} {options.crop_size[0]} '
                          f'{options.crop_size[1]}: windows would leave pixels unpredicted; use a '
                          'stride no larger than the crop.')
    _check_choices(where, precision=(options.precision, DYGRAPH_PRECISIONS),
                   amp_level=(options.amp_level, AMP_LEVELS))


def _check_choices(where, **values):
    for name, (value, choices) in values.items():
        if value not in choices:
            raise ConfigError(f'{where(name)} must be one of {" or ".join(choices)}, got '
                              f'{value!r}.')


def _check_integers(where, **values):
    """``name=(value, what 0 means)``; None there: 0 is refused too."""
    for name, (value, zero) in values.items():
        if not is_integer(value, 1 if zero is None else 0):
            allowed = 'a positive integer' if zero is None else f'0 ({zero}) or a positive integer'
            raise ConfigError(f'{where(name)} must be {allowed}, got {value!r}.')


@dataclass(frozen=True)
class EvalOptions:
    """An evaluation job (val.py's flags); ``print_detail``: progress bar and [EVAL] lines."""
    inference: InferenceOptions = InferenceOptions()
    num_workers: int = 0
    save_dir: Optional[str] = None
    print_detail: bool = True

    def __post_init__(self):
        _check_integers(_flag, num_workers=(self.num_workers, 'load in the main process'))

    @classmethod
    def from_flags(cls, flags, test_config=None):
        """val.py's flags (by field name) over ``test_config``."""
        own = {f.name for f in fields(cls)} - {'inference'}
        inference = InferenceOptions.from_flags(
            {k: v for k, v in flags.items() if k not in own}, test_config, '--aug_eval')
        return cls(inference=inference, **{k: v for k, v in flags.items() if k in own})


def training_recipe(config, iters, batch_size):
    """What a checkpoint records of a config's sections (``cfg.dic``) to tell another run's;
    no file locations."""
    def plain(value):
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items() if k not in _WHERE_KEYS}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)

    recipe = {name: plain(config[name]) for name in
              ('model', 'loss', 'optimizer', 'lr_scheduler', 'train_dataset') if name in config}
    return {**recipe, 'iters': iters, 'batch_size': batch_size}


def _flatten(value, prefix=''):
    if isinstance(value, dict):
        items = {}
        for key, item in value.items():
            items.update(_flatten(item, f'{prefix}.{key}' if prefix else str(key)))
        return items
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        items = {f'{prefix}.length': len(value)}
        for index, item in enumerate(value):
            items.update(_flatten(item, f'{prefix}[{index}]'))
        return items
    return {prefix: value}


def recipe_changes(saved, current):
    """``key: saved -> current`` for every dotted key whose value differs between two recipes."""
    saved, current = _flatten(saved), _flatten(current)
    missing = object()
    return [f'{key}: {saved.get(key, "(none)")} -> {current.get(key, "(none)")}'
            for key in sorted(set(saved) | set(current))
            if saved.get(key, missing) != current.get(key, missing)]


@dataclass(frozen=True)
class TrainOptions:
    """The training loop's settings: train.py's flags (their help says what each means).
    ``evaluation`` holds the ``num_workers``, ``precision`` and ``amp_level`` training shares
    with its evaluations (read as ``options.num_workers`` etc.); ``recipe_batch_size`` is the
    config's images per step, ``config`` its path, ``recipe`` :func:`training_recipe`."""
    iters: Optional[int] = None
    batch_size: Optional[int] = None
    save_dir: str = 'output'
    save_interval: int = 1000
    log_iters: int = 10
    keep_checkpoint_max: int = 5
    use_vdl: bool = False
    resume_model: Optional[str] = None
    seed: Optional[int] = None
    overwrite: bool = False
    sync_bn: bool = True
    recipe_batch_size: Optional[int] = None
    evaluation: EvalOptions = EvalOptions()
    device: Optional[str] = DEFAULT_DEVICE
    do_eval: bool = False
    config: Optional[str] = None
    recipe: Optional[dict] = None
    named_by: InitVar[Optional[Callable]] = None

    def __post_init__(self, named_by):
        where = named_by or _flag
        schedule = {name: (getattr(self, name), None) for name in ('iters', 'batch_size')
                    if getattr(self, name) is not None}
        _check_integers(where, **schedule, save_interval=(self.save_interval, None),
                        log_iters=(self.log_iters, None),
                        keep_checkpoint_max=(self.keep_checkpoint_max, 'keep every checkpoint'))
        if self.seed is not None and (not is_integer(self.seed, 0) or self.seed >= SEED_LIMIT):
            raise ConfigError(f'--seed must be an integer from 0 to {SEED_LIMIT - 1} (what numpy '
                              f'and Paddle accept), got {self.seed!r}.')
        if self.resume_model == RESUME_AUTO and self.overwrite:
            raise ConfigError('--resume_model auto continues the run in --save_dir and '
                              '--overwrite deletes it: a re-run of the command would start over '
                              'each time. Drop --overwrite (or --resume_model auto).')

    num_workers = property(lambda self: self.evaluation.num_workers)
    precision = property(lambda self: self.evaluation.inference.precision)
    amp_level = property(lambda self: self.evaluation.inference.amp_level)

    @classmethod
    def from_config(cls, cfg, num_workers=0, precision='fp32', amp_level='O1', **flags):
        """train.py's flags (by field name) over a loaded config; None for iters or
        batch_size takes the config's, and a bad value from there is named by its key."""
        from_config = {name: cfg.dic.get(name) for name in ('iters', 'batch_size')
                       if flags.get(name) is None}
        evaluation = EvalOptions.from_flags(
            {'num_workers': num_workers, 'precision': precision, 'amp_level': amp_level},
            cfg.dic.get('test_config'))

        def named_by(name):
            return f'config {cfg.path}: {name}' if name in from_config else f'--{name}'

        schedule = {**flags, **from_config}
        return cls(**schedule, sync_bn=bool(cfg.dic.get('sync_bn', True)),
                   recipe_batch_size=cfg.recipe_batch_size, evaluation=evaluation,
                   config=cfg.path, recipe=training_recipe(cfg.dic, schedule.get('iters'),
                                                           schedule.get('batch_size')),
                   named_by=named_by)

    def check_schedule(self):
        """Raises ConfigError unless iters and batch_size are set."""
        missing = [name for name in ('iters', 'batch_size') if getattr(self, name) is None]
        if missing:
            raise ConfigError(f'training needs {" and ".join(missing)}: set them in the config '
                              f'or with --{" --".join(missing)}.')
