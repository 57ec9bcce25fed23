"""serve.py as operations run it, launched on 127.0.0.1 over the mini export with a stand-in
for a slow backend (serve_helpers.Gate holds every model run until the test opens it), and
driven by real clients (httpx, Triton's tritonclient, Prometheus' parser):

- the queue holds exactly --max_queue, /ready says 503 when it is full and 200 one below,
  a collection takes exactly --max_batch (3: not a power of two), the in-flight count
  comes back to 0, and each answer's pixels are psanet.Segmenter's for the same batch;
- every limit from both sides: a body of exactly --max_body_bytes and an image of exactly
  --max_pixels answered, one byte or pixel more refused;
- deadlines (the X-Request-Timeout-S header, the protocol's timeout, --request_timeout_s):
  504 while queued, and the request never runs;
- /metrics scraped after a known set of requests: every count;
- the model in its worker: /health and a deadline's 504 answer while a run holds the
  worker's GIL; a killed worker's requests get 503, /ready 503 until it is back;
- the warm-up (one run per batch size before /ready says ready) and the bounded drain
  (SIGTERM during a run that never ends: 503 to it and the queue at --graceful_timeout_s,
  the worker killed, exit 0);
- bearer-token auth over TLS with a self-signed certificate made here;
- bad flags, a bad config and missing packages refused with one line before the model loads.
"""
import collections
import concurrent.futures
import hashlib
import os
import shutil
import signal
import ssl
import struct
import sys
import threading
import time
import zlib

import cv2
import httpx
import numpy as np
import pytest

from psanet import Segmenter
from psanet.serve.app import DRAIN_BACKSTOP_S
from psanet.serve.worker import END_GRACE_S
from conftest import ROOT, finish, read_text, run_process
from serve_helpers import (SERVE_SCRIPT, Gate, assert_refused, free_port, make_image,
                           png_labels, post_image, running_server, triton_image)

MAX_BATCH, MAX_QUEUE = 3, 4
MAX_BODY = 40_000
MAX_PIXELS = 100 * 62         # an image of 100x62 is exactly at the limit,
OVER_PIXELS = (117, 53)       # 6201 pixels one over it
SIZE = (96, 64)               # the images the queue tests send (6144 pixels)
DEADLINE_SIZES = [(80, 48), (72, 40)]  # sizes only a timed-out request has
DRAIN_GRACE_S = 2


@pytest.fixture(scope='module')
def images(tmp_path_factory):
    """name -> PNG path: q0..q5 (SIZE), the deadline sizes, the two pixel-limit sizes."""
    root = tmp_path_factory.mktemp('ops_images')
    rng = np.random.RandomState(5)
    sizes = {f'q{i}': SIZE for i in range(6)}
    sizes.update({'late0': DEADLINE_SIZES[0], 'late1': DEADLINE_SIZES[1],
                  'at_limit': (100, 62), 'over_limit': OVER_PIXELS})
    paths = {}
    for name, size in sizes.items():
        paths[name] = str(root / f'{name}.png')
        cv2.imwrite(paths[name], make_image(rng, size))
    return paths


@pytest.fixture(scope='module')
def seg(mini_export):
    return Segmenter.from_export(mini_export, backend='paddle', cpu_threads=1)


def _server_flags(mini_export, *more):
    return ['--config', mini_export, '--backend', 'paddle', '--cpu_threads', 1, *more]


@pytest.fixture(scope='module')
def started(mini_export, tmp_path_factory):
    """``(process, url, gate, log)`` of the module's server, held by a gate: started closed, in
    its warm-up (``--warmup_size 80 48``); the warm-up test runs first, the drain test last."""
    root = tmp_path_factory.mktemp('gated_server')
    gate = Gate(root / 'gate')
    gate.close()
    flags = _server_flags(mini_export, '--max_batch', MAX_BATCH, '--max_queue', MAX_QUEUE,
                          '--max_wait_ms', 100, '--max_body_bytes', MAX_BODY,
                          '--max_pixels', MAX_PIXELS, '--warmup_size', 80, 48,
                          '--graceful_timeout_s', DRAIN_GRACE_S)
    with running_server(flags, root / 'serve.log', gate=gate, wait_for='/health') as (
            process, url):
        yield process, url, gate, str(root / 'serve.log')
    assert 'Traceback' not in read_text(root / 'serve.log')


