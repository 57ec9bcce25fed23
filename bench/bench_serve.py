"""serve.py under load on the loopback: requests/s and latency at concurrency 1, 4 and 16, with
and without dynamic batching, the server's memory before and after, the server's overhead
against calling psanet.Segmenter in one process, the warm-up, deadlines, a run in progress
(how fast /health and a deadline's 504 answer meanwhile), and the SIGTERM drain with and
without CPU hogs beside the server; with --compare_root, the stall and the drain also of
another checkout's serve.py (e.g. one before the model moved to its worker), side by side.

    python bench/bench_serve.py [--config DEPLOY_YAML] [--size 256 128] [--requests 96]
        [--time_limit_s 60] [--max_batch 8] [--max_wait_ms 5] [--cpu_threads N]
        [--deadline_s 0.25] [--graceful_timeout_s 2] [--drain_requests 64]
        [--drain_size 512 256] [--stall_size 1024 512] [--compare_root DIR]
        [--parts load warmup deadline stall drain]

Protocol (docs/deploy.md, "Serving: measured"): one export (default: the mini config's
PSANet with its initial weights, exported with export.py's defaults); one PNG of --size,
POSTed raw (image/png) to /v1/segment. For each setting (--max_batch 1: batching off;
--max_batch N with --max_wait_ms) a fresh server; for each concurrency C, C client
threads each with a keep-alive connection send --requests in all (at most --time_limit_s),
after one untimed request per thread. Latency is the client's, request sent to PNG
received; errors are answers other than 200 (must be 0). RSS is the server's VmRSS after
a warm-up pass (every concurrency, half the requests: the backend has met every batch
shape) and after the measured pass. The direct figure: the same image through
Segmenter(path) in this process, one call at a time.

Warm-up: a fresh server without and with ``--warmup_size`` (the image's size), each timed
from its start to /ready, then one request (the first), nine more one at a time (the tenth
timed), and a burst of --max_batch at once (the first batch of that size), then another
burst. Deadlines: the batching server at concurrency 16 with ``X-Request-Timeout-S
--deadline_s`` on every request: how many are answered, how many get 504, and how fast. Drain:
a server with ``--graceful_timeout_s`` gets --drain_requests at once and SIGTERM once it has
read them all; with as many CPU hogs (busy processes) as CPUs beside it, and without: the
answers (200, 503, none), the last answer's and the exit's time after the signal, the exit
code, against the bound (--graceful_timeout_s + the server's DRAIN_BACKSTOP_S). Stall: a
--max_batch 1 server runs one --stall_size image (timed); 0.5 s into it, GET /health and a
--size request with ``X-Request-Timeout-S --deadline_s`` at once, each timed to its answer.
"""
import argparse
import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CONCURRENCY = (1, 4, 16)
PARTS = ['load', 'warmup', 'deadline', 'stall', 'drain']


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default=None,
                        help="An export's deploy.yaml. Default: the mini PSANet exported here.")
    parser.add_argument('--size', type=int, nargs=2, default=(256, 128), metavar=('W', 'H'))
    parser.add_argument('--requests', type=int, default=96, help='Per concurrency and setting.')
    parser.add_argument('--time_limit_s', type=float, default=60,
                        help='Most time per concurrency and setting.')
    parser.add_argument('--max_batch', type=int, default=8)
    parser.add_argument('--max_wait_ms', type=float, default=5)
    parser.add_argument('--cpu_threads', type=int, default=None)
    parser.add_argument('--deadline_s', type=float, default=0.25,
                        help='X-Request-Timeout-S of the deadline pass.')
    parser.add_argument('--graceful_timeout_s', type=int, default=2)
    parser.add_argument('--drain_requests', type=int, default=64)
    parser.add_argument('--drain_size', type=int, nargs=2, default=None, metavar=('W', 'H'),
                        help='The drain\'s image size. Default: --size.')
    parser.add_argument('--stall_size', type=int, nargs=2, default=(1024, 512),
                        metavar=('W', 'H'), help='The image whose run the stall part times.')
    parser.add_argument('--compare_root', default=None,
                        help='Another checkout of this project: its serve.py is measured beside '
                        'this one in the stall and drain parts.')
    parser.add_argument('--parts', nargs='+', default=PARTS, choices=PARTS,
                        help='What to measure. Default: all.')
    return parser.parse_args()


def _export(work):
    """The mini config's PSANet with its initial weights (seeded), as export.py exports it."""
    import glob
    import paddle
    from psanet.export import export_from_config
    config, = glob.glob(os.path.join(ROOT, 'configs', 'psanet', '*mini*.yml'))
    paddle.seed(0)
    return export_from_config(config, None, os.path.join(work, 'export'))


