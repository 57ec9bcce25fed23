"""The HTTP server: FastAPI routes over a :class:`~psanet.serve.served_model.ServedModel`, run
by uvicorn.

Routes: ``POST /v1/segment`` (an image -> palette PNG or JSON), ``GET /v1/model``,
``GET /health`` and ``GET /ready`` (for a load balancer), ``GET /v1/stats``,
``GET /metrics`` (Prometheus), the Open Inference Protocol's ``/v2/...``
(:mod:`psanet.serve.v2`), the explorer page (``/explorer/``, ``POST /v1/explore``,
``GET /v1/explore/{id}``) and ``/openapi.json``. Every refusal is a 4xx, 503 or 504
with one-line JSON ``{"error": ...}``; a failure inside is a 500 with one line, and
the next request is served. The model runs in a worker process
(:mod:`psanet.serve.worker`): the event loop answers probes, deadlines and
signals during a run. SIGTERM: no new connection is taken, the queue is served
one request a run until ``--graceful_timeout_s``, what still waits or runs then
gets 503 (the worker killed), and the process exits 0.
"""
import asyncio
import contextlib
import hmac
import logging
import os

import numpy as np

from psanet.contract import palette_png
from psanet.errors import DeployError, UserError

from .batcher import Batcher, DeadlineExceeded, QueueFull, Restarting, Stopping, batch_sizes
from .startup import ServeOptions
from .uploads import RequestError, decode_image, parse_timeout, read_image_bytes
from .worker import WorkerDied

__all__ = ['ServeOptions', 'Service', 'create_app', 'serve']

EXPLORER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'explorer')
RETRY_AFTER_S = 1
TIMEOUT_HEADER = 'X-Request-Timeout-S'
# After --graceful_timeout_s (every request answered by then), how long uvicorn still waits
# for the answers to be sent before it cuts the connections left.
DRAIN_BACKSTOP_S = 3
# Routes a load balancer's probe reaches without the token, and the page's static files.
OPEN_PATHS = ('/health', '/ready', '/v2/health/live', '/v2/health/ready', '/', '/explorer')
OPEN_PREFIXES = ('/explorer/',)
_logger = logging.getLogger('psanet.serve')


def _error(status, message, headers=None):
    from fastapi.responses import JSONResponse
    return JSONResponse({'error': message}, status_code=status, headers=headers)


IMAGE_BODY = {'requestBody': {'required': True, 'content': {
    'image/png': {'schema': {'type': 'string', 'format': 'binary'}},
    'image/jpeg': {'schema': {'type': 'string', 'format': 'binary'}},
    'application/octet-stream': {'schema': {'type': 'string', 'format': 'binary'}},
    'multipart/form-data': {'schema': {'type': 'object', 'required': ['image'], 'properties': {
        'image': {'type': 'string', 'format': 'binary'}}}}}}}


