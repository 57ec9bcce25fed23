"""What the attention figures and the evaluation charts share, drawn with OpenCV: the font and
colours, text (a line, a band of lines, a label read bottom to top), laying images out
(padding, stacking, scaling), a heat map, a marker at a pixel, a legend of colour swatches,
and writing a PNG whole."""
import os

import cv2
import numpy as np

from psanet.files import write_image

__all__ = ['FONT', 'WHITE', 'BLACK', 'GREY', 'GAP', 'text_width', 'put_text', 'text_band',
           'vertical_text', 'pad_to', 'hstack', 'vstack', 'scaled', 'mark', 'heat_map',
           'legend', 'write_png']

FONT = cv2.FONT_HERSHEY_SIMPLEX
WHITE, BLACK, GREY = (255, 255, 255), (0, 0, 0), (128, 128, 128)
# White pixels between stacked images.
GAP = 8


def text_width(text, scale):
    """Pixels ``text`` takes in :data:`FONT` at ``scale``, thickness 1."""
    return cv2.getTextSize(text, FONT, scale, 1)[0][0]


def put_text(image, text, origin, scale, colour=BLACK, thickness=1):
    """``text`` in :data:`FONT`, anti-aliased, its baseline starting at ``origin`` (x, y)."""
    cv2.putText(image, text, origin, FONT, scale, colour, thickness, cv2.LINE_AA)


def _font_scale(text, width, largest, smallest=0.35):
    """The largest scale (steps of 0.05 down from ``largest``) at which ``text`` fits ``width``."""
    scale = largest
    while scale > smallest and text_width(text, scale) > width:
        scale -= 0.05
    return scale


def text_band(width, lines, largest=0.55, background=WHITE, thickness=1):
    """A band ``width`` wide with one line of black text per item, each shrunk to fit."""
    line_height = int(round(40 * largest))
    band = np.full((len(lines) * line_height + 8, width, 3), background, np.uint8)
    for i, line in enumerate(lines):
        put_text(band, line, (4, (i + 1) * line_height - 4), _font_scale(line, width - 8, largest),
                 thickness=thickness)
    return band


def vertical_text(text, scale, colour=BLACK):
    """``text`` drawn bottom to top, on white."""
    (width, height), base = cv2.getTextSize(text, FONT, scale, 1)
    band = np.full((height + base + 4, width + 4, 3), 255, np.uint8)
    put_text(band, text, (2, height + 2), scale, colour)
    return cv2.rotate(band, cv2.ROTATE_90_COUNTERCLOCKWISE)


def pad_to(image, height, width):
    """``image`` at the top left of a white ``height x width`` image."""
    padded = np.full((height, width, 3), 255, np.uint8)
    padded[:image.shape[0], :image.shape[1]] = image
    return padded


def hstack(images):
    """Images side by side, :data:`GAP` apart, top-aligned on white."""
    height = max(image.shape[0] for image in images)
    gap = np.full((height, GAP, 3), 255, np.uint8)
    parts = []
    for image in images:
        parts += [pad_to(image, height, image.shape[1]), gap]
    return np.hstack(parts[:-1])


def vstack(images):
    """Images one under another, :data:`GAP` apart, left-aligned on white."""
    width = max(image.shape[1] for image in images)
    gap = np.full((GAP, width, 3), 255, np.uint8)
    parts = []
    for image in images:
        parts += [pad_to(image, image.shape[0], width), gap]
    return np.vstack(parts[:-1])


def scaled(image, scale, nearest=False):
    """``image`` resized by ``scale``: nearest neighbour (class maps), else linear up and
    area down; a copy at scale 1."""
    if scale == 1:
        return image.copy()
    size = (max(1, round(image.shape[1] * scale)), max(1, round(image.shape[0] * scale)))
    return cv2.resize(image, size, interpolation=cv2.INTER_NEAREST if nearest else
                      cv2.INTER_LINEAR if scale > 1 else cv2.INTER_AREA)


def mark(panel, point, scale):
    """The ``panel`` (an image resized by ``scale``) framed, with a circle and a cross at
    pixel ``point`` of the image.

    Black under white, to show on any colour; the white margin keeps the whole
    marker in view at the image's edges.
    """
    radius = max(6, int(round(min(panel.shape[:2]) / 40)))
    margin = 2 * radius + 2
    framed = cv2.copyMakeBorder(panel, margin, margin, margin, margin, cv2.BORDER_CONSTANT,
                                value=WHITE)
    cv2.rectangle(framed, (margin - 1, margin - 1),
                  (margin + panel.shape[1], margin + panel.shape[0]), GREY, 1)
    x, y = ((c + 0.5) * scale - 0.5 + margin for c in point)
    centre = (int(round(x)), int(round(y)))
    for colour, thickness in ((BLACK, 4), (WHITE, 2)):
        cv2.circle(framed, centre, radius, colour, thickness, cv2.LINE_AA)
        for dx, dy in ((1, 0), (0, 1)):
            start = (centre[0] - 2 * radius * dx, centre[1] - 2 * radius * dy)
            end = (centre[0] + 2 * radius * dx, centre[1] + 2 * radius * dy)
            cv2.line(framed, start, end, colour, thickness, cv2.LINE_AA)
    return framed


def heat_map(image, values):
    """``values`` [H, W] in JET (blue low, red high, its own min..max) over the image in grey."""
    low, high = float(values.min()), float(values.max())
    spread = (values - low) / (high - low) if high > low else np.zeros_like(values)
    heat = cv2.applyColorMap(np.clip(spread * 255, 0, 255).astype(np.uint8), cv2.COLORMAP_JET)
    grey = cv2.cvtColor(cv2.cvtColor(image, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)
    return cv2.addWeighted(grey, 0.4, heat, 0.6, 0)


def legend(width, entries, rows=3):
    """A colour swatch and a name for each ``(name, BGR colour)`` of ``entries``, wrapped to
    ``width``; at most ``rows`` rows (the entries that do not fit are left out)."""
    band = np.full((rows * 22 + 6, width, 3), 255, np.uint8)
    x, row, shown = 4, 0, 0
    for name, colour in entries:
        name_width = text_width(name, 0.45)
        if x + 18 + name_width > width - 4:
            x, row = 4, row + 1
        if row == rows:
            break
        top = 4 + row * 22
        cv2.rectangle(band, (x, top + 2), (x + 14, top + 16), tuple(int(c) for c in colour), -1)
        cv2.rectangle(band, (x, top + 2), (x + 14, top + 16), GREY, 1)
        put_text(band, name, (x + 18, top + 15), 0.45)
        x += 18 + name_width + 12
        shown += 1
    return band[:4 + (row + 1) * 22 + 2] if shown else band[:0]


def write_png(path, image):
    """Writes ``image`` as a PNG at ``path`` whole: a temporary file beside it, then renamed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return write_image(path, image, '.png')
