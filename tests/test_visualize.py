"""psanet.visualize: the attention maps of a point against the numpy op, the capture leaving
the model and its export unchanged, the evaluation charts' numbers, and
tools/visualize_attention.py end to end."""
import errno
import glob
import json
import os
import sys

import cv2
import numpy as np
import paddle
import pytest

import figure_reading as reading
import psanet.models  # noqa: F401  (registers PSANet, applies the paddleseg fixes)
import psanet.visualize.attention as attention_module
from conftest import MINI_CONFIG, ROOT, run_process
from psa_mask_reference import reference_forward
from psanet.errors import ConfigError
from psanet.models import PSANet
from psanet.ops import psa_impl
from psanet.core.visualize_attention import visualize_attention
from psanet.visualize.attention import (MapGeometry, branch_map, capture_attention,
                                        check_points, parse_points, point_maps)
from psanet.visualize.charts import (class_names, confusion_matrix_image, log_evaluation_figures, normalized_confusion,
                                     write_evaluation_figures)
from psanet.visualize.drawing import write_png

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


def cell_by_hand(x, y, image_hw, resized_hw, input_hw=INPUT_HW):
    """The map cell of image pixel (x, y), worked out from the resize ratio: the image is
    resized to ``resized_hw`` (pixel centres aligned) and padded at the bottom and right to
    ``input_hw``; the network input is 8 times its stride-8 feature (the model resizes its
    logits back with half-pixel centres), which the branch shrinks to the map with corners
    aligned; the cell is the nearest map position."""
    cell = []
    for u, image, resized, network, feature, shrunk in zip(
            (y, x), image_hw, resized_hw, input_hw, FEATURE_HW, MAP_HW):
        on_input = (u + 0.5) * (resized / image) - 0.5
        on_feature = (on_input + 0.5) / (network / feature) - 0.5
        on_map = on_feature * (shrunk - 1) / (feature - 1)
        cell.append(int(np.clip(np.floor(on_map + 0.5), 0, shrunk - 1)))
    return tuple(cell)


@pytest.fixture
def drawn_cells(monkeypatch):
    """(direction, row, col) of every map the figures draw, in order."""
    cells, real = [], attention_module.branch_map

    def recording(record, row, col, sample=0):
        cells.append((record.psa_type, row, col))
        return real(record, row, col, sample)

    monkeypatch.setattr(attention_module, 'branch_map', recording)
    return cells


def palette_colours_in(image, palette):
    """The classes whose BGR palette colour some pixel of ``image`` has."""
    pixels = {tuple(int(c) for c in p) for p in np.unique(image.reshape(-1, 3), axis=0)}
    return {cls for cls, colour in enumerate(palette) if tuple(int(c) for c in colour) in pixels}


def test_figures_of_points_on_an_image(drawn_cells):
    from paddleseg.transforms import Normalize
    from psanet.contract import color_map
    model = tiny_psanet(2)
    image = cv2.resize(np.random.RandomState(0).randint(0, 256, (4, 6, 3)).astype('uint8'),
                       INPUT_HW[::-1], interpolation=cv2.INTER_CUBIC)
    points = [(0, 0), (95, 63), (40, 30)]
    figures, sheet = visualize_attention(model, image, points, [Normalize()], title='tiny')
    assert len(figures) == 3 and all(f.dtype == np.uint8 and f.ndim == 3 for f in figures)
    # Each point's collect and distribute panels show the map at the point's own cell.
    assert drawn_cells == [(direction,) + cell_by_hand(x, y, INPUT_HW, INPUT_HW)
                           for x, y in points for direction in (0, 1)]
    assert len({cell[1:] for cell in drawn_cells}) == 3
    # The prediction panel and its legend: the colours of the classes the model predicts
    # (its logits on the image, normalised in numpy as RGB), and of no other class.
    rgb = image[:, :, ::-1].astype('float32')
    x = paddle.to_tensor(np.ascontiguousarray(((rgb / 255 - 0.5) / 0.5).transpose(2, 0, 1)[None]))
    with paddle.no_grad():
        predicted = set(np.unique(model(x)[0].numpy().argmax(1)).tolist())
    palette = np.asarray(color_map(NUM_CLASSES), np.uint8).reshape(-1, 3)[:NUM_CLASSES, ::-1]
    assert 2 <= len(predicted) < NUM_CLASSES
    for figure in figures:
        assert palette_colours_in(figure, palette) == predicted
    # The sheet is the figures, one under the other.
    assert [find_rows(sheet, figure) for figure in figures] == sorted(
        find_rows(sheet, figure) for figure in figures)
    with pytest.raises(ConfigError, match='--points 96,10 is outside the image tiny'):
        visualize_attention(model, image, [(96, 10)], [Normalize()], title='tiny')


