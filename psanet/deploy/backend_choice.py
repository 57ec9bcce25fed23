"""The backend an export runs in when none is named: on the CPU the fastest candidate, timed.

:func:`default_runner` loads each installed backend that can run the export
(:func:`psanet.deploy.backends.cpu_candidates`), runs each on a random batch of the size
it will meet (``WARMUP_RUNS`` untimed, then up to ``TIMED_RUNS`` timed, the backends taking
turns), keeps the runner with the lowest median, logs one line, and remembers the choice in
``backend_choice.json`` under ``$PSANET_CACHE_DIR`` (default ``~/.cache/psanet``), keyed by
what changes the ranking, so that the next load builds that runner alone. The GPU, one
candidate or ``PSANET_TIME_BACKENDS=0`` take the fixed order
(``CPU_ORDER``, ``INT8_ORDER``). Why and what it costs: docs/deploy.md, "Which backend by
default".
"""
import hashlib
import importlib.metadata
import json
import os
import platform
import time

import numpy as np

from psanet.errors import DeployError
from psanet.files import write_file_whole
from psanet.log import get_logger

from . import backends
from .attention_memory import check_batch_memory

__all__ = ['CACHE_ENV', 'TIMING_ENV', 'CACHE_FILE', 'WARMUP_RUNS', 'TIMED_RUNS',
           'TIMING_BUDGET_S', 'DYNAMIC_SIZE', 'cache_path', 'timing_wanted', 'timing_shape',
           'choice_key', 'default_runner', 'time_runners']

CACHE_ENV = 'PSANET_CACHE_DIR'
TIMING_ENV = 'PSANET_TIME_BACKENDS'  # 0, false, no or off: the fixed order, no timing
CACHE_FILE = 'backend_choice.json'
WARMUP_RUNS = 1
TIMED_RUNS = 3
# Once the timed runs have taken this long, no further round starts: a large model on a slow
# CPU is timed once per backend (after its warm-up), not three times.
TIMING_BUDGET_S = 20.0
# The (width, height) a dynamic export is timed at: Cityscapes' images at half size, the size
# Paddle Inference's TensorRT ranges are tuned for (predictor.py).
DYNAMIC_SIZE = (1024, 512)
# What another version of these changes in the ranking is a new key.
_DISTRIBUTIONS = {'paddle': ('paddlepaddle', 'paddlepaddle-gpu'),
                  'onnxruntime': ('onnxruntime', 'onnxruntime-gpu', 'onnxruntime-openvino'),
                  'openvino': ('openvino',)}
_CACHE_VERSION = 1


def cache_path():
    """``backend_choice.json`` in ``$PSANET_CACHE_DIR``, or in ``~/.cache/psanet``."""
    folder = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser('~'), '.cache',
                                                        'psanet')
    return os.path.join(folder, CACHE_FILE)


def timing_wanted():
    """True unless $PSANET_TIME_BACKENDS says off (0, false, no or off)."""
    return os.environ.get(TIMING_ENV, '1').strip().lower() not in ('0', 'false', 'no', 'off')


def timing_shape(deploy, batch_size):
    """``[N, 3, H, W]`` the candidates are timed on: the export's fixed dimensions, the
    pipeline's batch size and ``DYNAMIC_SIZE`` for the dynamic ones."""
    n, c, h, w = deploy.input_shape
    return [n if n > 0 else batch_size, 3, h if h > 0 else DYNAMIC_SIZE[1],
            w if w > 0 else DYNAMIC_SIZE[0]]


def _version(backend):
    for name in _DISTRIBUTIONS[backend]:
        try:
            return f'{name} {importlib.metadata.version(name)}'
        except importlib.metadata.PackageNotFoundError:
            continue
    return 'unknown'


def _cpu_model():
    try:
        with open('/proc/cpuinfo', errors='replace') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _file_digest(path, files):
    """SHA-256 of a file; ``files`` remembers it by real path, size and mtime, so that an
    unchanged file is read once, not at each load."""
    real, stat = os.path.realpath(path), os.stat(path)
    seen = files.get(real)
    if isinstance(seen, dict) and seen.get('size') == stat.st_size and \
            seen.get('mtime_ns') == stat.st_mtime_ns and isinstance(seen.get('sha256'), str):
        return seen['sha256']
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            digest.update(chunk)
    files[real] = {'size': stat.st_size, 'mtime_ns': stat.st_mtime_ns,
                   'sha256': digest.hexdigest()}
    return digest.hexdigest()


def _export_digest(deploy, int8, candidates, files):
    """SHA-256 (16 hex digits) of deploy.yaml and the model files the candidates read."""
    paths = [deploy.path]
    if 'paddle' in candidates:
        paths += [deploy.model, deploy.params]
    if any(backend != 'paddle' for backend in candidates):
        paths.append(deploy.onnx_int8 if int8 else deploy.onnx)
    digest = hashlib.sha256()
    for path in paths:
        if path is not None and os.path.isfile(path):  # else create_runner names it
            digest.update(f'{os.path.basename(path)} {_file_digest(path, files)}\n'.encode())
    return digest.hexdigest()[:16]


def choice_key(deploy, candidates, options, int8, shape, files=None):
    """What the ranking of ``candidates`` depends on, as a dict (the cache's key); ``files``
    as :func:`_file_digest`'s."""
    files = {} if files is None else files
    return {'export': _export_digest(deploy, int8, candidates, files), 'int8': bool(int8),
            'input_shape': list(shape), 'cpu_threads': options.cpu_threads,
            'onednn': bool(options.enable_mkldnn) if 'paddle' in candidates else None,
            'backends': {backend: _version(backend) for backend in candidates},
            'cpu': _cpu_model()}


