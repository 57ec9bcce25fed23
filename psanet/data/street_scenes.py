"""Draws one synthetic street scene of mini Cityscapes: sky, buildings, vegetation, the
ground and everything standing on it, each class with its own colour, texture, size and
place (why and what the scenes hold: docs/design.md).

:func:`render` returns the image, its label ids and its instance ids; which classes a
scene must hold, and the random stream it draws from, are :mod:`psanet.data.mini_cityscapes`'s.
"""
import cv2
import numpy as np

from .scene_canvas import LABEL_IDS, Scene, Street

__all__ = ['render']

_BUILDING_COLORS = ((72, 72, 74), (112, 102, 96), (152, 136, 116), (128, 92, 76),
                    (168, 162, 152), (96, 96, 112))
_CAR_COLORS = ((28, 36, 140), (150, 24, 24), (205, 205, 208), (32, 32, 34), (96, 96, 102),
               (24, 84, 44), (205, 172, 44), (70, 46, 104))
_CLOTHES = ((30, 30, 36), (180, 40, 40), (40, 70, 150), (220, 220, 210), (70, 110, 60),
            (150, 110, 60), (110, 40, 120))
_SKIN = ((226, 184, 152), (190, 140, 105), (140, 96, 66), (95, 64, 46))


def render(width, height, rng, wanted):
    """(image RGB uint8, label ids uint8, instance ids uint16) of one scene drawn from
    ``rng``, with objects of the classes in ``wanted`` among those it places."""
    scene = Scene(width, height, rng)
    street = Street(scene)
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
            scene.ids[ring] = LABEL_IDS['unlabeled']
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

