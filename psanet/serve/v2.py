"""The Open Inference Protocol (KServe v2, what Triton's clients speak) over HTTP/REST.

``GET /v2``, ``/v2/health/live``, ``/v2/health/ready``, ``/v2/models/<name>`` and
``/v2/models/<name>/ready`` (also under ``/versions/1``), and ``POST
/v2/models/<name>/infer``: one image a request, as input ``image`` (UINT8, ``[H, W, 3]``
or ``[1, H, W, 3]``, RGB) or ``image_file`` (BYTES ``[1]``: a PNG, JPEG or BMP file); the
answer is output ``class_map`` (INT32, ``[H, W]``, or ``[1, H, W]`` for a 4-D input).
Tensor data as JSON or with the binary tensor data extension (the
``Inference-Header-Content-Length`` header). The request parameter ``timeout``
(microseconds, as Triton's) is its deadline. Concurrent requests share runs as
``/v1/segment``'s do.
"""
import asyncio
import json
import struct

import numpy as np

from .uploads import RequestError, decode_image, parse_timeout, read_body

__all__ = ['add_v2_routes', 'INPUTS', 'OUTPUT']

VERSION = '1'
INPUTS = [{'name': 'image', 'datatype': 'UINT8', 'shape': [-1, -1, 3]},
          {'name': 'image_file', 'datatype': 'BYTES', 'shape': [1]}]
OUTPUT = {'name': 'class_map', 'datatype': 'INT32', 'shape': [-1, -1]}
HEADER_LENGTH = 'inference-header-content-length'


def _server_version():
    from importlib import metadata
    try:
        return metadata.version('psanet')
    except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return 'unknown'


def _split_body(body, header_length):
    """``(request JSON, binary part)``."""
    if header_length is None:
        json_part, binary = body, b''
    else:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise RequestError(400, f'Inference-Header-Content-Length {header_length} does not '
                                    f'fit a body of {len(body)} bytes.')
        json_part, binary = body[:int(header_length)], body[int(header_length):]
    try:
        request = json.loads(json_part)
    except (UnicodeDecodeError, ValueError) as error:
        raise RequestError(400, f'the inference request is not JSON ({error}): send the '
                                'protocol\'s JSON (with the binary tensor data after it, its '
                                'length in Inference-Header-Content-Length).') from None
    if not isinstance(request, dict):
        raise RequestError(400, 'the inference request must be a JSON object with "inputs".')
    return request, binary


def _parameters(item, what):
    parameters = item.get('parameters') or {}
    if not isinstance(parameters, dict):
        raise RequestError(400, f'{what}: "parameters" must be a JSON object.')
    return parameters


def _one_input(request):
    inputs = request.get('inputs')
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise RequestError(400, 'the request must carry one input, "image" (UINT8 [H, W, 3], RGB) '
                                'or "image_file" (BYTES [1], an image file): one image a request.')
    tensor = inputs[0]
    name, datatype, shape = tensor.get('name'), tensor.get('datatype'), tensor.get('shape')
    declared = {i['name']: i['datatype'] for i in INPUTS}
    if name not in declared:
        raise RequestError(400, f'unknown input {name!r}: the inputs are "image" (UINT8 '
                                '[H, W, 3], RGB) and "image_file" (BYTES [1]).')
    if datatype != declared[name]:
        raise RequestError(400, f'input {name!r} is {declared[name]}, not {datatype!r}.')
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool)
                                              and s >= 0 for s in shape):
        raise RequestError(400, f'input {name!r}: "shape" must be a list of sizes, got '
                                f'{shape!r}.')
    return tensor, name, shape


def _binary_data(tensor, binary, what):
    size = _parameters(tensor, what).get('binary_data_size')
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size != len(binary):
        raise RequestError(400, f'{what}: binary_data_size {size!r} does not match the '
                                f'{len(binary)} bytes after the JSON header.')
    return binary


def _pixels(tensor, shape, binary, max_pixels):
    """The BGR uint8 image of input ``image``, checked against the limits."""
    if len(shape) == 4 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 3 or shape[2] != 3 or shape[0] < 1 or shape[1] < 1:
        raise RequestError(400, f'input "image" has shape {tensor["shape"]}: send [H, W, 3] (or '
                                '[1, H, W, 3]), RGB; one image a request.')
    height, width = shape[:2]
    if height * width > max_pixels:
        raise RequestError(413, f'the image is {width}x{height} = {width * height} pixels, over '
                                f'the limit of {max_pixels} (--max_pixels): send a smaller '
                                'image.')
    data = _binary_data(tensor, binary, 'input "image"')
    count = height * width * 3
    if data is not None:
        if len(data) != count:
            raise RequestError(400, f'input "image" [{height}, {width}, 3] needs {count} bytes, '
                                    f'got {len(data)}.')
        values = np.frombuffer(data, np.uint8)
    else:
        try:
            given = np.asarray(tensor.get('data'), dtype=np.int64).reshape(-1)
        except (TypeError, ValueError):
            given = None
        if given is None or given.size != count or given.min() < 0 or given.max() > 255:
            raise RequestError(400, f'input "image": "data" must hold {count} integers 0..255 '
                                    '(or send it binary, with binary_data_size).')
        values = given.astype(np.uint8)
    return np.ascontiguousarray(values.reshape(height, width, 3)[:, :, ::-1])  # RGB -> BGR


