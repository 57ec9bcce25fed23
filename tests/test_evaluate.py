"""psanet.core.val / metrics / inference and val.py, against independent numpy computations."""
import glob
import logging
import os
import re
import sys

import cv2
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import engine_helpers as helpers
from conftest import FLOAT32_EPS, MINI_CONFIG, ROOT, TINY_SEGNET_RTOL, clear_margin_pixels, run_process
from psanet.cli import run_cli
from psanet.core import inference as infer
from psanet.core.checkpoint import save_checkpoint
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.metrics import class_areas, confusion_matrix, summarize
from psanet.core.options import EvalOptions, InferenceOptions
from psanet.core.val import evaluate, evaluate_from_config, format_report, prediction_file_name
from psanet.errors import CheckpointError, ConfigError

IGNORE = 255


def numpy_metrics(pred, label, num_classes):
    """mIoU, accuracy, kappa, Dice, precision and recall from a numpy confusion matrix."""
    keep = label != IGNORE
    confusion = np.bincount(label[keep].astype(np.int64) * num_classes + pred[keep],
                            minlength=num_classes**2).reshape(num_classes, num_classes)
    tp = np.diag(confusion).astype(np.float64)
    label_area, pred_area = confusion.sum(1), confusion.sum(0)
    union = label_area + pred_area - tp

    def ratio(a, b):
        return np.where(b > 0, a / np.maximum(b, 1), 0.0)

    total = confusion.sum()
    expected = (pred_area * label_area).sum() / total**2
    return {'confusion_matrix': confusion,
            'class_iou': ratio(tp, union), 'miou': ratio(tp, union).mean(),
            'acc': tp.sum() / total, 'kappa': (tp.sum() / total - expected) / (1 - expected),
            'class_dice': ratio(2 * tp, label_area + pred_area),
            'class_precision': ratio(tp, pred_area), 'class_recall': ratio(tp, label_area)}


def assert_metrics_equal(got, expected):
    # The same ratios of the same integer counts, in float64 in another order: a few ulps.
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-9, atol=1e-12, err_msg=key)


def test_metrics_match_numpy_confusion():
    rng = np.random.default_rng(0)
    num_classes = 6
    label = rng.integers(0, num_classes - 1, size=(3, 1, 13, 17))  # class 5 never in the labels
    label[rng.random(label.shape) < 0.2] = IGNORE
    pred = rng.integers(0, num_classes - 1, size=label.shape)
    pred[0, 0, 0, :4] = 5                                          # ... but predicted
    areas = class_areas(paddle.to_tensor(pred, dtype='int32'), paddle.to_tensor(label), num_classes)
    got = dict(summarize(areas), confusion_matrix=confusion_matrix(pred, label, num_classes))
    assert_metrics_equal(got, numpy_metrics(pred, label, num_classes))
    assert got['class_iou'][5] == 0


def test_class_areas_count_each_pixel_as_paddleseg_defines_the_areas():
    """Class i's intersection is label i predicted as i, its prediction area every scored
    pixel predicted as i (a label outside the classes included: a false positive), its label
    area label i; ignored pixels count nowhere. Counted here a pixel at a time."""
    rng = np.random.default_rng(7)
    num_classes = 5
    label = rng.integers(0, num_classes + 2, size=(2, 1, 9, 11))  # 5, 6: no class
    label[rng.random(label.shape) < 0.25] = IGNORE
    pred = rng.integers(0, num_classes, size=label.shape)
    expected = np.zeros((3, num_classes), dtype='int64')
    for p, t in zip(pred.ravel(), label.ravel()):
        if t != IGNORE:
            expected[1, p] += 1
            if t < num_classes:
                expected[0, t] += p == t
                expected[2, t] += 1
    for given in ((paddle.to_tensor(pred, dtype='int32'), paddle.to_tensor(label)),
                  (pred[:, 0], label[:, 0]), (pred, label[:, 0])):
        got = class_areas(*given, num_classes)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, expected)
    with pytest.raises(ValueError, match='class_areas: pred has 198 pixels but label has 99'):
        class_areas(pred, label[:1], num_classes)


@pytest.fixture
def toy(tmp_path):
    root = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=2, num_val=5)
    return helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(root)), root


def _model_and_val(config_path, seed=0):
    paddle.seed(seed)
    builder = ComponentBuilder(load_config(config_path))
    model = builder.model
    model.eval()
    return model, builder.dataset('val')


