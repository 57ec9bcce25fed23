"""Serve a PSANet over HTTP: an export (any backend, INT8 included), or a checkpoint with the
attention explorer page (docs/deploy.md, "Serving").

    python serve.py --config output/inference_model/deploy.yaml --port 8000
    python serve.py --config configs/psanet/<config>.yml --model_path output/best_model/model.pdparams
"""
import argparse
import logging
import os
import sys

from psanet.cli import exit_with, run_cli
from psanet.deploy.backends import EXPORT_BACKENDS
from psanet.serve.app import ServeOptions, serve


def parse_args(argv=None):
    defaults = ServeOptions(config='')
    parser = argparse.ArgumentParser(description='PSANet segmentation server (FastAPI + uvicorn).')
    parser.add_argument('--config', required=True,
                        help="An export's deploy.yaml (or its folder), or a training config "
                        'with --model_path (the dygraph model; the explorer page needs it).')
    parser.add_argument('--model_path', default=None,
                        help='model.pdparams or a checkpoint folder, with a training --config.')
    parser.add_argument('--backend', choices=EXPORT_BACKENDS, default=defaults.backend,
                        help='The backend of an export. Default: the fastest installed one '
                        '(as psanet.Segmenter.from_export).')
    parser.add_argument('--int8', action='store_true', help="Run an export's INT8 model (CPU).")
    parser.add_argument('--device', choices=['cpu', 'gpu'], default=defaults.device,
                        help="Default: the API's: the CPU for an export, the GPU when Paddle "
                        'sees one for a training config.')
    parser.add_argument('--cpu_threads', type=int, default=defaults.cpu_threads,
                        help="Backend threads on the CPU. Default: the API's (PaddleSeg's 10, "
                        'or the CPUs this process may use when fewer).')
    parser.add_argument('--host', default=defaults.host,
                        help=f'Address to listen on. Default: {defaults.host} (this machine '
                        'only); 0.0.0.0 for every interface.')
    parser.add_argument('--port', type=int, default=defaults.port, help='1 to 65535.')
    parser.add_argument('--max_batch', type=int, default=defaults.max_batch,
                        help='Most requests of one input size in one run (dynamic batching; '
                        '1 turns it off).')
    parser.add_argument('--max_wait_ms', type=float, default=defaults.max_wait_ms,
                        help='How long a request waits for others to share its run.')
    parser.add_argument('--max_queue', type=int, default=defaults.max_queue,
                        help='Most requests waiting for the model; more get 503 + Retry-After.')
    parser.add_argument('--max_body_bytes', type=int, default=defaults.max_body_bytes,
                        help='Largest request body; larger gets 413.')
    parser.add_argument('--max_pixels', type=int, default=defaults.max_pixels,
                        help='Largest image, width x height; larger gets 413.')
    parser.add_argument('--graceful_timeout_s', type=int, default=defaults.graceful_timeout_s,
                        help='On SIGTERM, how long the queue is still served; then what waits '
                        'gets 503, the run in progress is answered, and the server exits.')
    parser.add_argument('--request_timeout_s', type=float, default=defaults.request_timeout_s,
                        help='A request whose run has not begun this long after its arrival '
                        'gets 504 and never runs. Per request: the X-Request-Timeout-S header, '
                        "or the Open Inference Protocol's timeout parameter. Default: none.")
    parser.add_argument('--warmup_size', type=int, nargs=2, default=defaults.warmup_size,
                        metavar=('W', 'H'),
                        help='Before /ready says ready, one run of each batch size at this '
                        "image size. Default: the size the export's input shape or its "
                        'transforms fix, if any (else no warm-up).')
    parser.add_argument('--model_name', default=defaults.model_name,
                        help='The model\'s name in the Open Inference Protocol routes '
                        '(/v2/models/<name>/infer).')
    parser.add_argument('--auth_token_file', default=defaults.auth_token_file,
                        help='A file holding a token: every route but /health, /ready, '
                        '/v2/health/* and the explorer\'s files then needs '
                        '"Authorization: Bearer <token>".')
    parser.add_argument('--ssl_certfile', default=defaults.ssl_certfile,
                        help='HTTPS: the certificate (PEM), with --ssl_keyfile.')
    parser.add_argument('--ssl_keyfile', default=defaults.ssl_keyfile,
                        help='HTTPS: the certificate\'s private key (PEM).')
    return parser.parse_args(argv)


def main(argv=None):
    flags = vars(parse_args(argv))
    if flags['warmup_size'] is not None:
        flags['warmup_size'] = tuple(flags['warmup_size'])
    return run_cli(lambda: serve(ServeOptions(**flags)))


def exit_now(code):
    """Ends the server at once once it has stopped (answers sent, its worker ended): the
    interpreter's teardown of Paddle's modules would add seconds to the drain (measured:
    4.5 s on a loaded 2-core machine, docs/deploy.md "Serving: measured")."""
    if code not in (0, None):
        exit_with(code)  # an error's line and code, as every command line
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == '__main__':
    exit_now(main())
