"""psanet.visualize: the attention maps of a point against the numpy op, the capture leaving
the model and its export unchanged, the evaluation figures' numbers, and
tools/visualize_attention.py end to end."""
import glob
import json
import os
import sys

import cv2
import numpy as np
import paddle
import pytest

import psanet.models  # noqa: F401  (registers PSANet, applies the paddleseg fixes)
from conftest import MINI_CONFIG, ROOT, run_process
from psa_mask_reference import reference_forward
from psanet.errors import ConfigError
from psanet.models import PSANet
from psanet.ops import psa_impl
from psanet.core.attention import visualize_attention
from psanet.visualize import (MapGeometry, branch_map, capture_attention, check_points,
                              class_names, confusion_matrix_image, iou_bar_chart,
                              log_evaluation_figures, normalized_confusion, parse_points,
                              point_maps, write_evaluation_figures)

NUM_CLASSES = 5
INPUT_HW = (64, 96)         # ResNet18_vd at stride 8: an 8x12 feature,
FEATURE_HW = (8, 12)
MAP_HW = (4, 6)             # shrunk by 2 (corners aligned) to 4x6
WINDOW = (5, 7)             # the non-compact models' mask
CORNERS = [(0, 0), (0, MAP_HW[1] - 1), (MAP_HW[0] - 1, 0), (MAP_HW[0] - 1, MAP_HW[1] - 1)]
POSITIONS = CORNERS + [(1, 2), (2, 4)]
SCRIPT = os.path.join(ROOT, 'tools', 'visualize_attention.py')


def tiny_psanet(psa_type, compact=False, softmax=True, use_psa=True, seed=0):
    from paddleseg.models.backbones import ResNet18_vd
    paddle.seed(seed)
    mask_h, mask_w = MAP_HW if compact else WINDOW
    model = PSANet(NUM_CLASSES, ResNet18_vd(output_stride=8), psa_type=psa_type, mask_h=mask_h,
                   mask_w=mask_w, psa_channels=8, psa_softmax=softmax, use_psa=use_psa,
                   compact=compact, enable_auxiliary_loss=False)
    model.eval()
    return model


def branches(model):
    return list(model.head.branches)


def random_input(seed=1):
    return paddle.to_tensor(np.random.RandomState(seed).randn(1, 3, *INPUT_HW).astype('float32'))


def reference_attention(logits, branch):
    """[h*w, h*w] from a branch's attention logits [1, mask_h*mask_w, h, w], in float64:
    the numpy op (or the compact read-out), then softmax over the first position axis."""
    _, _, h, w = logits.shape
    if branch.compact:
        positions = logits.reshape(h * w, h * w)  # [q, p] = channel q at p
        dense = positions if branch.psa_type == 0 else positions.T
    else:
        dense = reference_forward(logits, branch.psa_type, branch.mask_h,
                                  branch.mask_w).reshape(h * w, h * w)
    dense = dense.astype(np.float64)
    if branch.psa_softmax:
        dense = np.exp(dense - dense.max(axis=0, keepdims=True))
        dense /= dense.sum(axis=0, keepdims=True)
    return dense


def capture_logits(model, x):
    """(records of capture_attention, each branch's attention conv output as numpy)."""
    logits = []
    handles = [branch.attention.register_forward_post_hook(
        lambda layer, inputs, output: logits.append(output.numpy())) for branch in branches(model)]
    try:
        with paddle.no_grad(), capture_attention(model) as records:
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return records, logits


# --- The map of a point ----------------------------------------------------------------------

CASES = [(psa_type, compact, impl) for psa_type in (0, 1, 2) for compact, impl in
         ((False, 'custom'), (False, 'paddle'), (True, None))]


@pytest.mark.parametrize('psa_type,compact,impl', CASES,
                         ids=[f'type{t}-{"compact" if c else i}' for t, c, i in CASES])
