"""PSANet's attention at chosen pixels, as pictures.

:func:`capture_attention` records, while a model runs, the attention map each
PSA branch aggregates with (forward hooks, installed only inside the block);
:func:`point_maps` reads the maps of one position and :func:`attention_figures`
draws them over the image beside the prediction (the engine runs the model:
:mod:`psanet.core.visualize_attention`, tools/visualize_attention.py). The model names
its branches (``PSANet.attention_layers()``); this module imports nothing of
the engine, the models or paddleseg.
"""
import contextlib
import dataclasses
import math
import re

import cv2
import numpy as np
import paddle

from psanet.errors import ConfigError
from psanet.ops import COLLECT, DISTRIBUTE
from psanet.visualize.drawing import heat_map, hstack, legend, mark, scaled, text_band, vstack

__all__ = ['AttentionRecord', 'MapGeometry', 'capture_attention', 'point_maps', 'branch_map',
           'parse_points', 'check_points', 'psa_branches', 'attention_figures']

# Panels are drawn at least this tall (small images are upscaled) and at most this tall.
_MIN_PANEL_HEIGHT, _MAX_PANEL_HEIGHT = 256, 512


# ---------------------------------------------------------------------------
# Reading the attention
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class AttentionRecord:
    """One PSA branch's attention map in one forward.

    Attributes:
        psa_type (int): the branch's direction, 0 collect or 1 distribute.
        attention (np.ndarray): float32 [N, h*w, h, w], after the mask op (or the
            compact read-out) and the softmax: the branch outputs
            ``out[n, c, p] = sum_a x[n, c, a] * attention[n, a, p]``.
        map_size (tuple): (h, w) of the shrunk map the branch attends over.
        feature_size (tuple): (H, W) of the feature the branch shrinks.
    """
    psa_type: int
    attention: np.ndarray
    map_size: tuple
    feature_size: tuple


def psa_branches(model):
    """The model's PSA branches (``model.attention_layers()``, a PSANet's); ConfigError when
    it has none (``use_psa: false``)."""
    branches = model.attention_layers()
    if not branches:
        raise ConfigError(f'{type(model).__name__} has no PSA branch (model.use_psa: false '
                          'builds none): there is no attention to show; use a PSANet with '
                          'use_psa: true.')
    return branches


def _branch_hooks(branch, records):
    """A pre-hook that notes the feature size and a hook on ``normalize`` that records."""
    seen = {}

    def note_feature(layer, inputs):
        seen['feature_size'] = tuple(int(s) for s in inputs[0].shape[-2:])

    def record(layer, inputs, output):
        if not paddle.in_dynamic_mode():  # traced for export: nothing to read
            return
        attention = output.detach().astype('float32').numpy()
        records.append(AttentionRecord(int(branch.psa_type), attention,
                                       tuple(attention.shape[-2:]), seen.get('feature_size')))

    return note_feature, record


@contextlib.contextmanager
def capture_attention(model):
    """Within the block, every forward of ``model`` appends one record per PSA branch.

    Forward hooks on each branch (its ``normalize`` layer, whose output is the
    map the branch aggregates with) are installed on entry and removed on exit;
    they return nothing, so the outputs stay bit-identical, and outside the
    block the model is as it was (training, evaluation and export unchanged).
    Dygraph only.

    Args:
        model (PSANet): or any layer whose ``attention_layers()`` lists PSA branches.

    Yields:
        list: receives an :class:`AttentionRecord` per branch per forward, in the
        order the branches run (collect before distribute).

    Raises:
        ConfigError: when the model has no PSA branch (``use_psa: false``).
    """
    branches = psa_branches(model)
    records, handles = [], []
    try:
        for branch in branches:
            note_feature, record = _branch_hooks(branch, records)
            handles.append(branch.register_forward_pre_hook(note_feature))
            handles.append(branch.normalize.register_forward_post_hook(record))
        yield records
    finally:
        for handle in handles:
            handle.remove()


