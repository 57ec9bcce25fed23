"""prepare_cityscapes on a tiny fake Cityscapes tree, and the label-id / train-id tables."""
import json
import os
import runpy
import sys

import cv2
import numpy as np
import pytest
from cityscapesscripts.helpers.labels import labels as CITYSCAPES_LABELS
from PIL import Image

from cityscapes_reference import reference_train_ids
from conftest import ROOT
from psanet.data.prepare_cityscapes import (label_ids_to_train_ids, prepare_cityscapes,
                                            train_ids_to_label_ids)
from psanet.errors import DatasetError

WIDTH, HEIGHT = 40, 24
CITY = 'fakecity'
# (label, [x0, y0, x1, y1], deleted), drawn in order as Cityscapes polygons
OBJECTS = [('road', [0, 12, 39, 23], 0),
           ('sky', [0, 0, 39, 5], 0),
           ('cargroup', [4, 8, 18, 20], 0),      # a group name: drawn as 'car'
           ('license plate', [8, 14, 12, 16], 0),  # id -1: never drawn
           ('person', [24, 14, 30, 22], 1),        # deleted: never drawn
           ('polegroup', [34, 2, 36, 20], 0)]      # id 18, a void train id


def official(name):
    for label in CITYSCAPES_LABELS:
        if label.name == name:
            return label
    raise KeyError(name)


def expected_polygon_train_ids():
    """Rectangle interiors painted in order; outline pixels are left out of the comparison."""
    expected = np.full((HEIGHT, WIDTH), 255, np.int64)
    compare = np.ones((HEIGHT, WIDTH), bool)
    for name, (x0, y0, x1, y1), deleted in OBJECTS:
        known = {l.name for l in CITYSCAPES_LABELS}
        label = official(name if name in known else name[:-len('group')])
        for x, y in ((x, y) for x in range(x0, x1 + 1) for y in (y0, y1)):
            compare[y, x] = False
        compare[y0:y1 + 1, x0] = compare[y0:y1 + 1, x1] = False
        if deleted or label.id < 0:
            continue
        expected[y0 + 1:y1, x0 + 1:x1] = label.trainId if 0 <= label.trainId < 255 else 255
    return expected, compare


def write_polygons(path, objects):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        json.dump({'imgHeight': HEIGHT, 'imgWidth': WIDTH, 'objects': [
            {'label': name, 'deleted': deleted,
             'polygon': [[x0, y0], [x1, y0], [x1, y1], [x0, y1]]}
            for name, (x0, y0, x1, y1), deleted in objects]}, f)


def write_image(root, split, frame):
    path = os.path.join(root, 'leftImg8bit', split, CITY, f'{CITY}_{frame}_leftImg8bit.png')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    cv2.imwrite(path, np.full((HEIGHT, WIDTH, 3), 90, np.uint8))


def gt(root, split, frame, kind):
    return os.path.join(root, 'gtFine', split, CITY, f'{CITY}_{frame}_gtFine_{kind}')


@pytest.fixture
def fake(tmp_path):
    """train: 000000 polygons, 000001 labelIds only, 000002 no label; val: 000003 polygons."""
    root = str(tmp_path / 'cityscapes')
    for split, frame in (('train', '000000_000019'), ('train', '000001_000019'),
                         ('train', '000002_000019'), ('val', '000003_000019')):
        write_image(root, split, frame)
    write_polygons(gt(root, 'train', '000000_000019', 'polygons.json'), OBJECTS)
    write_polygons(gt(root, 'val', '000003_000019', 'polygons.json'), OBJECTS)
    label_ids = np.random.default_rng(0).integers(0, 34, (HEIGHT, WIDTH)).astype(np.uint8)
    cv2.imwrite(gt(root, 'train', '000001_000019', 'labelIds.png'), label_ids)
    return root, label_ids


def check_outputs(root, label_ids):
    expected, compare = expected_polygon_train_ids()
    for split, frame in (('train', '000000_000019'), ('val', '000003_000019')):
        made = np.asarray(Image.open(gt(root, split, frame, 'labelTrainIds.png')))
        assert made.shape == (HEIGHT, WIDTH)
        np.testing.assert_array_equal(made[compare], expected[compare])
    made = np.asarray(Image.open(gt(root, 'train', '000001_000019', 'labelTrainIds.png')))
    np.testing.assert_array_equal(made, reference_train_ids(label_ids))


