"""The backend psanet.Segmenter picks when none is named (psanet.deploy.backend_choice): on the
CPU the candidate that ran fastest, timed with stand-in runners that sleep (so which one is
slow is certain; test_segmenter.py times the real ones); the choice remembered on disk and
read back without a run, timed again for another export, size, batch, threads, oneDNN,
backend version or CPU; a corrupt or unwritable cache one warning line; a named backend, the
GPU, one candidate and PSANET_TIME_BACKENDS=0 never time."""
import hashlib
import json
import logging
import os
import re
import shutil
import time

import numpy as np
import pytest
import yaml

from psanet import Segmenter
from psanet.deploy import backend_choice, backends, predictor
from psanet.deploy.deploy_config import DeployConfig
from psanet.deploy.pipeline import Pipeline
from psanet.deploy.predictor import PredictorOptions
from psanet.log import get_logger

SLOW_S = 0.03  # what a slow stand-in sleeps per run: far above a run that does nothing
SHAPE = [-1, 3, 32, 64]


class StandIns:
    """``create_runner`` for every backend: runners that return at once, or after SLOW_S;
    ``created`` lists the backends built, ``runs`` each run as (backend, batch shape)."""

    def __init__(self, slow):
        self.slow, self.created, self.runs = set(slow), [], []

    def create_runner(self, deploy, backend, options=None, int8=False):
        self.created.append(backend)
        stand_ins = self

        class Runner:
            def run(self, batch):
                stand_ins.runs.append((backend, list(batch.shape)))
                if backend in stand_ins.slow:
                    time.sleep(SLOW_S)
                return np.zeros((len(batch), 2) + batch.shape[2:], 'float32')
        return Runner()


def linked_export(source, folder, **entries):
    """``folder`` as a copy of the export folder ``source``: deploy.yaml copied with
    ``entries`` set in its Deploy section, the model files linked."""
    os.makedirs(folder)
    for name in os.listdir(source):
        if name != 'deploy.yaml':
            os.symlink(os.path.join(source, name), os.path.join(folder, name))
    shutil.copy(os.path.join(source, 'deploy.yaml'), folder)
    _edit(folder, **entries)
    return str(folder)


def _edit(folder, **entries):
    """Sets ``entries`` in the Deploy section of ``folder``'s deploy.yaml."""
    path = os.path.join(folder, 'deploy.yaml')
    with open(path) as f:
        dic = yaml.safe_load(f)
    dic['Deploy'].update(entries)
    with open(path, 'w') as f:
        yaml.safe_dump(dic, f)


@pytest.fixture
def export(mini_export, tmp_path, monkeypatch):
    """The mini export, its deploy.yaml naming a model.onnx (the stand-ins run no file) and a
    fixed 64x32 input; every backend installed, the cache in tmp_path/cache."""
    folder = linked_export(os.path.dirname(mini_export), tmp_path / 'export',
                           onnx='model.onnx', input_shape=SHAPE)
    monkeypatch.setattr(backends, 'installed', lambda backend: True)
    monkeypatch.setenv(backend_choice.CACHE_ENV, str(tmp_path / 'cache'))
    monkeypatch.delenv(backend_choice.TIMING_ENV, raising=False)
    return folder


