"""The canvas of a mini Cityscapes scene: Cityscapes' label table, a label map and an image
painted together, and the perspective of the street they show.

The scenes themselves are drawn in :mod:`psanet.data.street_scenes`; the dataset is
written in :mod:`psanet.data.mini_cityscapes`.
"""
import cv2
import numpy as np

__all__ = ['LABEL_IDS', 'LABEL_COLORS', 'TRAIN_CLASSES', 'HAS_INSTANCES', 'Scene', 'Street']


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


# Label id by name, RGB colour by label id, the 19 train classes in train-id order,
# and whether a label id has instances.
LABEL_IDS, LABEL_COLORS, TRAIN_CLASSES, HAS_INSTANCES = _label_table()


class Scene:
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
        return np.where(HAS_INSTANCES[self.ids], ids * 1000 + self.instances, ids)

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
        self.ids[mask] = LABEL_IDS[name]
        if HAS_INSTANCES[LABEL_IDS[name]]:
            key = (self._object, LABEL_IDS[name])
            if key not in self._numbers:
                self._numbers[key] = self._next_number.get(LABEL_IDS[name], 0)
                self._next_number[LABEL_IDS[name]] = self._numbers[key] + 1
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


class Street:
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

