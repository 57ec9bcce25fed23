"""The options of a job, each built and checked once where flags and config meet, then passed whole.

``InferenceOptions``: how an image is inferred (whole, sliding windows,
scales and flips, precision), for evaluation and prediction alike.
``EvalOptions``: an evaluation job (val.py): its ``InferenceOptions``, data
loading, where predictions go. ``TrainOptions``: a training job (train.py),
with the ``EvalOptions`` of its evaluations, whose ``InferenceOptions`` also
hold the precision every forward of the job runs in.

Each is checked in its ``__post_init__`` and nowhere else; ``from_flags`` /
``from_config`` only merge the command line over the config and say where each
value came from, so that a bad one is named by its flag or its config key.
"""
import math
from dataclasses import InitVar, dataclass, fields
from typing import Callable, Optional, Tuple

from psanet.deploy.predictor import PRECISIONS
from psanet.errors import ConfigError, is_integer

__all__ = ['InferenceOptions', 'EvalOptions', 'TrainOptions', 'RESUME_AUTO', 'training_recipe',
           'recipe_changes', 'AUG_COMBINES', 'DYGRAPH_PRECISIONS', 'AMP_LEVELS', 'DEFAULT_DEVICE']

# How aug_eval combines scales and flips: the mean of the logits (paddleseg 2.8's
# aug_inference), or the mean of their softmax.
AUG_COMBINES = ('logits', 'softmax')
# fp32, or fp16 autocast; int8 needs a quantised export.
DYGRAPH_PRECISIONS = tuple(p for p in PRECISIONS if p != 'int8')
AMP_LEVELS = ('O1', 'O2')
# The device of the dygraph jobs, train.py, val.py, predict.py and Segmenter.from_config's
# 'dygraph' route alike: None is the GPU when Paddle sees one, else the CPU, as PaddleSeg's
# (psanet.core.device.set_device). An export runs on the CPU unless told (infer.py's).
DEFAULT_DEVICE = None
# numpy's seeds are below 2**32.
SEED_LIMIT = 2 ** 32