class Service:
    """What the routes share: the model, the batcher, the limits and the counts.

    Args:
        served (ServedModel): The model.
        options (ServeOptions): The server's options.
        metrics (ServerMetrics): Where the counts go.
        warmup_shape (tuple, optional): ``(3, H, W)`` the batcher warms up at.
        on_failure (callable, optional): As the Batcher's.
        worker (ModelWorker, optional): The process the model runs in.
    """

    def __init__(self, served, options, metrics, warmup_shape=None, on_failure=None,
                 worker=None):
        self.served, self.options, self.metrics = served, options, metrics
        self.seg, self.worker = served.segmenter, worker
        self.warmup_shape = warmup_shape
        self.batcher = Batcher(self.seg.run, options.max_batch, options.max_wait_ms / 1000,
                               options.max_queue, metrics, on_failure, worker)
        self.in_flight = 0  # image requests being answered
        metrics.in_flight.set_function(lambda: self.in_flight)
        metrics.queue_depth.set_function(lambda: self.batcher.waiting)

    @contextlib.contextmanager
    def answering(self):
        """Counts an image request in flight while the block runs."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def not_ready(self):
        """Why the server takes no work now (a 503's message), or None when it does."""
        state = self.batcher.state
        if state == 'warming':
            return 'the model is warming up'
        if state in ('stopping', 'failed'):
            return 'the server is stopping'
        if state == 'restarting':
            return f'the model worker is restarting ({self.batcher.worker_error})'
        if self.worker is not None and not self.worker.alive:
            return 'the model worker is not running'
        if self.batcher.full:
            return 'the queue is full'
        return None

    def deadline(self, request, seconds=None, start=None):
        """The loop time a request's run must begin by, or None: ``start`` (its arrival; default
        now) plus ``seconds`` (the protocol's parameter), else the X-Request-Timeout-S header,
        else --request_timeout_s."""
        if seconds is None and TIMEOUT_HEADER.lower() in request.headers:
            seconds = parse_timeout(request.headers[TIMEOUT_HEADER.lower()], TIMEOUT_HEADER)
        if seconds is None:
            seconds = self.options.request_timeout_s
        if seconds is None:
            return None
        return (asyncio.get_running_loop().time() if start is None else start) + seconds

    async def preprocess(self, image):
        from starlette.concurrency import run_in_threadpool
        try:
            return await run_in_threadpool(self.seg.preprocess, [image], ['the image'])
        except UserError as error:
            raise RequestError(422, str(error)) from None

    async def result(self, submit, *args, deadline=None):
        """The model's answer to ``submit(*args, deadline=deadline)``, its refusals as HTTP."""
        try:
            return await submit(*args, deadline=deadline)
        except QueueFull as full:
            raise RequestError(503, f'the server is busy: {full}; retry after {RETRY_AFTER_S} '
                                    's.', {'Retry-After': str(RETRY_AFTER_S)}) from None
        except Stopping as stopping:
            raise RequestError(503, str(stopping), {'Connection': 'close'}) from None
        except Restarting as restarting:
            raise RequestError(503, str(restarting), {'Retry-After': str(RETRY_AFTER_S)}) \
                from None
        except WorkerDied as died:
            raise RequestError(503, f'{died}: this request\'s run did not end; the server '
                                    'restarts the worker: send it again in a few seconds.',
                               {'Retry-After': str(RETRY_AFTER_S)}) from None
        except DeadlineExceeded as late:
            raise RequestError(504, f'the request\'s deadline passed before the model ran it '
                                    f'({late}; --request_timeout_s, the {TIMEOUT_HEADER} header '
                                    'or the protocol\'s timeout): it did not run; send it '
                                    'again, or give it more time.') from None
        except UserError as error:  # e.g. attention memory over the host's
            raise RequestError(422, str(error)) from None

    async def class_map(self, image, deadline):
        """``(label, batch size)``: the uint8 class map of a BGR image, run in a batch."""
        from starlette.concurrency import run_in_threadpool
        batch, infos = await self.preprocess(image)
        output, batch_size = await self.result(self.batcher.submit, batch, deadline=deadline)
        label = (await run_in_threadpool(self.seg.postprocess, output, infos))[0]
        return label, batch_size


class BearerAuth:
    """ASGI middleware: every route but the probes and the page's files needs
    ``Authorization: Bearer <token>`` (401 otherwise)."""

    def __init__(self, app, token):
        self.app, self.token = app, ('Bearer ' + token).encode()

    async def __call__(self, scope, receive, send):
        path = scope.get('path', '')
        if scope['type'] != 'http' or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope['headers'] if k == b'authorization'), b'')
        if hmac.compare_digest(given, self.token):
            return await self.app(scope, receive, send)
        what = 'a wrong token' if given else 'no token'
        response = _error(401, f'this server needs a bearer token ({what} given): send '
                               '"Authorization: Bearer <token>", the token of its '
                               '--auth_token_file.', {'WWW-Authenticate': 'Bearer'})
        await response(scope, receive, send)