@pytest.fixture(scope='module')
def gated(started):
    """``(url, gate, log)`` of the module's server, warmed up, its gate open between tests."""
    _, url, gate, log = started
    gate.open()
    _wait_ready(url)
    return url, gate, log


def _wait_ready(url, timeout=120):
    deadline = time.monotonic() + timeout
    while httpx.get(f'{url}/ready', timeout=30).status_code != 200:
        assert time.monotonic() < deadline, 'not ready'
        time.sleep(0.05)


def _stats(url, client=None):
    return (client or httpx).get(f'{url}/v1/stats', timeout=30).json()


def _wait_stats(url, client=None, timeout=120, **want):
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(url, client)
        if all(stats[k] == v for k, v in want.items()):
            return stats
        assert time.monotonic() < deadline, (want, stats)
        time.sleep(0.02)


def test_the_warm_up_runs_every_batch_size_before_ready(started, images, seg):
    _, url, gate, _ = started
    gate.wait_entered(1)
    assert_refused(httpx.get(f'{url}/ready', timeout=30), 503, 'warming up')
    assert_refused(httpx.get(f'{url}/v2/health/ready', timeout=30), 503, 'warming up')
    assert httpx.get(f'{url}/health', timeout=30).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        early = pool.submit(post_image, url, images['q0'])  # waits for the warm-up
        _wait_stats(url, waiting=1)
        gate.open()
        assert np.array_equal(png_labels(early.result())[0], seg(images['q0']))
    _wait_ready(url)
    # One run of each batch size max_batch 3 can form (1, 2) at 80x48, then the request.
    assert gate.runs() == [[1, 3, 48, 80], [2, 3, 48, 80], [1, 3, 64, 96]]
    assert _stats(url)['warmup_s'] > 0


def test_the_queue_holds_max_queue_ready_says_so_and_runs_hold_max_batch(gated, images, seg,
                                                                          mini_export):
    url, gate, _ = gated
    base = gate.entered()
    runs_before = len(gate.runs())
    gate.close()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        try:
            first = pool.submit(post_image, url, images['q0'])
            gate.wait_entered(base + 1)  # taken into a run, held
            queued = []
            for i in range(1, MAX_QUEUE + 1):
                ready = httpx.get(f'{url}/ready', timeout=30)
                assert ready.status_code == 200, ready.text  # room for one more
                queued.append(pool.submit(post_image, url, images[f'q{i}']))
                _wait_stats(url, waiting=i)
            assert_refused(httpx.get(f'{url}/ready', timeout=30), 503, 'queue is full')
            assert_refused(httpx.get(f'{url}/v2/health/ready', timeout=30), 503, 'queue is full')
            refused = post_image(url, images['q5'])
            assert_refused(refused, 503, f'holds {MAX_QUEUE} requests', '--max_queue')
            assert refused.headers['retry-after'] == '1'
            assert _stats(url)['in_flight'] == 1 + MAX_QUEUE
        finally:
            gate.open()
        answers = [first.result()] + [f.result() for f in queued]
    # q0 alone; q1-q3 collected (max_batch 3): runs of 2 and 1; q4 alone.
    assert [shape[0] for shape in gate.runs()[runs_before:]] == [1, 2, 1, 1]
    assert [a.headers['x-batch-size'] for a in answers] == ['1', '2', '2', '1', '1']
    pair = Segmenter.from_export(mini_export, backend='paddle', cpu_threads=1, batch_size=2)
    want = [seg(images['q0']), *pair([images['q1'], images['q2']]), seg(images['q3']),
            seg(images['q4'])]
    for answer, label in zip(answers, want):
        assert np.array_equal(png_labels(answer)[0], label)
    stats = _wait_stats(url, in_flight=0)
    assert stats['waiting'] == 0


