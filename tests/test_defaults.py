"""One default per option: each read from the command line (the script's argparse) and from the
API (signatures, options dataclasses, what a call passes on) and compared. Where the two differ
on purpose, DIFFERENCES holds the reason, and the API's docstring must say it."""
import dataclasses
import importlib.util
import inspect
import os
import re

import pytest

import export as export_script
import predict as predict_script
import serve as serve_script
import train as train_script
import val as val_script
from conftest import INFER_SCRIPT
from psanet import Segmenter
from psanet.core import predict as core_predict
from psanet.core.options import (DYGRAPH_PRECISIONS, EvalOptions, InferenceOptions,
                                 TrainOptions)
from psanet.core.val import evaluate_from_config
from psanet.deploy.infer_images import infer
from psanet.deploy.predictor import PRECISIONS, PredictorOptions
from psanet.errors import ConfigError, DeployError
from psanet.export import ExportOptions, export_from_config
from psanet.serve.app import ServeOptions

SERVE_OPTIONS = ('model_path', 'backend', 'device', 'int8', 'cpu_threads', 'host', 'port',
                 'max_batch', 'max_wait_ms', 'max_queue', 'max_body_bytes', 'max_pixels',
                 'graceful_timeout_s', 'request_timeout_s', 'warmup_size', 'model_name',
                 'auth_token_file', 'ssl_certfile', 'ssl_keyfile')


def _infer_cli():
    spec = importlib.util.spec_from_file_location('infer_script', INFER_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return vars(script.parse_args(['--config', 'c', '--image_path', 'i']))


def _fields(cls):
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}


def _signature(function):
    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _dygraph_api(monkeypatch):
    """What Segmenter.from_config(backend='dygraph') passes on when given no options."""
    passed = {}

    def runner(config, weights, inference, device):
        passed['device'] = device
        return object(), None

    monkeypatch.setattr(core_predict, 'dygraph_runner', runner)
    segmenter = Segmenter.from_config('config.yml', 'model.pdparams', backend='dygraph')
    return {**passed, 'batch_size': segmenter.batch_size}


def _defaults(monkeypatch):
    """name -> (command line default, API default, the API's docstring)."""
    infer_cli = _infer_cli()
    predict_cli = vars(predict_script.parse_args(['--config', 'c', '--model_path', 'm',
                                                  '--image_path', 'i']))
    val_cli = vars(val_script.parse_args(['--config', 'c', '--model_path', 'm']))
    train_cli = vars(train_script.parse_args(['--config', 'c']))
    export_cli = vars(export_script.parse_args(['--config', 'c']))
    from_export = Segmenter.from_export
    export_api, predictor = _signature(from_export), _fields(PredictorOptions)
    infer_api, dygraph = _signature(infer), _dygraph_api(monkeypatch)
    train_options, eval_options = _fields(TrainOptions), _fields(EvalOptions)
    inference_options, export_options = _fields(InferenceOptions), _fields(ExportOptions)
    rows = {}
    # An export: infer.py, its infer(), PredictorOptions and Segmenter.from_export.
    for name in ('device', 'cpu_threads', 'enable_mkldnn', 'batch_size', 'backend'):
        rows[f'infer.py --{name} / Segmenter.from_export'] = (
            infer_cli[name], export_api[name], from_export.__doc__)
    for name in ('device', 'use_trt', 'precision', 'enable_mkldnn', 'cpu_threads',
                 'print_detail'):
        rows[f'infer.py --{name} / PredictorOptions'] = (
            infer_cli[name], predictor[name], PredictorOptions.__doc__)
    for name in ('save_dir', 'batch_size', 'benchmark', 'model_name', 'backend'):
        rows[f'infer.py --{name} / infer()'] = (infer_cli[name], infer_api[name], infer.__doc__)
    # The dygraph model: predict.py, val.py, train.py and Segmenter.from_config(backend='dygraph').
    for script, cli in (('predict.py', predict_cli), ('val.py', val_cli),
                        ('train.py', train_cli)):
        rows[f'{script} --device / Segmenter.from_config dygraph'] = (
            cli['device'], dygraph['device'], Segmenter.from_config.__doc__)
    rows['predict.py --device / predict_from_config'] = (
        predict_cli['device'], _signature(core_predict.predict_from_config)['device'], None)
    rows['predict.py --save_dir / predict_from_config'] = (
        predict_cli['save_dir'], _signature(core_predict.predict_from_config)['save_dir'], None)
    rows['val.py --device / evaluate_from_config'] = (
        val_cli['device'], _signature(evaluate_from_config)['device'], None)
    rows['train.py --device / TrainOptions'] = (train_cli['device'], train_options['device'],
                                                None)
    for script, cli in (('val.py', val_cli), ('train.py', train_cli)):
        for name in ('precision', 'amp_level'):
            rows[f'{script} --{name} / InferenceOptions'] = (cli[name], inference_options[name],
                                                              None)
            rows[f'{script} --{name} / TrainOptions.from_config'] = (
                cli[name], _signature(TrainOptions.from_config)[name], None)
        rows[f'{script} --num_workers / EvalOptions'] = (cli['num_workers'],
                                                         eval_options['num_workers'], None)
    rows['val.py --save_dir / EvalOptions'] = (val_cli['save_dir'], eval_options['save_dir'],
                                               None)
    for name in ('save_dir', 'save_interval', 'log_iters', 'keep_checkpoint_max', 'use_vdl',
                 'resume_model', 'seed', 'overwrite', 'do_eval', 'iters', 'batch_size'):
        rows[f'train.py --{name} / TrainOptions'] = (train_cli[name], train_options[name], None)
    # An export's files: export.py, ExportOptions and export_from_config.
    for name in ('input_shape', 'output_op', 'psa_impl', 'onnx', 'quantize', 'calib_images',
                 'calib_num'):
        rows[f'export.py --{name} / ExportOptions'] = (export_cli[name], export_options[name],
                                                       None)
    for name in ('save_dir', 'check_image_path', 'opts'):
        rows[f'export.py --{name} / export_from_config'] = (
            export_cli[name], _signature(export_from_config)[name], None)
    # The server: serve.py, ServeOptions, and the API it passes an export's options on to
    # (its device None is the API's own default for the route, so it is not passed).
    serve_cli = vars(serve_script.parse_args(['--config', 'c']))
    serve_options = _fields(ServeOptions)
    for name in SERVE_OPTIONS:
        rows[f'serve.py --{name} / ServeOptions'] = (serve_cli[name], serve_options[name], None)
    for name in ('backend', 'cpu_threads', 'int8'):
        rows[f'serve.py --{name} / Segmenter.from_export'] = (
            serve_cli[name], export_api[name], from_export.__doc__)
    return rows


