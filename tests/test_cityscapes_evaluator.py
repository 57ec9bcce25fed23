"""README's official-evaluator command on mini Cityscapes: it runs as written, and its IoUs
are the ones psanet computes."""
import glob
import json
import math
import os
import shlex
import shutil
import subprocess
import sys

import cv2
import numpy as np
import paddle
import pytest
from cityscapesscripts.helpers.labels import id2label, trainId2label

from conftest import ROOT, run_process
from psanet.core.metrics import class_areas, summarize
from psanet.data.prepare_cityscapes import train_ids_to_label_ids

EVALUATOR = 'tools/evaluate_cityscapes.py'
NUM_CLASSES = 19


def readme_evaluator_command():
    """The one README line that runs the official evaluator, and its environment assignments."""
    with open(os.path.join(ROOT, 'README.md')) as f:
        lines = [line.strip() for line in f
                 if EVALUATOR in line and '=' in line.split(EVALUATOR)[0]]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    assignments = dict(word.split('=', 1) for word in words[:words.index(EVALUATOR)]
                       if '=' in word)
    return lines[0], assignments


def predictions_from_ground_truth(dataset_root, results_dir, seed=0):
    """Writes a ``<city>/<stem>_labelIds.png`` per val image, as val.py --save_dir does: the
    train ids of the ground truth with a fifth of the pixels (and every ignored one) set to a
    random class, and every class predicted somewhere on a scored pixel, so that no class
    is absent from both (PaddleSeg counts such a class as IoU 0, the evaluator leaves it out).

    Returns:
        list: (predicted train ids, ground-truth train ids) per image.
    """
    rng = np.random.default_rng(seed)
    pairs = []
    labels = sorted(glob.glob(os.path.join(dataset_root, 'gtFine', 'val', '*',
                                           '*_gtFine_labelTrainIds.png')))
    assert labels
    for number, path in enumerate(labels):
        truth = cv2.imread(path, cv2.IMREAD_UNCHANGED)
        pred = truth.copy()
        changed = (rng.random(truth.shape) < 0.2) | (truth == 255)
        pred[changed] = rng.integers(0, NUM_CLASSES, int(changed.sum()))
        if number == 0:
            scored = np.flatnonzero(truth != 255)
            assert scored.size >= NUM_CLASSES
            pred.flat[rng.choice(scored, NUM_CLASSES, replace=False)] = np.arange(NUM_CLASSES)
        stem = os.path.basename(path)[:-len('_gtFine_labelTrainIds.png')]
        city = os.path.basename(os.path.dirname(path))
        out = os.path.join(results_dir, city, stem + '_labelIds.png')
        os.makedirs(os.path.dirname(out), exist_ok=True)
        assert cv2.imwrite(out, train_ids_to_label_ids(pred))
        pairs.append((pred, truth))
    return pairs


def psanet_metrics(pairs):
    areas = sum(class_areas(paddle.to_tensor(pred[None, None].astype('int64')),
                            paddle.to_tensor(truth[None, None].astype('int64')), NUM_CLASSES)
                for pred, truth in pairs)
    return summarize(areas)