def create_app(served, options, token=None, warmup_shape=None, on_failure=None, worker=None):
    """The FastAPI app serving ``served`` (a ServedModel's front, its runs in ``worker``)
    within ``options``' limits; with ``token`` every route but the probes needs it;
    ``warmup_shape`` ``(3, H, W)``: /ready says ready once a run of each batch size ran at
    it."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, RedirectResponse, Response
    from fastapi.staticfiles import StaticFiles
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from .explore import ExploredImages
    from .prometheus import CountRequests, ServerMetrics
    from .v2 import add_v2_routes

    seg = served.segmenter
    metrics = ServerMetrics(batch_sizes(options.max_batch), {
        'model_name': options.model_name, 'backend': str(seg.backend),
        'config': served.source, 'export_hash': served.digest})
    service = Service(served, options, metrics, warmup_shape, on_failure, worker)
    batcher = service.batcher
    explored = ExploredImages(served.align_corners) if served.align_corners is not None \
        else None
    limits = {'max_body_bytes': options.max_body_bytes, 'max_pixels': options.max_pixels}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await batcher.start(warmup_shape)
        yield
        await batcher.stop()

    app = FastAPI(title='PSANet segmentation', version='1', lifespan=lifespan, docs_url=None,
                  redoc_url=None)  # the docs pages load scripts from a CDN; the schema stays
    app.state.service = service

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

    async def read_image(request):
        data = await read_image_bytes(request, options.max_body_bytes)
        return await run_in_threadpool(decode_image, data, options.max_pixels)

    @app.post('/v1/segment', openapi_extra=IMAGE_BODY,
              responses={200: {'content': {'image/png': {}, 'application/json': {}}}})
    async def segment(request: Request, format: str = 'png'):
        """The class map of an image: a palette PNG (``format=png``) or JSON (``format=json``:
        its shape, the class ids row by row and the pixels of each class). Header
        ``X-Request-Timeout-S``: seconds its run must begin within, else 504."""
        if format not in ('png', 'json'):
            raise RequestError(400, f'format={format!r}: use format=png or format=json.')
        with service.answering():
            deadline = service.deadline(request)
            label, batch_size = await service.class_map(await read_image(request), deadline)
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
        """Readiness: 200 once warmed up and while the queue has room, else 503."""
        reason = service.not_ready()
        if reason is not None:
            return _error(503, reason, {'Retry-After': str(RETRY_AFTER_S)})
        return {'status': 'ready', 'waiting': batcher.waiting}

    @app.get('/v1/stats')
    async def stats():
        """Runs of the model by batch size, the requests waiting for it and those in flight, and
        the model's worker process."""
        return {'runs_by_batch_size': {str(k): v for k, v in sorted(batcher.runs.items())},
                'waiting': batcher.waiting, 'max_queue': options.max_queue,
                'in_flight': service.in_flight, 'state': batcher.state,
                'warmup_s': batcher.warmup_s, 'worker': None if worker is None else {
                    'pid': worker.process.pid, 'alive': worker.alive,
                    'restarts': worker.restarts, 'last_death': batcher.worker_error}}

    @app.get('/metrics', response_class=Response)
    async def prometheus():
        """Prometheus metrics (text format): requests, latencies, batches, queue, model."""
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def need_explorer():
        if explored is None:
            raise RequestError(409, 'the explorer needs the model: this server runs an export; '
                                    'start it with --config <training config> --model_path '
                                    '<weights>.')
        return explored

    @app.post('/v1/explore', openapi_extra=IMAGE_BODY)
    async def explore(request: Request):
        """Runs the model on an image, keeps its attention; returns its id and class map."""
        kept = need_explorer()
        with service.answering():
            deadline = service.deadline(request)
            image = await read_image(request)
            batch, infos = await service.preprocess(image)
            output, records = await service.result(
                batcher.submit_call, lambda: seg.runner.explore(batch), deadline=deadline)
            label = (await run_in_threadpool(seg.postprocess, output, infos))[0]
        try:
            return await run_in_threadpool(kept.add, image.shape[:2], batch, infos[0],
                                           records, label)
        except OverflowError as error:
            raise RequestError(413, str(error)) from None

    @app.get('/v1/explore/{image_id}')
    async def explore_point(image_id: str, x: int, y: int):
        """The collect and distribute maps of pixel (x, y) of an explored image."""
        kept = need_explorer()
        try:
            return await run_in_threadpool(kept.point, image_id, x, y)
        except KeyError:
            raise RequestError(404, f'image {image_id} is no longer kept (the last '
                                    f'{kept.capacity} are): send it again.') from None
        except ValueError as error:
            raise RequestError(400, str(error)) from None

    add_v2_routes(app, service)

    @app.get('/', include_in_schema=False)
    async def root():
        return RedirectResponse('/explorer/')

    app.mount('/explorer', StaticFiles(directory=EXPLORER_DIR, html=True), name='explorer')
    if token is not None:
        app.add_middleware(BearerAuth, token=token)
    app.add_middleware(CountRequests, metrics=metrics, routes=lambda: app.router.routes)
    return app


