"""Reading the evaluation figures back from their pixels, for tests that check what a figure
shows (a cell's shade, a bar's length, where the mIoU line stands), not its size.

The colours are the figures' documented key: the confusion matrix shades a share from
white (0 %) to dark blue (100 %) between light grey grid lines, a class without
ground-truth pixels is a light grey row; the IoU chart draws blue bars from IoU 0 and a
red mIoU line. All BGR, as OpenCV reads the PNG.
"""
import numpy as np

WHITE = (255, 255, 255)
FULL_SHARE = (107, 48, 8)       # the confusion matrix at 100 %
GRID = (210, 210, 210)
EMPTY_ROW = (235, 235, 235)
BAR = (180, 119, 31)
MIOU_LINE = (40, 40, 220)


def colour_mask(image, bgr):
    return np.all(np.asarray(image) == np.asarray(bgr, np.uint8), axis=-1)


def _runs(indices):
    """Consecutive indices grouped: [[3, 4], [9], ...]."""
    indices = np.asarray(indices)
    if indices.size == 0:
        return []
    return [list(run) for run in np.split(indices, np.flatnonzero(np.diff(indices) > 1) + 1)]


def _lines(mask, axis):
    """Positions of the 1-pixel lines of ``mask`` across ``axis`` (0: vertical lines).

    A line holds the colour along most of its length; anti-aliased text and the
    crossing lines hold it on a few pixels only.
    """
    counts = mask.sum(axis=axis)
    return [int(round(np.mean(run))) for run in _runs(np.flatnonzero(counts >= 0.3 *
                                                                     counts.max()))]


def _most_common(pixels):
    colours, counts = np.unique(pixels.reshape(-1, 3), axis=0, return_counts=True)
    return tuple(int(c) for c in colours[np.argmax(counts)])


def matrix_cells(image):
    """The fill of each cell of a confusion-matrix figure, found by its grid lines.

    Returns:
        list: rows of (B, G, R) tuples, the most common colour inside each cell (the
        fill; the percentage drawn on it covers fewer pixels).
    """
    grid = colour_mask(image, GRID)
    columns, rows = _lines(grid, 0), _lines(grid, 1)
    assert len(columns) == len(rows) >= 2, (columns, rows)
    return [[_most_common(image[top + 1:bottom, left + 1:right])
             for left, right in zip(columns, columns[1:])]
            for top, bottom in zip(rows, rows[1:])]


def share_shade(share):
    """The BGR the matrix's key gives a share in 0..1 (linear from white to FULL_SHARE)."""
    white, full = np.array(WHITE, np.float64), np.array(FULL_SHARE, np.float64)
    return white + (full - white) * share


def bars(image):
    """The blue bars of an IoU chart, top to bottom, as (first column, last column)."""
    mask = colour_mask(image, BAR)
    found = []
    for rows in _runs(np.flatnonzero(mask.any(axis=1))):
        columns = np.flatnonzero(mask[rows].any(axis=0))
        found.append((int(columns.min()), int(columns.max())))
    return found


def miou_line_column(image):
    """The column the red mIoU line stands on (the centre of its 2 pixels)."""
    counts = colour_mask(image, MIOU_LINE).sum(axis=0)
    columns = np.flatnonzero(counts >= 0.5 * counts.max())
    assert len(_runs(columns)) == 1, columns
    return float(np.mean(columns))
