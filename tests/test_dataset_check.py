"""The dataset check before training reads every label and image header, and remembers them.

A bad label anywhere in the list (not only near its ends) stops the run
before the first iteration with the file, its values and the fix; a second
check reads only the files that changed, counted by the reads it makes.
"""
import glob
import json
import os
import time

import cv2
import numpy as np
import pytest

from conftest import cityscapes, copy_dataset, generate_dataset, train_images, train_labels
import engine_helpers as helpers
import psanet.data.validate as validate
from psanet.core.config import ComponentBuilder, load_config
from psanet.errors import DatasetError

SIZE = (64, 32)
NUM_TRAIN = 9
AN_HOUR_AGO = time.time() - 3600


@pytest.fixture(scope='module')
def pristine(tmp_path_factory):
    return generate_dataset(tmp_path_factory, NUM_TRAIN, seed=1, size=SIZE)


@pytest.fixture
def root(pristine, tmp_path):
    copy = copy_dataset(pristine, tmp_path)
    _age(copy)
    return copy


def _age(root):
    """Every file an hour old: a check remembers only files not modified just now."""
    for path in glob.glob(os.path.join(root, '**', '*.png'), recursive=True):
        os.utime(path, (AN_HOUR_AGO, AN_HOUR_AGO))


_edits = []


def put_value(path, value, age=True):
    """Writes ``value`` into one pixel of a label; unless ``age`` is False, dates it over an
    hour ago, at a time no other edit has (mtime is what tells the check a file changed)."""
    label = cv2.imread(path, cv2.IMREAD_UNCHANGED)
    label[3, 5] = value
    cv2.imwrite(path, label)
    _edits.append(path)
    if age:
        when = AN_HOUR_AGO - 60 * len(_edits)
        os.utime(path, (when, when))


