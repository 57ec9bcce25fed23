"""The HTTP server: FastAPI routes over a :class:`~psanet.serve.served_model.ServedModel`, run
by uvicorn.

Routes: ``POST /v1/segment`` (an image -> palette PNG or JSON), ``GET /v1/model``,
``GET /health`` and ``GET /ready`` (for a load balancer), ``GET /v1/stats``, the
explorer page (``/explorer/``, ``POST /v1/explore``, ``GET /v1/explore/{id}``)
and ``/openapi.json``. Every refusal is a 4xx or 503 with one-line JSON
``{"error": ...}``; a failure inside is a 500 with one line, and the next request
is served. SIGTERM: uvicorn stops accepting, answers what it holds within
``--graceful_timeout_s``, and the process exits 0.
"""
import contextlib
import dataclasses
import logging
import os

import numpy as np

from psanet.contract import palette_png
from psanet.errors import ConfigError, UserError

from .batcher import Batcher, QueueFull
from .uploads import RequestError, decode_image, read_image_bytes

__all__ = ['ServeOptions', 'create_app', 'serve']

EXPLORER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'explorer')
RETRY_AFTER_S = 1
_logger = logging.getLogger('psanet.serve')


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """serve.py's flags (docs/deploy.md, "Serving"). ``backend``, ``device`` and
    ``cpu_threads`` None take the API's defaults (``psanet.Segmenter``)."""
    config: str
    model_path: str = None
    backend: str = None
    device: str = None
    int8: bool = False
    cpu_threads: int = None
    host: str = '127.0.0.1'
    port: int = 8000
    max_batch: int = 8
    max_wait_ms: float = 5.0
    max_queue: int = 64
    max_body_bytes: int = 20 * 2 ** 20
    max_pixels: int = 2048 * 2048
    graceful_timeout_s: int = 30

    def __post_init__(self):
        for name in ('max_batch', 'max_queue', 'max_body_bytes', 'max_pixels', 'port',
                     'graceful_timeout_s'):
            low = 0 if name in ('port', 'graceful_timeout_s') else 1
            if getattr(self, name) < low:
                raise ConfigError(f'--{name} must be >= {low}, got {getattr(self, name)}.')
        if self.max_wait_ms < 0:
            raise ConfigError(f'--max_wait_ms must be >= 0, got {self.max_wait_ms}.')


def _error(status, message, headers=None):
    from fastapi.responses import JSONResponse
    return JSONResponse({'error': message}, status_code=status, headers=headers)


IMAGE_BODY = {'requestBody': {'required': True, 'content': {
    'image/png': {'schema': {'type': 'string', 'format': 'binary'}},
    'image/jpeg': {'schema': {'type': 'string', 'format': 'binary'}},
    'application/octet-stream': {'schema': {'type': 'string', 'format': 'binary'}},
    'multipart/form-data': {'schema': {'type': 'object', 'required': ['image'], 'properties': {
        'image': {'type': 'string', 'format': 'binary'}}}}}}}