def _free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def _rss_mib(pid):
    with open(f'/proc/{pid}/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1]) / 1024
    return float('nan')


def _backstop_s(root):
    """DRAIN_BACKSTOP_S of the checkout ``root`` (read, not imported: it may be another one)."""
    import re
    with open(os.path.join(root, 'psanet', 'serve', 'app.py')) as f:
        return int(re.search(r'^DRAIN_BACKSTOP_S = (\d+)', f.read(), re.M).group(1))


def _png(path, size):
    import cv2
    rng = np.random.RandomState(0)
    cv2.imwrite(path, cv2.resize(rng.randint(0, 256, (6, 8, 3)).astype('uint8'), tuple(size),
                                 interpolation=cv2.INTER_CUBIC))
    with open(path, 'rb') as f:
        return f.read()


class Server:
    def __init__(self, deploy, args, max_batch, log, *flags, root=ROOT):
        import httpx
        self.port = _free_port()
        self.url = f'http://127.0.0.1:{self.port}'
        command = [sys.executable, os.path.join(root, 'serve.py'), '--config', deploy,
                   '--port', str(self.port), '--max_batch', str(max_batch),
                   '--max_wait_ms', str(args.max_wait_ms), '--max_queue', '256', *flags]
        if args.cpu_threads:
            command += ['--cpu_threads', str(args.cpu_threads)]
        start = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                        env=dict(os.environ, PYTHONPATH=root), cwd=root)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f'{self.url}/ready', timeout=5).status_code == 200:
                    self.ready_s = time.perf_counter() - start
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise SystemExit(f'serve.py did not start; see {log.name}')

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(60)


def _load(url, body, concurrency, count, time_limit):
    """(requests/s, latencies in s, errors) of ``count`` requests from ``concurrency`` threads."""
    import httpx
    end = time.monotonic() + time_limit
    per_thread = [count // concurrency + (i < count % concurrency) for i in range(concurrency)]

    def client(n):
        latencies, errors = [], 0
        with httpx.Client(timeout=120, headers={'Content-Type': 'image/png'}) as http:
            http.post(f'{url}/v1/segment', content=body)  # warm-up, untimed
            barrier.wait()
            for _ in range(n):
                if time.monotonic() > end:
                    break
                start = time.perf_counter()
                answer = http.post(f'{url}/v1/segment', content=body)
                latencies.append(time.perf_counter() - start)
                errors += answer.status_code != 200
        return latencies, errors

    import threading
    barrier = threading.Barrier(concurrency + 1)
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(client, n) for n in per_thread]
        barrier.wait()
        start = time.perf_counter()
        results = [f.result() for f in futures]
        elapsed = time.perf_counter() - start
    latencies = [t for r in results for t in r[0]]
    return len(latencies) / elapsed, latencies, sum(r[1] for r in results)


def _percentiles(latencies):
    return [1000 * float(np.percentile(latencies, q)) for q in (50, 95, 99)]


def _post(url, body, headers=None):
    import httpx
    return httpx.post(f'{url}/v1/segment', content=body, timeout=300,
                      headers={'Content-Type': 'image/png', **(headers or {})})


def _burst(url, body, count):
    """Latencies (s) of ``count`` requests sent at once."""
    def timed(_):
        start = time.perf_counter()
        assert _post(url, body).status_code == 200
        return time.perf_counter() - start
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(timed, range(count)))


def _warm_up(deploy, args, body, log):
    """Rows: (warm-up, s to /ready, warm-up s, first ms, tenth ms, first burst p50 ms, second
    burst p50 ms)."""
    import httpx
    rows = []
    for flags in ([], ['--warmup_size', str(args.size[0]), str(args.size[1])]):
        server = Server(deploy, args, args.max_batch, log, *flags)
        warmup_s = httpx.get(f'{server.url}/v1/stats', timeout=120).json()['warmup_s']
        times = []
        for _ in range(10):
            start = time.perf_counter()
            assert _post(server.url, body).status_code == 200
            times.append(time.perf_counter() - start)
        bursts = [1000 * float(np.median(_burst(server.url, body, args.max_batch)))
                  for _ in range(2)]
        rows.append(('on' if flags else 'off', server.ready_s, warmup_s, 1000 * times[0],
                     1000 * times[9], *bursts))
        server.stop()
    return rows


def _deadline(url, body, concurrency, count, deadline_s):
    """(answered, timed out, other, p50 ms of the answered, p50 ms of the 504s)."""
    def one(_):
        start = time.perf_counter()
        status = _post(url, body, {'X-Request-Timeout-S': str(deadline_s)}).status_code
        return status, time.perf_counter() - start
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(count)))
    by = {code: [t for s, t in results if s == code] for code in (200, 504)}
    median = lambda t: 1000 * float(np.median(t)) if t else float('nan')  # noqa: E731
    return (len(by[200]), len(by[504]), count - len(by[200]) - len(by[504]), median(by[200]),
            median(by[504]))


