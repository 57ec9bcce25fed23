"""A full disk under predict.py, val.py --save_dir, infer.py, a checkpoint, an export and the
data tools: the run ends with one line naming the folder and its free space, every file left
reads back whole (each output is written to a hidden file, then renamed: psanet.files), and
no temporary is left; the dataset check's cache, which is optional, falls back to the user
cache instead.

Each test mounts a small tmpfs itself and fills it (tests/disk_helpers.py)."""
import glob
import json
import os
import shutil

import cv2
import numpy as np
import paddle
import pytest
from PIL import Image

from conftest import (MINI_CONFIG, TINY_SEGNET_RTOL, cityscapes, generate_dataset,
                      infer_in_process, train_labels)
from engine_helpers import TinySegNet, assert_saved_masks_agree, mini_psanet_for_eval
from psanet.cli import run_cli
from psanet.contract import get_image_list
from psanet.core.checkpoint import WEIGHTS_FILE, save_checkpoint
from psanet.core.predict import predict
from psanet.core.val import evaluate_from_config
from psanet.data import prepare_cityscapes, validate_dataset
from psanet.data.prepare_cityscapes import LABEL_IDS_SUFFIX, label_ids_to_train_ids
from psanet.data.validate import CHECK_CACHE_NAME, TRAIN_IDS_SUFFIX
from psanet.export import ExportOptions, export_model
from paddleseg.transforms import Normalize
from disk_helpers import digests, fill, small_tmpfs, whole_files

NORMALIZE = [{'type': 'Normalize'}]


@pytest.fixture(scope='module')
def tiny():
    paddle.seed(5)
    model = TinySegNet(3)
    model.eval()
    return model


@pytest.fixture(scope='module')
def noisy_images(tmp_path_factory):
    """Six 160x120 PNGs of noise (about 57 KB each, so that an overlay needs room)."""
    folder = tmp_path_factory.mktemp('full_disk_images')
    rng = np.random.default_rng(0)
    for i in range(6):
        cv2.imwrite(str(folder / f'img_{i}.png'), rng.integers(0, 256, (120, 160, 3), np.uint8))
    return str(folder)


def one_error_line(err, code):
    """The one ``error:`` line (the progress bar shares stderr), with no traceback."""
    lines = [line for line in err.splitlines() if line.startswith('error: ')]
    assert code == 2 and len(lines) == 1 and 'Traceback' not in err, err
    return lines[0]


def assert_disk_full_line(line, folder):
    assert f'no space left in {folder}' in line and ' free)' in line, line
    assert 'Traceback' not in line


def assert_every_file_whole(folder):
    """No hidden temporary, and each PNG decodes to its end (PIL raises on one cut short)."""
    files = whole_files(folder)
    hidden = [path for path in files if os.path.basename(path).startswith('.')]
    assert not hidden, hidden
    for path in files:
        if path.endswith('.png'):
            with Image.open(path) as image:
                image.load()
    return files


def test_predict_on_a_full_disk(tmp_path, tiny, noisy_images, capsys):
    with small_tmpfs(tmp_path / 'disk', 1 << 20) as disk:
        fill(disk, 200 * 1024)
        save_dir = os.path.join(disk, 'result')
        code = run_cli(predict, tiny, [Normalize()], get_image_list(noisy_images), save_dir)
        line = one_error_line(capsys.readouterr().err, code)
        assert_disk_full_line(line, os.path.join(save_dir, 'added_prediction'))
        files = assert_every_file_whole(disk)
        masks = sorted(f for f in files if 'pseudo_color_prediction' in f)
        assert 0 < len(masks) < 6, files  # the disk filled up part way
        done = [os.path.join(noisy_images, os.path.basename(m)) for m in masks]
        assert_saved_masks_agree(save_dir, done, tiny, TINY_SEGNET_RTOL)


def test_predict_when_no_folder_can_be_made(tmp_path, tiny, noisy_images, capsys):
    """Out of inodes: making an output folder fails for lack of space too."""
    nested = tmp_path / 'nested'
    for city in ('a', 'b', 'c'):
        (nested / city).mkdir(parents=True)
        os.link(os.path.join(noisy_images, 'img_0.png'), nested / city / 'img.png')
    with small_tmpfs(tmp_path / 'disk', 1 << 20, inodes=5) as disk:
        save_dir = os.path.join(disk, 'result')
        code = run_cli(predict, tiny, [Normalize()], get_image_list(str(nested)), save_dir)
        line = one_error_line(capsys.readouterr().err, code)
        assert line.startswith('error: no space left in ' + save_dir) and ' free)' in line, line
        assert_every_file_whole(disk)


def test_val_save_dir_on_a_full_disk(tmp_path, mini_cityscapes, capsys):
    weights = str(tmp_path / 'model.pdparams')
    paddle.save(mini_psanet_for_eval(seed=2).state_dict(), weights)
    opts = [f'val_dataset.dataset_root={mini_cityscapes}',
            f'train_dataset.dataset_root={mini_cityscapes}']
    with small_tmpfs(tmp_path / 'disk', 256 * 1024) as disk:
        fill(disk, 1024)
        save_dir = os.path.join(disk, 'results')
        code = run_cli(evaluate_from_config, MINI_CONFIG, weights, device='cpu',
                       save_dir=save_dir, opts=opts)
        line = one_error_line(capsys.readouterr().err, code)
        assert 'no space left in ' + save_dir in line and ' free)' in line, line
        assert_every_file_whole(disk)


