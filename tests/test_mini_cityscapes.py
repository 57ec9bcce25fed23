"""mini Cityscapes: read by paddleseg's Cityscapes, official encodings (instances too), determinism,
learnable scenes."""
import filecmp
import glob
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from collections import Counter

import cv2
import numpy as np
import pytest
from cityscapesscripts.helpers.labels import labels as CITYSCAPES_LABELS
from cityscapesscripts.helpers.labels import id2label, name2label
from PIL import Image

from cityscapes_reference import reference_train_ids
from conftest import ROOT, finish, started_process
from disk_helpers import digests
from psanet.data import mini_cityscapes, scene_canvas, street_scenes
from psanet.data.mini_cityscapes import MARKER, generate

SIZE = (96, 48)  # (width, height): odd-ish, not the default, to catch width/height swaps
NUM_TRAIN, NUM_VAL = 8, 4
TRAIN_NAMES = [l.name for l in sorted(CITYSCAPES_LABELS, key=lambda l: l.trainId)
               if 0 <= l.trainId < 255]


def files(root, pattern):
    return sorted(glob.glob(os.path.join(root, pattern)))


def read_label(path):
    return np.asarray(Image.open(path))


@pytest.fixture(scope='module')
def mini(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('mini') / 'mini_cityscapes')
    return root, generate(root, NUM_TRAIN, NUM_VAL, SIZE, seed=0)


def test_paddleseg_cityscapes_reads_it(mini):
    from paddleseg.datasets import Cityscapes
    from paddleseg.transforms import Normalize
    root, _ = mini
    width, height = SIZE
    for mode, count in (('train', NUM_TRAIN), ('val', NUM_VAL)):
        dataset = Cityscapes(transforms=[Normalize()], dataset_root=root, mode=mode)
        assert len(dataset) == count
        for index in (0, count - 1):
            sample = dataset[index]
            image_path, label_path = dataset.file_list[index]
            assert os.path.basename(label_path).split('_gtFine_')[0] == \
                os.path.basename(image_path).split('_leftImg8bit')[0]
            assert sample['img'].shape == (3, height, width)
            label = sample['label'].reshape(height, width)
            np.testing.assert_array_equal(label, read_label(label_path))


def test_layout_and_names(mini):
    root, summary = mini
    for split, count in (('train', NUM_TRAIN), ('val', NUM_VAL)):
        images = files(root, f'leftImg8bit/{split}/*/*_leftImg8bit.png')
        assert len(images) == count == summary['splits'][split]['images']
        for path in images:
            city = os.path.basename(os.path.dirname(path))
            stem = os.path.basename(path)[:-len('_leftImg8bit.png')]
            parts = stem.split('_')
            assert parts[0] == city and len(parts) == 3 and all(len(p) == 6 and p.isdigit()
                                                                for p in parts[1:])
            for suffix in ('labelIds', 'labelTrainIds', 'color', 'instanceIds'):
                assert os.path.isfile(os.path.join(root, 'gtFine', split, city,
                                                   f'{stem}_gtFine_{suffix}.png'))
    assert os.path.isfile(os.path.join(root, MARKER))


def test_label_ids_and_train_ids_agree_through_the_official_table(mini):
    root, _ = mini
    colors = {l.id: l.color for l in CITYSCAPES_LABELS}
    for path in files(root, 'gtFine/*/*/*_gtFine_labelIds.png')[::3]:
        label_ids = read_label(path)
        train_ids = read_label(path.replace('_labelIds.png', '_labelTrainIds.png'))
        assert label_ids.dtype == train_ids.dtype == np.uint8 and label_ids.ndim == 2
        assert set(np.unique(label_ids)) <= set(colors)
        np.testing.assert_array_equal(train_ids, reference_train_ids(label_ids))
        color = np.asarray(Image.open(path.replace('_labelIds.png', '_color.png')).convert('RGB'))
        for value in np.unique(label_ids):
            assert (color[label_ids == value] == colors[int(value)]).all()


HAS_INSTANCES = np.array([id2label[i].hasInstances if i in id2label else False for i in range(256)])