def point_maps(record, row, col, sample=0):
    """The h x w maps of what map position p = (row, col) collects and distributes.

    The branch aggregates ``out[:, p] = sum_a x[:, a] * A[a, p]``: p gathers
    from every position through column ``A[:, p]``, and p's own feature reaches
    position b with weight ``A[p, b]``, row p. This is the paper's collect and
    distribute at p: a collect branch predicts column p at p (``Y[q, p]``), a
    distribute branch row p (``Y[p, q]``).

    Args:
        record (AttentionRecord): one branch's map.
        row (int): p's row on the shrunk map.
        col (int): p's column on the shrunk map.
        sample (int, optional): index in the batch. Default: 0.

    Returns:
        tuple: ``(collect, distribute)``, float32 [h, w] each: column p and row p.
    """
    h, w = record.map_size
    if not (0 <= row < h and 0 <= col < w):
        raise ValueError(f'position (row {row}, col {col}) is outside the {h}x{w} map.')
    square = record.attention[sample].reshape(h * w, h * w)
    p = row * w + col
    return square[:, p].reshape(h, w), square[p, :].reshape(h, w)


def branch_map(record, row, col, sample=0):
    """The map a branch itself predicts at p = (row, col): column p for collect, row p for
    distribute (:func:`point_maps`)."""
    collect, distribute = point_maps(record, row, col, sample)
    return collect if record.psa_type == COLLECT else distribute


@dataclasses.dataclass(frozen=True)
class MapGeometry:
    """Where a pixel of the image as read lies on a branch's shrunk map, and back.

    A pixel goes through the val transforms' recorded resizes (pixel centres
    aligned, as cv2.resize; paddings keep it in place), then from the network
    input to the backbone feature as the model resizes its logits back (its
    ``align_corners``, half-pixel by default), then to the shrunk map with
    corners aligned, as the branch shrinks. Positions are continuous, clipped
    to the map; the cell of a pixel is the nearest map position.

    Attributes:
        image_size (tuple): (H, W) of the image as read.
        input_size (tuple): (H, W) of the network input.
        trans_info (tuple): the transforms' ``(op, (h, w) before the op)`` entries.
        feature_size (tuple): (H, W) of the feature the branch shrinks.
        map_size (tuple): (h, w) of the shrunk map.
        align_corners (bool): the model's final resize. Default: False.
    """
    image_size: tuple
    input_size: tuple
    trans_info: tuple
    feature_size: tuple
    map_size: tuple
    align_corners: bool = False

    def _to_map(self, u, axis):
        u = np.asarray(u, np.float64)
        after = [size for _, size in self.trans_info[1:]] + [self.input_size]
        for (op, before), size in zip(self.trans_info, after):
            if op == 'resize':
                u = (u + 0.5) * size[axis] / before[axis] - 0.5
        n_input, n_feature, n_map = (int(s[axis]) for s in (self.input_size, self.feature_size,
                                                             self.map_size))
        if self.align_corners:
            feature = u * (n_feature - 1) / max(n_input - 1, 1)
        else:
            feature = (u + 0.5) * n_feature / n_input - 0.5
        return np.clip(feature * (n_map - 1) / max(n_feature - 1, 1), 0, n_map - 1)

    def cell(self, x, y):
        """(row, col) of the map cell of image pixel (x, y)."""
        return int(np.rint(self._to_map(y, 0))), int(np.rint(self._to_map(x, 1)))

    def upsample(self, values):
        """An [h, w] map as an [H, W] image: bilinear, each pixel read where it lies on the map."""
        height, width = self.image_size
        rows = self._to_map(np.arange(height), 0).astype(np.float32)
        cols = self._to_map(np.arange(width), 1).astype(np.float32)
        map_x = np.ascontiguousarray(np.broadcast_to(cols[None, :], (height, width)))
        map_y = np.ascontiguousarray(np.broadcast_to(rows[:, None], (height, width)))
        return cv2.remap(np.asarray(values, np.float32), map_x, map_y, cv2.INTER_LINEAR,
                         borderMode=cv2.BORDER_REPLICATE)


def parse_points(points):
    """``['x,y', ...]`` (or ``(x, y)`` pairs) -> ``[(x, y), ...]`` ints, in image pixels.

    Raises:
        ConfigError: naming the item that is not two integers ``x,y``.
    """
    parsed = []
    for point in points or []:
        if isinstance(point, str):
            match = re.fullmatch(r'\s*(-?\d+)\s*,\s*(-?\d+)\s*', point)
            if match is None:
                raise ConfigError(f'--points {point!r} is not a point: give each as x,y in image '
                                  'pixels (integers, no spaces), e.g. --points 120,40 300,200.')
            parsed.append((int(match.group(1)), int(match.group(2))))
        else:
            x, y = point
            parsed.append((int(x), int(y)))
    if not parsed:
        raise ConfigError('--points is empty: give at least one x,y in image pixels.')
    return parsed


