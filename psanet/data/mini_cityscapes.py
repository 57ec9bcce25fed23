"""Generates mini Cityscapes: synthetic street scenes in the exact Cityscapes layout and encodings.

All 19 train classes as shapes with their own colour, texture, size and place,
ignored pixels and instance ids as in the real labels, so that every Cityscapes
reader (paddleseg's ``Cityscapes``, the official evaluator) reads it unchanged.
Same seed, same bytes; a smaller dataset is a prefix of a larger one. Why and
what the scenes hold: docs/design.md.
"""
import json
import os

import cv2
import numpy as np

from psanet.contract import check_save_dir, write_folder
from psanet.errors import ConfigError

from .prepare_cityscapes import LABEL_IDS_SUFFIX, label_ids_to_train_ids
from .validate import IMAGE_SUFFIX, TRAIN_IDS_SUFFIX

__all__ = ['generate', 'format_summary', 'DEFAULT_CITIES', 'MARKER', 'TRAIN_CLASSES']

COLOR_SUFFIX = '_gtFine_color.png'
INSTANCE_IDS_SUFFIX = '_gtFine_instanceIds.png'
MARKER = 'mini_cityscapes.json'
DEFAULT_CITIES = {'train': ('aachen', 'bochum', 'bremen'),
                  'val': ('frankfurt', 'lindau', 'munster')}
SPLIT_SEEDS = {'train': 0, 'val': 1}
FRAME = 19  # the annotated frame of each Cityscapes sequence
MIN_SIZE = (32, 16)
MAX_SIZE = (4096, 2048)  # twice Cityscapes' 2048x1024; a scene is drawn in memory at once
_ATTEMPTS = 4


def _label_table():
    from cityscapesscripts.helpers.labels import labels
    ids = {label.name: label.id for label in labels if label.id >= 0}
    colors = np.zeros((256, 3), np.uint8)
    has_instances = np.zeros(256, bool)
    for label in labels:
        if label.id >= 0:
            colors[label.id] = label.color
            has_instances[label.id] = label.hasInstances
    train = sorted((label.trainId, label.name) for label in labels if 0 <= label.trainId < 255)
    return ids, colors, tuple(name for _, name in train), has_instances


_ID, _ID_COLORS, TRAIN_CLASSES, _HAS_INSTANCES = _label_table()

# Classes that a random scene may miss: each image is made to hold two of
# them in turn, so any ceil(11 / 2) = 6 consecutive images hold all 19.
_ROTATION = ('wall', 'fence', 'terrain', 'traffic light', 'truck', 'bus', 'train',
             'motorcycle', 'bicycle', 'rider', 'person')

_BUILDING_COLORS = ((72, 72, 74), (112, 102, 96), (152, 136, 116), (128, 92, 76),
                    (168, 162, 152), (96, 96, 112))
_CAR_COLORS = ((28, 36, 140), (150, 24, 24), (205, 205, 208), (32, 32, 34), (96, 96, 102),
               (24, 84, 44), (205, 172, 44), (70, 46, 104))
_CLOTHES = ((30, 30, 36), (180, 40, 40), (40, 70, 150), (220, 220, 210), (70, 110, 60),
            (150, 110, 60), (110, 40, 120))
_SKIN = ((226, 184, 152), (190, 140, 105), (140, 96, 66), (95, 64, 46))


