"""The explorer page's data: one forward's attention kept per image, a pixel's maps on demand.

``forward`` runs in the model's worker: the Segmenter's run of one image with
:func:`psanet.visualize.attention.capture_attention` recording each PSA branch.
``ExploredImages`` keeps the last few (bounded in count and in bytes); ``point`` gives, for an
image pixel, the map each branch predicts at its cell (collect: where the pixel
gathers from; distribute: where it sends to, the paper's figure) at the image's
size, as 0..255 over the map's own min..max, with the min and max.
"""
import base64
import collections
import secrets
import threading

import numpy as np

from psanet.errors import ConfigError

__all__ = ['ExploredImages', 'forward']


def forward(segmenter, model, batch):
    """``(output, records)``: the Segmenter's run of ``batch`` and its attention records."""
    from psanet.visualize.attention import capture_attention, psa_branches
    with capture_attention(model) as records:
        output = segmenter.run(batch)
    if len(records) != len(psa_branches(model)):
        raise ConfigError(f'the model ran its PSA branches {len(records)} times for one image '
                          f'({len(psa_branches(model))} branches): the explorer shows one whole-'
                          'image forward; remove test_config\'s is_slide and aug_eval.')
    return output, list(records)


def _bytes(array):
    return base64.b64encode(np.ascontiguousarray(array, np.uint8).tobytes()).decode('ascii')


class ExploredImages:
    """The attention of the last ``capacity`` images the page sent, by id, at most
    ``max_bytes`` of maps in all (an image's maps grow with the square of its pixels);
    ``align_corners`` is the model's (how its logits are resized back)."""

    def __init__(self, align_corners, capacity=8, max_bytes=512 * 2 ** 20):
        self.align_corners, self.capacity = bool(align_corners), capacity
        self.max_bytes = max_bytes
        self._entries, self._lock = collections.OrderedDict(), threading.Lock()

    def add(self, image_size, batch, info, records, label):
        """Keeps one image's records; returns the page's answer (id, size, class map).
        OverflowError for an image whose maps alone are over ``max_bytes``."""
        from psanet.ops.psa_mask import PSA_TYPE_NAMES
        from psanet.visualize.attention import MapGeometry
        size = sum(record.attention.nbytes for record in records)
        if size > self.max_bytes:
            raise OverflowError(f'the attention maps of a {image_size[1]}x{image_size[0]} image '
                                f'take {size / 2 ** 20:.0f} MiB, over the explorer\'s '
                                f'{self.max_bytes / 2 ** 20:.0f} MiB: send an image of about '
                                'half the width and height.')
        trans_info, _ = info
        geometries = [MapGeometry(tuple(image_size), tuple(batch.shape[2:]), tuple(trans_info),
                                  record.feature_size, record.map_size,
                                  self.align_corners) for record in records]
        image_id = secrets.token_hex(8)
        with self._lock:
            self._entries[image_id] = (image_size, records, geometries, size)
            while len(self._entries) > self.capacity or sum(
                    entry[3] for entry in self._entries.values()) > self.max_bytes:
                self._entries.popitem(last=False)
        classes, counts = np.unique(label, return_counts=True)
        return {'id': image_id, 'height': int(image_size[0]), 'width': int(image_size[1]),
                'label': _bytes(label),
                'counts': {int(c): int(n) for c, n in zip(classes, counts)},
                'branches': [{'direction': PSA_TYPE_NAMES[r.psa_type], 'map_size': list(r.map_size)}
                             for r in records]}

    def point(self, image_id, x, y):
        """The maps of image pixel (x, y); KeyError for an image no longer kept."""
        from psanet.ops.psa_mask import PSA_TYPE_NAMES
        from psanet.visualize.attention import branch_map, check_points
        with self._lock:
            image_size, records, geometries, _ = self._entries[image_id]
            self._entries.move_to_end(image_id)
        try:
            check_points([(x, y)], image_size)
        except ConfigError as error:
            raise ValueError(str(error).replace('--points ', 'point ')) from None
        maps = []
        for record, geometry in zip(records, geometries):
            row, col = geometry.cell(x, y)
            values = geometry.upsample(branch_map(record, row, col))
            low, high = float(values.min()), float(values.max())
            spread = (values - low) / (high - low) if high > low else np.zeros_like(values)
            maps.append({'direction': PSA_TYPE_NAMES[record.psa_type], 'cell': [row, col],
                         'map_size': list(record.map_size), 'min': low, 'max': high,
                         'values': _bytes(np.rint(spread * 255))})
        return {'x': x, 'y': y, 'maps': maps}
