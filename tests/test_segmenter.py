"""The Python API (psanet.Segmenter): a checkpoint and an export in every installed backend
against the dygraph model, the checkpoint run as the dygraph model itself (whole, flipped
and averaged, in windows) against the model's own outputs computed here, batching over
images of two sizes, logits and labels at the image's size after a resize, the default
backend (the fixed order, and a timing of the real backends), and its one-line errors (bad
images, a backend not installed, options of the other route)."""
import os
import time

import cv2
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from psanet import Segmenter
from psanet.deploy import backend_choice, backends
from psanet.deploy.deploy_config import DeployConfig
from psanet.deploy.processing import restore_logits
from psanet.errors import DeployError
from conftest import (MINI_CONFIG, MINI_PSANET_RTOL, assert_logits_agree, clear_margin_pixels,
                      infer_in_process, needs_onnx, onnx_tools_missing)
from engine_helpers import (assert_saved_masks_agree, dygraph_logits, mini_psanet_for_eval,
                            slide_reference)
from test_backend_choice import linked_export

SIZES = [(96, 64), (96, 64), (64, 48)]  # width, height: two of one size, then another


def _runtime_missing(runtime):
    """Why the checkpoint fixture's export cannot run in ``runtime`` here, or ''."""
    if runtime == 'paddle':
        return ''
    if not backends.installed(runtime):
        return f'{runtime} is not installed (pip install {backends.PACKAGES[runtime]})'
    # the checkpoint fixture's export has model.onnx only where paddle2onnx is
    return onnx_tools_missing()


def _runtime_param(runtime):
    if runtime == 'paddle':
        return runtime
    reason = _runtime_missing(runtime)
    return pytest.param(runtime, marks=pytest.mark.skipif(bool(reason), reason=reason))


EXPORT_BACKENDS = [_runtime_param(r) for r in backends.EXPORT_BACKENDS]


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """(model, its weights file, image paths, a folder for more)."""
    root = tmp_path_factory.mktemp('segmenter')
    model = mini_psanet_for_eval(seed=1)
    weights = str(root / 'model.pdparams')
    paddle.save(model.state_dict(), weights)
    rng = np.random.RandomState(0)
    paths = []
    for i, size in enumerate(SIZES):
        path = str(root / f'image{i}.png')
        small = rng.randint(0, 256, (4, 6, 3)).astype('uint8')
        cv2.imwrite(path, cv2.resize(small, size, interpolation=cv2.INTER_CUBIC))
        paths.append(path)
    return model, weights, paths, root


@pytest.fixture(scope='module')
def checkpoint(trained):
    """(model, Segmenter.from_config of its weights, the export it made, image paths)."""
    model, weights, paths, root = trained
    paddle.seed(123)  # the model from_config builds starts from other weights
    # The default backend, untimed: timing it at 1024x512 (a dynamic export) takes minutes
    # here; test_the_real_backends_are_timed_and_the_fast_one_runs times them at 64x32.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(backend_choice.TIMING_ENV, '0')
        seg = Segmenter.from_config(MINI_CONFIG, weights, save_dir=str(root / 'export'),
                                    cpu_threads=1, batch_size=2)
    return model, seg, str(root / 'export'), paths


def test_from_config_gives_the_dygraph_classes_and_logits(checkpoint):
    model, seg, _, paths = checkpoint
    labels = seg(paths)
    assert len(labels) == len(paths)
    for path, label in zip(paths, labels):
        want = dygraph_logits(model, path)
        assert label.shape == want.shape[1:] and label.dtype == np.uint8
        assert_logits_agree(label, want, MINI_PSANET_RTOL, f'{seg.backend} {path}', class_axis=0)
        assert_logits_agree(seg.logits(path), want, MINI_PSANET_RTOL, path, class_axis=0)


@pytest.mark.parametrize('runtime', EXPORT_BACKENDS)
def test_from_export_in_each_runtime_agrees_with_dygraph(checkpoint, runtime):
    model, _, export, paths = checkpoint
    seg = Segmenter.from_export(export, backend=runtime, cpu_threads=1, batch_size=3)
    assert seg.backend == runtime
    # A path, a BGR array and a list of both; batches split where the size changes.
    arrays = [cv2.imread(p) for p in paths]
    one = seg(arrays[2])
    assert one.shape == arrays[2].shape[:2]
    mixed = seg([paths[0], arrays[1], paths[2]])
    logits = seg.logits(arrays)
    for i, path in enumerate(paths):
        want = dygraph_logits(model, path)
        assert_logits_agree(mixed[i], want, MINI_PSANET_RTOL, f'{runtime} {path}', class_axis=0)
        assert_logits_agree(logits[i], want, MINI_PSANET_RTOL, f'{runtime} logits', class_axis=0)
    assert np.array_equal(one, mixed[2])


