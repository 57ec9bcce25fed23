"""deploy/python/infer.py under bad inputs: a cut-short model.pdiparams, missing or broken
export files, a --save_dir that is a file, and unreadable images among good ones."""
import os
import re
import shutil
import sys

import cv2
import numpy as np
import pytest

from conftest import INFER_SCRIPT as INFER, run_process
from conftest import MINI_PSANET_RTOL, ROOT, infer_in_process
from engine_helpers import assert_saved_masks_agree, mini_psanet_for_eval
from psanet.deploy.deploy_config import check_params_file
from psanet.export import ExportOptions, export_model

IMAGE_SIZE = (96, 64)  # width, height


def write_image(path, seed):
    small = np.random.RandomState(seed).randint(0, 256, (4, 6, 3)).astype('uint8')
    cv2.imwrite(str(path), cv2.resize(small, IMAGE_SIZE, interpolation=cv2.INTER_CUBIC))
    return str(path)


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
    """The mini PSANet and its pure-Paddle argmax export."""
    root = tmp_path_factory.mktemp('deploy_faults')
    model = mini_psanet_for_eval(seed=3)
    save_dir = str(root / 'export')
    export_model(model, [{'type': 'Normalize'}], save_dir, ExportOptions(psa_impl='paddle'),
                 num_classes=19)
    return model, save_dir


def copy_export(source, target, cut_params=None, cut_model=None):
    """A copy of an export, with model.pdiparams / model.json cut to so many bytes."""
    os.makedirs(target)
    for name in ('deploy.yaml', 'model.json', 'model.pdiparams'):
        shutil.copy(os.path.join(source, name), target)
    for name, cut in (('model.pdiparams', cut_params), ('model.json', cut_model)):
        if cut is not None:
            path = os.path.join(target, name)
            with open(path, 'rb') as f:
                data = f.read()
            with open(path, 'wb') as f:
                f.write(data[:cut])
    return os.path.join(target, 'deploy.yaml')


def test_a_complete_parameters_file_passes(exported):
    check_params_file(os.path.join(exported[1], 'model.pdiparams'))