def check_points(points, image_size, image_name=''):
    """Raises ConfigError for the first point outside an image of ``image_size`` (H, W)."""
    height, width = image_size
    name = f' {image_name}' if image_name else ''
    for x, y in points:
        if not (0 <= x < width and 0 <= y < height):
            raise ConfigError(f'--points {x},{y} is outside the image{name} ({width}x{height} '
                              f'pixels): x must be in 0..{width - 1} and y in 0..{height - 1}.')


# ---------------------------------------------------------------------------
# Attention figures
# ---------------------------------------------------------------------------

def _panel_scale(height):
    if height < _MIN_PANEL_HEIGHT:
        return math.ceil(_MIN_PANEL_HEIGHT / height)
    return min(1.0, _MAX_PANEL_HEIGHT / height)


_DIRECTION_TITLES = {
    COLLECT: ('collect: where p gathers from', 'column p of the collect map'),
    DISTRIBUTE: ('distribute: where p sends to', 'row p of the distribute map'),
}


def _point_figure(image, point, records, geometries, segmentation, names):
    """[image + point | one heat map per branch | prediction], titled, for one point."""
    scale = _panel_scale(image.shape[0])
    x, y = point
    panels = [(mark(scaled(image, scale), point, scale),
               ['image, p marked', f'{image.shape[1]}x{image.shape[0]} pixels'])]
    for record, geometry in zip(records, geometries):
        row, col = geometry.cell(x, y)
        values = branch_map(record, row, col)
        heat = heat_map(image, geometry.upsample(values))
        title, which = _DIRECTION_TITLES[record.psa_type]
        panels.append((mark(scaled(heat, scale), point, scale),
                       [title, f'{which}; p in map cell (row {row}, col {col}) of '
                        f'{record.map_size[0]}x{record.map_size[1]}',
                        f'blue {values.min():.2g} .. red {values.max():.2g}']))
    label, palette = segmentation
    seg = mark(scaled(palette[label], scale, nearest=True), point, scale)
    classes, counts = np.unique(label, return_counts=True)
    swatches = legend(seg.shape[1], [(_name(names, cls), palette[cls])
                                     for cls in classes[np.argsort(-counts)]])
    panels.append((np.vstack([seg, swatches]),
                   ['prediction', f'class at p: {_name(names, int(label[y, x]))}']))
    lines = max(len(text) for _, text in panels)
    return hstack([np.vstack([text_band(panel.shape[1], text + [''] * (lines - len(text))),
                              panel]) for panel, text in panels])


def _name(names, cls):
    return names[cls] if cls < len(names) else f'class {cls}'


def attention_figures(image, points, records, geometries, prediction, names, title=''):
    """The attention figures of ``points``: one per point, and a sheet of all.

    For each point and each branch, the map the branch predicts at the point's
    map cell (:func:`branch_map`: collect, what it gathers from; distribute,
    where it sends to) is drawn as a heat map over the image, beside the image
    with the point marked and the predicted classes.

    Args:
        image (np.ndarray): the BGR uint8 image as read.
        points (list): ``(x, y)`` pixels of ``image``, checked (:func:`check_points`).
        records (list): the :class:`AttentionRecord` of each branch, from one forward.
        geometries (list): the :class:`MapGeometry` of each record.
        prediction (tuple): ``(label, palette)``: int class ids at the image size, and
            the BGR palette as a [C, 3] uint8 array.
        names (list): class names.
        title (str, optional): starts the line above each figure, e.g. the image's name.

    Returns:
        tuple: ``(figures, sheet)``: a BGR uint8 image per point, and all of them
        stacked (a row per point).
    """
    figures = [_point_figure(image, point, records, geometries, prediction, names)
               for point in points]
    figures = [np.vstack([text_band(figure.shape[1], [f'{title}   point p = ({x}, {y})'.strip()],
                                     0.6, (235, 235, 235), 2), figure])
               for figure, (x, y) in zip(figures, points)]
    return figures, vstack(figures)