def test_instance_ids_follow_the_cityscapes_encoding(mini):
    """As cityscapesscripts' json2instanceImg writes them: 16-bit, label id * 1000 + instance
    number on classes with instances, the label id everywhere else."""
    root, _ = mini
    paths = files(root, 'gtFine/*/*/*_gtFine_instanceIds.png')
    assert len(paths) == NUM_TRAIN + NUM_VAL
    most = 0
    for path in paths:
        instance_ids = read_label(path)
        label_ids = read_label(path.replace('_instanceIds.png', '_labelIds.png'))
        assert instance_ids.dtype == np.uint16 and instance_ids.shape == label_ids.shape
        objects = HAS_INSTANCES[label_ids]
        np.testing.assert_array_equal(instance_ids[~objects], label_ids[~objects])
        np.testing.assert_array_equal(instance_ids[objects] // 1000, label_ids[objects])
        for label_id in np.unique(label_ids[objects]):
            most = max(most, np.unique(instance_ids[label_ids == label_id]).size)
    assert most >= 2  # some image holds several objects of a class


def test_each_object_is_an_instance_of_its_own(tmp_path, monkeypatch):
    """Each object drawn (a car, a person; a bicycle and its rider are two) has one instance
    id per class, and no two objects share one: checked against which drawing call painted
    each pixel last, recorded while the generator runs."""
    draws, paint, scene = street_scenes._objects, scene_canvas.Scene.paint, \
        mini_cityscapes._scene
    drawing = [None]  # the object whose drawing call runs
    renders, kept = [], []

    def objects(*args):
        def tracked(number, draw):
            def run():
                drawing[0] = number
                try:
                    return draw()
                finally:
                    drawing[0] = None
            return run
        listed = draws(*args)
        renders.append([])  # one render, one call of _objects
        return [(y, tracked(number, draw)) for number, (y, draw) in enumerate(listed)]

    def recorded_paint(self, mask, name, *args, **kwargs):
        if renders:
            renders[-1].append((drawing[0], name, np.array(mask, bool)))
        return paint(self, mask, name, *args, **kwargs)

    def recorded_scene(*args):
        del renders[:]
        result = scene(*args)
        kept.append(renders[-1])  # the paint of the render the image comes from
        return result

    monkeypatch.setattr(street_scenes, '_objects', objects)
    monkeypatch.setattr(scene_canvas.Scene, 'paint', recorded_paint)
    monkeypatch.setattr(mini_cityscapes, '_scene', recorded_scene)
    root = str(tmp_path / 'mini')
    count = 6
    generate(root, count, 0, SIZE, seed=1, cities=['town'])
    shared = 0
    for index, painted in enumerate(kept):
        stem = os.path.join(root, 'gtFine', 'train', 'town', f'town_{index:06d}_000019_gtFine_')
        label_ids = read_label(stem + 'labelIds.png')
        instance_ids = read_label(stem + 'instanceIds.png')
        owner = np.full(label_ids.shape, -1)  # (object, class) painted last, -1: not an object
        owners = []
        for number, name, mask in painted:
            if name2label[name].hasInstances:
                assert number is not None, f'{name} painted outside an object'
                if (number, name) not in owners:
                    owners.append((number, name))
                owner[mask] = owners.index((number, name))
            else:
                owner[mask] = -1
        objects = HAS_INSTANCES[label_ids]
        assert (owner[objects] >= 0).all()
        pairs = set(zip(owner[objects].tolist(), instance_ids[objects].tolist()))
        assert len({o for o, _ in pairs}) == len({i for _, i in pairs}) == len(pairs), index
        visible = Counter(name for _, name in {owners[o] for o, _ in pairs})
        shared = max([shared, *visible.values()])
    assert len(kept) == count and shared >= 2  # several objects of one class were told apart


def test_every_train_class_and_ignore_appear_in_train(mini):
    root, summary = mini
    seen = set()
    for path in files(root, 'gtFine/train/*/*_gtFine_labelTrainIds.png'):
        seen |= set(np.unique(read_label(path)).tolist())
    assert seen == set(range(19)) | {255}
    assert all(summary['splits']['train']['class_images'][name] > 0 for name in TRAIN_NAMES)


def test_summary_matches_the_files(mini):
    root, summary = mini
    for split in ('train', 'val'):
        histogram = np.zeros(256, np.int64)
        for path in files(root, f'gtFine/{split}/*/*_gtFine_labelTrainIds.png'):
            histogram += np.bincount(read_label(path).ravel(), minlength=256)
        stats = summary['splits'][split]
        assert histogram.sum() == stats['images'] * SIZE[0] * SIZE[1]
        # Ratios of the same integer counts in float64 (pytest.approx's 1e-6 is ample).
        for train_id, name in enumerate(TRAIN_NAMES):
            assert stats['class_pixels'][name] == pytest.approx(histogram[train_id] / histogram.sum())
        assert stats['ignore_pixels'] == pytest.approx(histogram[255] / histogram.sum())


def test_scenes_have_learnable_position_and_colour(mini):
    """Sky above buildings above road, and colour plus row alone beat the majority class by far."""
    root, _ = mini
    rows = {name: [] for name in ('sky', 'building', 'road')}
    pixels = {}
    for split in ('train', 'val'):
        features, targets = [], []
        for path in files(root, f'leftImg8bit/{split}/*/*_leftImg8bit.png'):
            label = read_label(path.replace('leftImg8bit', 'gtFine', 1).replace(
                '_leftImg8bit.png', '_gtFine_labelTrainIds.png'))
            image = cv2.cvtColor(cv2.imread(path), cv2.COLOR_BGR2RGB).astype(np.float64)
            y = np.repeat(np.arange(SIZE[1])[:, None], SIZE[0], axis=1) * (255.0 / SIZE[1])
            keep = label != 255
            features.append(np.concatenate([image[keep], y[keep][:, None]], axis=1))
            targets.append(label[keep])
            for name in rows:
                ys = np.nonzero(label == TRAIN_NAMES.index(name))[0]
                if ys.size:
                    rows[name].append(ys.mean())
        pixels[split] = np.concatenate(features), np.concatenate(targets)
    assert np.mean(rows['sky']) < np.mean(rows['building']) < np.mean(rows['road'])
    (x_train, t_train), (x_val, t_val) = pixels['train'], pixels['val']
    classes = np.unique(t_train)
    centroids = np.stack([x_train[t_train == c].mean(0) for c in classes])
    nearest = classes[np.argmin(((x_val[:, None] - centroids[None]) ** 2).sum(-1), axis=1)]
    accuracy = (nearest == t_val).mean()
    majority = np.bincount(t_val).max() / t_val.size
    assert accuracy > majority + 0.15, (accuracy, majority)


def test_same_seed_same_bytes_other_seed_other_images(tmp_path, mini):
    def make(name, seed, num_train=2, num_val=1):
        root = str(tmp_path / name)
        generate(root, num_train, num_val, SIZE, seed=seed)
        return root, [os.path.relpath(p, root) for p in files(root, '*/*/*/*.png')]

    root_a, names_a = make('a', 3)
    root_b, names_b = make('b', 3)
    root_c, names_c = make('c', 4)
    assert names_a == names_b == names_c and len(names_a) == 3 * 5
    for name in names_a:
        assert filecmp.cmp(os.path.join(root_a, name), os.path.join(root_b, name), shallow=False)
    for name in names_a:
        if 'leftImg8bit' in name:
            assert not filecmp.cmp(os.path.join(root_a, name), os.path.join(root_c, name),
                                   shallow=False)
    # image i does not depend on how many are made: a smaller dataset is a prefix
    root_d, names_d = make('d', 0)
    for name in names_d:
        assert filecmp.cmp(os.path.join(root_d, name), os.path.join(mini[0], name), shallow=False)


def test_regenerating_replaces_and_other_datasets_are_kept(tmp_path):
    root = str(tmp_path / 'mini')
    generate(root, 3, 2, SIZE)
    generate(root, 1, 1, SIZE)
    assert len(files(root, 'leftImg8bit/*/*/*.png')) == 2
    assert len(files(root, 'gtFine/*/*/*.png')) == 2 * 4
    other = tmp_path / 'real'
    (other / 'leftImg8bit' / 'train').mkdir(parents=True)
    with pytest.raises(FileExistsError, match='leftImg8bit'):
        generate(str(other), 1, 1, SIZE)


@pytest.mark.parametrize('kwargs, match', [
    ({'size': (16, 8)}, 'size'), ({'size': (200000, 100000)}, r'at most \(4096, 2048\)'),
    ({'seed': -1}, 'seed'), ({'num_train': -2}, 'num_train'),
    ({'cities': ['bad_name']}, 'cities')])
def test_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(str(tmp_path / 'x'), **{'num_train': 1, 'num_val': 1, **kwargs})


def test_command_line(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / 'cli')
    monkeypatch.setattr(sys, 'argv', ['make_mini_cityscapes.py', '--out', out, '--num_train', '2',
                                      '--num_val', '1', '--size', '64', '32', '--seed', '1'])
    runpy.run_path(os.path.join(ROOT, 'tools', 'make_mini_cityscapes.py'), run_name='__main__')
    printed = capsys.readouterr().out
    assert '2 train images' in printed and '1 val images' in printed and 'traffic light' in printed
    assert cv2.imread(files(out, 'leftImg8bit/val/*/*.png')[0]).shape == (32, 64, 3)


def _users_files(root):
    with open(os.path.join(root, 'notes.txt'), 'w') as f:
        f.write('mine')
    os.makedirs(os.path.join(root, '.git'))
    with open(os.path.join(root, '.git', 'HEAD'), 'w') as f:
        f.write('ref: refs/heads/main\n')


def test_an_interrupted_regeneration_leaves_the_old_set_whole(tmp_path, monkeypatch):
    root = str(tmp_path / 'mini')
    generate(root, 3, 2, SIZE)
    _users_files(root)
    before = digests(root)
    real_scene, calls = mini_cityscapes._scene, []

    def interrupted_scene(*args):
        calls.append(args)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_scene(*args)

    monkeypatch.setattr(mini_cityscapes, '_scene', interrupted_scene)
    with pytest.raises(KeyboardInterrupt):
        generate(root, 5, 3, SIZE, seed=1)  # other bytes from the first image on
    assert digests(root) == before  # 3 + 2 images, the summary that counts them, user files
    assert os.listdir(tmp_path) == ['mini']
    monkeypatch.setattr(mini_cityscapes, '_scene', real_scene)
    summary = generate(root, 1, 1, SIZE)
    after = digests(root)
    assert {k: after[k] for k in ('notes.txt', '.git/HEAD')} == \
        {k: before[k] for k in ('notes.txt', '.git/HEAD')}
    assert len(files(root, 'leftImg8bit/*/*/*.png')) == 2
    with open(os.path.join(root, MARKER)) as f:
        assert json.load(f) == summary and summary['root'] == root


def test_ctrl_c_in_the_tool_is_one_line_and_keeps_the_old_set(tmp_path):
    root = str(tmp_path / 'mini')
    generate(root, 1, 1, SIZE)
    before = digests(root)
    args = [sys.executable, os.path.join(ROOT, 'tools', 'make_mini_cityscapes.py'), '--out', root,
            '--num_train', '200', '--num_val', '50']
    with started_process(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True) as process:
        deadline = time.monotonic() + 120
        while not any(name.startswith('.mini.tmp-') for name in os.listdir(tmp_path)):
            assert process.poll() is None and time.monotonic() < deadline, 'never started'
            time.sleep(0.05)
        time.sleep(0.5)  # inside the generation, well before its 250 images are written
        process.send_signal(signal.SIGINT)
        _, err = finish(process, 120)
    assert process.returncode == 130 and 'Traceback' not in err, err
    assert err.strip().splitlines() == [
        f'error: interrupted (Ctrl-C); {root} is as it was before this run.']
    assert digests(root) == before and os.listdir(tmp_path) == ['mini']