def _normalised(path):
    image = cv2.cvtColor(cv2.imread(path), cv2.COLOR_BGR2RGB).astype(np.float32)
    return paddle.to_tensor(((image / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None])


def _expected_metrics(dataset, scores):
    """Metrics of the reference scores' argmax, with near-ties left out of the count.

    evaluate() runs the same model on tensors of its own and averages windows, flips
    and scales in an order of its own: its scores are within TINY_SEGNET_RTOL of the
    reference's (see conftest), so a pixel whose top two are closer than that may go
    either way. Those pixels become ignore (255) in the label files, before evaluate
    reads them; on every other pixel its prediction must be the reference argmax.
    """
    preds, labels = [], []
    for (_, label_path), score in zip(dataset.file_list, scores):
        score = np.asarray(score)
        clear = clear_margin_pixels(score, TINY_SEGNET_RTOL * np.abs(score).max())[0]
        assert clear.mean() > 0.9, 'the reference is too close to ties to compare'
        label = cv2.imread(label_path, cv2.IMREAD_UNCHANGED)
        if not clear.all():
            label[~clear] = IGNORE
            cv2.imwrite(label_path, label)
        preds.append(score.argmax(1))
        labels.append(label[None])
    return numpy_metrics(np.stack(preds), np.stack(labels), 3)


def test_evaluate_matches_independent_prediction(toy):
    config_path, root = toy
    model, dataset = _model_and_val(config_path)
    with paddle.no_grad():
        scores = [model(_normalised(image_path))[0].numpy()
                  for image_path, _ in dataset.file_list]
    expected = _expected_metrics(dataset, scores)
    result = evaluate(model, dataset, EvalOptions(print_detail=False))
    assert result['num_images'] == 5
    assert_metrics_equal(result, expected)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_evaluate_shows_paddleseg_progress_bar_instead_of_per_image_lines(toy, capfd):
    config_path, _ = toy
    model, dataset = _model_and_val(config_path)
    logger = logging.getLogger('test_evaluate.progress')
    logger.setLevel(logging.INFO)
    logger.propagate = False
    lines = _Lines()
    logger.addHandler(lines)
    capfd.readouterr()
    result = evaluate(model, dataset, logger=logger)
    err = capfd.readouterr().err
    # paddleseg.utils.progbar.Progbar's last update: the full bar, then the averages.
    assert re.search(r'^5/5 \[=+\] - \d+s \d+(s|ms|us)/step - batch_cost: \S+ - reader cost: '
                     r'\S+$', err.replace('\b', '').replace('\r', '\n'), re.M), repr(err)
    assert lines.lines == ['Start evaluating (total_samples: 5, this rank: 5)...'] + \
        format_report(result)
    evaluate(model, dataset, EvalOptions(print_detail=False))
    assert '5/5' not in capfd.readouterr().err


def test_reverse_transform_undoes_padding_then_resize():
    # Transforms recorded resize (from 16x32) then padding (from 12x20): undo padding first.
    valid = paddle.ones([1, 2, 12, 20])
    padded = F.pad(valid, [0, 4, 0, 6], value=100.0)
    restored = infer.reverse_transform(padded, [('resize', [16, 32]), ('padding', [12, 20])])
    assert restored.shape == [1, 2, 16, 32]
    # Bilinear weights of a constant sum to 1 up to float32 rounding (an FMA or not): 4 eps.
    np.testing.assert_allclose(restored.numpy(), 1.0, rtol=4 * FLOAT32_EPS, atol=0)
    with pytest.raises(ValueError, match='unknown trans_info'):
        infer.reverse_transform(padded, [('rotate', [1, 1])])


def test_evaluate_resized_input_is_scored_at_label_size(tmp_path):
    root = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=2, num_val=3)
    config = helpers.toy_config(root)
    config['val_dataset']['transforms'] = [{'type': 'Resize', 'target_size': [32, 16]},
                                           {'type': 'Normalize'}]
    model, dataset = _model_and_val(helpers.write_config(tmp_path / 'toy.yml', config))
    scores = []
    with paddle.no_grad():
        for image_path, _ in dataset.file_list:
            image = cv2.cvtColor(cv2.imread(image_path), cv2.COLOR_BGR2RGB).astype(np.float32)
            image = cv2.resize(image, (32, 16), interpolation=cv2.INTER_LINEAR)
            x = paddle.to_tensor(((image / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None])
            scores.append(F.interpolate(model(x)[0], [32, 64], mode='bilinear').numpy())
    expected = _expected_metrics(dataset, scores)
    assert_metrics_equal(evaluate(model, dataset, EvalOptions(print_detail=False)), expected)


class _WindowMean(nn.Layer):
    """Logits that depend on where the window is: every pixel gets the window's mean."""

    def forward(self, x):
        return [paddle.mean(x, axis=[2, 3], keepdim=True).expand_as(x)]


def _numpy_slide(image, crop, stride):
    def window_mean(window):
        return np.broadcast_to(window.astype(np.float64).mean(axis=(-2, -1), keepdims=True),
                               window.shape)
    return helpers.slide_reference(window_mean, image, crop, stride)


@pytest.mark.parametrize('crop, stride', [((16, 8), (10, 5)), ((16, 8), (16, 8)),
                                          ((7, 5), (3, 2)), ((64, 64), (8, 8))])
def test_slide_inference_matches_numpy_window_average(crop, stride):
    image = np.random.default_rng(1).normal(size=(1, 2, 21, 37)).astype(np.float32)
    got = infer.slide_inference(_WindowMean(), paddle.to_tensor(image), crop, stride)
    # float32 window means of <= 777 standard-normal values and sums of <= 9 windows,
    # against float64: in any order of the sums the rounding moves a mean by about
    # eps32 (1e-7) times the values' spread; a tenfold margin.
    np.testing.assert_allclose(got.numpy(), _numpy_slide(image, crop, stride), rtol=1e-5,
                               atol=1e-6)


def test_slide_covering_the_image_equals_whole_image_inference(toy):
    config_path, _ = toy
    model, dataset = _model_and_val(config_path)
    x = _normalised(dataset.file_list[0][0])
    whole = infer.inference(model, x)
    for crop in ((64, 32), (100, 50)):
        # One window, the whole image: the same convolutions of the same tensor, then a
        # zero padding and a division by 1, which are exact.
        slide = infer.inference(model, x, options=InferenceOptions(is_slide=True, crop_size=crop,
                                                                    stride=(8, 8)))
        np.testing.assert_array_equal(slide.numpy(), whole.numpy())
    # A per-pixel model gives the same logits from any overlapping windows: up to the
    # rounding of a 3-term dot product over windows of other widths and of the mean of
    # <= 9 windows, a few eps32 (1e-7) of logits of about 1.
    pointwise = nn.Conv2D(3, 4, 1)
    pointwise_model = lambda t: [pointwise(t)]  # noqa: E731
    np.testing.assert_allclose(
        infer.slide_inference(pointwise_model, x, (24, 12), (10, 6)).numpy(),
        pointwise(x).numpy(), rtol=1e-5, atol=1e-6)


def test_slide_arguments_are_checked_once_by_the_options():
    with pytest.raises(ConfigError, match='--stride 20 4 is larger than --crop_size 16 8'):
        InferenceOptions(is_slide=True, crop_size=(16, 8), stride=(20, 4))
    with pytest.raises(ConfigError, match='test_config.stride 20 4 is larger than '
                                          'test_config.crop_size 16 8'):
        InferenceOptions.from_flags({}, {'is_slide': True, 'crop_size': [16, 8],
                                         'stride': [20, 4]})
    with pytest.raises(ConfigError, match='--is_slide needs --crop_size'):
        InferenceOptions(is_slide=True, stride=(4, 4))


@pytest.mark.parametrize('combine', ['logits', 'softmax'])
def test_aug_inference_averages_flipped_and_scaled_outputs(toy, combine):
    config_path, _ = toy
    model, dataset = _model_and_val(config_path)
    x = _normalised(dataset.file_list[1][0])
    kwargs = {} if combine == 'logits' else {'aug_combine': combine}  # logits: the default
    got = infer.aug_inference(model, x, options=InferenceOptions(
        flip_horizontal=True, flip_vertical=True, **kwargs)).numpy()

    def scores(array):
        with paddle.no_grad():
            logit = model(paddle.to_tensor(np.ascontiguousarray(array)))[0]
            return (logit if combine == 'logits' else F.softmax(logit, 1)).numpy()

    image = x.numpy()
    expected = (scores(image) + scores(image[..., ::-1])[..., ::-1] +
                scores(image[..., ::-1, :])[..., ::-1, :] +
                scores(image[..., ::-1, ::-1])[..., ::-1, ::-1]) / 4
    # The same logits (flips are exact), or their softmax, averaged in another order:
    # a few eps32 (1e-7) of values of about 1.
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    scaled = infer.aug_inference(model, x, options=InferenceOptions(
        scales=[0.5, 1.0, 1.5], **kwargs)).numpy()
    height, width = x.shape[2:]
    expected = 0
    with paddle.no_grad():
        for scale in (0.5, 1.0, 1.5):
            resized = F.interpolate(x, [round(height * scale), round(width * scale)],
                                    mode='bilinear', align_corners=False)
            score = model(resized)[0]
            score = score if combine == 'logits' else F.softmax(score, axis=1)
            expected += F.interpolate(score, [height, width], mode='bilinear',
                                      align_corners=False).numpy() / 3
    np.testing.assert_allclose(scaled, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match='--scales'):
        infer.aug_inference(model, x, options=InferenceOptions(scales=[0.0]))
    with pytest.raises(ConfigError, match='--aug_combine'):
        infer.aug_inference(model, x, options=InferenceOptions(aug_combine='mean'))


def _reference_score(model, x, scales=(1.0, ), flips=((False, False), ), crop=None,
                     stride=None, combine='logits'):
    """Logits (or their softmax) summed over scales and flips (logits without them), step
    by step."""
    height, width = x.shape[2:]

    def logits(image):
        if crop is None:
            return model(image)[0]
        return paddle.to_tensor(helpers.slide_reference(
            lambda window: model(paddle.to_tensor(window))[0].numpy(), image.numpy(), crop,
            stride).astype(np.float32))

    if scales == (1.0, ) and flips == ((False, False), ):
        return logits(x).numpy()
    total = 0
    for scale in scales:
        resized = F.interpolate(x, [round(height * scale), round(width * scale)],
                                mode='bilinear', align_corners=False)
        for horizontal, vertical in flips:
            axes = ([3] if horizontal else []) + ([2] if vertical else [])
            flipped = paddle.flip(resized, axes) if axes else resized
            score = logits(flipped)
            score = F.softmax(score, axis=1) if combine == 'softmax' else score
            score = paddle.flip(score, axes) if axes else score
            total += F.interpolate(score, [height, width], mode='bilinear',
                                   align_corners=False).numpy()
    return total


@pytest.mark.parametrize('options, reference', [
    (dict(is_slide=True, crop_size=(32, 16), stride=(16, 8)),
     dict(crop=(32, 16), stride=(16, 8))),
    (dict(aug_eval=True, scales=[0.75, 1.0], flip_horizontal=True),
     dict(scales=(0.75, 1.0), flips=((False, False), (True, False)))),
    (dict(aug_eval=True, flip_vertical=True, is_slide=True, crop_size=(32, 32), stride=(16, 16)),
     dict(flips=((False, False), (False, True)), crop=(32, 32), stride=(16, 16))),
    (dict(aug_eval=True, scales=[0.75, 1.0], flip_horizontal=True, aug_combine='softmax'),
     dict(scales=(0.75, 1.0), flips=((False, False), (True, False)), combine='softmax')),
])
def test_evaluate_aug_and_slide_options_match_step_by_step_predictions(toy, options, reference):
    config_path, _ = toy
    model, dataset = _model_and_val(config_path)
    with paddle.no_grad():
        scores = [_reference_score(model, _normalised(image_path), **reference)
                  for image_path, _ in dataset.file_list]
    expected = _expected_metrics(dataset, scores)
    assert_metrics_equal(evaluate(model, dataset, EvalOptions(InferenceOptions(**options),
                                                              print_detail=False)), expected)


def _official_evaluation(results_dir, cityscapes_root):
    from cityscapesscripts.evaluation import evalPixelLevelSemanticLabeling as official
    args = official.args
    args.predictionPath, args.predictionWalk = results_dir, None
    args.evalInstLevelScore, args.JSONOutput, args.quiet = False, False, True
    ground_truth = sorted(glob.glob(os.path.join(cityscapes_root, 'gtFine', 'val', '*',
                                                 '*_gtFine_labelIds.png')))
    predictions = [official.getPrediction(args, gt) for gt in ground_truth]
    return official.evaluateImgLists(predictions, ground_truth, args)['classScores']


def test_val_save_dir_feeds_the_official_cityscapes_evaluator(tmp_path, mini_cityscapes):
    from cityscapesscripts.helpers.labels import trainId2label
    root = mini_cityscapes
    config = helpers.toy_config(root, num_classes=19, dataset_type='Cityscapes')
    model, dataset = _model_and_val(helpers.write_config(tmp_path / 'city.yml', config))
    save_dir = str(tmp_path / 'results')
    result = evaluate(model, dataset, EvalOptions(save_dir=save_dir, print_detail=False))
    written = sorted(os.path.relpath(p, save_dir)
                     for p in glob.glob(os.path.join(save_dir, '*', '*.png')))
    image_root = os.path.join(root, 'leftImg8bit', 'val')
    expected = sorted(os.path.relpath(image, image_root).replace('_leftImg8bit', '_labelIds')
                      for image, _ in dataset.file_list)
    assert written == expected
    scores = _official_evaluation(save_dir, root)
    areas = result['areas']
    for train_id in range(19):
        official = scores[trainId2label[train_id].name]
        if areas[1, train_id] + areas[2, train_id] == 0:
            assert np.isnan(official)  # neither predicted nor present
        else:
            # The same IoU of the same integer counts in float64: a few ulps.
            assert official == pytest.approx(result['class_iou'][train_id], abs=1e-12)


def test_prediction_file_names():
    class Plain:
        dataset_root, mode = '/data/toy', 'val'
    assert prediction_file_name('/data/toy/images/a/b.jpg', Plain()) == 'images/a/b.png'
    assert prediction_file_name('/elsewhere/c.jpg', Plain()) == 'c.png'


def test_bad_model_path_is_a_clear_error(tmp_path, toy, capsys):
    config_path, _ = toy
    with pytest.raises(CheckpointError, match='does not exist'):
        evaluate_from_config(config_path, str(tmp_path / 'missing.pdparams'), device='cpu')
    paddle.seed(0)
    save_checkpoint(str(tmp_path / 'other'), helpers.TinySegNet(5))
    code = run_cli(evaluate_from_config, config_path, str(tmp_path / 'other'), device='cpu')
    err = capsys.readouterr().err
    assert code == 2 and 'Traceback' not in err
    assert 'classifier.weight (file [5, 8, 1, 1], model [3, 8, 1, 1])' in err


def test_val_py_exit_code_on_bad_model_path(tmp_path, mini_cityscapes):
    root = mini_cityscapes
    missing = str(tmp_path / 'nope' / 'model.pdparams')
    done = run_process([sys.executable, os.path.join(ROOT, 'val.py'), '--config', MINI_CONFIG,
                        '--model_path', missing, '--device', 'cpu', '--opts',
                        f'val_dataset.dataset_root={root}',
                        f'train_dataset.dataset_root={root}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(f'error: --model_path {missing} does not exist'), done.stderr
    assert 'Traceback' not in done.stderr


def test_val_save_dir_draws_the_numbers_it_prints(tmp_path, mini_cityscapes, monkeypatch, caplog):
    """val.py --save_dir: class_iou.png and confusion_matrix.png are drawn from the arrays of
    the result, whose IoU (paddleseg's areas) the confusion matrix (a bincount) gives again."""
    import psanet.visualize.charts as visualize
    from engine_helpers import mini_psanet_for_eval
    from conftest import MINI_CONFIG
    drawn = {}
    real_chart, real_matrix = visualize.iou_bar_chart, visualize.confusion_matrix_image

    def chart(class_iou, names, miou):
        drawn['chart'] = (np.array(class_iou), list(names), miou)
        return real_chart(class_iou, names, miou)

    def matrix(confusion, names):
        drawn['matrix'] = (np.array(confusion), list(names))
        return real_matrix(confusion, names)

    monkeypatch.setattr(visualize, 'iou_bar_chart', chart)
    monkeypatch.setattr(visualize, 'confusion_matrix_image', matrix)
    weights = str(tmp_path / 'model.pdparams')
    paddle.save(mini_psanet_for_eval(seed=2).state_dict(), weights)
    save_dir = tmp_path / 'results'
    # The psanet logger stops propagating once a run has set it up: caplog's handler goes
    # on it (in a full run on Python 3.9 and pytest 8.4, caplog saw nothing otherwise).
    from psanet.log import get_logger
    monkeypatch.setattr(get_logger(), 'handlers', get_logger().handlers + [caplog.handler])
    with caplog.at_level('INFO', logger='psanet'):
        result = evaluate_from_config(MINI_CONFIG, weights, device='cpu', save_dir=str(save_dir),
                                      opts=[f'val_dataset.dataset_root={mini_cityscapes}'])
    printed = caplog.text
    assert (save_dir / 'class_iou.png').is_file() and (save_dir / 'confusion_matrix.png').is_file()
    class_iou, names, miou = drawn['chart']
    np.testing.assert_array_equal(class_iou, result['class_iou'])
    assert miou == result['miou'] and f'mIoU: {miou:.4f}' in printed
    confusion, matrix_names = drawn['matrix']
    np.testing.assert_array_equal(confusion, result['confusion_matrix'])
    assert names == matrix_names and names[:2] == ['road', 'sidewalk'] and len(names) == 19
    tp = np.diag(confusion).astype(np.float64)
    union = confusion.sum(0) + confusion.sum(1) - tp
    np.testing.assert_allclose(np.where(union > 0, tp / np.maximum(union, 1), 0.0),
                               result['class_iou'], rtol=1e-12, atol=0)
    np.testing.assert_array_equal(result['areas'], np.stack([np.diag(confusion),
                                                             confusion.sum(0), confusion.sum(1)]))