def create_app(served, options):
    """The FastAPI app serving ``served`` (a ServedModel) within ``options``' limits."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, RedirectResponse, Response
    from fastapi.staticfiles import StaticFiles
    from starlette.exceptions import HTTPException
    from starlette.concurrency import run_in_threadpool
    from .explore import ExploredImages, forward

    seg = served.segmenter
    batcher = Batcher(seg.run, options.max_batch, options.max_wait_ms / 1000, options.max_queue)
    explored = ExploredImages(served.model) if served.model is not None else None
    limits = {'max_body_bytes': options.max_body_bytes, 'max_pixels': options.max_pixels}
    in_flight = [0]  # image requests being answered

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title='PSANet segmentation', version='1', lifespan=lifespan, docs_url=None,
                  redoc_url=None)  # the docs pages load scripts from a CDN; the schema stays

    @app.exception_handler(RequestError)
    async def refused(request, error):
        return _error(error.status, error.message, error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, error):
        return _error(error.status_code, str(error.detail), getattr(error, 'headers', None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error):
        first = error.errors()[0]
        where = '.'.join(str(part) for part in first.get('loc', ()))
        return _error(422, f'{where}: {first.get("msg")}')

    @app.exception_handler(Exception)
    async def failed(request, error):
        _logger.exception('request %s failed', request.url.path)
        first_line = (str(error).strip().splitlines() or [''])[0][:300]
        return _error(500, f'internal error ({type(error).__name__}: {first_line}); the server '
                           'goes on serving.')

    async def preprocessed(request):
        data = await read_image_bytes(request, options.max_body_bytes)
        image = await run_in_threadpool(decode_image, data, options.max_pixels)
        try:
            batch, infos = await run_in_threadpool(seg.preprocess, [image], ['the image'])
        except UserError as error:
            raise RequestError(422, str(error)) from None
        return image, batch, infos

    async def model_result(future):
        try:
            return await future
        except UserError as error:  # e.g. attention memory over the host's
            raise RequestError(422, str(error)) from None

    def queued(submit, *args):
        try:
            return submit(*args)
        except QueueFull as full:
            raise RequestError(503, f'the server is busy: {full}; retry after {RETRY_AFTER_S} '
                                    's.', {'Retry-After': str(RETRY_AFTER_S)}) from None

    @app.post('/v1/segment', openapi_extra=IMAGE_BODY,
              responses={200: {'content': {'image/png': {}, 'application/json': {}}}})
    async def segment(request: Request, format: str = 'png'):
        """The class map of an image: a palette PNG (``format=png``) or JSON (``format=json``:
        its shape, the class ids row by row and the pixels of each class)."""
        if format not in ('png', 'json'):
            raise RequestError(400, f'format={format!r}: use format=png or format=json.')
        in_flight[0] += 1
        try:
            _, batch, infos = await preprocessed(request)
            output, batch_size = await model_result(queued(batcher.submit, batch))
            label = (await run_in_threadpool(seg.postprocess, output, infos))[0]
        finally:
            in_flight[0] -= 1
        headers = {'X-Batch-Size': str(batch_size)}
        if format == 'png':
            body = await run_in_threadpool(palette_png, label, served.colors)
            return Response(body, media_type='image/png', headers=headers)
        classes, counts = np.unique(label, return_counts=True)
        return JSONResponse({'shape': list(label.shape), 'class_ids': label.tolist(),
                             'counts': [{'id': int(c), 'name': _name(served.names, c),
                                         'pixels': int(n)} for c, n in zip(classes, counts)]},
                            headers=headers)

    @app.get('/v1/model')
    async def model_info():
        """The model's classes, palette and input contract, and whether the explorer runs."""
        return served.describe(limits)

    @app.get('/health')
    async def health():
        """Liveness: the process answers."""
        return {'status': 'ok'}

    @app.get('/ready')
    async def ready():
        """Readiness: 200 while the queue has room, else 503."""
        if batcher.full:
            return _error(503, 'the queue is full', {'Retry-After': str(RETRY_AFTER_S)})
        return {'status': 'ready', 'waiting': batcher.waiting}

    @app.get('/v1/stats')
    async def stats():
        """Runs of the model by batch size, the requests waiting for it and those in flight."""
        return {'runs_by_batch_size': {str(k): v for k, v in sorted(batcher.runs.items())},
                'waiting': batcher.waiting, 'max_queue': options.max_queue,
                'in_flight': in_flight[0]}

    def need_explorer():
        if explored is None:
            raise RequestError(409, 'the explorer needs the model: this server runs an export; '
                                    'start it with --config <training config> --model_path '
                                    '<weights>.')

    @app.post('/v1/explore', openapi_extra=IMAGE_BODY)
    async def explore(request: Request):
        """Runs the model on an image, keeps its attention; returns its id and class map."""
        need_explorer()
        image, batch, infos = await preprocessed(request)
        output, records = await model_result(
            queued(batcher.submit_call, lambda: forward(seg, served.model, batch)))
        label = (await run_in_threadpool(seg.postprocess, output, infos))[0]
        try:
            return await run_in_threadpool(explored.add, image.shape[:2], batch, infos[0],
                                           records, label)
        except OverflowError as error:
            raise RequestError(413, str(error)) from None

    @app.get('/v1/explore/{image_id}')
    async def explore_point(image_id: str, x: int, y: int):
        """The collect and distribute maps of pixel (x, y) of an explored image."""
        need_explorer()
        try:
            return await run_in_threadpool(explored.point, image_id, x, y)
        except KeyError:
            raise RequestError(404, f'image {image_id} is no longer kept (the last '
                                    f'{explored.capacity} are): send it again.') from None
        except ValueError as error:
            raise RequestError(400, str(error)) from None

    @app.get('/', include_in_schema=False)
    async def root():
        return RedirectResponse('/explorer/')

    app.mount('/explorer', StaticFiles(directory=EXPLORER_DIR, html=True), name='explorer')
    return app


def _name(names, cls):
    return names[cls] if cls < len(names) else f'class {cls}'


def serve(options):
    """serve.py: loads the model, then serves until SIGTERM or Ctrl-C (exit 0 after a graceful
    stop)."""
    import uvicorn
    from psanet import interrupts
    from .served_model import load_served_model
    served = load_served_model(options.config, options.model_path, options.backend,
                               options.device, options.int8, options.cpu_threads)
    if interrupts.requested():  # a stop while the model loaded
        raise interrupts.stopped(interrupts.requested())
    app = create_app(served, options)
    _logger.info('serving %s (%s) on http://%s:%d; the explorer at /explorer/', served.source,
                 served.segmenter.backend, options.host, options.port)
    server = uvicorn.Server(uvicorn.Config(
        app, host=options.host, port=options.port, log_level='info', access_log=False,
        timeout_graceful_shutdown=options.graceful_timeout_s))
    server.run()
    # uvicorn raises the signal it stopped on once its handlers are gone: the run_cli
    # handler records it, and the stop is the normal end.
