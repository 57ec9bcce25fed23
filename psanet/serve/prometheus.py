"""Prometheus metrics of the server (``GET /metrics``, prometheus-client's text format).

Requests by route and status, their latency, the queue wait and model runs, batch sizes,
the queue depth and requests in flight, requests refused (503) and timed out (504), and
which model is served. One registry per app: nothing global.
"""
import time

__all__ = ['ServerMetrics', 'CountRequests']

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                   60, 120)


class ServerMetrics:
    """The metrics and what feeds them: the batcher (queue wait, runs, refusals, timeouts), the
    request counter (:class:`CountRequests`) and the gauges' functions.

    Args:
        batch_sizes (list): The batch sizes the batcher forms (the histogram's buckets).
        model (dict): Labels of ``psanet_model_info``.
    """

    def __init__(self, batch_sizes, model):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
        self.registry = registry = CollectorRegistry()
        self.requests = Counter('psanet_requests', 'HTTP requests answered, by route and status.',
                                ['route', 'status'], registry=registry)
        self.request_seconds = Histogram(
            'psanet_request_duration_seconds', 'From a request\'s arrival to the end of its '
            'answer, by route.', ['route'], buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_seconds = Histogram(
            'psanet_queue_wait_seconds', 'From a request entering the queue to its model run.',
            buckets=LATENCY_BUCKETS, registry=registry)
        self.run_seconds = Histogram('psanet_model_run_seconds', 'One batched model run.',
                                     buckets=LATENCY_BUCKETS, registry=registry)
        self.batch_size = Histogram('psanet_batch_size', 'Requests in one model run.',
                                    buckets=[float(b) for b in batch_sizes], registry=registry)
        self.queue_depth = Gauge('psanet_queue_depth', 'Requests waiting for the model.',
                                 registry=registry)
        self.in_flight = Gauge('psanet_in_flight_requests', 'Image requests being answered.',
                               registry=registry)
        self.refused = Counter('psanet_rejected', 'Requests answered 503: the queue full '
                               '(queue_full), the server stopping (stopping), their run\'s '
                               'worker dead (worker_died), or queued while it restarts '
                               '(restarting).', ['reason'], registry=registry)
        self.deadlines = Counter('psanet_timed_out', 'Requests answered 504: their deadline '
                                 'passed before their run.', registry=registry)
        for reason in ('queue_full', 'stopping', 'worker_died', 'restarting'):
            self.refused.labels(reason)
        Info('psanet_model', 'The model served.', registry=registry).info(model)

    # What the batcher reports.
    def queue_wait(self, seconds):
        self.queue_seconds.observe(seconds)

    def model_run(self, seconds, batch_size):
        self.run_seconds.observe(seconds)
        self.batch_size.observe(batch_size)

    def timed_out(self):
        self.deadlines.inc()

    def rejected(self, reason):
        self.refused.labels(reason).inc()

    def render(self):
        """``(body, content type)`` of a scrape."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class CountRequests:
    """ASGI middleware: every HTTP request counted by its route's path template (``unmatched``
    for none) and status, and timed from its arrival to its answer's last byte."""

    def __init__(self, app, metrics, routes):
        self.app, self.metrics, self.routes = app, metrics, routes

    def _route(self, scope):
        from starlette.routing import Match
        partial = None
        for route in self.routes():
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route.path
            if match == Match.PARTIAL and partial is None:
                partial = route.path
        return partial or 'unmatched'

    async def __call__(self, scope, receive, send):
        if scope['type'] != 'http':
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]
        route = self._route(dict(scope))  # before the router adds its own keys to the scope

        async def sending(message):
            if message['type'] == 'http.response.start':
                status[0] = message['status']
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.requests.labels(route, str(status[0])).inc()
            self.metrics.request_seconds.labels(route).observe(time.perf_counter() - start)