def _image_file(tensor, shape, binary, max_pixels):
    """The BGR image of input ``image_file``: one length-prefixed file (the BYTES layout)."""
    if shape != [1]:
        raise RequestError(400, f'input "image_file" has shape {shape}: send [1], one image '
                                'file a request.')
    data = _binary_data(tensor, binary, 'input "image_file"')
    if data is None:
        raise RequestError(400, 'input "image_file" must be sent as binary tensor data (an '
                                'image file is not JSON text): binary_data=True in Triton\'s '
                                'client.')
    if len(data) < 4 or struct.unpack('<I', data[:4])[0] != len(data) - 4:
        raise RequestError(400, 'input "image_file": the BYTES element must be a 4-byte '
                                'little-endian length and that many bytes of one file.')
    return decode_image(data[4:], max_pixels)


def _binary_output(request):
    """Whether ``class_map`` goes back as binary data, and a 400 for any other output asked."""
    outputs = request.get('outputs')
    if outputs is None:
        return bool(_parameters(request, 'the request').get('binary_data_output', False))
    if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise RequestError(400, '"outputs" must be a list of objects naming "class_map".')
    names = [o.get('name') for o in outputs]
    if any(name != OUTPUT['name'] for name in names):
        raise RequestError(400, f'unknown output {[n for n in names if n != OUTPUT["name"]]}: '
                                'the one output is "class_map".')
    return any(bool(_parameters(o, 'output "class_map"').get('binary_data', False))
               for o in outputs)


def add_v2_routes(app, service):
    """The protocol's routes on ``app``, answered by ``service`` (psanet.serve.app.Service)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response
    from starlette.concurrency import run_in_threadpool

    options, served = service.options, service.served
    name = options.model_name

    def check_model(model_name, version=None):
        if model_name != name:
            raise RequestError(404, f'unknown model {model_name!r}: this server serves '
                                    f'{name!r}.')
        if version is not None and version != VERSION:
            raise RequestError(404, f'model {name!r} has version {VERSION} only, not '
                                    f'{version!r}.')

    def ready_answer():
        reason = service.not_ready()
        if reason is not None:
            return JSONResponse({'error': reason}, status_code=503, headers={'Retry-After': '1'})
        return {'ready': True}

    @app.get('/v2')
    async def server_metadata():
        """The protocol's server metadata."""
        return {'name': 'psanet', 'version': _server_version(),
                'extensions': ['binary_tensor_data']}

    @app.get('/v2/health/live')
    async def live():
        """Liveness (as /health)."""
        return {'live': True}

    @app.get('/v2/health/ready')
    async def server_ready():
        """Readiness (as /ready)."""
        return ready_answer()

    async def metadata(model_name, version=None):
        check_model(model_name, version)
        return {'name': name, 'versions': [VERSION], 'platform': str(served.segmenter.backend),
                'inputs': INPUTS, 'outputs': [OUTPUT]}

    async def model_ready(model_name, version=None):
        check_model(model_name, version)
        return ready_answer()

    async def infer(request, model_name, version=None):
        check_model(model_name, version)
        with service.answering():
            start = asyncio.get_running_loop().time()
            encoding = request.headers.get('content-encoding', 'identity').lower()
            if encoding != 'identity':
                raise RequestError(415, f'Content-Encoding {encoding} is not taken: send the '
                                        'request uncompressed.')
            body = await read_body(request, options.max_body_bytes)
            header, binary = _split_body(body, request.headers.get(HEADER_LENGTH))
            timeout = _parameters(header, 'the request').get('timeout')
            seconds = None if timeout is None else parse_timeout(timeout, 'parameter "timeout"',
                                                                 1e-6)
            deadline = service.deadline(request, seconds, start)
            tensor, input_name, shape = _one_input(header)
            binary_out = _binary_output(header)
            read = _pixels if input_name == 'image' else _image_file
            image = await run_in_threadpool(read, tensor, shape, binary, options.max_pixels)
            label, _ = await service.class_map(image, deadline)
        out = label.astype(np.int32)
        out_shape = [1, *out.shape] if len(shape) == 4 else list(out.shape)
        answer = {'model_name': name, 'model_version': VERSION,
                  'outputs': [{'name': OUTPUT['name'], 'datatype': OUTPUT['datatype'],
                               'shape': out_shape}]}
        if 'id' in header:
            answer['id'] = header['id']
        if not binary_out:
            answer['outputs'][0]['data'] = out.reshape(-1).tolist()
            return JSONResponse(answer)
        data = out.astype('<i4').tobytes()
        answer['outputs'][0]['parameters'] = {'binary_data_size': len(data)}
        head = json.dumps(answer).encode()
        return Response(head + data, media_type='application/octet-stream',
                        headers={'Inference-Header-Content-Length': str(len(head))})

    @app.get('/v2/models/{model_name}')
    async def model_metadata(model_name: str):
        """The protocol's model metadata: inputs ``image``/``image_file``, output
        ``class_map``."""
        return await metadata(model_name)

    @app.get('/v2/models/{model_name}/versions/{version}')
    async def model_version_metadata(model_name: str, version: str):
        """As /v2/models/{model_name}."""
        return await metadata(model_name, version)

    @app.get('/v2/models/{model_name}/ready')
    async def ready(model_name: str):
        """The model's readiness (as /ready)."""
        return await model_ready(model_name)

    @app.get('/v2/models/{model_name}/versions/{version}/ready')
    async def version_ready(model_name: str, version: str):
        """As /v2/models/{model_name}/ready."""
        return await model_ready(model_name, version)

    @app.post('/v2/models/{model_name}/infer')
    async def model_infer(request: Request, model_name: str):
        """One image's class map (the protocol's inference request and response)."""
        return await infer(request, model_name)

    @app.post('/v2/models/{model_name}/versions/{version}/infer')
    async def version_infer(request: Request, model_name: str, version: str):
        """As /v2/models/{model_name}/infer."""
        return await infer(request, model_name, version)