def test_point_maps_equal_the_numpy_op_softmaxed(psa_type, compact, impl):
    model = tiny_psanet(psa_type, compact)
    with psa_impl(impl or 'custom'):
        records, logits = capture_logits(model, random_input())
    expected_directions = [0, 1] if psa_type == 2 else [psa_type]
    assert [r.psa_type for r in records] == expected_directions
    for record, logit, branch in zip(records, logits, branches(model)):
        assert record.map_size == MAP_HW and record.feature_size == FEATURE_HW
        assert record.attention.shape == (1, MAP_HW[0] * MAP_HW[1]) + MAP_HW
        dense = reference_attention(logit, branch)
        for row, col in POSITIONS:
            p = row * MAP_HW[1] + col
            column, own_row = dense[:, p].reshape(MAP_HW), dense[p, :].reshape(MAP_HW)
            assert not np.allclose(column, own_row)  # a swap of the two would be seen
            collect, distribute = point_maps(record, row, col)
            np.testing.assert_allclose(collect, column, rtol=1e-5, atol=1e-8)
            np.testing.assert_allclose(distribute, own_row, rtol=1e-5, atol=1e-8)
            shown = column if record.psa_type == 0 else own_row
            np.testing.assert_allclose(branch_map(record, row, col), shown, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize('psa_type', [0, 1])
def test_without_softmax_the_maps_are_the_op_output_exactly(psa_type):
    model = tiny_psanet(psa_type, softmax=False)
    records, logits = capture_logits(model, random_input())
    dense = reference_forward(logits[0], psa_type, *WINDOW).reshape(24, 24)
    for row, col in POSITIONS:
        p = row * MAP_HW[1] + col
        collect, distribute = point_maps(records[0], row, col)
        np.testing.assert_array_equal(collect, dense[:, p].reshape(MAP_HW))
        np.testing.assert_array_equal(distribute, dense[p, :].reshape(MAP_HW))


def test_image_pixels_map_to_the_map_corners_and_mirror():
    geometry = MapGeometry(INPUT_HW, INPUT_HW, (), FEATURE_HW, MAP_HW)
    height, width = INPUT_HW
    last = (MAP_HW[0] - 1, MAP_HW[1] - 1)
    assert geometry.cell(0, 0) == (0, 0) and geometry.cell(width - 1, height - 1) == last
    assert geometry.cell(width - 1, 0) == (0, last[1]) and geometry.cell(0, height - 1) == \
        (last[0], 0)
    for x, y in ((10, 5), (30, 40), (70, 20)):
        row, col = geometry.cell(x, y)
        assert geometry.cell(width - 1 - x, height - 1 - y) == (last[0] - row, last[1] - col)
    cells = [geometry.cell(x, 0)[1] for x in range(width)]
    assert cells == sorted(cells) and set(cells) == set(range(MAP_HW[1]))
    # An image resized to the network input: its corners are still the map's.
    resized = MapGeometry((128, 192), INPUT_HW, (('resize', (128, 192)),), FEATURE_HW, MAP_HW)
    assert resized.cell(0, 0) == (0, 0) and resized.cell(191, 127) == last


def test_upsampled_map_keeps_its_corner_values_and_range():
    values = np.random.RandomState(0).rand(*MAP_HW).astype('float32')
    image = MapGeometry(INPUT_HW, INPUT_HW, (), FEATURE_HW, MAP_HW).upsample(values)
    assert image.shape == INPUT_HW
    for (row, col), (y, x) in zip(CORNERS, [(0, 0), (0, -1), (-1, 0), (-1, -1)]):
        assert image[y, x] == pytest.approx(values[row, col], abs=1e-6)
    assert values.min() - 1e-6 <= image.min() and image.max() <= values.max() + 1e-6


def test_points_are_parsed_and_checked():
    assert parse_points(['3,4', ' 10 , 0 ', (5, 6)]) == [(3, 4), (10, 0), (5, 6)]
    for bad in ('3', '3,4,5', 'a,b', '1.5,2'):
        with pytest.raises(ConfigError, match=f'--points {bad!r} is not a point'):
            parse_points([bad])
    with pytest.raises(ConfigError, match=r'--points 96,3 is outside the image a.png \(96x64'):
        check_points([(0, 0), (96, 3)], INPUT_HW, 'a.png')
    with pytest.raises(ConfigError, match='--points -1,0 is outside'):
        check_points([(-1, 0)], INPUT_HW, 'a.png')


def test_a_model_without_psa_branches_is_a_clear_error():
    with pytest.raises(ConfigError, match='has no PSA branch.*use_psa'):
        with capture_attention(tiny_psanet(0, use_psa=False)):
            pass


def test_figures_of_points_on_an_image():
    from paddleseg.transforms import Normalize
    model = tiny_psanet(2)
    image = cv2.resize(np.random.RandomState(0).randint(0, 256, (4, 6, 3)).astype('uint8'),
                       INPUT_HW[::-1], interpolation=cv2.INTER_CUBIC)
    points = [(0, 0), (95, 63), (40, 30)]
    figures, sheet = visualize_attention(model, image, points, [Normalize()], title='tiny')
    assert len(figures) == 3 and all(f.dtype == np.uint8 and f.ndim == 3 for f in figures)
    # Panels at least 256 px tall: image, collect, distribute, prediction side by side.
    assert all(f.shape[0] > 256 and f.shape[1] > 4 * 256 * 96 // 64 for f in figures)
    assert sheet.shape[0] >= 3 * figures[0].shape[0] and sheet.shape[1] == figures[0].shape[1]
    with pytest.raises(ConfigError, match='--points 96,10 is outside the image tiny'):
        visualize_attention(model, image, [(96, 10)], [Normalize()], title='tiny')


# --- The model and its export stay as they are -------------------------------------------------

@pytest.mark.parametrize('psa_type,compact', [(2, False), (1, True)])
def test_outputs_bit_identical_with_and_without_the_capture(psa_type, compact):
    model = tiny_psanet(psa_type, compact)
    x = random_input()
    with paddle.no_grad():
        before = model(x)[0].numpy()
        with capture_attention(model) as records:
            during = model(x)[0].numpy()
        after = model(x)[0].numpy()
    assert len(records) == (2 if psa_type == 2 else 1)
    np.testing.assert_array_equal(during, before)
    np.testing.assert_array_equal(after, before)
    with paddle.no_grad():
        model(x)
    assert len(records) == (2 if psa_type == 2 else 1)  # the hooks are gone
    with pytest.raises(RuntimeError, match='stop'):
        with capture_attention(model) as records:
            raise RuntimeError('stop')
    with paddle.no_grad():
        model(x)
    assert records == []


def _exported_ops(model, folder):
    spec = [paddle.static.InputSpec([1, 3, *INPUT_HW], 'float32', 'x')]
    prefix = os.path.join(str(folder), 'model')
    paddle.jit.save(paddle.jit.to_static(model, input_spec=spec, full_graph=True), prefix)
    with open(prefix + '.json') as f:
        program = json.load(f)['program']
    ops = []

    def walk(regions):
        for region in regions:
            for block in region['blocks']:
                for op in block['ops']:
                    ops.append(op['#'])
                    walk(op.get('regions', []))

    walk(program['regions'])
    return ops


def test_the_exported_program_is_unchanged_by_a_capture(tmp_path):
    used = tiny_psanet(2)
    with paddle.no_grad(), capture_attention(used) as records:
        used(random_input())
        during_ops = _exported_ops(used, tmp_path / 'during')  # traced with the hooks on
    assert len(records) == 2  # the trace recorded nothing
    used_ops = _exported_ops(used, tmp_path / 'used')
    # Run once as well: on Paddle 3.0 the tensor paddleseg's ResNet_vd.forward keeps
    # (conv1_logit) is saved as one more parameter of a model that has run.
    fresh = tiny_psanet(2)
    with paddle.no_grad():
        fresh(random_input())
    fresh_ops = _exported_ops(fresh, tmp_path / 'fresh')
    assert during_ops == used_ops == fresh_ops
    assert used_ops.count('1.softmax') == 2 and used_ops.count('3.psa_mask') == 2


# --- Evaluation figures ------------------------------------------------------------------------

def random_prediction(seed=0, num_classes=6, shape=(2, 1, 24, 32)):
    """Predictions and labels where class 4 has no label pixels and class 5 is never
    predicted nor labelled; a fifth of the labels are ignore (255)."""
    rng = np.random.RandomState(seed)
    pred = rng.randint(0, num_classes - 1, shape)
    label = rng.randint(0, num_classes - 2, shape)
    label[rng.rand(*shape) < 0.2] = 255
    return pred, label


def test_confusion_matrix_counts_every_pair_as_a_loop_does():
    from psanet.core.metrics import confusion_matrix
    pred, label = random_prediction()
    expected = np.zeros((6, 6), np.int64)
    for p, t in zip(pred.ravel(), label.ravel()):
        if t != 255:
            expected[t, p] += 1
    for given in ((pred, label), (paddle.to_tensor(pred), paddle.to_tensor(label))):
        got = confusion_matrix(*given, num_classes=6)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, expected)
    # Out-of-range ids count nowhere.
    np.testing.assert_array_equal(confusion_matrix(np.array([7, 1, 2]), np.array([1, 9, 2]), 6),
                                  np.eye(6, dtype=np.int64) * (np.arange(6) == 2))


def test_iou_from_the_confusion_matrix_is_the_printed_iou():
    from psanet.core.metrics import class_areas, confusion_matrix, summarize
    pred, label = random_prediction(seed=3)
    areas = class_areas(paddle.to_tensor(pred.astype('int32')), paddle.to_tensor(label), 6)
    confusion = confusion_matrix(pred, label, 6)
    intersect, predicted, labelled = np.diag(confusion), confusion.sum(0), confusion.sum(1)
    np.testing.assert_array_equal(areas, np.stack([intersect, predicted, labelled]))
    union = predicted + labelled - intersect
    iou = np.where(union > 0, intersect / np.maximum(union, 1), 0.0)
    np.testing.assert_allclose(summarize(areas)['class_iou'], iou, rtol=1e-12)


def test_normalized_confusion_rows_sum_to_one_and_empty_rows_are_nan():
    from psanet.core.metrics import confusion_matrix
    pred, label = random_prediction()
    confusion = confusion_matrix(pred, label, 6)
    shares = normalized_confusion(confusion)
    totals = confusion.sum(axis=1)
    assert list(np.flatnonzero(totals == 0)) == [4, 5]
    assert np.isnan(shares[4]).all() and np.isnan(shares[5]).all()
    full = totals > 0
    np.testing.assert_allclose(shares[full].sum(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(shares[full], confusion[full] / totals[full, None], rtol=1e-12)


def evaluation_result():
    from psanet.core.metrics import class_areas, confusion_matrix, summarize
    pred, label = random_prediction()
    result = summarize(class_areas(paddle.to_tensor(pred.astype('int32')),
                                   paddle.to_tensor(label), 6))
    result['confusion_matrix'] = confusion_matrix(pred, label, 6)
    return result


def test_figures_have_a_row_per_class(tmp_path):
    result, names = evaluation_result(), class_names(6)
    chart = iou_bar_chart(result['class_iou'], names, result['miou'])
    matrix = confusion_matrix_image(result['confusion_matrix'], names)
    for image in (chart, matrix):
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
        assert 6 * 20 < image.shape[0] < 2000 and 300 < image.shape[1] < 2000
    assert matrix.shape[0] > 6 * 30 and matrix.shape[1] > 6 * 30
    paths = write_evaluation_figures(result, names, str(tmp_path / 'figures'))
    assert [os.path.basename(p) for p in paths] == ['class_iou.png', 'confusion_matrix.png']
    np.testing.assert_array_equal(cv2.imread(paths[0]), chart)
    np.testing.assert_array_equal(cv2.imread(paths[1]), matrix)
    assert sorted(os.listdir(tmp_path / 'figures')) == ['class_iou.png', 'confusion_matrix.png']


def test_figures_are_logged_to_visualdl_as_rgb():
    class Writer:
        def __init__(self):
            self.images = []

        def add_image(self, tag, img, step, walltime=None, dataformats='HWC'):
            self.images.append((tag, img, step))

    result, names = evaluation_result(), class_names(6)
    writer = Writer()
    log_evaluation_figures(writer, result, names, 40)
    assert [(tag, step) for tag, _, step in writer.images] == \
        [('Evaluate/class_iou', 40), ('Evaluate/confusion_matrix', 40)]
    bgr = confusion_matrix_image(result['confusion_matrix'], names)
    np.testing.assert_array_equal(writer.images[1][1], bgr[:, :, ::-1])


def test_class_names():
    assert class_names(19) == [
        'road', 'sidewalk', 'building', 'wall', 'fence', 'pole', 'traffic light',
        'traffic sign', 'vegetation', 'terrain', 'sky', 'person', 'rider', 'car', 'truck', 'bus',
        'train', 'motorcycle', 'bicycle']
    from paddleseg.datasets import ADE20K, Cityscapes
    assert class_names(19, Cityscapes) == class_names(19)
    assert class_names(19, ADE20K)[:2] == ['class 0', 'class 1']
    assert class_names(3) == ['class 0', 'class 1', 'class 2']


# --- tools/visualize_attention.py ------------------------------------------------------------

@pytest.fixture(scope='module')
def mini_weights(tmp_path_factory, mini_cityscapes):
    """The mini config's PSANet, freshly initialised, saved; and the --opts that point the
    config at the generated mini Cityscapes."""
    from psanet.core.config import ComponentBuilder, load_config
    opts = [f'val_dataset.dataset_root={mini_cityscapes}',
            f'train_dataset.dataset_root={mini_cityscapes}']
    paddle.seed(0)
    model = ComponentBuilder(load_config(MINI_CONFIG, opts=opts)).model
    path = str(tmp_path_factory.mktemp('visualize') / 'model.pdparams')
    paddle.save(model.state_dict(), path)
    return path, opts


def run_tool(weights, opts, image, save_dir, *points):
    return run_process([sys.executable, SCRIPT, '--config', MINI_CONFIG, '--model_path', weights,
                        '--image_path', image, '--points', *points, '--save_dir', save_dir,
                        '--device', 'cpu', '--opts', *opts],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)


def val_image(root):
    return sorted(glob.glob(os.path.join(root, 'leftImg8bit', 'val', '*', '*.png')))[0]


def test_the_tool_writes_a_figure_per_point_and_a_sheet(mini_weights, mini_cityscapes, tmp_path):
    weights, opts = mini_weights
    image = val_image(mini_cityscapes)
    height, width = cv2.imread(image).shape[:2]
    out = str(tmp_path / 'out')
    done = run_tool(weights, opts, image, out, '0,0', f'{width - 1},{height - 1}', '20,10')
    assert done.returncode == 0, done.stderr[-3000:]
    stem = os.path.splitext(os.path.basename(image))[0]
    names = [f'{stem}_attention_x0_y0.png', f'{stem}_attention_x{width - 1}_y{height - 1}.png',
             f'{stem}_attention_x20_y10.png']
    assert sorted(os.listdir(out)) == sorted(names + [f'{stem}_attention_sheet.png'])
    figures = [cv2.imread(os.path.join(out, name)) for name in names]
    sheet = cv2.imread(os.path.join(out, f'{stem}_attention_sheet.png'))
    # Four panels (bi-directional) of the image upscaled to at least 256 px tall.
    assert all(f.shape == figures[0].shape and f.shape[0] > 256 for f in figures)
    assert figures[0].shape[1] > 4 * 256 * width // height
    assert sheet.shape[1] == figures[0].shape[1] and sheet.shape[0] > 3 * figures[0].shape[0]


def test_the_tool_names_a_point_outside_the_image(mini_weights, mini_cityscapes, tmp_path):
    weights, opts = mini_weights
    image = val_image(mini_cityscapes)
    height, width = cv2.imread(image).shape[:2]
    done = run_tool(weights, opts, image, str(tmp_path / 'out'), '1,1', f'{width},5')
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith('error:')]
    assert errors == [f'error: --points {width},5 is outside the image {image} '
                      f'({width}x{height} pixels): x must be in 0..{width - 1} and y in '
                      f'0..{height - 1}.'], done.stderr[-3000:]
    assert 'Traceback' not in done.stderr and not os.path.exists(tmp_path / 'out')
