"""serve.py under load on the loopback: requests/s and latency at concurrency 1, 4 and 16, with
and without dynamic batching, the server's memory before and after, the SIGTERM drain, and the
server's overhead against calling psanet.Segmenter in one process.

    python bench/bench_serve.py [--config DEPLOY_YAML] [--size 256 128] [--requests 96]
        [--time_limit_s 60] [--max_batch 8] [--max_wait_ms 5] [--cpu_threads N]

Protocol (docs/deploy.md, "Serving: measured"): one export (default: the mini config's
PSANet with its initial weights, exported with export.py's defaults); one PNG of --size,
POSTed raw (image/png) to /v1/segment. For each setting (--max_batch 1: batching off;
--max_batch N with --max_wait_ms) a fresh server; for each concurrency C, C client
threads each with a keep-alive connection send --requests in all (at most --time_limit_s),
after one untimed request per thread. Latency is the client's, request sent to PNG
received; errors are answers other than 200 (must be 0). RSS is the server's VmRSS after
a warm-up pass (every concurrency, half the requests: the backend has met every batch
shape) and after the measured pass. The direct figure: the same image through
Segmenter(path) in this process, one call at a time. Then one server gets 16 requests at
once and SIGTERM: the time to exit and its exit code.
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


class Server:
    def __init__(self, deploy, args, max_batch, log):
        import httpx
        self.port = _free_port()
        self.url = f'http://127.0.0.1:{self.port}'
        command = [sys.executable, os.path.join(ROOT, 'serve.py'), '--config', deploy,
                   '--port', str(self.port), '--max_batch', str(max_batch),
                   '--max_wait_ms', str(args.max_wait_ms), '--max_queue', '256']
        if args.cpu_threads:
            command += ['--cpu_threads', str(args.cpu_threads)]
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                        env=dict(os.environ, PYTHONPATH=ROOT))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f'{self.url}/ready', timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
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


def _sigterm_drain(deploy, args, body, log):
    import httpx
    server = Server(deploy, args, args.max_batch, log)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(httpx.post, f'{server.url}/v1/segment', content=body,
                               headers={'Content-Type': 'image/png'}, timeout=120)
                   for _ in range(16)]
        in_flight = 0
        while in_flight < 16 and not any(f.done() for f in futures):
            in_flight = httpx.get(f'{server.url}/v1/stats').json()['in_flight']
        start = time.perf_counter()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(120)
        drained = time.perf_counter() - start
        answered = sum(f.result().status_code == 200 for f in futures)
    return drained, code, answered, in_flight


def main():
    args = parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    import cv2
    from psanet import Segmenter
    with tempfile.TemporaryDirectory(prefix='bench_serve_') as work:
        deploy = args.config or _export(work)
        image = os.path.join(work, 'image.png')
        rng = np.random.RandomState(0)
        cv2.imwrite(image, cv2.resize(rng.randint(0, 256, (6, 8, 3)).astype('uint8'),
                                      tuple(args.size), interpolation=cv2.INTER_CUBIC))
        with open(image, 'rb') as f:
            body = f.read()
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
        print(f'export {deploy}, image {args.size[0]}x{args.size[1]} PNG ({len(body)} bytes), '
              f'{os.cpu_count()} CPUs, --cpu_threads {args.cpu_threads or "all"}')
        print(f'\ndirect: Segmenter(path) in one process, median {direct_ms:.1f} ms '
              f'({1000 / direct_ms:.1f} images/s)\n')
        print('| batching | concurrency | requests | requests/s | p50 ms | p95 ms | p99 ms '
              '| errors | runs by batch size | vs direct (req/s) |')
        print('|---|---:|---:|---:|---:|---:|---:|---:|---|---:|')
        import httpx
        memory = []
        log = open(os.path.join(work, 'serve.log'), 'w')
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
        drained, code, answered, in_flight = _sigterm_drain(deploy, args, body, log)
        print(f'\nSIGTERM with {in_flight} of 16 requests in flight: answered {answered}/16, '
              f'exit code {code}, {drained:.2f} s from the signal to the exit')
        log.close()


if __name__ == '__main__':
    main()
