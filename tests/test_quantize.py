"""INT8 post-training quantisation (export --quantize int8): which operators are INT8 and how
(per-channel weights), that the attention stays float, the INT8 model in the API's ONNX
backends against the float one, and the one-line refusals before any work."""
import importlib.util
import os

import cv2
import numpy as np
import pytest

from psanet import Segmenter
from psanet.deploy import quantize, backends
from psanet.deploy.deploy_config import DeployConfig
from psanet.errors import ConfigError, DeployError
from engine_helpers import mini_psanet_for_eval
from psanet.export import ExportOptions, export_model

MISSING = [name for name in ('paddle2onnx', 'onnxruntime', 'onnx', 'ml_dtypes')
           if importlib.util.find_spec(name) is None]
TOO_OLD = None if MISSING else quantize.quantiser_too_old()
needs_tools = pytest.mark.skipif(
    bool(MISSING) or bool(TOO_OLD),
    reason=(f'INT8 quantisation needs {", ".join(MISSING)}, not installed (pip install '
            f'{" ".join(MISSING)}; paddle2onnx has no Python 3.13 wheels)') if MISSING else
    f'INT8 quantisation needs onnxruntime>=1.32, which has no wheels for this Python '
    f'({TOO_OLD} here)')


def _write_images(folder, count, seed):
    os.makedirs(folder)
    rng = np.random.RandomState(seed)
    paths = []
    for i in range(count):
        small = rng.randint(0, 256, (4, 6, 3)).astype('uint8')
        paths.append(os.path.join(folder, f'{i}.png'))
        cv2.imwrite(paths[-1], cv2.resize(small, (96, 64), interpolation=cv2.INTER_CUBIC))
    return paths


@pytest.fixture(scope='module')
def export(tmp_path_factory):
    """(INT8 export folder, measured images): calibrated on 3 images, measured on 2 others."""
    root = str(tmp_path_factory.mktemp('quantize'))
    calib = os.path.join(root, 'calib')
    _write_images(calib, 4, seed=0)
    save_dir = os.path.join(root, 'export')
    export_model(mini_psanet_for_eval(seed=1), [{'type': 'Normalize'}], save_dir,
                 ExportOptions(output_op='none', psa_impl='paddle', onnx=True, quantize='int8',
                               calib_images=calib, calib_num=3), num_classes=19)
    return save_dir, _write_images(os.path.join(root, 'images'), 2, seed=1)


def _graph(path):
    import onnx
    graph = onnx.load(path).graph
    producers = {out: node for node in graph.node for out in node.output}
    initializers = {init.name: onnx.numpy_helper.to_array(init) for init in graph.initializer}
    return graph, producers, initializers


def _float_classifier_and_stem(graph, initializers):
    """The float convolutions (their weight an initializer, no DequantizeLinear) with a filter
    per class (19), 1x1: the classifier; and those that read 3 channels (the image's)."""
    convs = [node for node in graph.node if node.op_type == 'Conv']
    classifier = [conv for conv in convs if conv.input[1] in initializers and
                  initializers[conv.input[1]].shape[:1] == (19,)]
    stem = [conv for conv in convs if conv.input[1] in initializers and
            initializers[conv.input[1]].shape[1:2] == (3,)]
    return convs, classifier, stem