def _flag(name):
    return f'--{name}'


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
        stride (tuple): (w, h) between windows, at most crop_size, with is_slide. Default: None.
        precision (str): 'fp32', or 'fp16' autocast (GPU only). Default: 'fp32'.
        amp_level (str): 'O1' or 'O2'. Default: 'O1'.
        named_by (callable, optional): field name -> how a message names it (``from_flags``
            passes the flag or the test_config key); not stored. Default: ``--<name>``.

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
    named_by: InitVar[Optional[Callable]] = None

    # The keys of the config's test_config (paddleseg's, and aug_combine).
    TEST_CONFIG_KEYS = ('aug_eval', 'scales', 'flip_horizontal', 'flip_vertical', 'aug_combine',
                        'is_slide', 'crop_size', 'stride')

    def __post_init__(self, named_by):
        _check_inference(self, named_by or _flag)
        scales = self.scales if isinstance(self.scales, (list, tuple)) else [self.scales]
        object.__setattr__(self, 'scales', tuple(float(s) for s in scales))
        for name in ('crop_size', 'stride'):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))

    @classmethod
    def from_flags(cls, flags, test_config=None, aug_flag='--aug_eval'):
        """Command-line flags over the config's test_config over the defaults, checked.

        Args:
            flags (dict): the inference flags given, by field name (``aug_eval``,
                ``scales``, ``flip_horizontal``, ``flip_vertical``, ``aug_combine``,
                ``is_slide``, ``crop_size``, ``stride``, ``precision``, ``amp_level``),
                as :func:`psanet.cli.add_inference_flags` parses them; None where not given.
            test_config (dict, optional): the config's ``test_config``. Default: None.
            aug_flag (str, optional): how the command line spells the ``aug_eval``
                switch in messages: '--aug_eval' (val.py) or '--aug_pred' (predict.py).
                Default: '--aug_eval'.

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
        names = {f.name for f in fields(cls)}
        extra = sorted(set(flags) - names)
        if extra:
            raise TypeError(f'not inference flags: {extra}; known are {sorted(names)}.')
        given = {k: v for k, v in flags.items() if v is not None}
        _check_switches(given, test_config, aug_flag)

        def named_by(name):
            if name in given:
                return aug_flag if name == 'aug_eval' else f'--{name}'
            return f'test_config.{name}'

        return cls(**{**test_config, **given}, named_by=named_by)


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


def _check_inference(options, where):
    """Raises ConfigError for a bad value of ``options``, named by ``where(name)``."""
    if options.aug_combine not in AUG_COMBINES:
        raise ConfigError(f'{where("aug_combine")} must be one of '
                          f'{" or ".join(AUG_COMBINES)}, got {options.aug_combine!r}.')
    scales = options.scales
    items = scales if isinstance(scales, (list, tuple)) else [scales]
    if not items or not all(_positive_number(v) for v in items):
        raise ConfigError(f'{where("scales")} must be positive numbers, e.g. 0.75 1.0 1.25, '
                          f'got {scales!r}.')
    for name in ('crop_size', 'stride'):
        value = getattr(options, name)
        if value is None:
            if options.is_slide:
                raise ConfigError(f'--is_slide needs --{name} WIDTH HEIGHT (or '
                                  f'test_config.{name}): add it, e.g. --crop_size 1024 512 '
                                  '--stride 768 384.')
            continue
        if (not isinstance(value, (list, tuple)) or len(value) != 2 or
                not all(_positive_int(v) for v in value)):
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


def _positive_number(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and
            math.isfinite(value) and value > 0)


def _positive_int(value):
    return is_integer(value, 1)


def _check_positive(where, **values):
    for name, value in values.items():
        if not _positive_int(value):
            raise ConfigError(f'{where(name)} must be a positive integer, got {value!r}.')


def _check_not_negative(where, **values):
    """Raises ConfigError unless each ``name=(value, what 0 means)`` is an int >= 0."""
    for name, (value, zero) in values.items():
        if not is_integer(value, 0):
            raise ConfigError(f'{where(name)} must be 0 ({zero}) or a positive integer, got '
                              f'{value!r}.')


@dataclass(frozen=True)
class EvalOptions:
    """An evaluation job: val.py's flags over the config's test_config.

    Args:
        inference (InferenceOptions): how each image is inferred. Default: the whole
            image, fp32.
        num_workers (int): DataLoader workers. Default: 0.
        save_dir (str): also write the predictions (and, from val.py, the figures)
            there. Default: None.
        print_detail (bool): show PaddleSeg's progress bar (rank 0) and log the
            [EVAL] lines. Default: True.

    Raises:
        ConfigError: for a bad value, naming its flag.
    """
    inference: InferenceOptions = InferenceOptions()
    num_workers: int = 0
    save_dir: Optional[str] = None
    print_detail: bool = True

    def __post_init__(self):
        _check_not_negative(_flag, num_workers=(self.num_workers, 'load in the main process'))

    @classmethod
    def from_flags(cls, flags, test_config=None):
        """val.py's flags (by field name; the inference ones as
        :meth:`InferenceOptions.from_flags` takes them) over ``test_config``."""
        own = {f.name for f in fields(cls)} - {'inference'}
        inference = InferenceOptions.from_flags(
            {k: v for k, v in flags.items() if k not in own}, test_config, '--aug_eval')
        return cls(inference=inference, **{k: v for k, v in flags.items() if k in own})


RESUME_AUTO = 'auto'  # --resume_model auto: the newest checkpoint of --save_dir that loads
# Keys that name where files are, not what is trained: a moved dataset resumes.
_WHERE_KEYS = ('dataset_root', 'train_path', 'val_path', 'pretrained')


def training_recipe(config, iters, batch_size):
    """What a checkpoint records of a config: the model, loss, optimizer, LR schedule,
    training data and its transforms, iters and batch_size (not file locations).

    Args:
        config (dict): a loaded config's sections (``cfg.dic``).
        iters (int): the run's iterations (the flag's or the config's).
        batch_size (int): the run's images per process.

    Returns:
        dict: JSON-able.
    """
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
    """``key: saved -> current`` for every config key (dotted, with list indices) whose
    value differs between two :func:`training_recipe` records."""
    saved, current = _flatten(saved), _flatten(current)
    missing = object()
    return [f'{key}: {saved.get(key, "(none)")} -> {current.get(key, "(none)")}'
            for key in sorted(set(saved) | set(current))
            if saved.get(key, missing) != current.get(key, missing)]


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
        use_vdl (bool): write VisualDL scalars and evaluation figures to save_dir.
            Default: False.
        resume_model (str): an iter_N folder to continue from; ``'auto'``: the newest
            checkpoint in save_dir that loads, else start (the same command can be run
            again after any stop). Default: None.
        seed (int): base seed of augmentation and Dropout; None draws one (a resumed
            run takes the checkpoint's). Default: None.
        overwrite (bool): delete the checkpoints of another run in save_dir (or,
            resuming, those after resume_model) instead of refusing it. Default: False.
        sync_bn (bool): SyncBatchNorm when training on more than one GPU. Default: True.
        recipe_batch_size (int): images per step of the config's recipe (its batch_size
            on one card); with more than one process the start-of-training log line
            says which batch_size gives it. Default: None.
        evaluation (EvalOptions): the evaluations (``evaluation.inference``: the
            config's test_config), with what they share with the training loop:
            ``num_workers`` (DataLoader workers per process) and the precision of
            every forward (``inference.precision``, ``inference.amp_level``; for
            training 'fp16' is autocast + GradScaler, GPU only). Read them as
            ``options.num_workers``, ``options.precision``, ``options.amp_level``.
            Default: ``EvalOptions()``: no workers, fp32.
        device (str): 'cpu' or 'gpu' for :func:`~psanet.core.train.train_from_config`;
            None: the GPU when Paddle sees one. Default: None.
        do_eval (bool): ``train_from_config`` builds the val dataset and evaluates
            every save_interval. Default: False.
        config (str): the config file the run was built from, for train.log. Default: None.
        recipe (dict): what a checkpoint records of the config to tell another run's
            (:func:`training_recipe`; ``from_config`` fills it). Default: None.
        named_by (callable, optional): field name -> how a message names it
            (``from_config`` passes the flag or the config key); not stored.
            Default: ``--<name>``.

    Raises:
        ConfigError: for a value out of range, naming its flag.
    """
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
        schedule = {name: getattr(self, name) for name in ('iters', 'batch_size')
                    if getattr(self, name) is not None}
        _check_positive(where, **schedule, save_interval=self.save_interval,
                        log_iters=self.log_iters)
        _check_not_negative(where, keep_checkpoint_max=(self.keep_checkpoint_max,
                                                        'keep every checkpoint'))
        if self.seed is not None and (not is_integer(self.seed, 0) or self.seed >= SEED_LIMIT):
            raise ConfigError(f'--seed must be an integer from 0 to {SEED_LIMIT - 1} (what numpy '
                              f'and Paddle accept), got {self.seed!r}.')
        if self.resume_model == RESUME_AUTO and self.overwrite:
            raise ConfigError('--resume_model auto continues the run in --save_dir and '
                              '--overwrite deletes it: a re-run of the command would start over '
                              'each time. Drop --overwrite (or --resume_model auto).')

    @property
    def num_workers(self):
        """DataLoader workers per process, of training and evaluations alike."""
        return self.evaluation.num_workers

    @property
    def precision(self):
        """'fp32' or 'fp16', of training and evaluations alike."""
        return self.evaluation.inference.precision

    @property
    def amp_level(self):
        """'O1' or 'O2' with fp16."""
        return self.evaluation.inference.amp_level

    @classmethod
    def from_config(cls, cfg, num_workers=0, precision='fp32', amp_level='O1', **flags):
        """train.py's flags over ``cfg`` (a :func:`~psanet.core.config.load_config` result).

        ``iters`` and ``batch_size`` are the flags' when given, else the config's;
        ``sync_bn``, the recipe's batch_size and the evaluations' test_config come
        from the config; a bad value is named by its flag or by its config key.

        Args:
            cfg (psanet.core.config.LoadedConfig): the config, with --opts applied.
            num_workers (int, optional): train.py's --num_workers. Default: 0.
            precision (str, optional): train.py's --precision. Default: 'fp32'.
            amp_level (str, optional): train.py's --amp_level. Default: 'O1'.
            **flags: train.py's other flags, by field name; None for iters and
                batch_size takes the config's.
        """
        from_config = {name: cfg.dic.get(name) for name in ('iters', 'batch_size')
                       if flags.get(name) is None}
        evaluation = EvalOptions.from_flags(
            {'num_workers': num_workers, 'precision': precision, 'amp_level': amp_level},
            cfg.dic.get('test_config'))

        def named_by(name):
            return f'config {cfg.path}: {name}' if name in from_config else f'--{name}'

        schedule = {**flags, **from_config}
        return cls(**schedule, sync_bn=bool(cfg.dic.get('sync_bn', True)),
                   recipe_batch_size=cfg.recipe_batch_size,
                   evaluation=evaluation, config=cfg.path,
                   recipe=training_recipe(cfg.dic, schedule.get('iters'),
                                          schedule.get('batch_size')),
                   named_by=named_by)

    def check_schedule(self):
        """Raises ConfigError unless iters and batch_size are set."""
        missing = [name for name in ('iters', 'batch_size') if getattr(self, name) is None]
        if missing:
            raise ConfigError(f'training needs {" and ".join(missing)}: set them in the config '
                              f'or with --{" --".join(missing)}.')
