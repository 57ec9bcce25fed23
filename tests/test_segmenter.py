"""The Python API (psanet.Segmenter): a checkpoint and an export in every installed runtime
against the dygraph model, batching over images of two sizes, logits at the image's size,
the default runtime, and its one-line errors (bad images, a runtime not installed)."""
import importlib.util
import os

import cv2
import numpy as np
import paddle
import pytest

from psanet import Segmenter
from psanet.deploy import runtimes
from psanet.deploy.processing import restore_logits
from psanet.errors import DeployError
from conftest import (MINI_CONFIG, MINI_PSANET_RTOL, assert_logits_agree, infer_in_process,
                      onnx_tools_missing)
from engine_helpers import assert_saved_masks_agree, dygraph_logits, mini_psanet_for_eval

SIZES = [(96, 64), (96, 64), (64, 48)]  # width, height: two of one size, then another
needs_onnx = pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ('paddle2onnx', 'onnxruntime')),
    reason='paddle2onnx and onnxruntime are not installed (no Python 3.13 wheels yet)')


def _runtime_param(runtime):
    if runtime == 'paddle':
        return runtime
    if not runtimes.installed(runtime):
        reason = f'{runtime} is not installed (pip install {runtimes.PACKAGES[runtime]})'
    else:  # the checkpoint fixture's export has model.onnx only where paddle2onnx is
        reason = onnx_tools_missing()
    return pytest.param(runtime, marks=pytest.mark.skipif(bool(reason), reason=reason))


RUNTIMES = [_runtime_param(r) for r in runtimes.RUNTIMES]


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
    """(model, Segmenter.from_config of its weights, the export it made, image paths)."""
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
    paddle.seed(123)  # the model from_config builds starts from other weights
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


@pytest.mark.parametrize('runtime', RUNTIMES)
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


@pytest.mark.parametrize('backend', RUNTIMES[1:])
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
    monkeypatch.setattr(runtimes, 'installed', lambda name: name == 'paddle')
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
def test_the_default_runtime_is_the_fastest_installed(checkpoint, monkeypatch):
    _, _, export, _ = checkpoint
    from psanet.deploy.config import DeployConfig
    deploy = DeployConfig(export)
    fastest = 'openvino' if runtimes.installed('openvino') else 'onnxruntime'
    assert runtimes.default_runtime(deploy) == fastest
    assert runtimes.default_runtime(deploy, device='gpu') == 'paddle'
    monkeypatch.setattr(runtimes, 'installed', lambda runtime: runtime != 'openvino')
    assert runtimes.default_runtime(deploy) == 'onnxruntime'
    monkeypatch.setattr(runtimes, 'installed', lambda runtime: runtime == 'paddle')
    assert runtimes.default_runtime(deploy) == 'paddle'
    monkeypatch.setitem(deploy.dic, 'onnx', None)
    monkeypatch.setattr(runtimes, 'installed', lambda runtime: True)
    assert runtimes.default_runtime(deploy) == 'paddle'  # no model.onnx to run


@pytest.mark.parametrize('runtime', ['onnxruntime', 'openvino'])
def test_a_runtime_not_installed_names_its_package(checkpoint, monkeypatch, runtime):
    _, _, export, _ = checkpoint
    monkeypatch.setattr(runtimes, 'installed', lambda name: name == 'paddle')
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
    with pytest.raises(DeployError, match='batch_size must be >= 1'):
        Segmenter.from_export(export, backend='paddle', batch_size=0)
    with pytest.raises(DeployError, match='backend must be one of'):
        Segmenter.from_export(export, backend='tensorrt')
    monkeypatch.setitem(seg.deploy.dic, 'output_op', 'argmax')
    with pytest.raises(DeployError, match='--output_op none'):
        seg.logits(checkpoint[3][0])
