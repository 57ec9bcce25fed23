"""What the attention figures and the evaluation charts share: OpenCV's font, the colours, a
text's width, and writing a PNG whole."""
import os

import cv2

from psanet.files import write_image

__all__ = ['FONT', 'WHITE', 'BLACK', 'GREY', 'text_width', 'write_png']

FONT = cv2.FONT_HERSHEY_SIMPLEX
WHITE, BLACK, GREY = (255, 255, 255), (0, 0, 0), (128, 128, 128)


def text_width(text, scale):
    """Pixels ``text`` takes in :data:`FONT` at ``scale``, thickness 1."""
    return cv2.getTextSize(text, FONT, scale, 1)[0][0]


def write_png(path, image):
    """Writes ``image`` as a PNG at ``path`` whole: a temporary file beside it, then renamed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return write_image(path, image, '.png')