def _hogs(count):
    """``count`` busy processes (CPU hogs)."""
    return [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(count)]


def _stall(deploy, args, big, small, log, root):
    """(run s, /health ms, the deadline request's status and ms) while a --stall_size image
    runs alone."""
    import httpx
    pixels = str(args.stall_size[0] * args.stall_size[1])
    server = Server(deploy, args, 1, log, '--max_pixels', pixels, '--max_body_bytes',
                    str(len(big) + 1), root=root)
    try:
        _post(server.url, big)  # its kernels made
        def timed(function, *call_args, **kwargs):
            asked = time.perf_counter()
            answer = function(*call_args, **kwargs)
            return answer, 1000 * (time.perf_counter() - asked)

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            start = time.perf_counter()
            running = pool.submit(_post, server.url, big)
            time.sleep(0.5)  # read, preprocessed: running
            health = pool.submit(timed, httpx.get, f'{server.url}/health', timeout=300)
            late = pool.submit(timed, _post, server.url, small,
                               {'X-Request-Timeout-S': str(args.deadline_s)})
            (health, health_ms), (late, late_ms) = health.result(), late.result()
            assert running.result().status_code == 200 and health.status_code == 200
            run_s = time.perf_counter() - start
    finally:
        server.stop()
    return run_s, health_ms, late.status_code, late_ms


def _sigterm_drain(deploy, args, body, log, hogs, root=ROOT):
    """(in flight at the signal, 200s, 503s, others, s to the last answer, s to the exit, exit
    code) of --drain_requests sent at once and SIGTERM once all are read."""
    import httpx
    server = Server(deploy, args, args.max_batch, log, '--graceful_timeout_s',
                    str(args.graceful_timeout_s), root=root)
    busy = _hogs(os.cpu_count() if hogs else 0)
    answered = {}

    def send(i):
        try:
            answered[i] = (_post(server.url, body).status_code, time.perf_counter())
        except httpx.TransportError:
            answered[i] = (None, time.perf_counter())
    try:
        with concurrent.futures.ThreadPoolExecutor(args.drain_requests) as pool:
            futures = [pool.submit(send, i) for i in range(args.drain_requests)]
            in_flight, wait_until = 0, time.monotonic() + 120
            while in_flight < args.drain_requests and time.monotonic() < wait_until and \
                    not any(f.done() for f in futures):
                in_flight = httpx.get(f'{server.url}/v1/stats', timeout=120).json()['in_flight']
                time.sleep(0.01)
            start = time.perf_counter()
            server.process.send_signal(signal.SIGTERM)
            code = server.process.wait(300)
            exited = time.perf_counter() - start
            concurrent.futures.wait(futures)
    finally:
        for process in busy:
            process.kill()
            process.wait()
        server.stop()
    statuses = [status for status, _ in answered.values()]
    last = max(t for _, t in answered.values()) - start
    return (in_flight, statuses.count(200), statuses.count(503),
            len(statuses) - statuses.count(200) - statuses.count(503), last, exited, code)