def _png_of_size(path, size):
    """The PNG of ``path`` with a tEXt chunk that makes it exactly ``size`` bytes."""
    with open(path, 'rb') as f:
        png = f.read()
    filler = size - len(png) - 12 - len(b'pad\0')
    assert filler >= 0
    data = b'pad\0' + b'x' * filler
    chunk = struct.pack('>I', len(data)) + b'tEXt' + data + struct.pack(
        '>I', zlib.crc32(b'tEXt' + data))
    end = png.rindex(b'IEND') - 4
    padded = png[:end] + chunk + png[end:]
    assert len(padded) == size
    return padded


def test_every_limit_holds_from_both_sides(gated, images, seg, tmp_path):
    url, _, _ = gated
    exact = _png_of_size(images['q0'], MAX_BODY)
    want = seg(images['q0'])
    assert np.array_equal(png_labels(post_image(url, exact))[0], want)
    assert_refused(post_image(url, exact + b'\0'), 413, str(MAX_BODY), '--max_body_bytes')
    # Chunked: no Content-Length, the size counted as it arrives.
    chunks = lambda data: iter([data[i:i + 7000] for i in range(0, len(data), 7000)])  # noqa
    assert np.array_equal(png_labels(post_image(url, chunks(exact)))[0], want)
    assert_refused(post_image(url, chunks(exact + b'\0')), 413, str(MAX_BODY))
    assert np.array_equal(png_labels(post_image(url, images['at_limit']))[0],
                          seg(images['at_limit']))
    assert_refused(post_image(url, images['over_limit']), 413, '117x53', str(MAX_PIXELS),
                   '--max_pixels')
    import tritonclient.http as triton
    client = triton.InferenceServerClient(url.split('//')[1])
    for name, ok in (('at_limit', True), ('over_limit', False)):
        image = cv2.imread(images[name])
        tensor = triton_image(triton, image)
        if ok:
            label = client.infer('psanet', [tensor]).as_numpy('class_map')
            assert np.array_equal(label, seg(image))
        else:
            with pytest.raises(triton.InferenceServerException) as refused:
                client.infer('psanet', [tensor])
            assert refused.value.status() == '413' and '--max_pixels' in refused.value.message()


def test_a_request_past_its_deadline_in_the_queue_gets_504_and_never_runs(gated, images, seg):
    import tritonclient.http as triton
    url, gate, _ = gated
    base, runs_before = gate.entered(), len(gate.runs())
    client = triton.InferenceServerClient(url.split('//')[1], network_timeout=120)
    tensor = triton_image(triton, cv2.imread(images['late1']))
    gate.close()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        try:
            first = pool.submit(post_image, url, images['q0'])
            gate.wait_entered(base + 1)
            by_header = pool.submit(post_image, url, images['late0'],
                                    headers={'X-Request-Timeout-S': '1.0'})
            by_protocol = pool.submit(client.infer, 'psanet', [tensor], timeout=1_000_000)
            patient = pool.submit(post_image, url, images['q1'])
            assert_refused(by_header.result(), 504, 'deadline', 'did not run')
            with pytest.raises(triton.InferenceServerException) as timed_out:
                by_protocol.result()
            assert timed_out.value.status() == '504', timed_out.value
            assert _wait_stats(url, waiting=1)['in_flight'] == 2  # first and patient
        finally:
            gate.open()
        assert np.array_equal(png_labels(first.result())[0], seg(images['q0']))
        assert np.array_equal(png_labels(patient.result())[0], seg(images['q1']))
    ran = [tuple(shape[2:]) for shape in gate.runs()[runs_before:]]
    assert ran == [SIZE[::-1]] * 2, ran  # neither deadline size ever ran
    assert_refused(post_image(url, images['q0'], headers={'X-Request-Timeout-S': 'soon'}), 400,
                   'X-Request-Timeout-S')


