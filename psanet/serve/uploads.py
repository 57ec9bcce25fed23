"""A request's image (and its timeout), read within the server's limits, or a
:class:`RequestError`.

The body is raw image bytes (``Content-Type: image/...`` or
``application/octet-stream``) or ``multipart/form-data`` with a file field
``image``. Its size is checked against ``--max_body_bytes`` while it arrives, the
image's pixels against ``--max_pixels`` from its header, before it is decoded.
Pillow checks that the file is whole (OpenCV would decode a cut JPEG with a grey
end and no error); OpenCV then decodes it as ``cv2.imread`` does, so an answer
equals ``Segmenter(path)``'s.
"""
import io
import math

import cv2
import numpy as np
from PIL import Image, UnidentifiedImageError

__all__ = ['RequestError', 'read_body', 'read_image_bytes', 'decode_image', 'parse_timeout']

RAW_TYPES = ('application/octet-stream',)
FIELD = 'image'


class RequestError(Exception):
    """A request the server refuses: its HTTP status and a one-line message."""

    def __init__(self, status, message, headers=None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def _content_type(request):
    return request.headers.get('content-type', '').split(';')[0].strip().lower()


async def read_body(request, max_bytes):
    """The whole body, refused (413) once it is over ``max_bytes``."""
    from starlette.requests import ClientDisconnect
    too_large = RequestError(413, f'the request body is over the limit of {max_bytes} bytes '
                                  '(--max_body_bytes): send a smaller image.')
    length = request.headers.get('content-length')
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # nobody to answer; the request ends here
        raise RequestError(400, 'the client hung up before sending the whole body.') from None
    return b''.join(chunks)


async def read_image_bytes(request, max_bytes):
    """The image file a request carries (raw body or multipart field ``image``)."""
    kind = _content_type(request)
    raw = kind.startswith('image/') or kind in RAW_TYPES
    if not raw and kind != 'multipart/form-data':
        raise RequestError(415, f'Content-Type {kind or "(none)"} is not an image: send the '
                                'image file as the body with its type (image/png, image/jpeg, '
                                f'application/octet-stream), or as multipart/form-data field '
                                f'"{FIELD}".')
    body = await read_body(request, max_bytes)
    if not raw:
        body = await _multipart_image(request, body, max_bytes)
    if not body:
        raise RequestError(400, 'the request carries no image (an empty body): send the image '
                                'file.')
    return body


async def _multipart_image(request, body, max_bytes):
    from starlette.requests import Request

    async def replay():
        return {'type': 'http.request', 'body': body, 'more_body': False}

    try:
        form = await Request(request.scope, replay).form(max_files=1, max_fields=10,
                                                         max_part_size=max_bytes)
    except Exception as error:  # noqa: BLE001  (python-multipart's and Starlette's errors)
        detail = getattr(error, 'detail', None) or error
        raise RequestError(400, f'the multipart body cannot be read ({detail}): send '
                                f'multipart/form-data with one file field "{FIELD}".') from None
    upload = form.get(FIELD)
    if upload is None or isinstance(upload, str):
        raise RequestError(400, f'the multipart body has no file field "{FIELD}" (fields: '
                                f'{sorted(form.keys())}): send the image as -F {FIELD}=@file.')
    data = await upload.read()
    await form.close()
    return data


def decode_image(data, max_pixels):
    """A BGR uint8 image, as ``cv2.imread`` reads the same file."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise RequestError(413, f'the image is {width}x{height} = {width * height} '
                                        f'pixels, over the limit of {max_pixels} (--max_pixels): '
                                        'send a smaller image.')
            image.load()
    except RequestError:
        raise
    except Image.DecompressionBombError as error:
        raise RequestError(413, f'{error} (--max_pixels is {max_pixels}): send a smaller '
                                'image.') from None
    except UnidentifiedImageError:
        raise RequestError(400, 'the body is not an image (PNG, JPEG or BMP): send the image '
                                'file itself.') from None
    except (OSError, ValueError, SyntaxError) as error:
        raise RequestError(400, f'the image is truncated or corrupt ({error}): send the whole '
                                'file.') from None
    decoded = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if decoded is None:
        raise RequestError(400, 'OpenCV cannot decode this image: send a PNG, JPEG or BMP.')
    return decoded


def parse_timeout(value, where, scale=1.0):
    """Seconds from a request's timeout ``value`` (``scale`` seconds a unit), or a 400."""
    try:
        seconds = float(value) * scale
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not (math.isfinite(seconds) and 0 < seconds <= 86_400):
        raise RequestError(400, f'{where} must be a positive number of '
                                f'{"seconds" if scale == 1 else "microseconds"} (at most a day), '
                                f'got {value!r}.')
    return seconds