class _Scene:
    """A label-id map and an RGB float image painted together, back to front.

    Painting a class with instances (car, person, ...) also writes the
    current object's instance number of that class into ``instances``:
    objects are numbered per class from 0 in the order they are drawn, as
    cityscapesscripts' ``json2instanceImg`` numbers polygons.
    """

    def __init__(self, width, height, rng):
        self.w, self.h, self.rng = width, height, rng
        self.ids = np.zeros((height, width), np.uint8)
        self.instances = np.zeros((height, width), np.uint16)
        self.rgb = np.zeros((height, width, 3), np.float32)
        self.yy, self.xx = np.mgrid[0:height, 0:width].astype(np.float32)
        self._object = 0
        self._numbers = {}  # (object, label id) -> instance number
        self._next_number = {}  # label id -> instance number of its next object

    def new_object(self):
        """What is painted from now on is another object (a rider is one of a bicycle's)."""
        self._object += 1

    def instance_ids(self):
        """Cityscapes' ``instanceIds``: label id * 1000 + instance number on classes with
        instances, the label id elsewhere."""
        ids = self.ids.astype(np.uint16)
        return np.where(_HAS_INSTANCES[self.ids], ids * 1000 + self.instances, ids)

    def paint(self, mask, name, color, pattern=None, noise=4.0, jitter=10.0):
        count = int(mask.sum())
        if count == 0:
            return mask
        color = np.asarray(color, np.float32) + self.rng.normal(0.0, jitter, 3)
        values = np.repeat(color[None], count, axis=0)
        if pattern is not None:
            shift = pattern[mask]
            values += shift[:, None] if shift.ndim == 1 else shift
        values += self.rng.normal(0.0, noise, (count, 3))
        self.rgb[mask] = values
        self.ids[mask] = _ID[name]
        if _HAS_INSTANCES[_ID[name]]:
            key = (self._object, _ID[name])
            if key not in self._numbers:
                self._numbers[key] = self._next_number.get(_ID[name], 0)
                self._next_number[_ID[name]] = self._numbers[key] + 1
            self.instances[mask] = self._numbers[key]
        return mask

    def poly(self, points):
        mask = np.zeros((self.h, self.w), np.uint8)
        cv2.fillPoly(mask, [np.round(np.asarray(points, np.float64)).astype(np.int32)], 1)
        return mask.astype(bool)

    def rect(self, x0, y0, x1, y1):
        """Pixels whose centres lie in the box; never empty when the box is on screen."""
        xa, ya = int(round(x0)), int(round(y0))
        xb, yb = max(int(round(x1)), xa + 1), max(int(round(y1)), ya + 1)
        mask = np.zeros((self.h, self.w), bool)
        mask[max(ya, 0):max(yb, 0), max(xa, 0):max(xb, 0)] = True
        return mask

    def ellipse(self, cx, cy, rx, ry):
        rx, ry = max(rx, 0.6), max(ry, 0.6)
        return ((self.xx - cx) / rx) ** 2 + ((self.yy - cy) / ry) ** 2 <= 1.0

    def line(self, p0, p1, thickness):
        mask = np.zeros((self.h, self.w), np.uint8)
        cv2.line(mask, tuple(int(round(v)) for v in p0), tuple(int(round(v)) for v in p1), 1,
                 max(1, int(round(thickness))))
        return mask.astype(bool)

    def blobs(self, cells, amplitude):
        """Smooth noise (a few blobs across the image), for mottled surfaces."""
        small = self.rng.normal(0.0, 1.0, (max(2, cells // 2), max(2, cells)))
        return cv2.resize(small.astype(np.float32), (self.w, self.h),
                          interpolation=cv2.INTER_CUBIC) * amplitude

    def fine(self, amplitude):
        return self.rng.normal(0.0, amplitude, (self.h, self.w)).astype(np.float32)


class _Street:
    """The perspective of one scene: a horizon, a vanishing point and the lines through it."""

    def __init__(self, scene):
        rng, w, h = scene.rng, scene.w, scene.h
        self.horizon = h * rng.uniform(0.38, 0.5)
        self.vx = w * rng.uniform(0.38, 0.62)
        # x where each edge line meets the bottom row
        self.road = (w * rng.uniform(-0.1, 0.15), w * rng.uniform(0.85, 1.1))
        self.outer = (self.road[0] - w * rng.uniform(0.25, 0.5),
                      self.road[1] + w * rng.uniform(0.25, 0.5))
        self.h = h

    def x_at(self, x_bottom, y):
        return self.vx + (x_bottom - self.vx) * (y - self.horizon) / (self.h - self.horizon)

    def y_at(self, x_bottom, x):
        """Row where the line to ``x_bottom`` crosses column x, kept on the ground."""
        t = (x - self.vx) / (x_bottom - self.vx)
        return self.horizon + (self.h - self.horizon) * float(np.clip(t, 0.0, 1.0))

    def base(self, t):
        """Row of a ground point at depth t (0 horizon, 1 bottom) and its pixels per 1.2 m."""
        u = (self.h - self.horizon) * t
        return self.horizon + u, u


def _render(width, height, rng, wanted):
    scene = _Scene(width, height, rng)
    street = _Street(scene)
    _sky(scene, street)
    _buildings(scene, street)
    if 'terrain' in wanted or rng.random() < 0.45:
        _terrain(scene, street)
    for _ in range(rng.integers(1, 4)):
        _tree(scene, street)
    for kind in ('wall', 'fence'):
        if kind in wanted or rng.random() < 0.3:
            _wall_or_fence(scene, street, kind)
    _ground(scene, street)
    for _, draw in sorted(_objects(scene, street, wanted), key=lambda o: o[0]):
        scene.new_object()
        mask = draw()
        # Annotators leave thin unlabeled gaps around many objects.
        if mask is not None and rng.random() < 0.3:
            ring = mask & ~cv2.erode(mask.astype(np.uint8), np.ones((3, 3), np.uint8)).astype(bool)
            scene.ids[ring] = _ID['unlabeled']
    _ego_vehicle_and_border(scene, street)
    return _finish(scene)


def _sky(scene, street):
    rng = scene.rng
    glow = np.clip(scene.yy / street.horizon, 0, 1.5)[..., None] * np.float32([40, 30, 15])
    scene.paint(np.ones((scene.h, scene.w), bool), 'sky', (70, 128, 186), glow, noise=2.5)
    for _ in range(rng.integers(0, 4)):
        cloud = scene.ellipse(rng.uniform(0, scene.w), rng.uniform(0, street.horizon * 0.6),
                              scene.w * rng.uniform(0.05, 0.15), scene.h * rng.uniform(0.03, 0.07))
        scene.paint(cloud, 'sky', (222, 228, 236), noise=4)


def _buildings(scene, street):
    rng, w, h = scene.rng, scene.w, scene.h
    for side, x_outer in ((0, street.outer[0]), (1, street.outer[1])):
        step = 1 if side == 0 else -1
        x = 0.0 if side == 0 else float(w)
        stop = street.vx - step * w * rng.uniform(0.03, 0.15)
        while (stop - x) * step > 1:
            x_next = x + step * w * rng.uniform(0.08, 0.22)
            if (stop - x_next) * step < 0:
                x_next = stop
            x0, x1 = sorted((x, x_next))
            near = abs((x0 + x1) / 2 - street.vx) / (w / 2)
            if rng.random() < 0.15 + 0.3 * (near < 0.25):
                x = x_next  # a gap: sky or trees behind
                continue
            top = street.horizon - h * rng.uniform(0.12, 0.42) * (0.35 + 0.65 * near)
            corners = [(x0, top), (x1, top), (x1, street.y_at(x_outer, x1)),
                       (x0, street.y_at(x_outer, x0))]
            period = max(3.0, w * 0.035 * (0.4 + 0.6 * near))
            windows = (((scene.xx - x0) % period < 0.55 * period) &
                       ((scene.yy - top) % (1.3 * period) < 0.6 * period) &
                       (scene.yy > top + 0.6 * period))
            glass = np.float32([-58, -46, -22]) if rng.random() < 0.7 else np.float32([45, 40, 20])
            pattern = windows[..., None] * glass + scene.blobs(6, 6)[..., None]
            color = _BUILDING_COLORS[rng.integers(len(_BUILDING_COLORS))]
            scene.paint(scene.poly(corners), 'building', color, pattern, noise=5)
            x = x_next


def _terrain(scene, street):
    rng = scene.rng
    side = rng.integers(2)
    outer = street.outer[side]
    far = outer + (-1, 1)[side] * scene.w * rng.uniform(0.15, 0.4)
    y0 = street.horizon + (scene.h - street.horizon) * rng.uniform(0.0, 0.25)
    strip = scene.poly([(street.x_at(outer, y0), y0), (outer, scene.h), (far, scene.h),
                        (street.x_at(far, y0), y0)])
    scene.paint(strip, 'terrain', (150, 172, 92), scene.blobs(10, 16), noise=7)


def _tree(scene, street):
    rng = scene.rng
    side = rng.integers(2)
    y_base, u = street.base(rng.uniform(0.05, 0.55))
    x_base = street.x_at(street.outer[side], y_base)
    top = y_base - u * rng.uniform(3.0, 4.5)
    scene.paint(scene.line((x_base, y_base), (x_base, top), max(1.0, 0.15 * u)),
                'vegetation', (88, 70, 52), noise=6)
    leaves = np.zeros((scene.h, scene.w), bool)
    radius = max(2.0, u * rng.uniform(0.9, 1.5))
    for _ in range(rng.integers(3, 6)):
        leaves |= scene.ellipse(x_base + rng.normal(0, radius * 0.6), top + rng.normal(0, radius * 0.4),
                                radius * rng.uniform(0.6, 1.0), radius * rng.uniform(0.5, 0.9))
    leafy = (scene.fine(24) + scene.blobs(12, 14))[..., None] * np.float32([0.8, 1.0, 0.5])
    scene.paint(leaves, 'vegetation', (84, 128, 42), leafy, noise=6)


def _wall_or_fence(scene, street, kind):
    rng = scene.rng
    outer = street.outer[rng.integers(2)]
    t0 = rng.uniform(0.03, 0.35)
    corners = []
    for t in (t0, min(1.0, t0 + rng.uniform(0.2, 0.5))):
        y, u = street.base(t)
        corners.append((street.x_at(outer, y), y, u * rng.uniform(0.8, 1.3)))
    (xa, ya, ha), (xb, yb, hb) = corners
    band = scene.poly([(xa, ya), (xb, yb), (xb, yb - hb), (xa, ya - ha)])
    if kind == 'wall':
        bricks = np.where(scene.yy % 4 < 1, -30.0, 0.0).astype(np.float32)
        scene.paint(band, 'wall', (166, 154, 136), bricks, noise=4)
    else:
        wires = ((scene.xx + scene.yy) % 5 < 1.2) | ((scene.xx - scene.yy) % 5 < 1.2)
        scene.paint(band, 'fence', (176, 168, 150), np.where(wires, -80.0, 0.0).astype(np.float32),
                    noise=5)


def _ground(scene, street):
    rng, w, h = scene.rng, scene.w, scene.h
    vp = (street.vx, street.horizon)
    tiles = np.where((scene.yy % 5 < 1) | (scene.xx % 6 < 1), -28.0, 0.0).astype(np.float32)
    for side in (0, 1):
        scene.paint(scene.poly([vp, (street.road[side], h), (street.outer[side], h)]),
                    'sidewalk', (192, 174, 186), tiles, noise=5)
    scene.paint(scene.poly([vp, (street.road[0], h), (street.road[1], h)]), 'road',
                (84, 82, 88), scene.blobs(8, 8), noise=5)
    depth = np.clip((scene.yy - street.horizon) / (h - street.horizon), 1e-3, 1)
    center = (street.road[0] + street.road[1]) / 2 + w * rng.uniform(-0.08, 0.08)
    half = w * rng.uniform(0.008, 0.018)
    dashes = scene.poly([vp, (center - half, h), (center + half, h)]) & (np.floor(2.5 / depth) % 2 == 0)
    scene.paint(dashes, 'road', (226, 224, 214), noise=6)
    if rng.random() < 0.25:
        side = rng.integers(2)
        inner = street.road[side] + (1, -1)[side] * w * rng.uniform(0.1, 0.2)
        y0, y1 = street.base(rng.uniform(0.2, 0.5))[0], street.base(rng.uniform(0.7, 1.0))[0]
        lot = scene.poly([(street.x_at(street.road[side], y0), y0), (street.x_at(street.road[side], y1), y1),
                          (street.x_at(inner, y1), y1), (street.x_at(inner, y0), y0)])
        bays = np.where(scene.xx % 7 < 1, 60.0, 0.0).astype(np.float32)
        scene.paint(lot, 'parking', (122, 116, 120), bays, noise=5)


def _objects(scene, street, wanted):
    """(row of the ground point, drawing function) of everything standing on the ground."""
    rng = scene.rng
    objects = []

    def on_road(t_range, half_width):
        y, u = street.base(rng.uniform(*t_range))
        lo, hi = street.x_at(street.road[0], y), street.x_at(street.road[1], y)
        margin = min(half_width(u), (hi - lo) / 2)
        return rng.uniform(lo + margin, hi - margin), y, u

    def on_sidewalk(t_range, kerb=False):
        side = rng.integers(2)
        y, u = street.base(rng.uniform(*t_range))
        a, b = street.x_at(street.road[side], y), street.x_at(street.outer[side], y)
        x = a + (b - a) * (rng.uniform(0.1, 0.3) if kerb else rng.uniform(0.15, 0.85))
        return x, y, u

    def add(draw, x, y, u, **kwargs):
        objects.append((y, lambda: draw(scene, x, y, u, **kwargs)))

    for _ in range(rng.integers(1, 4)):
        add(_car, *on_road((0.15, 0.95), lambda u: 0.8 * u))
    lights = 'traffic light' in wanted
    for i in range(rng.integers(1, 4)):
        top = 'light' if (lights and i == 0) or rng.random() < 0.35 else 'sign'
        add(_pole, *on_sidewalk((0.1, 0.6), kerb=True), top=top)
    people = rng.integers(0, 3) + ('person' in wanted)
    for _ in range(people):
        add(_person, *on_sidewalk((0.1, 0.9)), kind='person')
    if rng.random() < 0.4:
        add(_static, *on_sidewalk((0.1, 0.9)))
    if 'truck' in wanted or rng.random() < 0.2:
        add(_truck, *on_road((0.15, 0.7), lambda u: 1.1 * u))
    if 'bus' in wanted or rng.random() < 0.15:
        add(_bus, *on_road((0.1, 0.3), lambda u: 0.0))
    if 'train' in wanted or rng.random() < 0.1:
        add(_train, *on_road((0.05, 0.15), lambda u: 0.0))
    if 'motorcycle' in wanted or rng.random() < 0.2:
        add(_two_wheeler, *on_road((0.15, 0.6), lambda u: 1.0 * u), kind='motorcycle',
            ridden=rng.random() < 0.8)
    ridden = 'rider' in wanted or rng.random() < 0.5
    if 'bicycle' in wanted or 'rider' in wanted or rng.random() < 0.2:
        where = on_road((0.15, 0.6), lambda u: 1.0 * u) if ridden else on_sidewalk((0.15, 0.6))
        add(_two_wheeler, *where, kind='bicycle', ridden=ridden)
    return objects


def _car(scene, cx, yb, u):
    rng = scene.rng
    w, h = 1.5 * u * rng.uniform(0.9, 1.1), 1.2 * u * rng.uniform(0.9, 1.1)
    color = _CAR_COLORS[rng.integers(len(_CAR_COLORS))]
    body = scene.rect(cx - w / 2, yb - 0.62 * h, cx + w / 2, yb - 0.1 * h)
    body |= scene.poly([(cx - 0.44 * w, yb - 0.62 * h), (cx + 0.44 * w, yb - 0.62 * h),
                        (cx + 0.32 * w, yb - h), (cx - 0.32 * w, yb - h)])
    shade = np.where(scene.yy > yb - 0.35 * h, -18.0, 8.0).astype(np.float32)
    scene.paint(body, 'car', color, shade, noise=4)
    window = scene.poly([(cx - 0.36 * w, yb - 0.64 * h), (cx + 0.36 * w, yb - 0.64 * h),
                         (cx + 0.27 * w, yb - 0.93 * h), (cx - 0.27 * w, yb - 0.93 * h)])
    scene.paint(window, 'car', (42, 52, 64), noise=4)
    for side in (-1, 1):
        scene.paint(scene.rect(cx + side * 0.46 * w - 0.05 * w, yb - 0.55 * h,
                               cx + side * 0.46 * w + 0.05 * w, yb - 0.45 * h), 'car', (205, 30, 30))
        scene.paint(scene.rect(cx + side * 0.34 * w - 0.1 * w, yb - 0.14 * h,
                               cx + side * 0.34 * w + 0.1 * w, yb), 'car', (22, 22, 24), noise=3)
        body |= scene.rect(cx + side * 0.34 * w - 0.1 * w, yb - 0.14 * h, cx + side * 0.34 * w + 0.1 * w, yb)
    return body


def _truck(scene, cx, yb, u):
    rng = scene.rng
    w, h = 2.1 * u * rng.uniform(0.9, 1.1), 2.8 * u * rng.uniform(0.9, 1.1)
    color = ((222, 222, 216), (176, 44, 34), (44, 92, 160))[rng.integers(3)]
    box = scene.rect(cx - w / 2, yb - h, cx + w / 2, yb - 0.15 * h)
    ribs = np.where((scene.xx - cx) % max(2.0, w / 8) < 1, -36.0, 0.0).astype(np.float32)
    scene.paint(box, 'truck', color, ribs, noise=4)
    bumper = scene.rect(cx - 0.48 * w, yb - 0.15 * h, cx + 0.48 * w, yb - 0.08 * h)
    scene.paint(bumper, 'truck', (50, 50, 52), noise=3)
    wheels = (scene.rect(cx - 0.45 * w, yb - 0.09 * h, cx - 0.2 * w, yb) |
              scene.rect(cx + 0.2 * w, yb - 0.09 * h, cx + 0.45 * w, yb))
    scene.paint(wheels, 'truck', (22, 22, 24), noise=3)
    return box | bumper | wheels


def _bus(scene, cx, yb, u):
    rng = scene.rng
    length, h = min(8.0 * u, 0.9 * scene.w), 2.3 * u * rng.uniform(0.9, 1.1)
    x0 = cx - length / 2
    color = ((232, 200, 44), (204, 44, 40), (44, 122, 204), (240, 240, 236))[rng.integers(4)]
    body = scene.rect(x0, yb - h, x0 + length, yb - 0.12 * h)
    scene.paint(body, 'bus', color, noise=4)
    band = scene.rect(x0 + 0.04 * length, yb - 0.88 * h, x0 + 0.96 * length, yb - 0.5 * h)
    panes = band & ((scene.xx - x0) % max(3.0, length / 10) > 1.2)
    scene.paint(panes, 'bus', (40, 56, 72), noise=4)
    wheels = np.zeros_like(body)
    for f in (0.18, 0.8):
        wheels |= scene.ellipse(x0 + f * length, yb - 0.16 * h, 0.16 * h, 0.16 * h)
    scene.paint(wheels, 'bus', (22, 22, 24), noise=3)
    return body | wheels


def _train(scene, cx, yb, u):
    rng, w = scene.rng, scene.w
    length, h = min(14.0 * u, 1.4 * w), 2.6 * u * rng.uniform(0.9, 1.1)
    x0 = cx - length / 2
    rails = scene.rect(x0 - 0.2 * length, yb - 0.06 * h, x0 + 1.2 * length, yb + 0.1 * h)
    sleepers = np.where(scene.xx % 3 < 1, -30.0, 0.0).astype(np.float32)
    scene.paint(rails, 'rail track', (112, 100, 92), sleepers, noise=5)
    body = scene.rect(x0, yb - h, x0 + length, yb - 0.05 * h)
    scene.paint(body, 'train', (232, 232, 228), noise=3)
    scene.paint(scene.rect(x0, yb - 0.35 * h, x0 + length, yb - 0.2 * h), 'train', (200, 32, 44))
    windows = scene.rect(x0, yb - 0.85 * h, x0 + length, yb - 0.5 * h) & (
        (scene.xx - x0) % max(3.0, 1.2 * u) < max(2.0, 0.8 * u))
    scene.paint(windows, 'train', (40, 50, 62), noise=4)
    pantograph = scene.line((cx, yb - h), (cx + 0.3 * u, yb - 1.4 * h), max(1.0, 0.1 * u))
    scene.paint(pantograph, 'train', (60, 60, 60))
    return body | pantograph


def _person(scene, cx, yb, u, kind='person', seated=False):
    rng = scene.rng
    hp = 1.45 * u * rng.uniform(0.85, 1.1)
    w = 0.33 * hp
    clothes = _CLOTHES[rng.integers(len(_CLOTHES))]
    mask = np.zeros((scene.h, scene.w), bool)
    if not seated:
        legs = (scene.rect(cx - 0.45 * w, yb - 0.48 * hp, cx - 0.05 * w, yb) |
                scene.rect(cx + 0.05 * w, yb - 0.48 * hp, cx + 0.45 * w, yb))
        mask |= scene.paint(legs, kind, (38, 40, 56), noise=4)
    torso = scene.rect(cx - w / 2, yb - 0.84 * hp, cx + w / 2, yb - 0.46 * hp)
    mask |= scene.paint(torso, kind, clothes, noise=5)
    head = scene.ellipse(cx, yb - 0.91 * hp, 0.1 * hp, 0.1 * hp)
    skin = _SKIN[rng.integers(len(_SKIN))]
    if kind == 'rider':
        mask |= scene.paint(head, kind, ((236, 236, 236), (30, 30, 30), (200, 40, 30))[rng.integers(3)])
    else:
        mask |= scene.paint(head, kind, skin, noise=4)
        mask |= scene.paint(head & (scene.yy < yb - 0.95 * hp), kind, (40, 30, 24), noise=4)
    return mask


def _two_wheeler(scene, cx, yb, u, kind, ridden):
    rng = scene.rng
    length = (1.8 if kind == 'motorcycle' else 1.6) * u * rng.uniform(0.9, 1.1)
    r = 0.2 * length
    x0 = cx - length / 2
    mask = np.zeros((scene.h, scene.w), bool)
    hubs = [(x0 + r, yb - r), (x0 + length - r, yb - r)]
    for x, y in hubs:
        tyre = scene.ellipse(x, y, r, r)
        mask |= scene.paint(tyre, kind, (24, 24, 26), noise=3)
        if kind == 'bicycle':  # spokes: the wheel is mostly see-through, keep it light
            mask |= scene.paint(scene.ellipse(x, y, 0.75 * r, 0.75 * r), kind, (128, 128, 132),
                                np.where((scene.xx + scene.yy) % 3 < 1, -40.0, 0.0).astype(np.float32))
    seat = (x0 + 0.4 * length, yb - 2.3 * r)
    bar = (x0 + 0.8 * length, yb - 2.6 * r)
    if kind == 'motorcycle':
        body = scene.poly([(hubs[0][0], hubs[0][1] - 0.3 * r), (seat[0], seat[1]), (bar[0], bar[1]),
                           (hubs[1][0], hubs[1][1] - 0.2 * r), (cx, yb - 0.5 * r)])
        mask |= scene.paint(body, kind, ((40, 40, 46), (150, 22, 22), (30, 60, 140))[rng.integers(3)])
    else:
        frame_color = ((30, 160, 200), (220, 220, 40), (200, 40, 160))[rng.integers(3)]
        thickness = max(1.0, 0.07 * u)
        for p, q in ((hubs[0], seat), (seat, (cx, yb - r)), ((cx, yb - r), hubs[1]),
                     (seat, bar), (bar, hubs[1])):
            mask |= scene.paint(scene.line(p, q, thickness), kind, frame_color, noise=3)
    if ridden:
        rider_base = yb - 2.0 * r + 0.48 * 1.45 * u
        mask |= _person(scene, seat[0] + 0.1 * length, rider_base, u, kind='rider', seated=True)
    return mask


def _pole(scene, x, yb, u, top):
    rng = scene.rng
    height = 3.6 * u
    width = max(1.0, 0.12 * u)
    shine = np.where((scene.xx - x) % 3 < 1, 20.0, 0.0).astype(np.float32)
    mask = scene.paint(scene.rect(x - width / 2, yb - height, x + width / 2, yb), 'pole',
                       (150, 150, 156), shine, noise=4)
    size = max(3.0, 0.6 * u)
    # Poles near the camera leave the picture: mount the box lower so it stays visible.
    y = max(yb - height + size, 0.05 * scene.h + size)
    if top == 'sign':
        shape = rng.integers(3)
        if shape == 0:
            outer, inner = (scene.ellipse(x, y, size / 2, size / 2),
                            scene.ellipse(x, y, size / 3, size / 3))
            colors = ((210, 30, 30), (236, 236, 236)) if rng.random() < 0.6 else ((30, 70, 190),) * 2
        elif shape == 1:
            outer = scene.poly([(x - size / 2, y - size / 3), (x + size / 2, y - size / 3), (x, y + size / 2)])
            inner = scene.poly([(x - size / 4, y - size / 5), (x + size / 4, y - size / 5), (x, y + size / 4)])
            colors = ((210, 30, 30), (236, 236, 236))
        else:
            outer = scene.rect(x - size / 2, y - size / 2, x + size / 2, y + size / 2)
            inner = scene.rect(x - size / 3, y - size / 3, x + size / 3, y + size / 3)
            colors = ((236, 236, 236), (30, 70, 190)) if rng.random() < 0.5 else ((220, 200, 20),) * 2
        mask |= scene.paint(outer, 'traffic sign', colors[0], noise=4)
        mask |= scene.paint(inner, 'traffic sign', colors[1], noise=4)
    else:
        bw = max(2.0, 0.35 * u)
        x_box = x + width / 2 + bw / 2
        box = scene.rect(x_box - bw / 2, y - 1.4 * bw, x_box + bw / 2, y + 1.4 * bw)
        mask |= scene.paint(box, 'traffic light', (34, 34, 30), noise=3)
        lit = rng.integers(3)
        lamp_color = ((240, 40, 30), (250, 190, 20), (40, 230, 90))[lit]
        lamp = scene.ellipse(x_box, y - 0.9 * bw + 0.9 * bw * lit, 0.35 * bw, 0.35 * bw)
        mask |= scene.paint(lamp, 'traffic light', lamp_color, noise=4)
    return mask


def _static(scene, x, yb, u):
    w = 0.5 * u
    box = scene.rect(x - w / 2, yb - 0.9 * u, x + w / 2, yb)
    scene.paint(box, 'static', ((62, 82, 62), (110, 110, 114))[scene.rng.integers(2)], noise=4)
    return None


def _ego_vehicle_and_border(scene, street):
    rng, w, h = scene.rng, scene.w, scene.h
    if rng.random() < 0.35:
        bonnet = scene.ellipse(w * rng.uniform(0.4, 0.6), h * 1.02, w * 0.75, h * rng.uniform(0.07, 0.13))
        gleam = np.clip(50 - 4 * np.abs(scene.yy - h * 0.96), 0, None).astype(np.float32)
        scene.paint(bonnet, 'ego vehicle', (34, 38, 48), gleam, noise=3)
    border = int(rng.integers(0, 3)) * max(1, h // 128)
    if border:
        frame = ~scene.rect(border, border, w - border, h - border)
        scene.paint(frame, 'rectification border', (4, 4, 4), noise=2, jitter=2)


def _finish(scene):
    rng = scene.rng
    gain = rng.uniform(0.85, 1.15) * rng.uniform(0.94, 1.06, 3)
    rgb = scene.rgb * gain.astype(np.float32) + rng.normal(0, 6, 3).astype(np.float32)
    rgb = cv2.GaussianBlur(rgb, (3, 3), 0.6) + scene.fine(2.5)[..., None]
    return np.clip(np.round(rgb), 0, 255).astype(np.uint8), scene.ids, scene.instance_ids()


def _scene(width, height, seed, split, index):
    rng = np.random.default_rng([seed, SPLIT_SEEDS[split], index])
    wanted = {_ROTATION[index % len(_ROTATION)],
              _ROTATION[(index + (len(_ROTATION) + 1) // 2) % len(_ROTATION)]}
    for _ in range(_ATTEMPTS):
        image, label_ids, instance_ids = _render(width, height, rng, wanted)
        present = {name for name in wanted if (label_ids == _ID[name]).any()}
        if present == wanted:  # else a nearer object hid it: draw the scene anew
            break
    return image, label_ids, instance_ids


def _cities(cities, split):
    if cities is None:
        chosen = DEFAULT_CITIES[split]
    elif isinstance(cities, dict):
        chosen = cities[split]
    else:
        chosen = cities
    chosen = tuple(chosen)
    if not chosen or any(not c or '_' in c or os.sep in c for c in chosen):
        raise ValueError(f'cities must be non-empty names without "_" or "{os.sep}", got {chosen!r}')
    return chosen


def _check_root(root):
    """Refuses a root that holds another dataset (a previous mini Cityscapes is replaced)."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise FileExistsError(f'--out {root} is a file, not a folder: choose a folder path '
                              '(it is made if missing).')
    parent = _existing_ancestor(root)
    if not os.path.isdir(parent):
        raise FileExistsError(f'--out {root} cannot be made: {parent} is a file, not a folder; '
                              'choose another --out path.')
    if os.path.exists(os.path.join(root, MARKER)):
        return
    for folder in ('leftImg8bit', 'gtFine'):
        if os.path.isdir(os.path.join(root, folder)) and os.listdir(os.path.join(root, folder)):
            raise FileExistsError(
                f'{os.path.join(root, folder)} exists and was not made by this generator '
                f'(no {MARKER}): choose an empty --out folder or remove that one.')
    try:
        check_save_dir(root, '--out')
    except ConfigError as error:
        raise OSError(str(error)) from None


def _existing_ancestor(path):
    """The nearest of ``path`` and its parents that exists (a file or a folder)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _write(path, array):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not cv2.imwrite(path, array):
        raise OSError(f'cannot write {path}: check the folder permissions and free space.')


def generate(root, num_train=40, num_val=10, size=(256, 128), seed=0, cities=None):
    """Writes mini Cityscapes into ``root`` and returns its summary.

    Layout, file names and encodings are those of Cityscapes::

        leftImg8bit/<split>/<city>/<city>_<seq:06d>_000019_leftImg8bit.png
        gtFine/<split>/<city>/<same stem>_gtFine_labelIds.png        (ids 0-33)
        gtFine/<split>/<city>/<same stem>_gtFine_labelTrainIds.png   (0-18, 255 ignore)
        gtFine/<split>/<city>/<same stem>_gtFine_color.png
        gtFine/<split>/<city>/<same stem>_gtFine_instanceIds.png     (16-bit: label id, or
            label id * 1000 + instance number on the classes with instances)

    Args:
        root (str): output folder; a previous mini Cityscapes there is replaced,
            any other dataset there is an error.
        num_train (int, optional): train images. Default: 40.
        num_val (int, optional): val images. Default: 10.
        size (tuple, optional): (width, height) of every image, at least (32, 16). Default: (256, 128).
        seed (int, optional): non-negative; the same seed gives byte-identical files. Default: 0.
        cities (optional): None for three real city names per split, a list of
            names for both splits, or a dict ``{'train': [...], 'val': [...]}``.
            Images go to the cities in turn. Default: None.

    Returns:
        dict: ``root``, ``size``, ``seed``, ``classes`` (the 19 train-class
        names) and per split ``images``, ``cities`` ({city: images}),
        ``class_pixels`` (fraction of the split's pixels per class),
        ``ignore_pixels`` (fraction at 255) and ``class_images`` (images
        holding each class). Also written to ``root/mini_cityscapes.json``.
    """
    width, height = (int(v) for v in size)
    if width < MIN_SIZE[0] or height < MIN_SIZE[1]:
        raise ValueError(f'size (width, height) must be at least {MIN_SIZE}, got {tuple(size)}')
    if width > MAX_SIZE[0] or height > MAX_SIZE[1]:
        raise ValueError(f'size (width, height) must be at most {MAX_SIZE} (twice Cityscapes), '
                         f'got {tuple(size)}')
    for name, value in (('num_train', num_train), ('num_val', num_val), ('seed', seed)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f'{name} must be a non-negative int, got {value!r}')
    counts = {'train': int(num_train), 'val': int(num_val)}
    split_cities = {split: _cities(cities, split) for split in counts}
    _check_root(root)
    # Written into a hidden folder that then replaces root, so that an interrupted run
    # leaves the previous set (images and summary) as it was; the user's files stay.
    summary = {'root': root, 'size': [width, height], 'seed': int(seed),
               'classes': list(TRAIN_CLASSES), 'splits': {}}
    write_folder(root, lambda folder: _write_splits(folder, counts, split_cities, summary),
                 carry_over=lambda name: True)
    return summary


def _write_splits(root, counts, split_cities, summary):
    (width, height), seed = summary['size'], summary['seed']
    """Fills ``root`` (the hidden folder) with both splits; their statistics go to
    ``summary`` and the summary to ``root/mini_cityscapes.json``."""
    for split, count in counts.items():
        histogram = np.zeros(256, np.int64)
        class_images = np.zeros(256, np.int64)
        per_city = {}
        for index in range(count):
            city = split_cities[split][index % len(split_cities[split])]
            stem = f'{city}_{index // len(split_cities[split]):06d}_{FRAME:06d}'
            image, label_ids, instance_ids = _scene(width, height, seed, split, index)
            train_ids = label_ids_to_train_ids(label_ids)
            _write(os.path.join(root, 'leftImg8bit', split, city, stem + IMAGE_SUFFIX),
                   cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
            label_stem = os.path.join(root, 'gtFine', split, city, stem)
            _write(label_stem + LABEL_IDS_SUFFIX, label_ids)
            _write(label_stem + TRAIN_IDS_SUFFIX, train_ids)
            _write(label_stem + COLOR_SUFFIX, cv2.cvtColor(_ID_COLORS[label_ids], cv2.COLOR_RGB2BGR))
            _write(label_stem + INSTANCE_IDS_SUFFIX, instance_ids)
            pixels = np.bincount(train_ids.ravel(), minlength=256)
            histogram += pixels
            class_images += pixels > 0
            per_city[city] = per_city.get(city, 0) + 1
        total = max(1, int(histogram.sum()))
        summary['splits'][split] = {
            'images': count,
            'cities': per_city,
            'class_pixels': {name: float(histogram[i]) / total for i, name in enumerate(TRAIN_CLASSES)},
            'ignore_pixels': float(histogram[255]) / total,
            'class_images': {name: int(class_images[i]) for i, name in enumerate(TRAIN_CLASSES)},
        }
    with open(os.path.join(root, MARKER), 'w') as f:
        json.dump(summary, f, indent=1)
    return summary


def format_summary(summary):
    """The summary of ``generate`` as a printable table."""
    splits = summary['splits']
    lines = [f'mini Cityscapes in {summary["root"]}: {summary["size"][0]}x{summary["size"][1]}, '
             f'seed {summary["seed"]}, '
             + ', '.join(f'{s["images"]} {name} images' for name, s in splits.items()),
             f'{"class":<14}' + ''.join(f'{name + " px%":>11}{"imgs":>6}' for name in splits)]
    for name in summary['classes']:
        lines.append(f'{name:<14}' + ''.join(
            f'{100 * s["class_pixels"][name]:>11.2f}{s["class_images"][name]:>6}'
            for s in splits.values()))
    lines.append(f'{"ignore (255)":<14}' + ''.join(
        f'{100 * s["ignore_pixels"]:>11.2f}{"":>6}' for s in splits.values()))
    return '\n'.join(lines)
