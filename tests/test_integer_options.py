"""Every integer option refuses a bool, a float, a string and a value below its minimum
with one line naming the option (psanet.errors.is_integer, the one check)."""
import json
import os

import numpy as np
import pytest

from psanet import Segmenter
from psanet.errors import ArgumentError, CheckpointError, ConfigError, DeployError, is_integer

# True is 1 and 2.7 truncates to 2 under int(): both must be refused, never taken.
NOT_INTEGERS = [True, False, 2.7, 2.0, '2', None, np.bool_(True), np.float32(3)]


@pytest.mark.parametrize('value', NOT_INTEGERS)
def test_a_bool_a_float_or_a_string_is_no_integer(value):
    assert not is_integer(value)
    assert not is_integer(value, 0)


@pytest.mark.parametrize('value, minimum, verdict', [
    (0, None, True), (-3, None, True), (2, 1, True), (1, 1, True), (0, 1, False),
    (-1, 0, False), (np.int64(5), 1, True), (np.uint8(0), 1, False), (10 ** 20, 1, True),
])
def test_integers_at_or_above_the_minimum_pass(value, minimum, verdict):
    assert is_integer(value, minimum) is verdict


class _Identity:
    def run(self, batch):
        return batch


def _segmenter(batch_size):
    return Segmenter(_Identity(), transforms=None, batch_size=batch_size)


def _fake_export(folder):
    """A deploy.yaml and (empty) model files: enough for the options checked before a
    runner is built."""
    folder.mkdir()
    for name in ('model.json', 'model.pdiparams'):
        (folder / name).write_bytes(b'')
    (folder / 'deploy.yaml').write_text(
        'Deploy:\n  model: model.json\n  params: model.pdiparams\n  transforms: []\n')
    return str(folder)


BAD_COUNTS = NOT_INTEGERS[:5] + [0, -1]


@pytest.mark.parametrize('batch_size', BAD_COUNTS)
def test_batch_size_must_be_an_integer_of_one_or_more(tmp_path, batch_size):
    line = (f"batch_size must be an integer >= 1 (images per run), got {batch_size!r}: pass "
            f"a whole number such as 1.")
    with pytest.raises(DeployError) as error:
        _segmenter(batch_size)
    assert str(error.value) == line
    with pytest.raises(DeployError) as error:
        Segmenter.from_export(_fake_export(tmp_path / 'export'), backend='paddle',
                              batch_size=batch_size)
    assert str(error.value) == line


def test_a_numpy_integer_batch_size_is_taken_as_an_int():
    seg = _segmenter(np.int64(3))
    assert seg.batch_size == 3 and type(seg.batch_size) is int


@pytest.mark.parametrize('cpu_threads', [True, 2.7, '2', 0, -2])
def test_cpu_threads_must_be_an_integer_of_one_or_more(tmp_path, cpu_threads):
    with pytest.raises(DeployError, match=rf"^cpu_threads must be an integer >= 1 \(or None: "
                       rf".*\), got {cpu_threads!r}\.$"):
        Segmenter.from_export(_fake_export(tmp_path / 'export'), backend='paddle',
                              cpu_threads=cpu_threads)


@pytest.mark.parametrize('cpu_threads', [True, 2.7, '2', 0])
def test_predictor_cpu_threads_must_be_an_integer_of_one_or_more(cpu_threads):
    from psanet.deploy.predictor import PredictorOptions
    with pytest.raises(DeployError, match=rf'^--cpu_threads must be an integer >= 1, got '
                       rf'{cpu_threads!r}\.$'):
        PredictorOptions(cpu_threads=cpu_threads)


@pytest.mark.parametrize('batch_size', [True, 2.7, '2', 0])
def test_infer_batch_size_must_be_an_integer_of_one_or_more(tmp_path, batch_size):
    from psanet.deploy.infer_images import infer
    with pytest.raises(DeployError, match=rf'^--batch_size must be an integer >= 1, got '
                       rf'{batch_size!r}\.$'):
        infer(_fake_export(tmp_path / 'export'), str(tmp_path), str(tmp_path / 'out'),
              batch_size=batch_size)
    assert not os.path.exists(tmp_path / 'out')


@pytest.mark.parametrize('classes', [True, 2.7, 0])
def test_deploy_num_classes_must_be_a_positive_integer(tmp_path, classes):
    folder = _fake_export(tmp_path / 'export')
    with open(os.path.join(folder, 'deploy.yaml'), 'a') as f:
        f.write(f'  num_classes: {json.dumps(classes)}\n')
    with pytest.raises(DeployError, match=rf'Deploy.num_classes must be a positive integer, '
                       rf'got {classes!r}: fix it or export the model again.$'):
        Segmenter.from_export(folder, backend='paddle')


@pytest.mark.parametrize('num_classes', [True, 2.7, '19', 0])
def test_a_model_size_must_be_a_positive_integer(num_classes):
    from psanet.models.psanet import PSAHead
    with pytest.raises(ArgumentError, match=rf'^num_classes must be a positive integer, got '
                       rf'{num_classes!r}\.$'):
        PSAHead(num_classes, (4, 8), 2, 3, 3, 4, 1, None, True, True, False, False)


@pytest.mark.parametrize('iteration', [True, 2.5, '7', -1])
def test_a_checkpoint_iteration_must_be_a_non_negative_integer(tmp_path, iteration):
    from psanet.core.checkpoint import STATE_FILE, load_checkpoint
    for name in ('model.pdparams', 'model.pdopt'):
        (tmp_path / name).write_bytes(b'')
    (tmp_path / STATE_FILE).write_text(json.dumps({'iteration': iteration}))
    with pytest.raises(CheckpointError, match=rf'"iteration" must be a non-negative integer, '
                       rf'got {iteration!r}: pass another iter_N folder'):
        load_checkpoint(str(tmp_path))


@pytest.mark.parametrize('value', [True, 2.7, -1])
def test_mini_cityscapes_counts_must_be_integers(tmp_path, value):
    from psanet.data.mini_cityscapes import generate
    with pytest.raises(ValueError, match=rf'^num_train must be a non-negative int, got '
                       rf'{value!r}$'):
        generate(str(tmp_path / 'mini'), num_train=value)
    assert not os.path.exists(tmp_path / 'mini')


@pytest.mark.parametrize('num_workers', [True, 2.7, 0])
def test_prepare_cityscapes_workers_must_be_a_positive_integer(tmp_path, num_workers):
    from psanet.data.prepare_cityscapes import prepare_cityscapes
    with pytest.raises(ValueError, match=rf'^num_workers must be a positive int, got '
                       rf'{num_workers!r}$'):
        prepare_cityscapes(str(tmp_path), num_workers=num_workers)


@pytest.mark.parametrize('sample', [True, 2.7, 0])
def test_validate_sample_must_be_a_positive_integer(sample):
    from psanet.data.validate import validate_dataset
    with pytest.raises(ValueError, match=rf'^sample must be a positive int, got {sample!r}$'):
        validate_dataset(None, 19, check_labels='sample', sample=sample)


@pytest.mark.parametrize('stride', [True, 8.0, '8', 4])
def test_output_stride_must_be_an_integer_the_backbone_builds(stride):
    from psanet.core.config import _check_output_stride
    model = {'backbone': {'type': 'ResNet50_vd', 'output_stride': stride}}
    with pytest.raises(ConfigError, match=rf'^config c.yml: model.backbone.output_stride must be '
                       rf'one of 8, 16 for ResNet50_vd, got {stride!r} \(it builds no other '
                       rf'stride\)'):
        _check_output_stride(model, 'c.yml')