def _name(names, cls):
    return names[cls] if cls < len(names) else f'class {cls}'


def serve(options: ServeOptions) -> None:
    """serve.py: checks every flag and binds the address, loads the model, then serves until
    SIGTERM or Ctrl-C (exit 0 after a graceful stop)."""
    from .startup import bind, check_packages, check_tls, read_token
    from .served_model import check_config
    check_packages()
    check_config(options.config, options.model_path, options.backend, options.int8,
                 options.cpu_threads)
    token = read_token(options.auth_token_file) if options.auth_token_file else None
    if options.ssl_certfile is not None and options.ssl_keyfile is not None:  # both or none
        check_tls(options.ssl_certfile, options.ssl_keyfile)
    sockets = bind(options.host, options.port)
    try:
        _serve_on(sockets, options, token)
    finally:
        for sock in sockets:
            sock.close()


def _serve_on(sockets, options, token):
    from psanet import interrupts
    from .served_model import warmup_shape
    from .worker import ModelWorker
    worker = ModelWorker((options.config, options.model_path, options.backend, options.device,
                          options.int8, options.cpu_threads))
    try:
        served = worker.start(should_stop=interrupts.requested)
        if served is None:  # a stop while the model loaded
            raise interrupts.stopped(interrupts.requested())
        _run_server(sockets, options, token, served, worker,
                    warmup_shape(served.segmenter, options.warmup_size))
    finally:
        worker.end()


def _run_server(sockets, options, token, served, worker, shape):
    import uvicorn
    if shape is None:
        _logger.info('no warm-up: the model takes each image at its own size (--warmup_size W H '
                     'warms it up for the size you expect)')
    failures = []

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            app.state.service.batcher.drain(options.graceful_timeout_s)
            await super().shutdown(sockets=sockets)

    def failed(error, stage):
        failures.append((error, stage))
        server.should_exit = True

    app = create_app(served, options, token, shape, failed, worker)
    server = Server(uvicorn.Config(
        app, log_level='info', access_log=False, ssl_certfile=options.ssl_certfile,
        ssl_keyfile=options.ssl_keyfile,
        timeout_graceful_shutdown=options.graceful_timeout_s + DRAIN_BACKSTOP_S))
    scheme = 'https' if options.ssl_certfile else 'http'
    _logger.info('serving %s (%s) on %s://%s:%d as model %r%s; the explorer at /explorer/',
                 served.source, served.segmenter.backend, scheme, options.host, options.port,
                 options.model_name, ', bearer token required' if token else '')
    server.run(sockets=sockets)
    # uvicorn raises the signal it stopped on once its handlers are gone: the run_cli
    # handler records it, and the stop is the normal end.
    if failures:
        error, stage = failures[0]
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        if stage == 'restart':
            raise DeployError(f'the model worker died and did not come back '
                              f'({type(error).__name__}: {first_line}); the server stopped.')
        raise DeployError(f'the warm-up run at {"x".join(map(str, shape))} failed '
                          f'({type(error).__name__}: {first_line}); the server stopped. Give '
                          '--warmup_size W H of an image the model takes.')