HOLD_S = 5  # how long the stand-in run holds its process's GIL


def test_during_a_run_holding_the_gil_health_and_a_deadline_answer_before_it_ends(gated,
                                                                                   images):
    """Paddle Inference holds the GIL for a whole run (the gate's hold_gil stands in for it);
    the model's worker holds its own, so /health and a 0.25 s deadline's 504 come first."""
    url, gate, _ = gated
    base, runs_before = gate.entered(), len(gate.runs())
    gate.hold_gil(HOLD_S)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            running = pool.submit(post_image, url, images['q0'])
            gate.wait_entered(base + 1)
            entered = time.monotonic()
            health = httpx.get(f'{url}/health', timeout=30)
            late = post_image(url, images['late0'], headers={'X-Request-Timeout-S': '0.25'})
            answered_s = time.monotonic() - entered
            ran_meanwhile = len(gate.runs()) - runs_before
        finally:
            gate.hold_gil(0)
        assert running.result().status_code == 200
    assert health.status_code == 200 and health.json() == {'status': 'ok'}
    assert_refused(late, 504, 'deadline', 'did not run')
    assert ran_meanwhile == 0 and answered_s < HOLD_S - 1, (ran_meanwhile, answered_s)


def test_a_killed_worker_fails_its_requests_with_503_and_comes_back(gated, images, seg):
    url, gate, log = gated
    base, pid = gate.entered(), _stats(url)['worker']['pid']
    gate.close()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            running = pool.submit(post_image, url, images['q0'])
            gate.wait_entered(base + 1)
            queued = pool.submit(post_image, url, images['late1'])
            _wait_stats(url, waiting=1)
            os.kill(pid, signal.SIGKILL)
            assert_refused(running.result(timeout=60), 503, f'pid {pid}', 'killed by SIGKILL',
                           'send it again')
            assert_refused(queued.result(timeout=60), 503, 'killed by SIGKILL', 'restarting')
            assert_refused(httpx.get(f'{url}/ready', timeout=30), 503, 'restarting')
        finally:
            gate.open()
    _wait_ready(url)
    worker = _stats(url)['worker']
    assert worker['restarts'] == 1 and worker['pid'] != pid and worker['alive'], worker
    assert np.array_equal(png_labels(post_image(url, images['q2']))[0], seg(images['q2']))
    assert f'the model worker (pid {pid}) was killed by SIGKILL' in read_text(log)


def _scrape(url, client=None):
    """{(sample name, sorted label items): value} of /metrics, read by Prometheus' parser."""
    from prometheus_client.parser import text_string_to_metric_families
    answer = (client or httpx).get(f'{url}/metrics', timeout=30)
    assert answer.status_code == 200
    assert answer.headers['content-type'].startswith('text/plain')
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(answer.text) for s in family.samples}


ROUTES = {'/v1/segment': '/v1/segment', '/v1/stats': '/v1/stats', '/ready': '/ready',
          '/metrics': '/metrics', '/nothing': 'unmatched'}