@pytest.fixture
def logged():
    """The psanet logger's records from INFO on, as (level, message)."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append((record.levelname, record.getMessage()))
    logger = get_logger()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def _load(export, monkeypatch, slow, batch_size=1, cpu_threads=1, **options):
    stand_ins = StandIns(slow)
    monkeypatch.setattr(backends, 'create_runner', stand_ins.create_runner)
    seg = Segmenter.from_export(export, batch_size=batch_size, cpu_threads=cpu_threads,
                                **options)
    return seg, stand_ins


def _cache(tmp_path, part='choices'):
    with open(tmp_path / 'cache' / backend_choice.CACHE_FILE) as f:
        return json.load(f)[part]


def _sha256(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize('fast', ['onnxruntime', 'paddle', 'openvino'])
def test_the_fastest_candidate_is_chosen_logged_and_cached(export, tmp_path, monkeypatch,
                                                           logged, fast):
    slow = {'paddle', 'onnxruntime', 'openvino'} - {fast}
    seg, stand_ins = _load(export, monkeypatch, slow)
    assert seg.backend == fast and seg.runner is not None
    assert stand_ins.created == list(backends.CPU_ORDER)
    # A warm-up run each, then the timed runs, the backends taking turns, on the export's size.
    runs = backend_choice.WARMUP_RUNS + backend_choice.TIMED_RUNS
    assert stand_ins.runs == [(b, [1, 3, 32, 64]) for b in backends.CPU_ORDER
                              for _ in range(backend_choice.WARMUP_RUNS)] + \
        [(b, [1, 3, 32, 64]) for _ in range(backend_choice.TIMED_RUNS)
         for b in backends.CPU_ORDER]
    assert len(stand_ins.runs) == 3 * runs
    line, = [message for level, message in logged if message.startswith('backend ')]
    times = dict(re.findall(r'(\w+) (\d+\.\d) ms', line))
    assert line.startswith(f'backend {fast} for {os.path.abspath(export)} at 1x3x32x64, '
                           '1 thread(s), the fastest timed: '), line
    assert set(times) == {'paddle', 'onnxruntime', 'openvino'}
    assert all(float(times[b]) >= SLOW_S * 1000 for b in slow), line  # they did sleep
    choices = _cache(tmp_path)
    (record,) = choices.values()
    assert record['backend'] == fast
    assert record['key']['input_shape'] == [1, 3, 32, 64] and record['key']['cpu_threads'] == 1
    assert set(record['ms']) == set(backends.CPU_ORDER)


def test_the_next_load_reads_the_choice_and_runs_nothing(export, tmp_path, monkeypatch, logged):
    first, _ = _load(export, monkeypatch, {'openvino', 'paddle'})
    before = _cache(tmp_path)
    files = {os.path.realpath(os.path.join(export, name)) for name in
             ('deploy.yaml', 'model.json', 'model.pdiparams')}
    assert {path: record['sha256'] for path, record in _cache(tmp_path, 'files').items()} == \
        {path: _sha256(path) for path in files}
    opened = []
    monkeypatch.setattr(backend_choice, 'open', lambda path, *a, **k: opened.append(
        os.path.realpath(path)) or open(path, *a, **k), raising=False)
    seg, stand_ins = _load(export, monkeypatch, {'openvino', 'paddle'})
    assert (first.backend, seg.backend) == ('onnxruntime', 'onnxruntime')
    assert stand_ins.created == ['onnxruntime'] and stand_ins.runs == []
    assert not files & set(opened), opened  # the files' digests are remembered too
    assert _cache(tmp_path) == before
    assert logged[-1][1].startswith(f'backend onnxruntime for {os.path.abspath(export)} at '
                                    '1x3x32x64, 1 thread(s), the fastest when timed before '
                                    '(onnxruntime '), logged[-1]
    # A copy of the export elsewhere: its files read once, the choice found by their bytes.
    copy = linked_export(export, tmp_path / 'copy')
    seg, stand_ins = _load(copy, monkeypatch, {'openvino', 'paddle'})
    assert seg.backend == 'onnxruntime' and stand_ins.runs == []
    assert os.path.join(copy, 'deploy.yaml') in _cache(tmp_path, 'files')


@pytest.mark.parametrize('change', ['batch_size', 'size', 'cpu_threads', 'export', 'int8',
                                    'onednn', 'backend version', 'cpu'])
def test_another_size_batch_threads_or_export_is_timed_again(export, tmp_path, monkeypatch,
                                                             logged, change):
    first, _ = _load(export, monkeypatch, {'openvino', 'paddle'})
    options = {}
    monkeypatch.setattr(predictor, 'usable_cpus', lambda: 4)  # 2 threads on any CI machine
    if change == 'batch_size':
        options['batch_size'] = 2
    elif change == 'size':
        _edit(export, input_shape=[-1, 3, 48, 64])
    elif change == 'cpu_threads':
        options['cpu_threads'] = 2
    elif change == 'export':
        params = os.path.join(export, 'model.pdiparams')
        shutil.copy(os.path.realpath(params), params + '.copy')
        os.replace(params + '.copy', params)  # the link: the session's export stays as it is
        with open(params, 'r+b') as f:
            f.seek(-1, os.SEEK_END)  # other weights: the last byte of the last tensor
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
    elif change == 'int8':
        _edit(export, onnx_int8='model_int8.onnx')
        options['int8'] = True
    elif change == 'onednn':
        options['enable_mkldnn'] = False
    elif change == 'backend version':
        version = backend_choice._version
        monkeypatch.setattr(backend_choice, '_version', lambda backend: version(backend) + (
            '.1' if backend == 'openvino' else ''))
    else:
        monkeypatch.setattr(backend_choice, '_cpu_model', lambda: 'another CPU')
    seg, stand_ins = _load(export, monkeypatch, {'openvino', 'paddle'}, **options)
    assert seg.backend == 'onnxruntime'
    candidates = list(backends.INT8_ORDER if change == 'int8' else backends.CPU_ORDER)
    assert stand_ins.created == candidates
    assert len(stand_ins.runs) == len(candidates) * (backend_choice.WARMUP_RUNS +
                                                     backend_choice.TIMED_RUNS)
    want = [options.get('batch_size', 1), 3, 48 if change == 'size' else 32, 64]
    assert all(shape == want for _, shape in stand_ins.runs), stand_ins.runs
    assert len(_cache(tmp_path)) == 2  # both choices kept


@pytest.mark.parametrize('content', [b'{"version": 1, "choi', b'\xff\xfe\x00garbage',
                                     b'[1, 2]', b'{"version": 1, "choices": [1]}'])
def test_a_corrupt_cache_is_one_warning_and_is_rewritten(export, tmp_path, monkeypatch,
                                                         logged, content):
    path = tmp_path / 'cache' / backend_choice.CACHE_FILE
    path.parent.mkdir()
    path.write_bytes(content)
    seg, stand_ins = _load(export, monkeypatch, {'openvino', 'onnxruntime'})
    assert seg.backend == 'paddle' and len(stand_ins.runs) == 3 * (
        backend_choice.WARMUP_RUNS + backend_choice.TIMED_RUNS)
    warnings = [message for level, message in logged if level == 'WARNING']
    assert warnings == [f'the backend choice cache {path} cannot be read ('
                        + warnings[0].split(' cannot be read (', 1)[1]], warnings
    assert warnings[0].endswith('): timing the backends again; it is rewritten after the '
                                'timing.') and '\n' not in warnings[0]
    assert [record['backend'] for record in _cache(tmp_path).values()] == ['paddle']


def test_an_unwritable_cache_is_one_warning(export, tmp_path, monkeypatch, logged):
    blocker = tmp_path / 'a file'
    blocker.write_text('not a folder')
    monkeypatch.setenv(backend_choice.CACHE_ENV, str(blocker / 'cache'))
    seg, stand_ins = _load(export, monkeypatch, {'openvino', 'paddle'})
    assert seg.backend == 'onnxruntime' and stand_ins.runs
    warnings = [message for level, message in logged if level == 'WARNING']
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f'the backend choice cannot be saved in '
                                  f'{blocker / "cache" / backend_choice.CACHE_FILE} (')
    assert warnings[0].endswith(f'): the next load times the backends again; set '
                                f'{backend_choice.CACHE_ENV} to a folder you can write.')
    assert blocker.read_text() == 'not a folder'


@pytest.mark.parametrize('how', ['named', 'PSANET_TIME_BACKENDS=0', 'gpu', 'one candidate'])
def test_no_timing_when_named_off_on_the_gpu_or_alone(export, tmp_path, monkeypatch, logged,
                                                      how):
    want = backends.CPU_ORDER[0]
    stand_ins = StandIns({want})  # the fixed order's first is slow: no one may time it
    monkeypatch.setattr(backends, 'create_runner', stand_ins.create_runner)
    if how == 'named':
        seg = Segmenter.from_export(export, backend='paddle', cpu_threads=1)
        want = 'paddle'
    elif how == 'PSANET_TIME_BACKENDS=0':
        monkeypatch.setenv(backend_choice.TIMING_ENV, '0')
        seg = Segmenter.from_export(export, cpu_threads=1)
    elif how == 'gpu':
        seg = Pipeline.from_deploy(DeployConfig(export), None, PredictorOptions(device='gpu'))
        want = 'paddle'
    else:
        monkeypatch.setattr(backends, 'installed', lambda backend: backend == 'paddle')
        seg = Segmenter.from_export(export, cpu_threads=1)
        want = 'paddle'
    assert seg.backend == want
    # A named backend's runner is made by the pipeline itself, without the choice's.
    assert stand_ins.created == ([] if how == 'named' else [want]) and stand_ins.runs == []
    assert not (tmp_path / 'cache').exists()
    assert not [message for _, message in logged if message.startswith('backend ')]


