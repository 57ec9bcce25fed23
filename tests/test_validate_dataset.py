"""validate_dataset / check_dataset_root / check_dataset_config: each bad input names its file."""
import glob
import os
import shutil

import cv2
import numpy as np
import pytest
from paddleseg.datasets import Dataset
from paddleseg.transforms import Normalize

from conftest import cityscapes, copy_dataset, generate_dataset, train_images, train_labels
from psanet.data.validate import (DatasetError, check_dataset_config, check_dataset_root,
                                  validate_dataset)

SIZE = (64, 32)
NUM_TRAIN = 5


@pytest.fixture(scope='module')
def pristine(tmp_path_factory):
    return generate_dataset(tmp_path_factory, NUM_TRAIN, seed=0, size=SIZE)


@pytest.fixture
def root(pristine, tmp_path):
    return copy_dataset(pristine, tmp_path)


def list_dataset(root, pairs, mode='train'):
    list_path = os.path.join(root, f'{mode}_list.txt')
    with open(list_path, 'w') as f:
        f.writelines(f'{os.path.relpath(i, root)} {os.path.relpath(l, root)}\n' for i, l in pairs)
    return Dataset(mode=mode, dataset_root=root, transforms=[Normalize()], num_classes=19,
                   **{f'{mode}_path': list_path})


def test_good_datasets_pass(root):
    for mode in ('train', 'val'):
        report = validate_dataset(cityscapes(root, mode), 19, check_labels='all')
        assert report['read'] == report['samples'] > 0
    pairs = list(zip(train_images(root), train_labels(root)))
    assert validate_dataset(list_dataset(root, pairs), 19)['samples'] == NUM_TRAIN
    check_dataset_root(root, 'val')
    check_dataset_config({'type': 'Cityscapes', 'dataset_root': root, 'mode': 'val'})


def test_missing_root(tmp_path):
    missing = str(tmp_path / 'no_such_dataset')
    for check in (lambda: check_dataset_root(missing),
                  lambda: check_dataset_config({'type': 'Cityscapes', 'dataset_root': missing}),
                  lambda: check_dataset_config({'type': 'Dataset', 'dataset_root': missing})):
        with pytest.raises(DatasetError, match='no_such_dataset'):
            check()


def test_missing_split_and_list_file(root):
    shutil.rmtree(os.path.join(root, 'gtFine', 'val'))
    with pytest.raises(DatasetError, match=r'gtFine/val/'):
        check_dataset_root(root, 'val')
    with pytest.raises(DatasetError, match='val_path'):
        check_dataset_config({'type': 'Dataset', 'dataset_root': root, 'mode': 'val',
                              'val_path': os.path.join(root, 'val_list.txt')})


def test_no_images(root):
    for path in glob.glob(os.path.join(root, '*', 'val', '*', '*.png')):
        os.remove(path)
    with pytest.raises(DatasetError, match=r'no images found in .*leftImg8bit/val'):
        validate_dataset(cityscapes(root, 'val'), 19)


def test_image_without_label_is_named_with_the_fix(root):
    stem = os.path.basename(train_labels(root)[2]).split('_gtFine_')[0]
    os.remove(train_labels(root)[2])
    with pytest.raises(DatasetError, match=f'{stem}.*prepare_cityscapes.py'):
        validate_dataset(cityscapes(root), 19, check_labels='none')


def test_label_without_image_is_named(root):
    stem = os.path.basename(train_images(root)[1]).split('_leftImg8bit')[0]
    os.remove(train_images(root)[1])
    with pytest.raises(DatasetError, match=stem):
        validate_dataset(cityscapes(root), 19, check_labels='none')


def test_pairs_of_different_frames(root):
    images, labels = train_images(root), train_labels(root)
    dataset = list_dataset(root, [(images[0], labels[1])])
    with pytest.raises(DatasetError, match=os.path.basename(labels[1])):
        validate_dataset(dataset, 19)


def test_file_that_does_not_exist(root):
    images, labels = train_images(root), train_labels(root)
    ghost = images[0].replace('_leftImg8bit.png', '_x_leftImg8bit.png')
    with pytest.raises(DatasetError, match=os.path.basename(ghost)):
        validate_dataset(list_dataset(root, [(ghost, labels[0])]), 19, check_labels='none')
    ghost_label = os.path.join(root, 'labels', 'a.png')
    with pytest.raises(DatasetError, match='a.png'):
        validate_dataset(list_dataset(root, [(images[0], ghost_label)]), 19, check_labels='none')


@pytest.mark.parametrize('which', ['image', 'label'])
def test_corrupt_files(root, which):
    path = (train_images if which == 'image' else train_labels)(root)[0]
    with open(path, 'wb') as f:
        f.write(b'\x89PNG this is not an image')
    with pytest.raises(DatasetError, match=f'{os.path.basename(path)}.*cannot be read'):
        validate_dataset(cityscapes(root), 19)


def test_label_ids_instead_of_train_ids(root):
    target = train_labels(root)[-1]
    label_ids = np.zeros(SIZE[::-1], np.uint8)
    label_ids[:, :10] = 26  # the label id of 'car'; its train id is 13
    label_ids[:, 10:20] = 33
    cv2.imwrite(target, label_ids)
    with pytest.raises(DatasetError) as error:
        validate_dataset(cityscapes(root), 19)
    message = str(error.value)
    assert os.path.basename(target) in message and '[26, 33]' in message
    assert 'prepare_cityscapes.py' in message and 'num_classes' in message


def test_too_few_classes(root):
    with pytest.raises(DatasetError, match=r'outside \[0, 5\)'):
        validate_dataset(cityscapes(root), 5, check_labels='all')


def test_colour_or_resized_label(root):
    colour = train_labels(root)[0].replace('_labelTrainIds.png', '_color.png')
    shutil.copy(colour, train_labels(root)[0])
    with pytest.raises(DatasetError, match=r'single-channel'):
        validate_dataset(cityscapes(root), 19)
    small = np.zeros((SIZE[1] // 2, SIZE[0] // 2), np.uint8)
    cv2.imwrite(train_labels(root)[0], small)
    with pytest.raises(DatasetError, match=r'is 32x16 but its image .* is 64x32'):
        validate_dataset(cityscapes(root), 19)


def test_check_labels_modes(root):
    middle = train_labels(root)[NUM_TRAIN // 2]
    cv2.imwrite(middle, np.full(SIZE[::-1], 40, np.uint8))
    dataset = cityscapes(root)
    assert validate_dataset(dataset, 19, check_labels='none')['read'] == 0
    assert validate_dataset(dataset, 19, check_labels='sample', sample=2)['read'] == 2
    with pytest.raises(DatasetError, match=os.path.basename(middle)):
        validate_dataset(dataset, 19, check_labels='all')
    with pytest.raises(ValueError, match='check_labels'):
        validate_dataset(dataset, 19, check_labels='some')