def test_infer_on_a_full_disk(tmp_path, tiny, noisy_images, capfd):
    export = str(tmp_path / 'export')
    export_model(tiny, NORMALIZE, export, ExportOptions(psa_impl='paddle'), num_classes=3)
    with small_tmpfs(tmp_path / 'disk', 1 << 20) as disk:
        fill(disk, 200 * 1024)
        save_dir = os.path.join(disk, 'out')
        code, _, err = infer_in_process(capfd, '--config', os.path.join(export, 'deploy.yaml'),
                                        '--image_path', noisy_images, '--save_dir', save_dir)
        line = one_error_line(err, code)
        assert_disk_full_line(line, os.path.join(save_dir, 'added_prediction'))
        files = assert_every_file_whole(disk)
        assert any('pseudo_color_prediction' in f for f in files)


def test_a_checkpoint_on_a_full_disk(tmp_path, tiny, capsys):
    with small_tmpfs(tmp_path / 'disk', 512 * 1024) as disk:
        target = os.path.join(disk, 'iter_10')
        save_checkpoint(target, tiny, state={'iteration': 10})
        before = digests(target)
        fill(disk, 2048)
        paddle.seed(6)
        code = run_cli(save_checkpoint, target, TinySegNet(3), state={'iteration': 10})
        line = one_error_line(capsys.readouterr().err, code)
        assert_disk_full_line(line, disk)
        assert digests(target) == before
        assert sorted(os.listdir(disk)) == ['.filler', 'iter_10']
        assert paddle.load(os.path.join(target, WEIGHTS_FILE)).keys() == tiny.state_dict().keys()


def test_an_export_on_a_full_disk(tmp_path, tiny, capsys):
    with small_tmpfs(tmp_path / 'disk', 512 * 1024) as disk:
        target = os.path.join(disk, 'export')
        export_model(tiny, NORMALIZE, target, ExportOptions(psa_impl='paddle'))
        before = digests(target)
        fill(disk, 4096)
        code = run_cli(export_model, tiny, NORMALIZE, target,
                       ExportOptions(psa_impl='paddle', output_op='softmax'))
        line = one_error_line(capsys.readouterr().err, code)
        assert_disk_full_line(line, disk)
        assert digests(target) == before
        assert sorted(os.listdir(disk)) == ['.filler', 'export']


def test_prepare_cityscapes_on_a_full_disk(tmp_path, capsys):
    rng = np.random.default_rng(1)
    with small_tmpfs(tmp_path / 'disk', 2 << 20) as disk:
        city = os.path.join(disk, 'cityscapes', 'gtFine', 'train', 'aachen')
        os.makedirs(city)
        os.makedirs(os.path.join(disk, 'cityscapes', 'leftImg8bit', 'train', 'aachen'))
        label_ids = {}
        for i in range(6):  # noise, about 50 KB a PNG, so that the disk fills up part way
            label_ids[i] = rng.integers(0, 34, (240, 240), np.uint8)
            cv2.imwrite(os.path.join(city, f'aachen_{i:06d}_000019{LABEL_IDS_SUFFIX}'),
                        label_ids[i])
        fill(disk, 120 * 1024)
        code = run_cli(prepare_cityscapes, os.path.join(disk, 'cityscapes'), log=None)
        assert_disk_full_line(one_error_line(capsys.readouterr().err, code), city)
        assert_every_file_whole(disk)
        made = sorted(glob.glob(os.path.join(city, '*' + TRAIN_IDS_SUFFIX)))
        assert 0 < len(made) < 6, os.listdir(city)
        for path in made:
            i = int(os.path.basename(path).split('_')[1])
            np.testing.assert_array_equal(cv2.imread(path, cv2.IMREAD_UNCHANGED),
                                          label_ids_to_train_ids(label_ids[i]))


def test_the_dataset_check_cache_on_a_full_disk(tmp_path_factory, tmp_path, monkeypatch):
    pristine = generate_dataset(tmp_path_factory, 4, seed=3)
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'user_cache'))
    with small_tmpfs(tmp_path / 'disk', 1 << 20) as disk:
        root = shutil.copytree(pristine, os.path.join(disk, 'mini'))
        for path in glob.glob(os.path.join(root, '**', '*.png'), recursive=True):
            os.utime(path, (1e9, 1e9))  # long ago: the check remembers only settled files
        dataset = cityscapes(root)
        assert validate_dataset(dataset, 19)['read'] == 4
        before = digests(root)
        label = train_labels(root)[0]
        os.utime(label, (1e9 + 60, 1e9 + 60))  # changed: read again, remembered anew
        fill(disk, 0)
        assert validate_dataset(dataset, 19) == {'samples': 4, 'read': 1, 'cached': 3}
        assert digests(root) == before  # the root's cache as it was, no temporary beside it
        users = glob.glob(str(tmp_path / 'user_cache' / 'psanet' / 'dataset_check' / '*.json'))
        assert len(users) == 1
        with open(users[0]) as f:
            remembered = json.load(f)['files'][os.path.relpath(label, root)]
        assert remembered[1] == os.stat(label).st_mtime_ns  # the change, remembered there
        assert os.path.isfile(os.path.join(root, CHECK_CACHE_NAME))