def run_readme_command(tmp_path, mini_cityscapes):
    """README's command in a folder holding the dataset and the results where it points."""
    line, assignments = readme_evaluator_command()
    work = tmp_path / 'work'
    dataset_root = str(work / assignments['CITYSCAPES_DATASET'])
    results_dir = str(work / assignments['CITYSCAPES_RESULTS'])
    shutil.copytree(mini_cityscapes, dataset_root)  # the evaluator writes into the dataset root
    os.symlink(os.path.join(ROOT, 'tools'), work / 'tools')  # README's path, from the root
    pairs = predictions_from_ground_truth(dataset_root, results_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith('CITYSCAPES_')}
    env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env.get('PATH', '')
    done = run_process(line, shell=True, cwd=str(work), env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout
    export_dir = (str(work / assignments['CITYSCAPES_EXPORT_DIR'])
                  if 'CITYSCAPES_EXPORT_DIR' in assignments
                  else os.path.join(dataset_root, 'evaluationResults'))
    with open(os.path.join(export_dir, 'resultPixelLevelSemanticLabeling.json')) as f:
        return json.load(f), pairs, dataset_root


@pytest.fixture
def official(tmp_path, mini_cityscapes):
    return run_readme_command(tmp_path, mini_cityscapes)


def test_readme_command_scores_the_iou_psanet_computes(official):
    result, pairs, _ = official
    ours = psanet_metrics(pairs)
    for train_id in range(NUM_CLASSES):
        score = result['classScores'][trainId2label[train_id].name]
        assert not math.isnan(score)  # every class is predicted: none is left out
        # The same IoU of the same integer counts in float64: a few ulps.
        assert score == pytest.approx(ours['class_iou'][train_id], abs=1e-12)
    assert result['averageScoreClasses'] == pytest.approx(ours['miou'], abs=1e-12)


def instance_scores_by_count(pairs, dataset_root):
    """The instance-weighted iIoU of each instance class, counted here from the label files
    as the Cityscapes benchmark defines it: every ground-truth instance (instance id
    ``label id * 1000 + n`` in *_gtFine_instanceIds.png) weighs its pixels by the class's
    mean instance size over its own size; true positives and false negatives are its
    weighted pixels predicted as its class or not; false positives are the (unweighted)
    pixels predicted as the class whose ground truth (*_gtFine_labelIds.png) is another
    evaluated class. The predictions' train ids become label ids by cityscapesScripts'
    table; the class sizes are the evaluator's constants (the benchmark's).

    Returns:
        dict: class name -> iIoU, for each evaluated class with instances (NaN where
        nothing counts).
    """
    from cityscapesscripts.evaluation.evalPixelLevelSemanticLabeling import args
    from cityscapesscripts.helpers.labels import labels
    evaluated = [label for label in labels if label.id >= 0 and not label.ignoreInEval]
    counts = {label.name: {'tp': 0.0, 'fn': 0.0, 'fp': 0} for label in evaluated
              if label.hasInstances}
    truth_paths = sorted(glob.glob(os.path.join(dataset_root, 'gtFine', 'val', '*',
                                                '*_gtFine_labelTrainIds.png')))
    assert len(truth_paths) == len(pairs)
    to_label_id = np.full(256, 0, np.int64)
    for train_id in range(NUM_CLASSES):
        to_label_id[train_id] = trainId2label[train_id].id
    for (pred, _), path in zip(pairs, truth_paths):
        predicted = to_label_id[pred]
        truth = cv2.imread(path.replace('_labelTrainIds', '_labelIds'), cv2.IMREAD_UNCHANGED)
        instances = cv2.imread(path.replace('_labelTrainIds', '_instanceIds'),
                               cv2.IMREAD_UNCHANGED).astype(np.int64)
        for label in evaluated:
            if label.hasInstances:
                other = (truth != label.id) & np.isin(truth, [l.id for l in evaluated])
                counts[label.name]['fp'] += int(np.sum((predicted == label.id) & other))
        for instance in np.unique(instances[instances > 1000]):
            label = id2label[int(instance) // 1000]
            if label.ignoreInEval:
                continue
            mask = instances == instance
            size = int(mask.sum())
            hit = int(np.sum(predicted[mask] == label.id))
            weight = args.avgClassSize[label.name] / size
            counts[label.name]['tp'] += hit * weight
            counts[label.name]['fn'] += (size - hit) * weight
    scores = {}
    for name, c in counts.items():
        denominator = c['tp'] + c['fp'] + c['fn']
        scores[name] = c['tp'] / denominator if denominator > 0 else math.nan
    return scores


def test_readme_command_scores_the_instance_iou_counted_here(official):
    """The instance-weighted iIoU the evaluator computes from *_gtFine_instanceIds.png is the
    one counted here from the same files."""
    result, pairs, dataset_root = official
    ours = instance_scores_by_count(pairs, dataset_root)
    present = set()
    for path in glob.glob(os.path.join(dataset_root, 'gtFine', 'val', '*',
                                       '*_gtFine_instanceIds.png')):
        instance_ids = cv2.imread(path, cv2.IMREAD_UNCHANGED)
        labels = {id2label[int(v) // 1000] for v in np.unique(instance_ids[instance_ids >= 1000])}
        present |= {label.name for label in labels if not label.ignoreInEval}
    assert present and all(0 < ours[name] < 1 for name in present), ours
    for name, score in result['classInstScores'].items():
        if name in ours and not math.isnan(ours[name]):
            assert score == pytest.approx(ours[name], rel=1e-9), name
        else:
            assert math.isnan(score), name
    valid = [score for score in ours.values() if not math.isnan(score)]
    assert result['averageScoreInstClasses'] == pytest.approx(np.mean(valid), rel=1e-9)


def test_the_in1d_numpy_lost_is_still_what_the_evaluator_calls():
    """psanet.compat.NUMPY_IN1D: fails once cityscapesScripts stops calling
    np.in1d (then delete the workaround and run csEvalPixelLevelSemanticLabeling directly)."""
    import inspect
    from cityscapesscripts.evaluation import evalPixelLevelSemanticLabeling
    assert 'np.in1d(' in inspect.getsource(evalPixelLevelSemanticLabeling)


@pytest.mark.parametrize('invert', [False, True])
def test_the_in1d_given_back_is_numpys_old_one(invert):
    from psanet.compat.fixes import _in1d
    rng = np.random.default_rng(0)
    values, members = rng.integers(0, 10, (6, 7)), [1, 3, 3, 8]
    expected = np.array([(v in set(members)) != invert for v in values.ravel()])
    np.testing.assert_array_equal(_in1d(values, members, invert=invert), expected)


def _evaluator(env, *args):
    clean = {k: v for k, v in os.environ.items() if not k.startswith('CITYSCAPES_')}
    return run_process([sys.executable, EVALUATOR, *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**clean, **env})


def test_help_prints_help_and_evaluates_nothing(tmp_path):
    done = _evaluator({'CITYSCAPES_DATASET': str(tmp_path)}, '--help')
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith('usage: evaluate_cityscapes.py')
    assert 'CITYSCAPES_DATASET' in done.stdout and 'CITYSCAPES_RESULTS' in done.stdout
    assert 'nan' not in done.stdout.lower() and 'Evaluating' not in done.stdout
    assert not (tmp_path / 'evaluationResults').exists()


def test_nothing_to_pair_is_one_line_naming_both_variables(tmp_path, mini_cityscapes):
    empty = tmp_path / 'results'
    empty.mkdir()
    cases = [({}, 'CITYSCAPES_DATASET is not set'),
             ({'CITYSCAPES_DATASET': str(tmp_path)},
              f'no ground truth {tmp_path}/gtFine/val/*/*_gtFine_labelIds.png'),
             ({'CITYSCAPES_DATASET': mini_cityscapes, 'CITYSCAPES_RESULTS': str(empty)},
              f'no predictions (*.png) in {empty}')]
    for env, words in cases:
        done = _evaluator(env)
        assert done.returncode == 2, (env, done.stdout[-2000:], done.stderr[-2000:])
        line, = done.stderr.strip().splitlines()
        assert line.startswith('error: ' + words), line
        assert 'CITYSCAPES_DATASET' in line and 'CITYSCAPES_RESULTS' in line
        assert 'nan' not in done.stdout.lower()