@pytest.fixture
def opened(monkeypatch):
    """The paths the check opens with PIL, its only way to read an image or a label."""
    paths = []
    real_open = validate.Image.open

    def spy(path, *args, **kwargs):
        paths.append(os.path.abspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(validate.Image, 'open', spy)
    return paths


def test_a_bad_label_in_the_middle_is_found_before_training(root):
    middle = train_labels(root)[NUM_TRAIN // 2]
    put_value(middle, 77)
    with pytest.raises(DatasetError) as error:
        validate.validate_dataset(cityscapes(root), 19)
    message = str(error.value)
    assert f'label {middle} has values [77] outside [0, 19)' in message
    assert 'prepare_cityscapes.py' in message


def test_the_engine_checks_every_label(root, tmp_path):
    """ComponentBuilder.dataset, what train.py and val.py call, reads the whole list."""
    middle = train_labels(root)[NUM_TRAIN // 2]
    put_value(middle, 77)
    config = helpers.toy_config(root, iters=2, num_classes=19, dataset_type='Cityscapes')
    cfg = load_config(helpers.write_config(tmp_path / 'city.yml', config))
    with pytest.raises(DatasetError, match=f'label {middle} has values \\[77\\]'):
        ComponentBuilder(cfg).dataset('train')


def test_every_bad_file_is_counted_the_first_named(root):
    labels = train_labels(root)
    put_value(labels[2], 40)
    put_value(labels[6], 41)
    with pytest.raises(DatasetError) as error:
        validate.validate_dataset(cityscapes(root), 19, num_workers=4)
    message = str(error.value)
    assert message.startswith(f'label {labels[2]} has values [40]'), message
    assert f'1 more of the {NUM_TRAIN} samples fail the check: {labels[6]}' in message


def test_a_damaged_image_in_the_middle_is_named(root):
    image = train_images(root)[NUM_TRAIN // 2]
    with open(image, 'rb') as f:
        data = f.read()
    with open(image, 'wb') as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(DatasetError, match=f'image {image} cannot be read'):
        validate.validate_dataset(cityscapes(root), 19)


def test_a_second_check_reads_nothing_that_did_not_change(root, opened):
    dataset = cityscapes(root)
    first = validate.validate_dataset(dataset, 19)
    assert first == {'samples': NUM_TRAIN, 'read': NUM_TRAIN, 'cached': 0}
    assert len(opened) == 2 * NUM_TRAIN
    assert os.path.isfile(os.path.join(root, validate.CHECK_CACHE_NAME))
    del opened[:]
    second = validate.validate_dataset(dataset, 19)
    assert opened == []
    assert second == {'samples': NUM_TRAIN, 'read': 0, 'cached': NUM_TRAIN}


def test_a_changed_file_is_read_again(root, opened):
    dataset = cityscapes(root)
    validate.validate_dataset(dataset, 19)
    target = train_labels(root)[3]
    put_value(target, 90)  # new content, new (old) mtime
    del opened[:]
    with pytest.raises(DatasetError, match=f'label {target} has values \\[90\\]'):
        validate.validate_dataset(dataset, 19)
    assert opened == [os.path.abspath(target)]


def test_a_file_modified_just_now_is_not_remembered(root, opened):
    """Coarse file-system clocks: a file written within the same tick could change unseen."""
    target = train_labels(root)[1]
    put_value(target, 3, age=False)
    dataset = cityscapes(root)
    validate.validate_dataset(dataset, 19)
    del opened[:]
    validate.validate_dataset(dataset, 19)
    assert opened == [os.path.abspath(target)]


def test_what_was_read_before_a_failure_is_kept(root, opened):
    labels = train_labels(root)
    put_value(labels[4], 50)
    dataset = cityscapes(root)
    with pytest.raises(DatasetError):
        validate.validate_dataset(dataset, 19)
    del opened[:]
    with pytest.raises(DatasetError, match=f'label {labels[4]} has values \\[50\\]'):
        validate.validate_dataset(dataset, 19)
    assert opened == []  # the bad label's values were remembered too
    put_value(labels[4], 5)
    del opened[:]
    assert validate.validate_dataset(dataset, 19)['read'] == 1
    assert opened == [os.path.abspath(labels[4])]


def test_the_cache_does_not_decide_num_classes(root):
    dataset = cityscapes(root)
    validate.validate_dataset(dataset, 19)
    values = set()
    for label in train_labels(root):
        values |= set(np.unique(cv2.imread(label, cv2.IMREAD_UNCHANGED)).tolist())
    largest = max(values - {255})
    with pytest.raises(DatasetError, match=f'values \\[{largest}\\] outside \\[0, {largest}\\)'):
        validate.validate_dataset(dataset, largest)


def test_a_broken_cache_file_is_ignored_and_replaced(root, opened):
    path = os.path.join(root, validate.CHECK_CACHE_NAME)
    with open(path, 'w') as f:
        f.write('{"version": 1, "files": {"leftImg8')
    dataset = cityscapes(root)
    assert validate.validate_dataset(dataset, 19)['read'] == NUM_TRAIN
    with open(path) as f:
        assert len(json.load(f)['files']) == 2 * NUM_TRAIN
    del opened[:]
    validate.validate_dataset(dataset, 19)
    assert opened == []


def test_an_unwritable_root_falls_back_to_the_user_cache(root, tmp_path, monkeypatch, opened):
    # A folder where the cache file would go: neither readable nor replaceable as a file,
    # which holds for root too (unlike chmod).
    os.mkdir(os.path.join(root, validate.CHECK_CACHE_NAME))
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'user_cache'))
    dataset = cityscapes(root)
    assert validate.validate_dataset(dataset, 19)['read'] == NUM_TRAIN
    assert len(glob.glob(str(tmp_path / 'user_cache' / 'psanet' / 'dataset_check' / '*.json'))) == 1
    del opened[:]
    assert validate.validate_dataset(dataset, 19)['read'] == 0
    assert opened == []


def test_no_writable_cache_still_checks(root, tmp_path, monkeypatch):
    os.mkdir(os.path.join(root, validate.CHECK_CACHE_NAME))
    blocker = tmp_path / 'a_file'
    blocker.write_text('')
    monkeypatch.setenv('XDG_CACHE_HOME', str(blocker))  # a file: nothing can be made under it
    dataset = cityscapes(root)
    assert validate.validate_dataset(dataset, 19)['read'] == NUM_TRAIN
    put_value(train_labels(root)[0], 66)
    with pytest.raises(DatasetError, match='values \\[66\\]'):
        validate.validate_dataset(dataset, 19)


def test_cache_off_reads_everything(root, opened):
    dataset = cityscapes(root)
    validate.validate_dataset(dataset, 19, cache=False)
    validate.validate_dataset(dataset, 19, cache=False)
    assert len(opened) == 4 * NUM_TRAIN
    assert not os.path.exists(os.path.join(root, validate.CHECK_CACHE_NAME))