def test_metrics_count_every_request_run_refusal_and_timeout(gated, images, mini_export):
    import tritonclient.http as triton
    url, gate, _ = gated
    tally, lock = collections.Counter(), threading.Lock()

    def counted(response):  # the test's own count of what it sent, by route and status
        with lock:
            tally[(ROUTES[response.request.url.path], str(response.status_code))] += 1

    def client():
        return httpx.Client(timeout=120, event_hooks={'response': [counted]})

    http = client()
    before = _scrape(url, http)
    runs_before = len(gate.runs())
    for name in ('q0', 'q1'):
        assert post_image(url, images[name], client=http).status_code == 200
    assert post_image(url, images['q0'], client=http, format='xml').status_code == 400
    assert http.get(f'{url}/nothing').status_code == 404
    tensor = triton_image(triton, cv2.imread(images['q2']))
    triton.InferenceServerClient(url.split('//')[1]).infer('psanet', [tensor])
    tally[('/v2/models/{model_name}/infer', '200')] += 1
    # The queue full once (503) and a deadline passed in it once (504).
    gate.close()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        try:
            base = gate.entered()

            def send(name, **kw):
                with client() as own:
                    return post_image(url, images[name], client=own, **kw)
            post = lambda name, **kw: pool.submit(send, name, **kw)  # noqa: E731
            jobs = [post('q0')]
            gate.wait_entered(base + 1)
            for i in (1, 2, 3):
                jobs.append(post(f'q{i}'))
                _wait_stats(url, http, waiting=i)
            late = post('late0', headers={'X-Request-Timeout-S': '0.5'})
            assert late.result().status_code == 504
            jobs.append(post('q4'))
            _wait_stats(url, http, waiting=4)
            assert post_image(url, images['q5'], client=http).status_code == 503
        finally:
            gate.open()
        assert [job.result().status_code for job in jobs] == [200] * 5
    _wait_stats(url, http, in_flight=0, waiting=0)
    after = _scrape(url)  # not counted: it is the reading
    sizes = [shape[0] for shape in gate.runs()[runs_before:]]
    assert sizes == [1, 1, 1, 1, 2, 1, 1]

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    requests = {dict(k[1])['route']: 0 for k in after if k[0] == 'psanet_requests_total'}
    for key in after:
        if key[0] == 'psanet_requests_total':
            labels = dict(key[1])
            assert delta(key[0], **labels) == tally[(labels['route'], labels['status'])], key
            requests[labels['route']] += tally[(labels['route'], labels['status'])]
    assert set(tally) <= {(dict(k[1])['route'], dict(k[1])['status'])
                          for k in after if k[0] == 'psanet_requests_total'}
    for route, count in requests.items():
        assert delta('psanet_request_duration_seconds_count', route=route) == count, route
    assert delta('psanet_model_run_seconds_count') == len(sizes)
    assert delta('psanet_batch_size_count') == len(sizes)
    assert delta('psanet_batch_size_sum') == sum(sizes)
    assert delta('psanet_batch_size_bucket', le='1.0') == sizes.count(1)
    assert delta('psanet_batch_size_bucket', le='2.0') == len(sizes)
    assert delta('psanet_queue_wait_seconds_count') == sum(sizes)
    assert delta('psanet_rejected_total', reason='queue_full') == 1
    assert delta('psanet_rejected_total', reason='stopping') == 0
    assert delta('psanet_timed_out_total') == 1
    assert after[('psanet_queue_depth', ())] == 0
    assert after[('psanet_in_flight_requests', ())] == 0
    info = [dict(k[1]) for k in after if k[0] == 'psanet_model_info']
    from psanet.deploy.deploy_config import DeployConfig
    deploy = DeployConfig(mini_export)
    digest = hashlib.sha256()
    for path in (deploy.path, deploy.model, deploy.params):
        with open(path, 'rb') as f:
            digest.update(f.read())
    assert info == [{'backend': 'paddle', 'config': deploy.path, 'model_name': 'psanet',
                     'export_hash': digest.hexdigest()[:16]}]


