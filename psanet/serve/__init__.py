"""PSANet behind HTTP: ``python serve.py`` serves a :class:`psanet.Segmenter` with FastAPI.

- :mod:`psanet.serve.app`: the routes (segment, model, health, readiness, the
  attention explorer page) and the uvicorn server with its bounded drain.
- :mod:`psanet.serve.v2`: the Open Inference Protocol's routes.
- :mod:`psanet.serve.prometheus`: ``/metrics``.
- :mod:`psanet.serve.startup`: the options, checked before the model loads.
- :mod:`psanet.serve.batcher`: the one model thread, fed by a bounded queue;
  requests of one input size share a run (dynamic batching), deadlines, warm-up, drain.
- :mod:`psanet.serve.worker`: the model's process, which the model thread sends runs to
  (the event loop never waits on a run).
- :mod:`psanet.serve.uploads`: reading a request's image within the limits.
- :mod:`psanet.serve.served_model`: the Segmenter, its classes and palette, from an
  export or a checkpoint.
- :mod:`psanet.serve.explore`: a pixel's collect and distribute maps for the page.

Importing this package loads none of them (docs/deploy.md, "Serving").
"""