# name -> the reason, as the API's docstring says it.
DIFFERENCES = {
    'infer.py --enable_mkldnn / Segmenter.from_export':
        "infer.py's --enable_mkldnn keeps PaddleSeg's False (so that a PaddleSeg command line "
        "runs the same); oneDNN is 1.6x faster",
    'infer.py --backend / Segmenter.from_export':
        'the fastest installed one that runs the export',
}

NAMES = [
    *(f'infer.py --{n} / Segmenter.from_export'
      for n in ('device', 'cpu_threads', 'enable_mkldnn', 'batch_size', 'backend')),
    *(f'infer.py --{n} / PredictorOptions'
      for n in ('device', 'use_trt', 'precision', 'enable_mkldnn', 'cpu_threads',
                'print_detail')),
    *(f'infer.py --{n} / infer()'
      for n in ('save_dir', 'batch_size', 'benchmark', 'model_name', 'backend')),
    *(f'{s} --device / Segmenter.from_config dygraph' for s in ('predict.py', 'val.py',
                                                                'train.py')),
    'predict.py --device / predict_from_config', 'predict.py --save_dir / predict_from_config',
    'val.py --device / evaluate_from_config', 'train.py --device / TrainOptions',
    *(f'{s} --{n} / {o}' for s in ('val.py', 'train.py') for n in ('precision', 'amp_level')
      for o in ('InferenceOptions', 'TrainOptions.from_config')),
    'val.py --num_workers / EvalOptions', 'train.py --num_workers / EvalOptions',
    'val.py --save_dir / EvalOptions',
    *(f'train.py --{n} / TrainOptions'
      for n in ('save_dir', 'save_interval', 'log_iters', 'keep_checkpoint_max', 'use_vdl',
                'resume_model', 'seed', 'overwrite', 'do_eval', 'iters', 'batch_size')),
    *(f'export.py --{n} / ExportOptions'
      for n in ('input_shape', 'output_op', 'psa_impl', 'onnx', 'quantize', 'calib_images',
                'calib_num')),
    *(f'export.py --{n} / export_from_config' for n in ('save_dir', 'check_image_path', 'opts')),
    *(f'serve.py --{n} / ServeOptions' for n in SERVE_OPTIONS),
    *(f'serve.py --{n} / Segmenter.from_export' for n in ('backend', 'cpu_threads', 'int8')),
]


@pytest.fixture(scope='module')
def defaults():
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield _defaults(monkeypatch)


def test_every_default_read_is_checked(defaults):
    assert sorted(defaults) == sorted(NAMES)
    assert set(DIFFERENCES) <= set(NAMES)
    assert set(SERVE_OPTIONS) == set(_fields(ServeOptions)), 'a ServeOptions field is unchecked'


@pytest.mark.parametrize('name', NAMES)
def test_the_command_line_and_the_api_have_one_default(defaults, name):
    cli, api, doc = defaults[name]
    if name not in DIFFERENCES:
        assert cli == api, f'{name}: the command line defaults to {cli!r}, the API to {api!r}'
        return
    assert cli != api, f'{name}: both default to {cli!r} now; drop it from DIFFERENCES'
    assert DIFFERENCES[name] in ' '.join(doc.split()), \
        f'{name}: the docstring does not give the reason for {cli!r} / {api!r}'


def test_the_dygraph_device_is_the_gpu_when_paddle_sees_one(defaults):
    # None: set_device's "the GPU when Paddle sees one, else the CPU", as PaddleSeg's predict.py.
    assert defaults['predict.py --device / Segmenter.from_config dygraph'][:2] == (None, None)


def test_cpu_threads_not_given_are_paddlesegs_ten_or_the_usable_cpus():
    want = min(10, len(os.sched_getaffinity(0)))
    assert PredictorOptions().cpu_threads == want
    assert PredictorOptions(device='gpu').cpu_threads == want


def test_one_list_of_precisions_the_dygraph_model_takes_its_float_ones(capsys):
    assert DYGRAPH_PRECISIONS == ('fp32', 'fp16') and set(DYGRAPH_PRECISIONS) < set(PRECISIONS)
    for script, argv in ((train_script, ['--config', 'c']),
                         (val_script, ['--config', 'c', '--model_path', 'm'])):
        for precision in DYGRAPH_PRECISIONS:
            assert script.parse_args(argv + ['--precision', precision]).precision == precision
        with pytest.raises(SystemExit):
            script.parse_args(argv + ['--precision', 'int8'])
        assert "invalid choice: 'int8' (choose from 'fp32', 'fp16')" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="precision must be one of fp32 or fp16, got 'int8'"):
        InferenceOptions(precision='int8')
    with pytest.raises(DeployError, match=re.escape(f'must be one of {PRECISIONS}')):
        PredictorOptions(precision='int4')