def test_sigterm_during_a_held_run_answers_503_at_the_bound_and_exits_0(started, gated,
                                                                         images):
    """The run never ends (the gate stays closed): at --graceful_timeout_s it and the queue get
    503, the worker is killed, and the server exits 0 within the bound (the module's last use
    of its server)."""
    process, url, gate, log = started
    base = gate.entered()
    gate.close()
    bound_s = DRAIN_GRACE_S + DRAIN_BACKSTOP_S + END_GRACE_S
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        try:
            running = pool.submit(post_image, url, images['q0'])
            gate.wait_entered(base + 1)
            queued = [pool.submit(post_image, url, images[f'q{i}']) for i in (1, 2)]
            _wait_stats(url, waiting=2)
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            answers = [f.result(timeout=bound_s + 10) for f in (running, *queued)]
            refused_after = time.monotonic() - signalled
            assert_refused(answers[0], 503, 'stopping', 'run did not end', 'abandoned',
                           '--graceful_timeout_s')
            for answer in answers[1:]:
                assert_refused(answer, 503, 'stopping', 'did not reach', '--graceful_timeout_s')
            assert refused_after > DRAIN_GRACE_S - 0.5, refused_after
            with pytest.raises(httpx.TransportError):  # no new connection taken
                httpx.get(f'{url}/health', timeout=5)
            finish(process, timeout=bound_s + 10)
        finally:
            gate.open()
    assert process.returncode == 0, read_text(log)
    assert 'the model worker is killed' in read_text(log)
    assert 'Traceback' not in read_text(log)


