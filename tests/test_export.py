"""Export: one dynamic export agrees with the dygraph model in paddle.jit.load, the
inference predictor (oneDNN off and on) and onnxruntime at two input sizes; fixed
shapes, output ops, which graphs hold the custom op, and bad arguments. The ONNX tests
skip where paddle2onnx or onnxruntime is not installed, saying why."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import paddle
import pytest
import yaml

import psanet.models  # noqa: F401  (registers PSANet)
from psanet.deploy.deploy_config import DeployConfig, graph_holds_custom_op
from psanet.deploy.predictor import OnnxRunner, PaddleRunner, PredictorOptions
from psanet.errors import DeployError
from conftest import (MINI_CONFIG, MINI_PSANET_RTOL, ROOT, assert_logits_agree, needs_onnx,
                      clear_margin_pixels, run_process)
from engine_helpers import build_config_model
from psanet.export import ExportOptions, export_model, parse_input_shape

# Every backend here (jit.load, Paddle Inference with and without oneDNN, onnxruntime)
# adds the convolutions' sums in an order of its own: logits within MINI_PSANET_RTOL of
# the largest, argmax equal wherever the top two are clear of that (see conftest).
RTOL = MINI_PSANET_RTOL
# Two sizes for one dynamic export; neither is the training crop, and batch 2 on one.
SHAPES = [(1, 3, 64, 128), (2, 3, 80, 96)]




def build_mini_model():
    cfg, model = build_config_model(seed=0)
    model.eval()
    return cfg, model


def inputs(shape, seed=3):
    return np.random.RandomState(seed).uniform(-1, 1, shape).astype('float32')


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
    """The untrained mini model, its dygraph logits, and dynamic exports of both op forms."""
    cfg, model = build_mini_model()
    root = tmp_path_factory.mktemp('export')
    dirs = {
        'custom': str(root / 'custom'),
        'paddle': str(root / 'paddle'),
    }
    export_model(model, cfg.dic['val_dataset']['transforms'], dirs['custom'],
                 ExportOptions(output_op='none', psa_impl='custom'))
    export_model(model, cfg.dic['val_dataset']['transforms'], dirs['paddle'],
                 ExportOptions(output_op='none', psa_impl='paddle'))
    logits = {}
    with paddle.no_grad():
        for shape in SHAPES:
            logits[shape] = model(paddle.to_tensor(inputs(shape)))[0].numpy()
    return model, dirs, logits


@pytest.mark.parametrize('impl', ['custom', 'paddle'])
def test_jit_load_agrees_with_dygraph(exported, impl):
    _, dirs, logits = exported
    loaded = paddle.jit.load(os.path.join(dirs[impl], 'model'))
    loaded.eval()
    for shape in SHAPES:
        with paddle.no_grad():
            got = loaded(paddle.to_tensor(inputs(shape))).numpy()
        assert_logits_agree(got, logits[shape], RTOL, f'jit.load {impl} {shape}')


@pytest.mark.parametrize('impl', ['custom', 'paddle'])
@pytest.mark.parametrize('enable_mkldnn', [False, True])
def test_predictor_agrees_with_dygraph(exported, impl, enable_mkldnn):
    _, dirs, logits = exported
    runner = PaddleRunner(DeployConfig(dirs[impl]),
                          PredictorOptions(device='cpu', enable_mkldnn=enable_mkldnn,
                                           cpu_threads=1))
    for shape in SHAPES:
        got = runner.run(inputs(shape))
        assert_logits_agree(got, logits[shape], RTOL,
                            f'predictor {impl} mkldnn={enable_mkldnn} {shape}')


@pytest.mark.parametrize('impl', ['custom', 'paddle'])
def test_every_convolution_runs_in_onednn(exported, impl, tmp_path, monkeypatch):
    """With oneDNN on, a run's profile holds oneDNN convolutions only: none is left in
    Paddle's plain conv2d kernel (PSA's attention convolution, which has neither a bias
    nor a batch norm, is saved with a zero bias that a fusion pass takes); the dygraph
    model keeps no bias it did not have."""
    import paddle.profiler as profiler
    model, dirs, _ = exported
    bias_free = sorted(name for name, layer in model.named_sublayers()
                       if isinstance(layer, paddle.nn.Conv2D) and layer.bias is None)
    assert 'head.branches.0.attention.1' in bias_free
    runner = PaddleRunner(DeployConfig(dirs[impl]),
                          PredictorOptions(device='cpu', enable_mkldnn=True, cpu_threads=1))
    runner.run(inputs(SHAPES[0]))
    monkeypatch.chdir(tmp_path)
    tracer = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU])
    tracer.start()
    runner.run(inputs(SHAPES[0]))
    tracer.stop()
    tracer.export('profile.json', format='json')
    with open('profile.json') as f:
        events = json.load(f)
    ops = [re.sub(r'\[.*\]$', '', e['name']) for e in events['traceEvents']
           if e.get('cat') == 'Operator']
    # The eval graph: every Conv2D of the model but the auxiliary head's.
    convs = sum(isinstance(layer, paddle.nn.Conv2D) for name, layer in model.named_sublayers()
                if not name.startswith('head.auxlayer'))
    assert ops.count('pd_op.conv2d') == 0
    assert ops.count('onednn_op.fused_conv2d') == convs
    export_model(model, [{'type': 'Normalize'}], str(tmp_path / 'again'),
                 ExportOptions(output_op='none', psa_impl=impl))
    assert sorted(name for name, layer in model.named_sublayers()
                  if isinstance(layer, paddle.nn.Conv2D) and layer.bias is None) == bias_free


@pytest.fixture(scope='module')
def onnx_export(exported, tmp_path_factory):
    """The pure-Paddle export of the same model with model.onnx."""
    model = exported[0]
    folder = str(tmp_path_factory.mktemp('export') / 'onnx')
    export_model(model, build_config_model()[0].dic['val_dataset']['transforms'], folder,
                 ExportOptions(output_op='none', psa_impl='paddle', onnx=True))
    return folder


@needs_onnx
def test_onnxruntime_agrees_with_dygraph(exported, onnx_export):
    _, _, logits = exported
    with open(os.path.join(onnx_export, 'deploy.yaml')) as f:
        deploy = yaml.safe_load(f)['Deploy']
    assert os.path.isfile(os.path.join(onnx_export, deploy['onnx']))
    runner = OnnxRunner(DeployConfig(onnx_export))
    for shape in SHAPES:
        assert_logits_agree(runner.run(inputs(shape)), logits[shape], RTOL,
                            f'onnxruntime {shape}')


def test_deploy_yaml_names_what_was_exported(exported):
    _, dirs, _ = exported
    for impl in ('custom', 'paddle'):
        with open(os.path.join(dirs[impl], 'deploy.yaml')) as f:
            deploy = yaml.safe_load(f)['Deploy']
        assert deploy['psa_impl'] == impl
        assert deploy['output_op'] == 'none'
        assert deploy['input_shape'] == [-1, 3, -1, -1]
        assert deploy['transforms'] == build_config_model()[0].dic['val_dataset']['transforms']
        for key in ('model', 'params'):
            assert os.path.isfile(os.path.join(dirs[impl], deploy[key])), key
        assert 'onnx' not in deploy


def test_only_the_custom_export_holds_the_custom_op(exported):
    _, dirs, _ = exported
    assert graph_holds_custom_op(os.path.join(dirs['custom'], 'model.json'))
    assert not graph_holds_custom_op(os.path.join(dirs['paddle'], 'model.json'))
    assert DeployConfig(dirs['custom']).holds_custom_op
    assert not DeployConfig(dirs['paddle']).holds_custom_op


def test_fixed_input_shape_with_argmax_and_softmax(exported, tmp_path):
    model, _, logits = exported
    shape = SHAPES[0]
    want = logits[shape]
    for output_op in ('argmax', 'softmax'):
        save_dir = str(tmp_path / output_op)
        export_model(model, [{'type': 'Normalize'}], save_dir,
                     ExportOptions(input_shape=list(shape), output_op=output_op))
        runner = PaddleRunner(DeployConfig(save_dir), PredictorOptions(device='cpu'))
        assert runner.deploy.input_shape == list(shape)
        got = runner.run(inputs(shape))
        if output_op == 'argmax':
            # paddleseg.deploy.export's contract: int32 class ids [N, H, W].
            assert got.shape == (shape[0],) + shape[2:] and got.dtype == np.int32
            assert_logits_agree(got, want, RTOL, 'argmax export')
        else:
            # Logits moved by at most d move a softmax output by at most d/2
            # (|dp_i| = p_i |dz_i - sum_j p_j dz_j| <= 2 p_i (1 - p_i) d): the logits'
            # tolerance, halved, in probability.
            e = np.exp(want - want.max(1, keepdims=True))
            assert_logits_agree(got, e / e.sum(1, keepdims=True), RTOL, 'softmax export',
                                scale=np.abs(want).max() / 2)
        with pytest.raises(DeployError, match='exported for input shape'):
            runner.run(inputs((1, 3, 64, 96)))


@pytest.mark.parametrize('text, want', [
    (None, [-1, 3, -1, -1]),
    (['None', '3', 'None', 'None'], [-1, 3, -1, -1]),
    (['1', '3', '512', '1024'], [1, 3, 512, 1024]),
    ([-1, 3, 256, -1], [-1, 3, 256, -1]),
])
def test_parse_input_shape(text, want):
    assert parse_input_shape(text) == want


@pytest.mark.parametrize('shape', [[1, 3, 64], [1, 1, 64, 64], ['a', 3, 4, 4], [0, 3, 8, 8]])
def test_parse_input_shape_rejects(shape):
    with pytest.raises(ValueError, match='--input_shape'):
        parse_input_shape(shape)


def test_export_rejects_bad_arguments():
    with pytest.raises(ValueError, match='--psa_impl paddle'):
        ExportOptions(psa_impl='custom', onnx=True)
    with pytest.raises(ValueError, match='--output_op'):
        ExportOptions(output_op='max')
    with pytest.raises(ValueError, match='--psa_impl'):
        ExportOptions(psa_impl='cuda')
    with pytest.raises(ValueError, match='palette'):
        ExportOptions(palette='rainbow')


@pytest.mark.parametrize('onnx', [False, pytest.param(True, marks=needs_onnx)])
def test_export_from_config_loads_the_weights(exported, tmp_path, onnx):
    from psanet.export import export_from_config
    model, _, logits = exported
    weights = str(tmp_path / 'model.pdparams')
    paddle.save(model.state_dict(), weights)
    paddle.seed(123)  # the model export_from_config builds starts from other weights
    save_dir = str(tmp_path / 'export')
    export_from_config(MINI_CONFIG, weights, save_dir, input_shape=['1', '3', '64', '128'],
                       output_op='none', psa_impl='paddle', onnx=onnx)
    deploy = DeployConfig(save_dir)
    assert deploy.input_shape == [1, 3, 64, 128] and deploy.num_classes == 19
    assert deploy.palette == 'cityscapes'  # the mini config's val dataset is Cityscapes
    assert deploy.output_op == 'none' and bool(deploy.onnx) == onnx
    assert not deploy.holds_custom_op
    shape = SHAPES[0]
    runner = OnnxRunner(deploy) if onnx else PaddleRunner(deploy, PredictorOptions())
    assert_logits_agree(runner.run(inputs(shape)), logits[shape], RTOL, 'export_from_config')


def test_compare_with_dygraph_tells_a_different_model_apart(exported, tmp_path):
    import cv2

    from psanet.deploy.processing import preprocess
    from psanet.export import compare_with_dygraph
    model, dirs, _ = exported
    image = str(tmp_path / 'image.png')
    cv2.imwrite(image, np.random.RandomState(0).randint(0, 256, (64, 96, 3)).astype('uint8'))
    same = compare_with_dygraph(model, DeployConfig(dirs['custom']), [image],
                                PredictorOptions(enable_mkldnn=True))
    # oneDNN's convolutions round differently (RTOL): only near-ties may change class.
    batch = preprocess([image], DeployConfig(dirs['custom']).build_transforms())[0]
    with paddle.no_grad():
        want = model(paddle.to_tensor(batch))[0].numpy()
    atol = RTOL * np.abs(want).max()
    clear = clear_margin_pixels(want, atol)
    assert clear.mean() > 0.9
    assert same['pixel_agreement'] >= clear.mean() and same['max_abs_diff'] <= atol, same
    _, other = build_config_model(seed=7)
    different = compare_with_dygraph(other, DeployConfig(dirs['paddle']), [image])
    assert different['pixel_agreement'] < 0.99 and different['max_abs_diff'] > 1.0


def test_export_command_line_exits_2_on_a_missing_model(tmp_path):
    result = run_process([sys.executable, 'export.py', '--config', MINI_CONFIG,
                          '--model_path', 'no/such/model.pdparams',
                          '--save_dir', str(tmp_path / 'out')], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=300)
    assert result.returncode == 2, result.stdout
    assert 'does not exist' in result.stdout


@pytest.mark.parametrize('options, message', [
    ({'onnx': True}, '--psa_impl paddle'),
    ({'input_shape': ['1', '3', 'x', '64']}, '--input_shape'),
    ({'output_op': 'max'}, '--output_op'),
])
def test_export_from_config_rejects_bad_flags(tmp_path, options, message):
    from psanet.errors import ConfigError
    from psanet.export import export_from_config
    with pytest.raises(ConfigError, match=message):
        export_from_config(MINI_CONFIG, None, str(tmp_path / 'out'), **options)
    assert not (tmp_path / 'out').exists()


@needs_onnx
def test_a_paddle2onnx_that_fails_to_import_is_one_line_before_any_work(tmp_path):
    """Installed is not importable: a broken install (here one whose import raises, found
    first on the path) is named before the model is built, not as a traceback mid-export."""
    broken = tmp_path / 'site' / 'paddle2onnx'
    broken.mkdir(parents=True)
    (broken / '__init__.py').write_text("raise RuntimeError('libpaddle2onnx.so: cannot open "
                                        "shared object file')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path / 'site')] + [p for p in [os.environ.get('PYTHONPATH')] if p]))
    result = run_process([sys.executable, 'export.py', '--config', MINI_CONFIG,
                          '--psa_impl', 'paddle', '--onnx', '--save_dir', str(tmp_path / 'out')],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=300)
    assert result.returncode == 2, result.stdout
    assert 'Traceback' not in result.stdout, result.stdout
    assert result.stdout.strip().splitlines()[-1] == (
        'error: --onnx needs paddle2onnx, which is installed but fails to import (RuntimeError: '
        'libpaddle2onnx.so: cannot open shared object file): pip install --force-reinstall '
        'paddle2onnx, or export without --onnx.')
    assert not (tmp_path / 'out').exists()