@pytest.mark.parametrize('cut', ['empty', 'header', 'middle', 'last tensor'])
def test_cut_short_parameters_are_named(exported, tmp_path, capfd, cut):
    _, save_dir = exported
    size = os.path.getsize(os.path.join(save_dir, 'model.pdiparams'))
    keep = {'empty': 0, 'header': 10, 'middle': size // 3, 'last tensor': size - 100}[cut]
    deploy = copy_export(save_dir, str(tmp_path / 'cut'), cut_params=keep)
    params = os.path.join(tmp_path, 'cut', 'model.pdiparams')
    image = write_image(tmp_path / 'a.png', 0)
    code, out, err = infer_in_process(capfd, '--config', deploy, '--image_path', image,
                                      '--save_dir', tmp_path / 'out')
    assert code == 2 and 'Traceback' not in err
    line, = err.strip().splitlines()
    assert line.startswith(f'error: the parameters file {params} ')
    assert 'export the model again' in line and 'export.py' in line
    assert not (tmp_path / 'out').exists()


def test_cut_short_parameters_on_the_command_line(exported, tmp_path):
    """The case as reported: infer.py said only '(Unavailable) Cannot read tensor desc size'."""
    _, save_dir = exported
    deploy = copy_export(save_dir, str(tmp_path / 'cut'), cut_params=1000000)
    image = write_image(tmp_path / 'a.png', 0)
    done = run_process([sys.executable, INFER, '--config', deploy, '--image_path', image,
                        '--save_dir', str(tmp_path / 'out')], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith('error:')]
    assert len(errors) == 1 and 'Traceback' not in done.stderr
    assert os.path.join(tmp_path, 'cut', 'model.pdiparams') in errors[0]
    assert 'export.py' in errors[0]


def test_missing_and_broken_export_files_are_named(exported, tmp_path, capfd):
    _, save_dir = exported
    image = write_image(tmp_path / 'a.png', 0)
    cases = []
    deploy = copy_export(save_dir, str(tmp_path / 'no_params'))
    os.remove(os.path.join(tmp_path, 'no_params', 'model.pdiparams'))
    cases.append((deploy, ['model file not found', 'model.pdiparams', 'Export']))
    deploy = copy_export(save_dir, str(tmp_path / 'no_graph'))
    os.remove(os.path.join(tmp_path, 'no_graph', 'model.json'))
    cases.append((deploy, ['model file not found', 'model.json', 'Export']))
    deploy = copy_export(save_dir, str(tmp_path / 'cut_graph'), cut_model=1000)
    cases.append((deploy, ['cannot read the model graph',
                           os.path.join(tmp_path, 'cut_graph', 'model.json'), 'export.py']))
    cases.append((str(tmp_path / 'nowhere' / 'deploy.yaml'),
                  ['deploy config not found', str(tmp_path / 'nowhere' / 'deploy.yaml')]))
    for deploy, words in cases:
        code, out, err = infer_in_process(capfd, '--config', deploy, '--image_path', image,
                                          '--save_dir', tmp_path / 'out')
        assert code == 2 and 'Traceback' not in err
        line, = err.strip().splitlines()
        assert all(word in line for word in words), line


def test_save_dir_that_is_a_file(exported, tmp_path, capfd):
    _, save_dir = exported
    image = write_image(tmp_path / 'a.png', 0)
    taken = tmp_path / 'taken'
    taken.write_text('keep me')
    code, out, err = infer_in_process(capfd, '--config', save_dir, '--image_path', image,
                                      '--save_dir', taken)
    assert code == 2
    assert err.strip().splitlines() == [
        f'error: --save_dir {taken} is a file, not a folder: pass a folder (it is created when '
        'missing) or move the file away.']
    assert taken.read_text() == 'keep me'


@pytest.mark.parametrize('batch_size', [1, 2])
def test_unreadable_images_are_skipped_and_reported(exported, tmp_path, capfd, batch_size):
    model, save_dir = exported
    images = tmp_path / 'images'
    images.mkdir()
    good = [write_image(images / name, seed) for seed, name in
            enumerate(['a.png', 'c.png', 'd.jpg'])]
    bad = str(images / 'b.png')
    (images / 'b.png').write_bytes(b'\x89PNG\r\n\x1a\n cut short')
    out = tmp_path / 'out'
    code, stdout, err = infer_in_process(capfd, '--config', save_dir, '--image_path', images,
                                         '--save_dir', out, '--batch_size', batch_size,
                                         '--benchmark', 'True')
    assert code == 2 and 'Traceback' not in err
    assert len([line for line in stdout.splitlines() if f'cannot read image {bad}' in line]) == 1
    # (libpng may add its own line about the file to stderr; ours is the one error line.)
    assert [line for line in err.splitlines() if line.startswith('error:')] == [
        f'error: 3 of 4 images written to {out}; image {bad} cannot be read (corrupt or not an '
        'image): replace it or leave it out of --image_path.']
    assert 'ms per image over 3 images' in stdout
    assert_saved_masks_agree(out, good, model, MINI_PSANET_RTOL)
    for path in good:
        name = os.path.basename(path)
        assert cv2.imread(str(out / 'added_prediction' / name)).shape == (64, 96, 3)
    assert sorted(os.listdir(out / 'added_prediction')) == ['a.png', 'c.png', 'd.jpg']


def test_a_batch_of_mixed_sizes_names_each_image(exported, tmp_path, capfd):
    _, save_dir = exported
    folder = tmp_path / 'mixed'
    folder.mkdir()
    write_image(folder / 'a.png', 0)
    small = np.random.RandomState(1).randint(0, 256, (40, 56, 3)).astype('uint8')
    cv2.imwrite(str(folder / 'b.png'), small)
    code, _, err = infer_in_process(capfd, '--config', save_dir, '--image_path', folder,
                                    '--batch_size', 2, '--save_dir', tmp_path / 'out')
    assert code == 2
    width, height = IMAGE_SIZE
    assert err.strip().splitlines()[-1] == (
        'error: the images of one batch must have one size after the transforms, got '
        f'a.png {width}x{height}, b.png 56x40; use --batch_size 1, or images of one size.')


def _small_psanet_export(folder, psa_channels):
    import paddle
    from paddleseg.models.backbones import ResNet18_vd
    from psanet.models import PSANet
    paddle.seed(psa_channels)
    model = PSANet(5, ResNet18_vd(output_stride=16), psa_type=0, mask_h=5, mask_w=5,
                   psa_channels=psa_channels, shrink_factor=3)
    model.eval()
    export_model(model, [{'type': 'Normalize'}], str(folder), ExportOptions(psa_impl='paddle'),
                 num_classes=5)
    return str(folder)


def test_parameters_of_another_model_are_refused_naming_both_files(tmp_path, capfd):
    """A psa_channels=16 export's model.pdiparams beside an 8-channel model.json: Paddle
    Inference would run it (0-3% of pixels right); the graph's parameter shapes tell."""
    narrow = _small_psanet_export(tmp_path / 'narrow', 8)
    wide = _small_psanet_export(tmp_path / 'wide', 16)
    check_params_file(os.path.join(narrow, 'model.pdiparams'), os.path.join(narrow, 'model.json'))
    mixed = copy_export(narrow, str(tmp_path / 'mixed'))
    shutil.copy(os.path.join(wide, 'model.pdiparams'), os.path.join(tmp_path, 'mixed'))
    image = write_image(tmp_path / 'a.png', 0)
    code, _, err = infer_in_process(capfd, '--config', mixed, '--image_path', image,
                                    '--save_dir', tmp_path / 'out')
    line, = err.strip().splitlines()
    assert code == 2 and 'Traceback' not in err
    params, graph = (os.path.join(tmp_path, 'mixed', name)
                     for name in ('model.pdiparams', 'model.json'))
    assert line.startswith(f'error: the parameters file {params} does not fit the graph {graph}:')
    # (Paddle loads the file's tensors in the order of the graph's parameter names.)
    assert re.search(r'\d+ tensors have another shape, such as \S+ \(graph \[\d+(, \d+)*\], '
                     r'file \[\d+(, \d+)*\]\)', line), line
    assert 'copy model.json and model.pdiparams of one export together' in line
    assert not (tmp_path / 'out').exists()


def _edited_export(exported, target, edit=None, raw=None):
    """A copy of the export whose deploy.yaml has ``edit(Deploy section)`` applied, or is
    ``raw`` bytes."""
    import yaml
    deploy = copy_export(exported[1], str(target))
    if raw is not None:
        with open(deploy, 'wb') as f:
            f.write(raw)
        return deploy
    with open(deploy) as f:
        dic = yaml.safe_load(f)
    edit(dic['Deploy'])
    with open(deploy, 'w') as f:
        yaml.safe_dump(dic, f)
    return deploy


def test_bad_deploy_yaml_values_are_one_line(exported, tmp_path, capfd):
    image = write_image(tmp_path / 'a.png', 0)
    latin1 = 'Deploy:\n  model: model.json # Stra\xdfe\n'.encode('latin-1')
    cases = [
        ('latin1', None, latin1, f'is not UTF-8 text (byte {latin1.index(bytes([0xdf]))}): save '
         'it as UTF-8, or export the model again.'),
        ('letters', lambda d: d.update(input_shape=['a', 'b', 'c', 'd']), None,
         "Deploy.input_shape must be four integers N, 3, H, W (-1 for a dynamic one), got "
         "['a', 'b', 'c', 'd']"),
        ('three', lambda d: d.update(input_shape=[1, 3, 64]), None,
         'Deploy.input_shape must be four integers'),
        ('mean', lambda d: d.update(transforms=[{'type': 'Normalize', 'mean': 'abc'}]), None,
         "Deploy.transforms [{'mean': 'abc', 'type': 'Normalize'}] fail on an image"),
    ]
    for name, edit, raw, words in cases:
        deploy = _edited_export(exported, tmp_path / name, edit, raw)
        code, _, err = infer_in_process(capfd, '--config', deploy, '--image_path', image,
                                        '--save_dir', tmp_path / 'out')
        assert code == 2 and 'Traceback' not in err, err
        line, = err.strip().splitlines()
        assert line.startswith(f'error: {deploy}') and words in line, line
    assert not (tmp_path / 'out').exists()


def test_more_cpu_threads_than_cores_are_cut_to_the_cores(caplog, monkeypatch):
    from psanet.deploy.predictor import PredictorOptions
    from psanet.log import get_logger
    cores = len(os.sched_getaffinity(0))
    # The psanet logger stops propagating once a run has set it up: caplog's handler goes on it.
    monkeypatch.setattr(get_logger(), 'handlers', get_logger().handlers + [caplog.handler])
    with caplog.at_level('WARNING', logger='psanet'):
        options = PredictorOptions(cpu_threads=4096)
    assert options.cpu_threads == cores
    assert f'--cpu_threads 4096 is more than the {cores} cores' in caplog.text
    assert PredictorOptions(cpu_threads=cores).cpu_threads == cores


def test_paddle_alone_loads_a_file_cut_inside_its_last_tensor(exported, tmp_path):
    """Why check_params_file walks the file: Paddle Inference builds a predictor from a
    model.pdiparams cut inside its last tensor without a word, and for one cut earlier says
    only 'Cannot read tensor desc size', naming no file. Fails once Paddle tells (then the
    walk can go, docs/design.md)."""
    from paddle import inference
    _, save_dir = exported
    size = os.path.getsize(os.path.join(save_dir, 'model.pdiparams'))
    for cut, says in ((size - 100, None), (size // 3, 'Cannot read tensor desc size')):
        folder = tmp_path / str(cut)
        copy_export(save_dir, str(folder), cut_params=cut)
        config = inference.Config(str(folder / 'model.json'), str(folder / 'model.pdiparams'))
        config.disable_gpu()
        config.disable_glog_info()
        if says is None:
            inference.create_predictor(config)
        else:
            with pytest.raises(Exception, match=says) as caught:
                inference.create_predictor(config)
            assert 'model.pdiparams' not in str(caught.value)