@pytest.fixture(scope='module')
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and its key, made by the openssl command."""
    if shutil.which('openssl') is None:
        pytest.skip('no openssl command (apt-get install openssl)')
    root = tmp_path_factory.mktemp('tls')
    cert, key = str(root / 'cert.pem'), str(root / 'key.pem')
    run_process(['openssl', 'req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-keyout', key,
                 '-out', cert, '-days', '2', '-subj', '/CN=127.0.0.1', '-addext',
                 'subjectAltName=IP:127.0.0.1'], check=True, capture_output=True, timeout=120)
    return cert, key


def test_tls_and_the_bearer_token(mini_export, certificate, images, seg, tmp_path):
    import tritonclient.http as triton
    cert, key = certificate
    token_file = tmp_path / 'token'
    token_file.write_text('s3cret-token\n')
    gate = Gate(tmp_path / 'gate')
    flags = _server_flags(mini_export, '--auth_token_file', token_file, '--ssl_certfile', cert,
                          '--ssl_keyfile', key, '--request_timeout_s', 1, '--max_wait_ms', 0)
    patient = {'X-Request-Timeout-S': '600'}  # the others are not cut by a slow machine
    trusted = ssl.create_default_context(cafile=cert)
    with running_server(flags, tmp_path / 'serve.log', gate=gate, scheme='https',
                        verify=trusted) as (_, url):
        https = httpx.Client(verify=trusted, timeout=120)
        assert https.get(f'{url}/health').json() == {'status': 'ok'}
        assert https.get(f'{url}/ready').status_code == 200
        assert https.get(f'{url}/explorer/').status_code == 200
        with pytest.raises(httpx.TransportError):  # plain HTTP
            httpx.get(url.replace('https', 'http') + '/health', timeout=10)
        with pytest.raises(httpx.ConnectError):  # the certificate is not a system CA's
            httpx.get(f'{url}/health', timeout=10)
        assert_refused(post_image(url, images['q0'], client=https), 401, 'no token',
                       'Authorization: Bearer')
        wrong = post_image(url, images['q0'], client=https,
                           headers={'Authorization': 'Bearer s3cret-tokem'})
        assert_refused(wrong, 401, 'wrong token')
        assert wrong.headers['www-authenticate'] == 'Bearer'
        for route in ('/metrics', '/v1/model', '/v1/stats', '/v2/models/psanet'):
            assert https.get(f'{url}{route}').status_code == 401, route
        auth = {'Authorization': 'Bearer s3cret-token', **patient}
        answer = post_image(url, images['q0'], client=https, headers=auth)
        assert np.array_equal(png_labels(answer)[0], seg(images['q0']))
        assert https.get(f'{url}/metrics', headers=auth).status_code == 200
        client = triton.InferenceServerClient(url.split('//')[1], ssl=True,
                                              ssl_options={'ca_certs': cert})
        image = cv2.imread(images['q1'])
        tensor = triton_image(triton, image)
        label = client.infer('psanet', [tensor], headers=dict(auth),  # it adds its own to it
                             timeout=600_000_000).as_numpy('class_map')
        assert np.array_equal(label, seg(image))
        # --request_timeout_s 1: a request queued behind a held run for longer gets 504.
        base = gate.entered()
        gate.close()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            try:
                first = pool.submit(post_image, url, images['q0'], client=https, headers=auth)
                gate.wait_entered(base + 1)
                late = post_image(url, images['late0'], client=https,
                                  headers={'Authorization': auth['Authorization']})
            finally:
                gate.open()
            assert_refused(late, 504, '--request_timeout_s')
            assert np.array_equal(png_labels(first.result())[0], seg(images['q0']))


def _serve_main(argv, monkeypatch, capsys):
    """serve.main(argv) in this process with the model load replaced by a failure: ``(exit
    code, stderr)`` of a start refused before anything loads."""
    import serve
    from psanet.serve.worker import ModelWorker

    def load(*args, **kwargs):
        raise AssertionError('the model loaded before the flags were checked')
    monkeypatch.setattr(ModelWorker, 'start', load)
    code = serve.main([str(a) for a in argv])
    return code, capsys.readouterr().err


@pytest.fixture(scope='module')
def bad_files(tmp_path_factory, mini_export):
    root = tmp_path_factory.mktemp('bad_files')
    files = {'empty.yml': b'', 'binary.yml': bytes(range(256)) * 4,
             'broken.yml': b'model:\n  type: PSANet\n   num_classes: [19\n',
             'list.yml': b'- a\n- b\n', 'other.yml': b'dataset: x\nbatch: 2\n',
             'empty_token': b'\n', 'two_tokens': b'one two\n', 'not_pem.pem': b'hello\n'}
    paths = {}
    for name, data in files.items():
        (root / name).write_bytes(data)
        paths[name] = str(root / name)
    (root / 'folder').mkdir()
    paths['folder'] = str(root / 'folder')
    paths['export'] = mini_export
    return paths


MINI = os.path.join(ROOT, 'configs', 'psanet')


@pytest.mark.parametrize('flags, words', [
    (['--max_wait_ms', 'inf'], ['--max_wait_ms', 'finite', 'got inf']),
    (['--max_wait_ms', 'nan'], ['--max_wait_ms', 'got nan']),
    (['--max_wait_ms', '-1'], ['--max_wait_ms', 'from 0 to 60000']),
    (['--max_wait_ms', '60001'], ['--max_wait_ms', 'from 0 to 60000']),
    (['--port', '70000'], ['--port', 'from 1 to 65535', 'got 70000']),
    (['--port', '0'], ['--port', 'from 1 to 65535']),
    (['--max_batch', '0'], ['--max_batch', 'from 1']),
    (['--max_queue', '0'], ['--max_queue', 'from 1']),
    (['--max_body_bytes', '0'], ['--max_body_bytes']),
    (['--max_pixels', '0'], ['--max_pixels']),
    (['--graceful_timeout_s', '-1'], ['--graceful_timeout_s', 'from 0 to 3600']),
    (['--request_timeout_s', 'inf'], ['--request_timeout_s', 'finite']),
    (['--request_timeout_s', '0'], ['--request_timeout_s']),
    (['--request_timeout_s', 'nan'], ['--request_timeout_s']),
    (['--cpu_threads', '0'], ['--cpu_threads']),
    (['--warmup_size', '0', '10'], ['--warmup_size']),
    (['--warmup_size', '3000', '3000'], ['--warmup_size', '--max_pixels']),
    (['--model_name', 'a/b'], ['--model_name']),
    (['--ssl_certfile', 'cert.pem'], ['--ssl_certfile and --ssl_keyfile go together']),
    (['--host', 'not a host'], ['--host not a host', 'does not resolve']),
    (['--host', 'a..b'], ['--host a..b', 'does not resolve']),
    (['--host', '192.0.2.1'], ['192.0.2.1', 'not an address of this machine']),  # bound only
])
def test_a_bad_number_or_address_is_one_line_before_the_model_loads(flags, words, bad_files,
                                                                    monkeypatch, capsys):
    code, err = _serve_main(['--config', bad_files['export'], *flags], monkeypatch, capsys)
    lines = [line for line in err.splitlines() if line.startswith('error:')]
    assert code == 2 and len(lines) == 1 and 'Traceback' not in err, err
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize('config, flags, words', [
    ('empty.yml', [], ['is empty']),
    ('binary.yml', [], ['is not text', 'binary']),
    ('broken.yml', [], ['is not valid YAML', 'line 3']),
    ('list.yml', [], ['neither', 'a list']),
    ('other.yml', [], ['neither', "'batch'"]),
    ('folder', [], ['folder without a deploy.yaml']),
    ('missing.yml', [], ['does not exist']),
    ('export', ['--model_path', 'w.pdparams'], ['is an export', 'leave out --model_path']),
    ('training', [], ['training config', '--model_path']),
    ('training', ['--model_path', 'w.pdparams', '--backend', 'onnxruntime'],
     ['--backend, --int8 and --cpu_threads']),
    ('export', ['--auth_token_file', 'no_such_token'], ['--auth_token_file', 'cannot be read']),
    ('export', ['--auth_token_file', 'empty_token'], ['one token', 'holds nothing']),
    ('export', ['--auth_token_file', 'two_tokens'], ['one token', 'more than that']),
    ('export', ['--ssl_certfile', 'not_pem.pem', '--ssl_keyfile', 'not_pem.pem'],
     ['do not load as a certificate']),
    ('export', ['--ssl_certfile', 'no_such.pem', '--ssl_keyfile', 'not_pem.pem'],
     ['--ssl_certfile', 'does not exist']),
])
def test_a_bad_config_or_file_is_named_before_the_model_loads(config, flags, words, bad_files,
                                                               monkeypatch, capsys, tmp_path):
    import glob
    training, = glob.glob(os.path.join(MINI, '*mini*.yml'))
    path = {'training': training, 'missing.yml': str(tmp_path / 'missing.yml')}.get(
        config, bad_files.get(config))
    flags = [bad_files.get(f, f) if not f.startswith('--') else f for f in flags]
    code, err = _serve_main(['--config', path, *flags], monkeypatch, capsys)
    lines = [line for line in err.splitlines() if line.startswith('error:')]
    assert code == 2 and len(lines) == 1 and 'Traceback' not in err, err
    for word in words:
        assert word in lines[0], lines[0]


def test_a_port_in_use_is_named_before_the_model_loads(bad_files, monkeypatch, capsys):
    import socket
    with socket.socket() as taken:
        taken.bind(('127.0.0.1', 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = _serve_main(['--config', bad_files['export'], '--port', port], monkeypatch,
                                capsys)
    assert code == 2 and f'port {port} is in use on 127.0.0.1' in err, err


def test_without_the_server_packages_one_line_names_the_pip_command(mini_export):
    hide = ("import runpy, sys; sys.modules['starlette'] = None; sys.argv = ['serve.py', "
            f"'--config', {mini_export!r}, '--port', '{free_port()}']; "
            f"runpy.run_path({SERVE_SCRIPT!r}, run_name='__main__')")
    done = run_process([sys.executable, '-c', hide], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == ['error: serve.py needs starlette, not installed here: pip install -r '
                     'requirements-serve.txt'], done.stderr


def test_the_server_checks_its_config_without_paddle():
    done = run_process([sys.executable, '-c', (
        'import sys; from psanet.serve.served_model import config_kind; '
        'from psanet.serve.startup import ServeOptions, bind; '
        'print(sorted(m for m in sys.modules if m.split(".")[0] in ("paddle", "paddleseg")))')],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.stdout.strip() == '[]', done.stdout + done.stderr