@needs_tools
def test_every_convolution_but_the_first_and_the_classifier_is_int8_per_channel(export):
    save_dir, _ = export
    deploy = DeployConfig(save_dir)
    assert deploy.onnx_int8 == os.path.join(save_dir, quantize.INT8_FILE)
    assert deploy.dic['int8_calibration'] == {
        'images': 3, 'ops': ['Conv'], 'calibration': 'minmax', 'per_channel': True,
        'float_classifier': True, 'float_stem': True, 'reduce_range': False}
    graph, producers, initializers = _graph(deploy.onnx_int8)
    convs, classifier, stem = _float_classifier_and_stem(graph, initializers)
    assert len(classifier) == 1 and initializers[classifier[0].input[1]].shape[2:] == (1, 1)
    assert len(stem) == 1
    assert quantize.classifier_nodes(graph) == [classifier[0].name]
    assert quantize.stem_nodes(graph) == [stem[0].name]
    for conv in classifier + stem:
        assert producers.get(conv.input[0]) is None or \
            producers[conv.input[0]].op_type != 'DequantizeLinear', conv.name
    assert len(convs) > 20
    for conv in convs:
        if conv in classifier + stem:
            continue
        data, weight = (producers.get(name) for name in conv.input[:2])
        assert data is not None and data.op_type == 'DequantizeLinear', conv.name
        assert weight is not None and weight.op_type == 'DequantizeLinear', conv.name
        q = initializers[weight.input[0]]
        scale = initializers[weight.input[1]]
        assert q.dtype == np.int8 and scale.shape == (q.shape[0],), conv.name
        # Symmetric per output channel: each channel's largest weight maps to +-127.
        # One scale for the whole tensor would leave most channels short of it.
        per_channel_max = np.abs(q.reshape(q.shape[0], -1).astype(int)).max(1)
        assert (per_channel_max >= 126).all(), (conv.name, per_channel_max.min())
        activation = producers[data.input[0]]
        assert activation.op_type == 'QuantizeLinear'
        assert initializers[activation.input[2]].dtype == np.uint8  # U8S8


@pytest.fixture(scope='module')
def recipe_export(export, tmp_path_factory):
    """The fixture's export quantised again with every choice off its default: per-tensor
    7-bit weights, percentile calibration, the classifier and the first convolution INT8."""
    import shutil
    save_dir = str(tmp_path_factory.mktemp('recipe') / 'export')
    shutil.copytree(export[0], save_dir)
    calib = os.path.join(os.path.dirname(export[0]), 'calib')
    recipe = quantize.Int8Recipe(calibration='percentile', per_channel=False,
                                 float_classifier=False, float_stem=False, reduce_range=True)
    quantize.quantize_export(DeployConfig(save_dir), calib,
                             quantize.check_calib_images(calib, 3), recipe=recipe)
    return save_dir


@needs_tools
def test_a_recipe_sets_the_weights_the_float_convs_and_the_calibration(export, recipe_export):
    deploy = DeployConfig(recipe_export)
    assert deploy.dic['int8_calibration'] == {
        'images': 3, 'ops': ['Conv'], 'calibration': 'percentile', 'per_channel': False,
        'float_classifier': False, 'float_stem': False, 'reduce_range': True}
    graph, producers, initializers = _graph(deploy.onnx_int8)
    convs, classifier, stem = _float_classifier_and_stem(graph, initializers)
    assert classifier == stem == []  # both INT8 in this recipe
    assert len(convs) > 20
    for conv in convs:
        weight = producers[conv.input[1]]
        q = initializers[weight.input[0]]
        # One scale per tensor; 7-bit: the largest weight maps to +-64, not +-127.
        assert initializers[weight.input[1]].shape == (), conv.name
        assert 60 <= np.abs(q.astype(int)).max() <= 64, conv.name
    # Percentile calibration sets other activation ranges than min/max on the same images.
    default_graph, _, default_inits = _graph(DeployConfig(export[0]).onnx_int8)

    def activation_scales(graph, inits):
        return {node.input[0]: float(inits[node.input[1]]) for node in graph.node
                if node.op_type == 'QuantizeLinear' and node.input[1] in inits}

    ours, theirs = (activation_scales(graph, initializers),
                    activation_scales(default_graph, default_inits))
    shared = set(ours) & set(theirs)
    assert len(shared) > 10
    assert sum(ours[name] != theirs[name] for name in shared) > len(shared) / 2


def test_a_recipe_that_cannot_work_is_refused():
    with pytest.raises(ConfigError, match="calibration must be one of .*'minmax'.*got 'kl'"):
        quantize.Int8Recipe(calibration='kl')
    with pytest.raises(ConfigError, match='at least one operator type'):
        quantize.Int8Recipe(op_types=())


@needs_tools
def test_the_attention_stays_float(export):
    # The mask gather, its softmax and the (HW) x (HW) aggregation take float inputs that no
    # DequantizeLinear made (a resize may read a convolution's rounded input: still float).
    graph, producers, _ = _graph(DeployConfig(export[0]).onnx_int8)
    kinds = {node.op_type for node in graph.node}
    assert {'Softmax', 'MatMul', 'Gather'} <= kinds
    for node in graph.node:
        if node.op_type in ('Softmax', 'MatMul', 'Gather'):
            fed = [producers[name].op_type for name in node.input if name in producers]
            assert 'DequantizeLinear' not in fed, node.name