@pytest.mark.parametrize('num_workers', [1, 2])
def test_makes_train_ids_from_polygons_and_label_ids(fake, num_workers):
    root, label_ids = fake
    lines = []
    summary = prepare_cityscapes(root, num_workers=num_workers, log=lines.append)
    check_outputs(root, label_ids)
    train, val = summary['train'], summary['val']
    assert (train['images'], train['polygons'], train['label_ids_only'], train['made']) == (3, 1, 1, 2)
    assert train['images_without_labels'] == [os.path.join(CITY, f'{CITY}_000002_000019')]
    assert (val['images'], val['made'], val['images_without_labels']) == (1, 1, [])
    assert summary['test']['images'] == 0
    assert any('2/2' in line for line in lines)


def test_keeps_finished_files_unless_overwrite(fake):
    root, label_ids = fake
    prepare_cityscapes(root, log=None)
    target = gt(root, 'train', '000000_000019', 'labelTrainIds.png')
    cv2.imwrite(target, np.zeros((HEIGHT, WIDTH), np.uint8))
    summary = prepare_cityscapes(root, log=None)
    assert (summary['train']['made'], summary['train']['kept']) == (0, 2)
    assert not np.asarray(Image.open(target)).any()
    summary = prepare_cityscapes(root, overwrite=True, log=None)
    assert summary['train']['made'] == 2
    check_outputs(root, label_ids)


def test_wrong_layout_names_the_layout_and_the_download(tmp_path):
    with pytest.raises(DatasetError) as error:
        prepare_cityscapes(str(tmp_path), log=None)
    message = str(error.value)
    for part in ('leftImg8bit/', 'gtFine/', 'https://www.cityscapes-dataset.com',
                 'leftImg8bit_trainvaltest.zip', 'gtFine_trainvaltest.zip'):
        assert part in message
    # zips unpacked into folders of their own
    (tmp_path / 'gtFine_trainvaltest' / 'gtFine').mkdir(parents=True)
    with pytest.raises(DatasetError, match='gtFine_trainvaltest/gtFine'):
        prepare_cityscapes(str(tmp_path), log=None)
    with pytest.raises(DatasetError, match='does not exist'):
        prepare_cityscapes(str(tmp_path / 'missing'), log=None)


def test_empty_tree_and_unknown_label(tmp_path, fake):
    empty = tmp_path / 'empty'
    (empty / 'leftImg8bit').mkdir(parents=True)
    (empty / 'gtFine').mkdir()
    with pytest.raises(DatasetError, match='no images or labels'):
        prepare_cityscapes(str(empty), log=None)
    root, _ = fake
    bad = gt(root, 'val', '000003_000019', 'polygons.json')
    write_polygons(bad, [('dragon', [0, 0, 5, 5], 0)])
    with pytest.raises(DatasetError, match=f'{CITY}_000003_000019_gtFine_polygons.json'):
        prepare_cityscapes(root, log=None)
    assert not os.path.exists(gt(root, 'val', '000003_000019', 'labelTrainIds.png'))


def test_id_tables_match_the_official_list():
    all_values = np.arange(256)
    to_train = label_ids_to_train_ids(all_values)
    to_label = train_ids_to_label_ids(all_values)
    first_with_train_id = {}
    for label in CITYSCAPES_LABELS:
        first_with_train_id.setdefault(label.trainId, label.id)
    for value in range(256):
        known = [l for l in CITYSCAPES_LABELS if l.id == value]
        want = known[0].trainId if known and 0 <= known[0].trainId < 255 else 255
        assert to_train[value] == want
        want = first_with_train_id[value] if 0 <= value < 19 else 0
        assert to_label[value] == want
    assert to_label[255] == official('unlabeled').id == 0
    train_ids = np.array([[0, 18, 255], [13, 7, 10]])
    np.testing.assert_array_equal(label_ids_to_train_ids(train_ids_to_label_ids(train_ids)), train_ids)
    with pytest.raises(ValueError, match='0, 255'):
        train_ids_to_label_ids(np.array([300]))
    with pytest.raises(TypeError, match='integer'):
        label_ids_to_train_ids(np.array([1.0]))


def test_command_line(fake, monkeypatch, capsys, tmp_path):
    script = os.path.join(ROOT, 'tools', 'prepare_cityscapes.py')
    root, _ = fake
    monkeypatch.setattr(sys, 'argv', ['prepare_cityscapes.py', '--root', root])
    runpy.run_path(script, run_name='__main__')
    printed = capsys.readouterr().out
    assert 'images without labels' in printed and f'{CITY}_000002_000019' in printed
    monkeypatch.setattr(sys, 'argv', ['prepare_cityscapes.py', '--root', str(tmp_path / 'nowhere')])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(script, run_name='__main__')
    assert stop.value.code == 2 and 'does not exist' in capsys.readouterr().err