def find_rows(sheet, figure):
    """The first row of ``sheet`` where ``figure`` lies whole at the left edge; fails if none."""
    height, width = figure.shape[:2]
    starts = [top for top in range(sheet.shape[0] - height + 1)
              if np.array_equal(sheet[top, :width], figure[0])]
    for top in starts:
        if np.array_equal(sheet[top:top + height, :width], figure):
            return top
    raise AssertionError(f'a {height}x{width} figure is not in the {sheet.shape[:2]} sheet')


# (image size, val transforms, size after the resize): the input is 64x96 in both.
RESIZING = [((128, 192), [('Resize', {'target_size': (96, 64)})], (64, 96)),
            ((100, 150), [('Resize', {'target_size': (72, 48)}),
                          ('Padding', {'target_size': (96, 64)})], (48, 72))]


@pytest.mark.parametrize('image_hw, transforms, resized_hw', RESIZING, ids=['resize', 'pad'])
def test_points_land_in_their_cell_through_resizing_transforms(drawn_cells, image_hw,
                                                               transforms, resized_hw):
    from paddleseg import transforms as T
    model = tiny_psanet(2)
    height, width = image_hw
    image = cv2.resize(np.random.RandomState(1).randint(0, 256, (5, 7, 3)).astype('uint8'),
                       (width, height), interpolation=cv2.INTER_CUBIC)
    points = [(0, 0), (width - 1, height - 1), (width // 2, height // 3),
              (int(width * 0.7), int(height * 0.8)), (width - 1, 0)]
    pipeline = [getattr(T, name)(**args) for name, args in transforms] + [T.Normalize()]
    figures, _ = visualize_attention(model, image, points, pipeline)
    assert len(figures) == len(points)
    by_hand = [cell_by_hand(x, y, image_hw, resized_hw) for x, y in points]
    assert drawn_cells == [(direction,) + cell for cell in by_hand for direction in (0, 1)]
    # The transforms matter: read as if the image were the input, points land elsewhere.
    assert by_hand != [cell_by_hand(x, y, INPUT_HW, INPUT_HW) for x, y in points]


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
    # Both branches' op, each softmaxed over its map's last axis (the custom op's export:
    # PSABranch._aggregate_exported asks the op for the other branch's form).
    assert used_ops.count('3.psa_mask') == 2
    assert used_ops.count('1.softmax') == 2 and used_ops.count('1.exp') == 0


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


def check_matrix_shows_shares(image, confusion):
    """Each cell of the matrix figure (BGR) has the shade of its row-normalised share, worked
    out here; a class without ground-truth pixels is a grey row."""
    confusion = np.asarray(confusion, np.float64)
    cells = reading.matrix_cells(image)
    count = len(confusion)
    assert len(cells) == count and all(len(row) == count for row in cells), np.shape(cells)
    for i in range(count):
        total = confusion[i].sum()
        for j in range(count):
            if total == 0:
                assert cells[i][j] == reading.EMPTY_ROW, (i, j)
            else:
                shade = reading.share_shade(confusion[i, j] / total)
                assert np.abs(np.array(cells[i][j]) - shade).max() <= 0.5, (i, j, cells[i][j],
                                                                            shade)


def check_chart_shows_ious(image, class_iou, printed_miou):
    """One bar per class, top to bottom, each as long as its IoU on the scale that the
    IoU 1.0 bar gives (class 0's), and the red line at the printed mIoU."""
    found = reading.bars(image)
    assert len(found) == len(class_iou)
    zero = found[0][0]
    assert all(start == zero for start, _ in found)
    assert class_iou[0] == 1.0
    one = found[0][1]
    for (_, end), iou in zip(found, class_iou):
        # A bar is at least 2 pixels wide, so that an IoU of 0 shows.
        assert abs(end - (zero + max(iou * (one - zero), 1))) <= 1, (end, iou)
    expected = zero + float(printed_miou) * (one - zero)
    assert abs(reading.miou_line_column(image) - expected) <= 1, (expected, printed_miou)


# Rows ground truth: class 2 has no pixels, and no row equals its column.
ASYMMETRIC = np.array([[50, 30, 20, 0], [5, 80, 10, 5], [0, 0, 0, 0], [40, 0, 10, 50]])


def test_confusion_matrix_cells_show_each_ground_truth_row_share():
    assert not np.array_equal(normalized_confusion(ASYMMETRIC.T)[[0, 1, 3]],
                              normalized_confusion(ASYMMETRIC)[[0, 1, 3]])
    check_matrix_shows_shares(confusion_matrix_image(ASYMMETRIC, class_names(4)), ASYMMETRIC)


def evaluation_with_a_perfect_class():
    """evaluation_result() of predictions right on every class-0 pixel and nowhere else 0:
    IoU 1.0 for class 0, 0.0 for classes 4 and 5, so that the mean of all IoUs (the printed
    mIoU) and the mean of the non-zero ones differ."""
    from psanet.core.metrics import class_areas, confusion_matrix, summarize
    pred, label = random_prediction(seed=5)
    pred = np.where(label == 0, 0, np.where(pred == 0, 1, pred))
    result = summarize(class_areas(paddle.to_tensor(pred.astype('int32')),
                                   paddle.to_tensor(label), 6))
    result['confusion_matrix'] = confusion_matrix(pred, label, 6)
    return result


def test_class_iou_chart_draws_the_printed_miou(tmp_path):
    result = evaluation_with_a_perfect_class()
    iou = np.asarray(result['class_iou'])
    assert iou[0] == 1.0 and iou[4] == iou[5] == 0.0
    printed = f'{result["miou"]:.4f}'  # as evaluate logs it
    assert abs(float(printed) - iou[iou > 0].mean()) * 500 > 20  # far apart on the chart
    chart_path, _ = write_evaluation_figures(result, class_names(6), str(tmp_path / 'figures'))
    check_chart_shows_ious(cv2.imread(chart_path), iou, printed)


def test_figures_have_a_row_per_class(tmp_path):
    result, names = evaluation_with_a_perfect_class(), class_names(6)
    paths = write_evaluation_figures(result, names, str(tmp_path / 'figures'))
    assert [os.path.basename(p) for p in paths] == ['class_iou.png', 'confusion_matrix.png']
    assert sorted(os.listdir(tmp_path / 'figures')) == ['class_iou.png', 'confusion_matrix.png']
    chart, matrix = (cv2.imread(p) for p in paths)
    check_chart_shows_ious(chart, result['class_iou'], result['miou'])
    check_matrix_shows_shares(matrix, result['confusion_matrix'])
    assert (result['confusion_matrix'][4:].sum(axis=1) == 0).all()  # two grey rows among them


def test_figures_are_logged_to_visualdl_as_rgb():
    class Writer:
        def __init__(self):
            self.images = []

        def add_image(self, tag, img, step, walltime=None, dataformats='HWC'):
            self.images.append((tag, img, step))

    result, names = evaluation_with_a_perfect_class(), class_names(6)
    writer = Writer()
    log_evaluation_figures(writer, result, names, 40)
    assert [(tag, step) for tag, _, step in writer.images] == \
        [('Evaluate/class_iou', 40), ('Evaluate/confusion_matrix', 40)]
    # Read as RGB, the logged images show the shares and IoUs in the key's colours.
    chart, matrix = (np.ascontiguousarray(image[:, :, ::-1]) for _, image, _ in writer.images)
    check_chart_shows_ious(chart, result['class_iou'], result['miou'])
    check_matrix_shows_shares(matrix, result['confusion_matrix'])


@pytest.mark.parametrize('failing', ['write', 'rename'])
def test_a_failed_png_write_keeps_the_earlier_file_and_no_temporary(tmp_path, monkeypatch,
                                                                   failing):
    folder = tmp_path / 'figures'
    path = write_png(str(folder / 'class_iou.png'), np.full((8, 8, 3), 7, np.uint8))
    before = (folder / 'class_iou.png').read_bytes()

    if failing == 'write':  # the disk fills up after a few bytes
        import builtins
        real_open = builtins.open

        class FullDisk:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                self.f.write(bytes(data)[:16])
                self.f.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def full_for_files_being_written(file, mode='r', *a, **k):
            opened = real_open(file, mode, *a, **k)
            return FullDisk(opened) if 'w' in mode else opened
        monkeypatch.setattr(builtins, 'open', full_for_files_being_written)
    else:
        def refused(src, dst):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), dst)
        monkeypatch.setattr(os, 'replace', refused)
    with pytest.raises(OSError):
        write_png(path, np.full((8, 8, 3), 200, np.uint8))
    monkeypatch.undo()
    assert os.listdir(folder) == ['class_iou.png']
    assert (folder / 'class_iou.png').read_bytes() == before


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
    # The sheet is the figures, one under the other, in the order of the points.
    assert [find_rows(sheet, figure) for figure in figures] == sorted(
        find_rows(sheet, figure) for figure in figures)
    # Each file holds what the weights draw in this process through the config's val
    # transforms, in the Cityscapes palette with the Cityscapes names.
    from psanet.contract import color_map
    from psanet.core.config import ComponentBuilder, load_config
    builder = ComponentBuilder(load_config(MINI_CONFIG, opts=opts))
    model = builder.model
    model.set_state_dict(paddle.load(weights))
    points = [(0, 0), (width - 1, height - 1), (20, 10)]
    expected, _ = visualize_attention(model, cv2.imread(image), points, builder.val_transforms,
                                      color_map(19, cityscapes=True), class_names(19),
                                      os.path.basename(image))
    for name, figure, drawn in zip(names, figures, expected):
        np.testing.assert_array_equal(figure, drawn, err_msg=name)
    # The prediction panel's colours: the Cityscapes colour of each class the model
    # predicts on the image (its logits with the val Normalize written out in numpy; a
    # near-tie may go either way), and of no other class.
    from conftest import MINI_PSANET_RTOL, clear_margin_pixels
    from engine_helpers import dygraph_logits
    logits = dygraph_logits(model, image)
    clear = clear_margin_pixels(logits, MINI_PSANET_RTOL * np.abs(logits).max(), class_axis=0)
    top2 = np.argsort(logits, axis=0)[-2:]
    must = set(np.unique(top2[-1][clear]).tolist())
    may = must | set(np.unique(top2[:, ~clear]).tolist())
    palette = np.asarray(color_map(19, cityscapes=True), np.uint8).reshape(-1, 3)[:19, ::-1]
    colourful = [cls for cls in range(19) if len(set(palette[cls].tolist())) > 1]  # not grey
    for figure in figures:
        shown = palette_colours_in(figure, palette) & set(colourful)
        assert must & set(colourful) <= shown <= may, (must, shown, may)


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