def main():
    args = parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    import logging
    logging.getLogger('httpx').setLevel(logging.WARNING)  # not a line per request
    from psanet import Segmenter
    with tempfile.TemporaryDirectory(prefix='bench_serve_') as work:
        deploy = args.config or _export(work)
        image = os.path.join(work, 'image.png')
        body = _png(image, args.size)
        import httpx
        log = open(os.path.join(work, 'serve.log'), 'w')
        print(f'export {deploy}, image {args.size[0]}x{args.size[1]} PNG ({len(body)} bytes), '
              f'{os.cpu_count()} CPUs, --cpu_threads {args.cpu_threads or "all"}')
        if 'load' in args.parts:
            seg = Segmenter.from_export(deploy, cpu_threads=args.cpu_threads)
            for _ in range(3):
                seg(image)
            times = []
            for _ in range(min(args.requests, 48)):
                start = time.perf_counter()
                seg(image)
                times.append(time.perf_counter() - start)
            direct_ms = 1000 * float(np.median(times))
            del seg
            print(f'\ndirect: Segmenter(path) in one process, median {direct_ms:.1f} ms '
                  f'({1000 / direct_ms:.1f} images/s)\n')
            print('| batching | concurrency | requests | requests/s | p50 ms | p95 ms | p99 ms '
                  '| errors | runs by batch size | vs direct (req/s) |')
            print('|---|---:|---:|---:|---:|---:|---:|---:|---|---:|')
            memory = []
            for max_batch in (1, args.max_batch):
                server = Server(deploy, args, max_batch, log)
                for concurrency in CONCURRENCY:  # warm-up: every batch shape the load makes
                    _load(server.url, body, concurrency, args.requests // 2, args.time_limit_s)
                rss = [_rss_mib(server.process.pid)]
                for concurrency in CONCURRENCY:
                    before = httpx.get(f'{server.url}/v1/stats').json()['runs_by_batch_size']
                    rate, latencies, errors = _load(server.url, body, concurrency, args.requests,
                                                    args.time_limit_s)
                    after = httpx.get(f'{server.url}/v1/stats').json()['runs_by_batch_size']
                    runs = {n: after[n] - before.get(n, 0) for n in after
                            if after[n] - before.get(n, 0)}
                    p50, p95, p99 = _percentiles(latencies)
                    what = 'off' if max_batch == 1 else f'max {max_batch}, {args.max_wait_ms:g} ms'
                    print(f'| {what} | {concurrency} | {len(latencies)} | {rate:.1f} | {p50:.1f} | '
                          f'{p95:.1f} | {p99:.1f} | {errors} | '
                          f'{", ".join(f"{n}: {r}" for n, r in runs.items())} | '
                          f'{rate * direct_ms / 1000:.2f} |')
                rss.append(_rss_mib(server.process.pid))
                memory.append((max_batch, rss))
                server.stop()
            print('\n| batching | server RSS after the warm-up MiB | after the measured load MiB |')
            print('|---|---:|---:|')
            for max_batch, (first, last) in memory:
                print(f'| {"off" if max_batch == 1 else f"max {max_batch}"} | {first:.0f} | '
                      f'{last:.0f} |')
        if 'warmup' in args.parts:
            print('\n| warm-up | start to /ready s | warm-up s | 1st request ms | 10th request ms '
                  f'| 1st burst of {args.max_batch}, p50 ms | 2nd burst, p50 ms |')
            print('|---|---:|---:|---:|---:|---:|---:|')
            for what, ready_s, warmup_s, first, tenth, burst1, burst2 in _warm_up(deploy, args, body,
                                                                                  log):
                print(f'| {what} | {ready_s:.1f} | {warmup_s or 0:.2f} | {first:.1f} | {tenth:.1f} '
                      f'| {burst1:.1f} | {burst2:.1f} |')
        if 'deadline' in args.parts:
            server = Server(deploy, args, args.max_batch, log)
            _load(server.url, body, 16, args.requests // 2, args.time_limit_s)  # warm
            print('\n| X-Request-Timeout-S | concurrency | requests | 200 | 504 | other '
                  '| p50 ms of the 200s | p50 ms of the 504s |')
            print('|---:|---:|---:|---:|---:|---:|---:|---:|')
            for deadline_s in (args.deadline_s, 60):
                ok, late, other, ok_ms, late_ms = _deadline(server.url, body, 16, args.requests,
                                                            deadline_s)
                print(f'| {deadline_s:g} | 16 | {args.requests} | {ok} | {late} | {other} '
                      f'| {ok_ms:.1f} | {late_ms:.1f} |')
            server.stop()
        roots = [('this tree', ROOT)] + ([('compare', os.path.abspath(args.compare_root))]
                                         if args.compare_root else [])
        if 'stall' in args.parts:
            big = _png(os.path.join(work, 'big.png'), args.stall_size)
            print(f'\n| serve.py | a {args.stall_size[0]}x{args.stall_size[1]} run s '
                  f'| /health during it ms | X-Request-Timeout-S {args.deadline_s:g} during it: '
                  'status | after ms |')
            print('|---|---:|---:|---:|---:|')
            for name, root in roots:
                run_s, health_ms, status, late_ms = _stall(deploy, args, big, body, log, root)
                print(f'| {name} | {run_s:.2f} | {health_ms:.0f} | {status} | {late_ms:.0f} |')
        if 'drain' in args.parts:
            drain_body = body if args.drain_size is None else _png(
                os.path.join(work, 'drain.png'), args.drain_size)
            width, height = args.drain_size or args.size
            print(f'\n| serve.py | CPU hogs | {width}x{height} requests | in flight at SIGTERM '
                  '| 200 | 503 | none | last answer s | exit s | bound s | exit code |')
            print('|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
            for hogs in (False, True):
                for name, root in roots:
                    in_flight, ok, refused, none, last, exited, code = _sigterm_drain(
                        deploy, args, drain_body, log, hogs, root)
                    print(f'| {name} | {os.cpu_count() if hogs else 0} | {args.drain_requests} '
                          f'| {in_flight} | {ok} | {refused} | {none} | {last:.2f} '
                          f'| {exited:.2f} | {args.graceful_timeout_s + _backstop_s(root)} '
                          f'| {code} |')
        log.close()


if __name__ == '__main__':
    main()