@pytest.mark.parametrize('backend', EXPORT_BACKENDS[1:])
def test_infer_runs_the_onnx_runtimes(checkpoint, tmp_path, capfd, backend):
    model, _, export, paths = checkpoint
    images = tmp_path / 'images'
    images.mkdir()
    for path in paths:
        os.link(path, images / os.path.basename(path))
    out = tmp_path / 'out'
    code, stdout, stderr = infer_in_process(
        capfd, '--config', export, '--image_path', images, '--save_dir', out, '--backend',
        backend, '--cpu_threads', 1, '--batch_size', 2, '--benchmark', 'True')
    assert code == 0, stderr
    assert f'cpu, {backend}, 1 threads, fp32:' in stdout
    assert_saved_masks_agree(out, paths, model, MINI_PSANET_RTOL)


def test_infer_names_a_runtime_to_install(checkpoint, tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(backends, 'installed', lambda name: name == 'paddle')
    code, _, stderr = infer_in_process(capfd, '--config', checkpoint[2], '--image_path',
                                       checkpoint[3][0], '--save_dir', tmp_path / 'out',
                                       '--backend', 'openvino')
    assert code == 2
    assert stderr.strip().splitlines()[-1].endswith('not installed: pip install openvino')


def test_batches_split_where_the_size_changes_and_equal_batches_of_one(checkpoint):
    _, _, export, paths = checkpoint
    one = Segmenter.from_export(export, backend='paddle', cpu_threads=1, batch_size=1)
    three = Segmenter.from_export(export, backend='paddle', cpu_threads=1, batch_size=3)
    calls = []
    run = three.runner.run
    three.runner.run = lambda batch: calls.append(len(batch)) or run(batch)
    images = paths + paths[:1]  # two of one size, one of another, the first size again
    for a, b in zip(one.logits(images), three.logits(images)):
        assert_logits_agree(b, a, MINI_PSANET_RTOL, 'batch 3 vs 1', class_axis=0)
    assert calls == [2, 1, 1]


def test_logits_are_resized_back_like_paddleseg():
    from paddleseg.core.infer import reverse_transform
    logit = np.random.RandomState(0).randn(5, 8, 12).astype('float32')
    info = [('resize', (20, 30)), ('padding', (16, 24))]  # undone last-first
    want = reverse_transform(paddle.to_tensor(logit[None]), info, mode='bilinear').numpy()[0]
    got = restore_logits(logit, info)
    assert got.shape == (5, 20, 30)
    np.testing.assert_allclose(got, want, atol=1e-5)


@needs_onnx
def test_untimed_the_default_runtime_is_the_first_installed_of_the_fixed_order(checkpoint,
                                                                              monkeypatch):
    _, _, export, _ = checkpoint
    deploy = DeployConfig(export)
    # bench_deploy's order at R50 512x256 (docs/deploy.md): onnxruntime, OpenVINO, Paddle.
    assert backends.default_backend(deploy) == 'onnxruntime'
    assert backends.default_backend(deploy, device='gpu') == 'paddle'
    monkeypatch.setattr(backends, 'installed', lambda runtime: runtime != 'onnxruntime')
    assert backends.default_backend(deploy) == 'openvino'
    monkeypatch.setattr(backends, 'installed', lambda runtime: runtime == 'paddle')
    assert backends.default_backend(deploy) == 'paddle'
    monkeypatch.setitem(deploy.dic, 'onnx', None)
    monkeypatch.setattr(backends, 'installed', lambda runtime: True)
    assert backends.default_backend(deploy) == 'paddle'  # no model.onnx to run


@needs_onnx
def test_the_real_backends_are_timed_and_the_fast_one_runs(checkpoint, tmp_path, monkeypatch):
    """onnxruntime, the fixed order's first of the two, made slow by a wrapper: Paddle
    Inference is chosen, its runner gives what the named backend gives, and the next load
    reads the choice without a run."""
    export = linked_export(checkpoint[2], tmp_path / 'export', input_shape=[-1, 3, 32, 64])
    monkeypatch.setattr(backends, 'installed', lambda backend: backend != 'openvino')
    monkeypatch.setenv(backend_choice.CACHE_ENV, str(tmp_path / 'cache'))
    monkeypatch.delenv(backend_choice.TIMING_ENV, raising=False)  # conftest turns it off
    create, runs = backends.create_runner, []

    def slowed(deploy, backend, options=None, int8=False):
        runner = create(deploy, backend, options, int8)
        run = runner.run

        def counted(batch):
            runs.append(backend)
            if backend == 'onnxruntime':
                time.sleep(0.5)  # the mini model runs a 64x32 input in some 10-50 ms
            return run(batch)
        runner.run = counted
        return runner
    monkeypatch.setattr(backends, 'create_runner', slowed)
    seg = Segmenter.from_export(export, cpu_threads=1)
    assert seg.backend == 'paddle'
    each = backend_choice.WARMUP_RUNS + backend_choice.TIMED_RUNS
    assert sorted(runs) == ['onnxruntime'] * each + ['paddle'] * each
    image = np.random.RandomState(0).randint(0, 256, (32, 64, 3)).astype('uint8')
    want = Segmenter.from_export(export, backend='paddle', cpu_threads=1).logits(image)
    np.testing.assert_array_equal(seg.logits(image), want)
    runs.clear()
    again = Segmenter.from_export(export, cpu_threads=1)
    assert again.backend == 'paddle' and runs == []


@pytest.mark.parametrize('runtime', ['onnxruntime', 'openvino'])
def test_a_runtime_not_installed_names_its_package(checkpoint, monkeypatch, runtime):
    _, _, export, _ = checkpoint
    monkeypatch.setattr(backends, 'installed', lambda name: name == 'paddle')
    with pytest.raises(DeployError, match=f'needs {runtime}.*: pip install {runtime}$'):
        Segmenter.from_export(export, backend=runtime)


@pytest.mark.parametrize('image, message', [
    (np.zeros((8, 8), 'uint8'), r'H x W x 3, got shape \[8, 8\].*COLOR_GRAY2BGR'),
    (3, 'expected a path or a BGR numpy array, got int'),
    ('no/such/image.png', 'no/such/image.png'),
])
def test_a_bad_image_is_one_clear_error(checkpoint, image, message):
    _, seg, _, _ = checkpoint
    with pytest.raises(DeployError, match=message):
        seg([image])


def test_bad_options_are_refused(checkpoint, monkeypatch):
    _, seg, export, _ = checkpoint
    with pytest.raises(DeployError, match='batch_size must be an integer >= 1'):
        Segmenter.from_export(export, backend='paddle', batch_size=0)
    with pytest.raises(DeployError, match='backend must be one of'):
        Segmenter.from_export(export, backend='tensorrt')
    monkeypatch.setattr(seg, 'output_op', 'argmax')
    with pytest.raises(DeployError, match='--output_op none'):
        seg.logits(checkpoint[3][0])


# --- The checkpoint as the dygraph model (predict.py's route) ----------------------------

def _normalized(image_bgr):
    """[1, 3, H, W]: the val Normalize of the mini config, written out in numpy."""
    rgb = image_bgr[:, :, ::-1].astype('float32')
    return np.ascontiguousarray(((rgb / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None])


def _model_logits(model, x):
    with paddle.no_grad():
        return model(paddle.to_tensor(np.ascontiguousarray(x)))[0].numpy()


def _flip_mean(model, x):
    return (_model_logits(model, x) + _model_logits(model, x[..., ::-1])[..., ::-1]) / 2


CROP, STRIDE = (48, 32), (32, 24)  # 2 x 2 overlapping windows of a 64x48 image, 3 x 3 of 96x64
DYGRAPH_CASES = {
    'whole': (None, _model_logits),
    'flips': ({'aug_eval': True, 'flip_horizontal': True}, _flip_mean),
    'windows': ({'is_slide': True, 'crop_size': list(CROP), 'stride': list(STRIDE)},
                lambda model, x: slide_reference(lambda w: _model_logits(model, w), x,
                                                 CROP, STRIDE)),
}


@pytest.mark.parametrize('case', sorted(DYGRAPH_CASES))
def test_from_config_dygraph_gives_the_models_own_classes_and_logits(trained, case):
    model, weights, paths, _ = trained
    inference, reference = DYGRAPH_CASES[case]
    paddle.seed(123)  # the model from_config builds starts from other weights
    seg = Segmenter.from_config(MINI_CONFIG, weights, backend='dygraph', inference=inference,
                                batch_size=2)
    assert seg.backend == 'dygraph' and seg.deploy is None
    labels, logits = seg(paths), seg.logits(paths)
    for path, label, logit in zip(paths, labels, logits):
        x = _normalized(cv2.imread(path))
        want = reference(model, x)[0]
        if case != 'whole':  # the options change the classes: a run without them fails
            plain = _model_logits(model, x)[0]
            atol = MINI_PSANET_RTOL * np.abs(want).max()
            assert ((want.argmax(0) != plain.argmax(0)) &
                    clear_margin_pixels(want, atol, class_axis=0)).any(), path
        assert label.shape == want.shape[1:] and label.dtype == np.uint8
        assert_logits_agree(label, want, MINI_PSANET_RTOL, f'{case} {path}', class_axis=0)
        assert_logits_agree(logit, want, MINI_PSANET_RTOL, f'{case} logits', class_axis=0)


def test_a_resize_in_the_transforms_is_undone_on_the_logits_like_paddleseg(trained):
    """The labels are the argmax of the logits resized back (paddleseg's reverse_transform,
    bilinear), as predict.py's were; not the class map resized back (nearest)."""
    from paddleseg.transforms import Compose, Normalize, Resize
    from psanet.core.predict import DygraphRunner
    model, _, paths, _ = trained
    seg = Segmenter(DygraphRunner(model), Compose([Resize(target_size=(40, 24)), Normalize()]))
    for path in paths:
        image = cv2.imread(path)
        small = cv2.resize(image.astype('float32'), (40, 24), interpolation=cv2.INTER_LINEAR)
        logit = F.interpolate(paddle.to_tensor(_model_logits(model, _normalized(small))),
                              image.shape[:2], mode='bilinear', align_corners=False)
        want = logit.numpy()[0]
        assert_logits_agree(seg(path), want, MINI_PSANET_RTOL, path, class_axis=0)
        assert_logits_agree(seg.logits(path), want, MINI_PSANET_RTOL, path, class_axis=0)


def test_each_route_refuses_the_options_of_the_other(trained):
    _, weights, _, _ = trained
    with pytest.raises(DeployError, match='cpu_threads, int8: options of an export; '
                       'backend="dygraph" takes device and batch_size'):
        Segmenter.from_config(MINI_CONFIG, weights, backend='dygraph', cpu_threads=2, int8=True)
    with pytest.raises(DeployError, match='pass backend="dygraph"'):
        Segmenter.from_config(MINI_CONFIG, weights, inference={'aug_eval': True})


# --- Around any runner: a stand-in model whose output is worked out here ------------------

class _ChannelScores:
    """A stand-in runner: the normalised R, G, B of every ``stride``-th pixel as the scores
    of three classes (so an image's labels are the argmax of its own channels); records
    the size of each batch it runs."""

    def __init__(self, stride=1):
        self.stride, self.batches = stride, []

    def run(self, batch):
        self.batches.append(len(batch))
        return np.ascontiguousarray(batch[:, :, ::self.stride, ::self.stride])


def _channel_segmenter(stride=1, batch_size=1):
    from paddleseg.transforms import Compose, Normalize
    return Segmenter(_ChannelScores(stride), Compose([Normalize()]), batch_size=batch_size)


def _image(seed, height=12, width=20):
    return np.random.RandomState(seed).randint(0, 256, (height, width, 3)).astype('uint8')


@pytest.mark.parametrize('image, message', [
    (_image(0).astype('float32') / 255, r'must be uint8 .*got float32; a float image in '
                                        r'\[0, 1\] becomes one with \(image \* 255\)'),
    (_image(0).astype('uint16') * 257, r'must be uint8 .*got uint16; read 8 bits with '
                                       r'cv2.imread\(path\)'),
    (_image(0).astype('int64'), 'must be uint8 .*got int64; read images with cv2.imread'),
    (np.zeros((0, 0, 3), 'uint8'), r'image 0: the array is empty \(shape \[0, 0, 3\]\)'),
    (None, r'got None \(cv2.imread returns None'),
    ([None], r'image 0: got None \(cv2.imread returns None'),
    (7, 'expected an image path, a BGR numpy array or a list of them, got int'),
])
def test_an_array_cv2_imread_would_not_give_is_refused_not_misread(image, message):
    """A float image in [0, 1] or a 16-bit one would be taken as 0-255 values: other classes,
    no error (the labels of the uint8 image agree on 88% / 81% of the pixels)."""
    seg = _channel_segmenter()
    with pytest.raises(DeployError, match=message):
        seg(image)
    with pytest.raises(DeployError, match=message):
        seg.logits(image)
    # The uint8 image itself: the argmax of its own normalised R, G, B.
    want = np.argmax(_image(0)[:, :, ::-1], axis=2)
    np.testing.assert_array_equal(seg(_image(0)), want)


@pytest.mark.parametrize('count, batch_size, want', [
    (4, 3, [3, 1]), (7, 2, [2, 2, 2, 1]), (3, 3, [3]), (2, 1, [1, 1])])
def test_a_run_holds_at_most_batch_size_images(count, batch_size, want):
    seg = _channel_segmenter(batch_size=batch_size)
    images = [_image(i) for i in range(count)]
    labels = seg(images)
    assert seg.runner.batches == want
    for image, label in zip(images, labels):
        np.testing.assert_array_equal(label, np.argmax(image[:, :, ::-1], axis=2))


@pytest.mark.parametrize('height, width', [(12, 20), (13, 21), (7, 31)])
def test_scores_of_a_model_whose_output_is_smaller_come_back_at_the_image_size(height, width):
    """A model whose output is a quarter of its input (every other pixel): logits and labels
    are resized to the image (bilinear, as paddleseg's F.interpolate), the labels their
    argmax there."""
    seg = _channel_segmenter(stride=2)
    image = _image(3, height, width)
    x = ((image[:, :, ::-1].astype('float32') / 255 - 0.5) / 0.5).transpose(2, 0, 1)[None]
    small = paddle.to_tensor(np.ascontiguousarray(x[:, :, ::2, ::2]))
    want = F.interpolate(small, (height, width), mode='bilinear',
                         align_corners=False).numpy()[0]
    logits = seg.logits(image)
    assert logits.shape == (3, height, width)
    np.testing.assert_allclose(logits, want, atol=1e-5)
    assert_logits_agree(seg(image), want, 1e-5, 'labels', class_axis=0, min_clear=0.8)


@pytest.mark.parametrize('own', [
    'my: settings\n',                     # the user's own YAML
    'Deploy:\n  transforms: []\n',        # a Deploy section that names no model
    b'\xff\xfe not text',                 # not even text
])
def test_from_config_leaves_a_deploy_yaml_of_the_users_as_it_was(trained, tmp_path, own):
    folder = tmp_path / 'mine'
    folder.mkdir()
    mine = folder / 'deploy.yaml'
    (mine.write_bytes if isinstance(own, bytes) else mine.write_text)(own)
    before = mine.read_bytes()
    with pytest.raises(Exception, match=f'^save_dir {folder} holds deploy.yaml of no export '
                       r'\(no deploy.yaml with a `Deploy:` section naming model and params\): '
                       'an export would replace them; pass a new or empty folder'):
        Segmenter.from_config(MINI_CONFIG, trained[1], save_dir=str(folder), cpu_threads=1)
    assert mine.read_bytes() == before and os.listdir(folder) == ['deploy.yaml']


def test_an_export_folder_is_exported_into_again(checkpoint, tmp_path):
    """The folder of an export (its deploy.yaml names model and params) is replaced."""
    from psanet.export import check_export_dir
    check_export_dir(checkpoint[2])  # raises nothing


@pytest.mark.parametrize('backend', ['dynamic', 'tensorrt', 'Paddle'])
def test_an_unknown_backend_is_refused_before_any_export(trained, tmp_path, backend):
    """Before the export (12 s), and with 'dygraph' among the choices."""
    with pytest.raises(DeployError, match=r"^backend must be one of \('dygraph', 'paddle', "
                       rf"'onnxruntime', 'openvino'\) \(or None: .*got '{backend}'"):
        Segmenter.from_config(MINI_CONFIG, trained[1], backend=backend,
                              save_dir=str(tmp_path / 'export'))
    assert not os.path.exists(tmp_path / 'export')


@pytest.mark.parametrize('runtime', EXPORT_BACKENDS[2:])
def test_openvino_is_asked_for_f32_on_any_cpu(checkpoint, monkeypatch, runtime):
    """On a CPU with bfloat16 instructions OpenVINO runs in bf16 unless told f32, and the
    classes move (the agreement test above catches that only there): on any CPU, what
    OpenVINO is asked for, and what the compiled model says it runs in, is f32."""
    import openvino
    asked = []

    class Core(openvino.Core):
        def compile_model(self, model, device_name=None, config=None):
            asked.append((device_name, dict(config or {})))
            return super().compile_model(model, device_name, config or {})

    monkeypatch.setattr(openvino, 'Core', Core)
    runner = backends.create_runner(DeployConfig(checkpoint[2]), runtime,
                                    backends.PredictorOptions(cpu_threads=1))
    assert [(device, config.get('INFERENCE_PRECISION_HINT')) for device, config in asked] == \
        [('CPU', 'f32')]
    assert runner.compiled.get_property('INFERENCE_PRECISION_HINT') == openvino.Type.f32


# --- A new user's mistakes with an export: each one line ----------------------------------

def _copy_export(export, folder, **entries):
    """A copy of the export's files, deploy.yaml's Deploy section updated with ``entries``
    (None deletes one)."""
    import shutil
    import yaml
    shutil.copytree(export, folder)
    with open(os.path.join(folder, 'deploy.yaml')) as f:
        dic = yaml.safe_load(f)
    for key, value in entries.items():
        if value is None:
            dic['Deploy'].pop(key, None)
        else:
            dic['Deploy'][key] = value
    with open(os.path.join(folder, 'deploy.yaml'), 'w') as f:
        yaml.safe_dump(dic, f)
    return str(folder)


@pytest.mark.parametrize('cpu_threads', [0, -2, True, 1.5])
def test_cpu_threads_below_one_is_refused_not_taken_as_the_default(checkpoint, cpu_threads):
    with pytest.raises(DeployError, match=r"^cpu_threads must be an integer >= 1 \(or None: "
                       r"PaddleSeg's 10, or the CPUs this process may use when fewer, \d+ "
                       rf"here\), got {cpu_threads!r}\.$"):
        Segmenter.from_export(checkpoint[2], backend='paddle', cpu_threads=cpu_threads)


def test_an_inference_option_that_does_not_exist_is_named(trained):
    with pytest.raises(Exception, match=r"^inference= has no option 'flip'; its options "
                       r"\(InferenceOptions' fields\) are \['aug_eval', .*'flip_horizontal'"):
        Segmenter.from_config(MINI_CONFIG, trained[1], backend='dygraph',
                              inference={'flip': True})


@pytest.mark.parametrize('name', ['model.pdparams', 'model.pdiparams', 'model.json',
                                  'model.onnx'])
def test_a_model_file_given_for_the_export_names_what_to_pass(checkpoint, tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b'\x80\x04 pickled weights')
    with pytest.raises(DeployError, match=f'^{path} is a model file, not a deploy.yaml: pass '
                       f"the export's folder \\({tmp_path}\\) or its deploy.yaml; a checkpoint"):
        Segmenter.from_export(str(path))


@pytest.mark.parametrize('entries, message', [
    ({'model': ['model.json']}, r"Deploy.model must be a file name such as model.json, got "
                                r"\['model.json'\]"),
    ({'params': 7}, 'Deploy.params must be a file name such as model.pdiparams, got 7'),
    ({'onnx': {'file': 'model.onnx'}}, 'Deploy.onnx must be a file name such as model.onnx'),
    ({'num_classes': 'many'}, "Deploy.num_classes must be a positive integer, got 'many'"),
    ({'num_classes': 0}, 'Deploy.num_classes must be a positive integer, got 0'),
    ({'min_input_size': 0}, 'Deploy.min_input_size must be a positive integer, got 0'),
    ({'min_input_size': '5'}, "Deploy.min_input_size must be a positive integer, got '5'"),
])
def test_a_deploy_yaml_entry_of_the_wrong_kind_is_named(checkpoint, tmp_path, entries, message):
    folder = _copy_export(checkpoint[2], tmp_path / 'export', **entries)
    with pytest.raises(DeployError, match=f'^{folder}/deploy.yaml: {message}.*: fix it or '
                       'export the model again.$'):
        Segmenter.from_export(folder, backend='paddle')


@pytest.mark.parametrize('runtime', EXPORT_BACKENDS[1:])
@pytest.mark.parametrize('int8', [False, True])
def test_a_deleted_onnx_file_is_called_missing_not_unnamed(checkpoint, tmp_path, runtime, int8):
    entries = {'onnx_int8': 'model_int8.onnx'} if int8 else {}
    folder = _copy_export(checkpoint[2], tmp_path / 'export', **entries)
    name = 'model_int8.onnx' if int8 else 'model.onnx'
    if os.path.exists(os.path.join(folder, name)):
        os.remove(os.path.join(folder, name))
    with pytest.raises(DeployError, match=f'^{folder}/deploy.yaml names {name}, which is '
                       rf'missing \({folder}/{name}\); copy the whole export folder'):
        Segmenter.from_export(folder, backend=runtime, int8=int8)


@pytest.mark.parametrize('runtime', EXPORT_BACKENDS[1:])
@pytest.mark.parametrize('name', ['model.onnx', 'model_int8.onnx'])
@pytest.mark.parametrize('keep', [0, 1000])
def test_an_empty_or_cut_short_onnx_file_is_one_line(checkpoint, tmp_path, runtime, name,
                                                     keep):
    folder = _copy_export(checkpoint[2], tmp_path / 'export',
                          **({'onnx_int8': name} if 'int8' in name else {}))
    with open(os.path.join(checkpoint[2], 'model.onnx'), 'rb') as f:
        data = f.read()[:keep]
    with open(os.path.join(folder, name), 'wb') as f:
        f.write(data)
    what = 'is empty' if keep == 0 else f'\\({keep} bytes\\) cannot be read as an ONNX model'
    runtime_name = {'onnxruntime': 'onnxruntime', 'openvino': 'OpenVINO'}[runtime]
    with pytest.raises(DeployError, match=f'^{folder}/{name} {what} by {runtime_name} .*: it '
                       r'was cut short .*export the model again'):
        Segmenter.from_export(folder, backend=runtime, int8='int8' in name, cpu_threads=1)


@pytest.mark.parametrize('runtime', EXPORT_BACKENDS)
def test_an_image_too_small_for_the_model_is_refused_before_it_runs_in_every_runtime(
        checkpoint, runtime, monkeypatch):
    """deploy.yaml's min_input_size (5 for the mini PSANet's output stride 8): a smaller side
    is one line naming the image and the size to reach, in every runtime, before the runner
    runs; the smallest size runs and agrees with the dygraph model."""
    model, _, export, _ = checkpoint
    assert DeployConfig(export).min_input_size == model.min_input_size() == 5
    seg = Segmenter.from_export(export, backend=runtime, cpu_threads=1)
    ran, run = [], seg.runner.run
    monkeypatch.setattr(seg.runner, 'run', lambda batch: ran.append(batch.shape) or run(batch))
    for height, width in ((1, 1), (4, 9), (9, 4)):
        with pytest.raises(DeployError) as error:
            seg([_image(5, 8, 8), _image(height * width, height, width)])
        assert str(error.value) == (
            f'image 1: a {width}x{height} network input (after the transforms) is too small for '
            'this model, which needs at least 5 pixels a side (deploy.yaml\'s min_input_size): '
            'pass a larger image, or scale it up to at least 5x5 first (cv2.resize).')
    assert ran == []  # not even the 8x8 image before it
    for height, width in ((5, 5), (5, 9), (9, 5)):
        image = _image(height * width, height, width)
        label = seg(image)
        assert label.shape == (height, width)
        assert_logits_agree(label, _model_logits(model, _normalized(image))[0],
                            MINI_PSANET_RTOL, f'{runtime} {height}x{width}', class_axis=0,
                            min_clear=0.0)


@pytest.mark.skipif(bool(_runtime_missing('openvino')), reason=_runtime_missing('openvino'))
@pytest.mark.parametrize('cpu_threads', [1, 2])
def test_the_smallest_input_is_the_smallest_openvino_runs(checkpoint, cpu_threads):
    """The geometry behind min_input_size, seen in OpenVINO itself (its runner, the check
    bypassed): a side of 4 fails (no output, or its AvgPool kernel's RuntimeError, depending
    on the threads), 5 runs."""
    _, _, export, _ = checkpoint
    seg = Segmenter.from_export(export, backend='openvino', cpu_threads=cpu_threads)
    for height, width in ((4, 12), (12, 4), (4, 4)):
        with pytest.raises((DeployError, RuntimeError)) as error:
            seg.runner.run(np.zeros((1, 3, height, width), 'float32'))
        assert 'AvgPool' in str(error.value) or 'cannot run an input this small' in \
            str(error.value), error.value
    for height, width in ((5, 12), (12, 5), (5, 5)):
        assert seg.runner.run(np.zeros((1, 3, height, width), 'float32')).shape == (
            1, 19, height, width)


def test_a_folder_given_as_an_image_is_named_with_a_list_that_works(checkpoint, tmp_path,
                                                                    monkeypatch):
    """Refused before any image runs, naming its images and a list to pass instead; that list,
    evaluated, segments them."""
    import glob
    import re
    import shutil
    _, seg, _, paths = checkpoint
    folder = tmp_path / 'photos'
    folder.mkdir()
    for name, path in zip(('a.png', 'b.png'), paths):
        shutil.copy(path, folder / name)
    ran, run = [], seg.runner.run
    monkeypatch.setattr(seg.runner, 'run', lambda batch: ran.append(batch.shape) or run(batch))

    def refused(images):
        with pytest.raises(DeployError) as error:
            seg(images)
        return str(error.value)

    message = refused(paths + [str(folder)])  # after a full batch of two and one more
    assert message == (f'image {folder} is a folder, not an image (2 images in it, such as '
                       f'{folder}/a.png): pass a list of its images, e.g. '
                       f"seg(sorted(glob.glob('{folder}/*.png'))).")
    assert ran == []
    (folder / 'day').mkdir()
    shutil.copy(paths[2], folder / 'day' / 'c.png')
    message = refused(str(folder))
    assert f"glob.glob('{folder}/**/*.png', recursive=True)" in message, message
    call = re.search(r'e\.g\. seg\((.*)\)\.$', message).group(1)
    listed = eval(call, {'glob': glob})  # the suggestion, as the user would paste it
    assert sorted(listed) == sorted(str(p) for p in (folder / 'a.png', folder / 'b.png',
                                                     folder / 'day' / 'c.png'))
    assert [label.shape for label in seg(listed)] == [cv2.imread(p).shape[:2] for p in listed]
    empty = tmp_path / 'empty'
    empty.mkdir()
    assert refused(str(empty)) == (f'image {empty} is a folder, and it holds no images: pass '
                                   'the path of an image file, or a list of them.')


def test_an_image_whose_attention_does_not_fit_is_refused_before_it_runs(checkpoint,
                                                                         monkeypatch):
    """The export route checks the memory as predict.py does: the need is the dygraph model's
    own plan (PSANet.attention_memory), the memory stood in (an 8000x8000 image of the mini PSANet
    needs 0.45 TiB; the runner is stood in too)."""
    from psanet.deploy import attention_memory as memory
    model, _, export, _ = checkpoint
    seg = Segmenter.from_export(export, backend='paddle', cpu_threads=1)
    ran = []
    monkeypatch.setattr(seg.runner, 'run',
                        lambda batch: ran.append(batch.shape) or np.zeros(len(batch)))
    for height, width in ((8000, 8000), (300, 410)):
        need = model.attention_memory(height, width).peak_bytes
        monkeypatch.setattr(memory, 'host_memory_available', lambda: need - 1)
        batch = np.zeros((1, 3, height, width), 'float32')
        with pytest.raises(DeployError, match=rf'^a {width}x{height} network input \(after the '
                           r'transforms\) needs [\d.]+ [GMKT]iB for the model\'s attention maps, '
                           r'but only .* of host memory is available: use smaller images .*'
                           r'inference=\{"is_slide": True, "crop_size": \[\d+, \d+\]'):
            seg.run(batch)
        monkeypatch.setattr(memory, 'host_memory_available', lambda: need)
        seg.run(batch)  # what fits runs
    assert ran == [(1, 3, 8000, 8000), (1, 3, 300, 410)]