OPENVINO = pytest.param('openvino', marks=pytest.mark.skipif(
    not backends.installed('openvino'), reason='openvino is not installed (pip install openvino)'))


@needs_tools
@pytest.mark.parametrize('backend', ['onnxruntime', OPENVINO])
def test_the_int8_model_stays_close_to_the_float_one(export, backend):
    save_dir, images = export
    fp32 = Segmenter.from_export(save_dir, backend='onnxruntime', cpu_threads=1)
    int8 = Segmenter.from_export(save_dir, backend=backend, cpu_threads=1, int8=True)
    for want, got in zip(fp32.logits(images), int8.logits(images)):
        assert got.shape == want.shape
        scale = np.abs(want).max()
        # 8-bit steps over ~30 convolutions: a few per cent of the logits' range, not 0
        # (the INT8 model really runs) and not more (its scales fit the activations).
        error = np.abs(got - want).mean() / scale
        assert 1e-4 < error < 0.05, error
        assert (got.argmax(0) == want.argmax(0)).mean() > 0.9


@needs_tools
def test_the_int8_default_is_openvino_where_installed(export, monkeypatch):
    deploy = DeployConfig(export[0])
    want = 'openvino' if backends.installed('openvino') else 'onnxruntime'
    assert backends.default_backend(deploy, int8=True) == want
    monkeypatch.setattr(backends, 'installed', lambda name: name == 'paddle')
    with pytest.raises(DeployError, match='INT8 model needs onnxruntime'):
        backends.default_backend(deploy, int8=True)


@needs_tools
def test_paddle_inference_is_refused_the_int8_model(export):
    with pytest.raises(DeployError, match='INT8 model is an ONNX model'):
        Segmenter.from_export(export[0], backend='paddle', int8=True)


@needs_tools
def test_no_int8_model_says_how_to_make_one(export, tmp_path):
    import shutil
    plain = str(tmp_path / 'plain')
    shutil.copytree(export[0], plain)
    deploy = DeployConfig(plain)
    deploy.dic.pop('onnx_int8')
    with pytest.raises(DeployError, match='--quantize int8 --calib_images'):
        backends.create_runner(deploy, 'onnxruntime', int8=True)


@needs_tools
@pytest.mark.parametrize('options, message', [
    (dict(quantize='int8', calib_images='CALIB'), 'add --psa_impl paddle --onnx'),
    (dict(quantize='int4', psa_impl='paddle', onnx=True, calib_images='CALIB'),
     '--quantize must be int8'),
    (dict(quantize='int8', psa_impl='paddle', onnx=True, calib_images='no/such/folder'),
     '--calib_images no/such/folder does not exist'),
    (dict(quantize='int8', psa_impl='paddle', onnx=True, calib_images='CALIB', calib_num=0),
     '--calib_num must be an integer >= 1'),
])
def test_bad_quantize_options_are_refused_before_any_work(tmp_path, options, message):
    calib = str(tmp_path / 'calib')
    _write_images(calib, 1, seed=0)
    options = {k: calib if v == 'CALIB' else v for k, v in options.items()}
    with pytest.raises(ConfigError, match=message):
        ExportOptions(**options)


def test_missing_quantiser_packages_are_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec',
                        lambda name: None if name == 'ml_dtypes' else real(name))
    with pytest.raises(ConfigError, match='needs (.*, )?ml_dtypes, not installed: pip install'):
        quantize.check_quantize_tools()


@pytest.mark.skipif(bool(MISSING), reason=f'needs {", ".join(MISSING)}')
@pytest.mark.parametrize('version, refused', [('1.19.2', True), ('1.23.2', True),
                                              ('1.32.0', False), ('2.0.1', False)])
def test_an_onnxruntime_older_than_the_tested_quantiser_is_refused(monkeypatch, version,
                                                                    refused):
    from importlib import metadata
    real = metadata.version
    monkeypatch.setattr(metadata, 'version',
                        lambda name: version if name == 'onnxruntime' else real(name))
    if refused:
        with pytest.raises(ConfigError, match=f'needs onnxruntime>=1.32 .*found onnxruntime '
                                              f'{version}: pip install -U onnxruntime'):
            quantize.check_quantize_tools()
    else:
        quantize.check_quantize_tools()