def _key_digest(key):
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _read_cache(path):
    """The cache's ``{'choices': {key digest: record}, 'files': {path: digest record}}``;
    empty for none, and for an unreadable one after a warning line."""
    empty = {'choices': {}, 'files': {}}
    if not os.path.exists(path):
        return empty
    try:
        with open(path, encoding='utf-8') as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get('version') != _CACHE_VERSION or \
                not all(isinstance(data.get(part), dict) for part in empty):
            raise ValueError('not a backend choice cache of this version')
        return {part: data[part] for part in empty}
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError too
        get_logger().warning(f'the backend choice cache {path} cannot be read ({error}): '
                             'timing the backends again; it is rewritten after the timing.')
        return empty


def _write_cache(path, cache):
    def write(temporary):
        with open(temporary, 'w', encoding='utf-8') as f:
            json.dump(dict(cache, version=_CACHE_VERSION), f, indent=1, sort_keys=True)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_file_whole(path, write)
    except Exception as error:  # OSError, or the DiskFullError write_file_whole makes of one
        get_logger().warning(f'the backend choice cannot be saved in {path} ({error}): the next '
                             f'load times the backends again; set {CACHE_ENV} to a folder you '
                             'can write.')


def _cached(choices, digest, candidates):
    record = choices.get(digest)
    if isinstance(record, dict) and record.get('backend') in candidates and \
            isinstance(record.get('ms'), dict):
        return record
    return None


def time_runners(runners, batch, warmup=WARMUP_RUNS, runs=TIMED_RUNS, budget_s=TIMING_BUDGET_S):
    """``{name: [ms, ...]}`` of each runner on ``batch``: ``warmup`` untimed runs each, then
    rounds of one timed run each, the runners taking turns, until ``runs`` rounds or
    ``budget_s`` seconds of timed runs (at least one round)."""
    for runner in runners.values():
        for _ in range(warmup):
            runner.run(batch)
    times = {name: [] for name in runners}
    spent = 0.0
    for _ in range(runs):
        for name, runner in runners.items():
            start = time.perf_counter()
            runner.run(batch)
            elapsed = time.perf_counter() - start
            times[name].append(elapsed * 1000.0)
            spent += elapsed
        if spent >= budget_s:
            break
    return times


def _describe(ms):
    return ', '.join(f'{name} {value:.1f} ms' for name, value in
                     sorted(ms.items(), key=lambda item: item[1]))


def default_runner(deploy, options, int8=False, batch_size=1, shape=None):
    """``(backend, runner)`` of ``deploy`` when no backend is named.

    On the CPU with two or more candidates and timing wanted (:func:`timing_wanted`): the
    one with the lowest median time on a batch of ``shape`` (default :func:`timing_shape`),
    read from the cache when this key was timed before; else
    :func:`psanet.deploy.backends.default_backend`.
    """
    candidates = backends.cpu_candidates(deploy, int8) if options.device == 'cpu' else []
    if len(candidates) < 2 or not timing_wanted():
        backend = backends.default_backend(deploy, options.device, int8)
        return backend, backends.create_runner(deploy, backend, options, int8)
    logger = get_logger()
    shape = list(shape) if shape is not None else timing_shape(deploy, batch_size)
    if deploy.attention_cost is not None:
        try:
            check_batch_memory(deploy.attention_cost, shape)
        except DeployError:
            backend = candidates[0]
            logger.warning(f'the backends are not timed: the attention maps of a '
                           f'{shape[3]}x{shape[2]} input (batch {shape[0]}) would not fit in '
                           f'the host memory available; running {backend}, the first '
                           'installed of the fixed order.')
            return backend, backends.create_runner(deploy, backend, options, int8)
    path = cache_path()
    cache = _read_cache(path)
    files = json.dumps(cache['files'], sort_keys=True)
    key = choice_key(deploy, candidates, options, int8, shape, cache['files'])
    digest = _key_digest(key)
    record = _cached(cache['choices'], digest, candidates)
    what = (f'{deploy.dir}{" (INT8)" if int8 else ""} at {"x".join(map(str, shape))}, '
            f'{options.cpu_threads} thread(s)')
    if record is not None:
        backend = record['backend']
        logger.info(f'backend {backend} for {what}, the fastest when timed before '
                    f'({_describe(record["ms"])}; {path}).')
        if json.dumps(cache['files'], sort_keys=True) != files:  # a copy of a timed export
            _write_cache(path, cache)
        return backend, backends.create_runner(deploy, backend, options, int8)
    runners = {backend: backends.create_runner(deploy, backend, options, int8)
               for backend in candidates}
    batch = np.random.RandomState(0).standard_normal(shape).astype('float32')
    times = time_runners(runners, batch)
    ms = {name: float(np.median(values)) for name, values in times.items()}
    backend = min(ms, key=ms.get)
    rounds = len(next(iter(times.values())))
    logger.info(f'backend {backend} for {what}, the fastest timed: {_describe(ms)} (median of '
                f'{rounds} run(s) each after {WARMUP_RUNS} warm-up; remembered in {path}).')
    cache['choices'][digest] = {'key': key, 'backend': backend, 'ms': ms,
                                'timed_at': time.strftime('%Y-%m-%dT%H:%M:%S')}
    _write_cache(path, cache)
    return backend, runners[backend]