@needs_tools
def test_the_export_check_compares_the_int8_model_with_dygraph(export):
    from engine_helpers import dygraph_logits
    from psanet.export import compare_with_dygraph
    save_dir, images = export
    model = mini_psanet_for_eval(seed=1)  # the fixture's weights again
    result = compare_with_dygraph(model, DeployConfig(save_dir), images, backend='onnxruntime',
                                  int8=True)
    labels = Segmenter.from_export(save_dir, backend='onnxruntime', int8=True)(images)
    want = np.mean([(label == dygraph_logits(model, path).argmax(0)).mean()
                    for label, path in zip(labels, images)])
    assert result['pixel_agreement'] == pytest.approx(want)
    assert 0.9 < result['pixel_agreement'] < 1.0


def test_calib_images_without_quantize_is_refused(tmp_path):
    """Not ignored: the user meant an INT8 model and would get none, without a word."""
    calib = str(tmp_path / 'calib')
    _write_images(calib, 1, seed=0)
    with pytest.raises(ConfigError, match='^--calib_images calibrates --quantize int8, which is '
                       'not given: add --quantize int8'):
        ExportOptions(psa_impl='paddle', onnx=True, calib_images=calib)


@needs_tools
def test_sigterm_during_calibration_stops_the_export_and_keeps_the_old_one(export, tmp_path,
                                                                           monkeypatch):
    """The signal comes while the second calibration image is read: the export stops there
    (Interrupted, exit 143 from export.py), and the folder holds the previous export, byte
    for byte (not a new one without the INT8 model, nor one with it)."""
    import shutil
    import signal
    from disk_helpers import digests
    from psanet import interrupts
    from psanet.errors import Interrupted
    folder = tmp_path / 'export'
    shutil.copytree(export[0], folder)
    before = digests(folder)
    reads = []
    get_next = quantize._CalibrationReader.get_next

    def signalled(self):
        reads.append(1)
        if len(reads) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return get_next(self)

    monkeypatch.setattr(quantize._CalibrationReader, 'get_next', signalled)
    calib = os.path.join(os.path.dirname(export[0]), 'calib')
    with interrupts.stop_at_boundaries():
        with pytest.raises(Interrupted) as info:
            export_model(mini_psanet_for_eval(seed=2), [{'type': 'Normalize'}], str(folder),
                         ExportOptions(output_op='none', psa_impl='paddle', onnx=True,
                                       quantize='int8', calib_images=calib, calib_num=3),
                         num_classes=19)
    assert info.value.exit_code == 143 and len(reads) == 2
    assert digests(folder) == before
    assert sorted(os.listdir(tmp_path)) == ['export']  # no temporary left


def test_the_int8_bench_counts_near_ties_and_its_first_row_is_the_default(monkeypatch):
    """bench/bench_int8.py's margin shares against a loop over pixels, and its rows: each a
    valid recipe, the first DEFAULT_RECIPE (the row docs/deploy.md reads the default from)."""
    from conftest import ROOT
    monkeypatch.syspath_prepend(os.path.join(ROOT, 'bench'))
    import bench_int8
    rng = np.random.RandomState(0)
    logits = rng.normal(0, 0.4, (2, 5, 3, 4)).astype('float32')
    logits[0, 1, 0, 0] = logits[0, :, 0, 0].max() + 0.3  # a clear winner: no tie
    want = []
    for margin in (0.25, 0.5):
        near = [sorted(logits[n, :, i, j])[-1] - sorted(logits[n, :, i, j])[-2] < margin
                for n in range(2) for i in range(3) for j in range(4)]
        want.append(sum(near) / len(near))
    assert 0 < want[0] < want[1] < 1
    assert bench_int8.near_ties(logits, (0.25, 0.5)) == pytest.approx(want)
    recipes = [bench_int8._split(name) for name in bench_int8.RECIPES]
    assert recipes[0] == (quantize.DEFAULT_RECIPE, None)
    assert len(set(recipes)) == len(recipes)
