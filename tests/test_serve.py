"""serve.py as a user starts it: its class maps against psanet.Segmenter called directly (byte
for byte), dynamic batching against the dygraph model's logits, the model's contract on GET,
every bad request a 4xx with one line of JSON and the next request served, the queue full
(503 + Retry-After), a client that hangs up, and SIGTERM under load (every accepted request
answered, exit 0)."""
import concurrent.futures
import io
import json
import os
import signal
import socket
import sys
import time

import cv2
import httpx
import numpy as np
import pytest
from PIL import Image

from psanet import Segmenter
from conftest import (MINI_CONFIG, MINI_PSANET_RTOL, ROOT, assert_logits_agree, finish, read_text,
                      run_process)
from serve_helpers import SERVE_SCRIPT, running_server

MAX_BODY, MAX_PIXELS = 3_000_000, 700_000
# width, height: two of one size, another size, one with a resize-free odd size.
SIZES = [(96, 64), (96, 64), (128, 64), (75, 41)]
BIG = (480, 320)  # under MAX_PIXELS; its run takes long enough to fill the queue


def _image(rng, size):
    small = rng.randint(0, 256, (4, 6, 3)).astype('uint8')
    return cv2.resize(small, size, interpolation=cv2.INTER_CUBIC)


@pytest.fixture(scope='module')
def images(tmp_path_factory):
    """Image files: PNGs of SIZES, a JPEG, a grey PNG, an RGBA PNG, and a big PNG."""
    root = tmp_path_factory.mktemp('serve_images')
    rng = np.random.RandomState(0)
    paths = []
    for i, size in enumerate(SIZES):
        paths.append(str(root / f'image{i}.png'))
        cv2.imwrite(paths[-1], _image(rng, size))
    paths.append(str(root / 'photo.jpg'))
    cv2.imwrite(paths[-1], _image(rng, (96, 64)), [cv2.IMWRITE_JPEG_QUALITY, 90])
    paths.append(str(root / 'grey.png'))
    cv2.imwrite(paths[-1], cv2.cvtColor(_image(rng, (64, 48)), cv2.COLOR_BGR2GRAY))
    paths.append(str(root / 'rgba.png'))
    Image.fromarray(np.dstack([_image(rng, (64, 48)), np.full((48, 64), 200, np.uint8)]),
                    'RGBA').save(paths[-1])
    big = str(root / 'big.png')
    cv2.imwrite(big, _image(rng, BIG))
    return paths, big


@pytest.fixture(scope='module')
def export_server(mini_export, tmp_path_factory):
    log = tmp_path_factory.mktemp('export_server') / 'serve.log'
    with running_server(['--config', mini_export, '--backend', 'paddle', '--cpu_threads', 1,
                         '--max_batch', 4, '--max_wait_ms', 30, '--max_queue', 2,
                         '--max_body_bytes', MAX_BODY, '--max_pixels', MAX_PIXELS], log) as (
            process, url):
        yield process, url, str(log)


def _post(url, path, content_type='image/png', **params):
    with open(path, 'rb') as f:
        return httpx.post(f'{url}/v1/segment', content=f.read(), params=params, timeout=120,
                          headers={'Content-Type': content_type})


def _png_labels(response):
    assert response.status_code == 200, response.text
    assert response.headers['content-type'] == 'image/png'
    with Image.open(io.BytesIO(response.content)) as png:
        assert png.mode == 'P'
        return np.asarray(png), png.getpalette()


def _cityscapes_palette():
    from cityscapesscripts.helpers.labels import trainId2label
    return [list(trainId2label[i].color) for i in range(19)]


def test_the_class_maps_are_the_segmenters_byte_for_byte(export_server, mini_export, images):
    _, url, _ = export_server
    paths, _ = images
    seg = Segmenter.from_export(mini_export, backend='paddle', cpu_threads=1)
    for path in paths:
        want = seg(path)
        content_type = 'image/jpeg' if path.endswith('.jpg') else 'image/png'
        labels, palette = _png_labels(_post(url, path, content_type))
        assert labels.dtype == np.uint8 and labels.shape == want.shape, path
        assert np.array_equal(labels, want), path
        assert [palette[3 * i:3 * i + 3] for i in range(19)] == _cityscapes_palette()
        with open(path, 'rb') as f:  # multipart, as curl -F image=@file sends it
            multipart = httpx.post(f'{url}/v1/segment', files={'image': f}, timeout=120)
        assert np.array_equal(_png_labels(multipart)[0], want), path
        answer = _post(url, path, 'application/octet-stream', format='json').json()
        assert answer['shape'] == list(want.shape)
        assert np.array_equal(np.array(answer['class_ids'], np.uint8), want), path
        ids, counts = np.unique(want, return_counts=True)
        assert [(c['id'], c['pixels']) for c in answer['counts']] == list(zip(ids.tolist(),
                                                                               counts.tolist()))


def test_get_says_the_classes_palette_contract_health_and_schema(export_server, mini_export):
    _, url, _ = export_server
    from cityscapesscripts.helpers.labels import trainId2label
    info = httpx.get(f'{url}/v1/model').json()
    assert info['num_classes'] == 19 and info['backend'] == 'paddle'
    assert [c['name'] for c in info['classes']] == [trainId2label[i].name for i in range(19)]
    assert [c['color'] for c in info['classes']] == _cityscapes_palette()
    assert info['input']['max_body_bytes'] == MAX_BODY
    assert info['input']['max_pixels'] == MAX_PIXELS
    assert info['explorer'] is False
    assert httpx.get(f'{url}/health').json() == {'status': 'ok'}
    assert httpx.get(f'{url}/ready').status_code == 200
    schema = httpx.get(f'{url}/openapi.json').json()
    assert {'/v1/segment', '/v1/model', '/health', '/ready'} <= set(schema['paths'])
    assert 'image/png' in schema['paths']['/v1/segment']['post']['requestBody']['content']


def _assert_refused(response, status, *words):
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers['content-type'] == 'application/json'
    assert '\n' not in response.text and 'Traceback' not in response.text
    message = response.json()['error']
    for word in words:
        assert word in message, message
    return message


def _raw_request(url, head, body=b''):
    port = int(url.rsplit(':', 1)[1])
    sock = socket.create_connection(('127.0.0.1', port), timeout=60)
    sock.sendall(head.encode() + b'\r\n\r\n' + body)
    return sock


def _read_response(sock):
    data = b''
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return data
        data += chunk


def test_bad_requests_get_one_line_4xx_and_the_next_is_served(export_server, images, tmp_path):
    process, url, log = export_server
    paths, _ = images
    with open(paths[0], 'rb') as f:
        png = f.read()
    with open(paths[4], 'rb') as f:
        jpeg = f.read()
    segment = f'{url}/v1/segment'
    post = lambda data, kind='image/png', **kw: httpx.post(  # noqa: E731
        segment, content=data, headers={'Content-Type': kind} if kind else {}, timeout=60, **kw)
    _assert_refused(post(b'plain text, not pixels'), 400, 'not an image')
    _assert_refused(post(png[:len(png) // 2]), 400, 'truncated')
    _assert_refused(post(jpeg[:len(jpeg) // 2], 'image/jpeg'), 400, 'truncated')
    _assert_refused(post(png, 'application/json'), 415, 'application/json', 'image/png')
    _assert_refused(post(png, None), 415, 'Content-Type')
    _assert_refused(post(b''), 400, 'empty')
    _assert_refused(httpx.post(segment, files={'picture': png}, timeout=60), 400, '"image"')
    _assert_refused(post(png, params={'format': 'xml'}), 400, 'format=json')
    _assert_refused(post(b'\0' * (MAX_BODY + 1)), 413, str(MAX_BODY), '--max_body_bytes')
    chunks = iter([b'\0' * 1_000_000] * 4)  # chunked: no Content-Length to refuse it by
    _assert_refused(post(chunks), 413, str(MAX_BODY))
    wide = tmp_path / 'wide.png'
    cv2.imwrite(str(wide), np.zeros((800, 1000, 3), np.uint8))  # 800000 pixels, small file
    _assert_refused(_post(url, wide), 413, '1000x800', str(MAX_PIXELS), '--max_pixels')
    _assert_refused(httpx.get(f'{url}/nothing'), 404)
    _assert_refused(httpx.post(f'{url}/v1/explore', content=png,
                               headers={'Content-Type': 'image/png'}), 409, '--model_path')
    # Clients that hang up: half a body, and a whole request whose answer nobody reads.
    _raw_request(url, f'POST /v1/segment HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n'
                      f'Content-Length: {len(png)}', png[:100]).close()
    _raw_request(url, f'POST /v1/segment HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n'
                      f'Content-Length: {len(png)}', png).close()
    want = _png_labels(_post(url, paths[0]))[0]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: _post(url, paths[0]), range(2)))
    for answer in answers:
        assert np.array_equal(_png_labels(answer)[0], want)
    assert process.poll() is None
    assert 'Traceback' not in read_text(log)


class _RawAnswer:
    """An HTTP/1.1 answer read whole from a socket, as far as the tests look at it."""

    def __init__(self, data):
        head, _, self.content = data.partition(b'\r\n\r\n')
        lines = head.decode('latin-1').split('\r\n')
        self.status_code = int(lines[0].split()[1])
        self.headers = {k.strip().lower(): v.strip()
                        for k, _, v in (line.partition(':') for line in lines[1:])}
        self.text = self.content.decode('utf-8', 'replace')

    def json(self):
        return json.loads(self.content)


def _send_at_once(url, paths):
    """Sockets with a POST of each file sent: all connected first, then all sent within
    milliseconds (far less than one run takes)."""
    port = int(url.rsplit(':', 1)[1])
    sockets = [socket.create_connection(('127.0.0.1', port), timeout=120) for _ in paths]
    for sock, path in zip(sockets, paths):
        with open(path, 'rb') as f:
            body = f.read()
        sock.sendall(f'POST /v1/segment HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n'
                     f'Connection: close\r\nContent-Length: {len(body)}\r\n\r\n'.encode() + body)
    return sockets


def _answers(sockets):
    answers = []
    for sock in sockets:
        answers.append(_RawAnswer(_read_response(sock)))
        sock.close()
    return answers


def _sent_at_once(url, paths):
    return _answers(_send_at_once(url, paths))


def test_a_full_queue_answers_503_with_retry_after(export_server, images):
    _, url, _ = export_server
    paths, big = images
    answers = _sent_at_once(url, [big] * 12)
    refused = [a for a in answers if a.status_code == 503]
    served = [a for a in answers if a.status_code == 200]
    # At most max_batch (4) taken into a run and max_queue (2) waiting at any time.
    assert refused and len(refused) + len(served) == len(answers), [a.status_code
                                                                    for a in answers]
    for answer in refused:
        _assert_refused(answer, 503, '--max_queue')
        assert answer.headers['retry-after'] == '1'
    labels = [_png_labels(a)[0] for a in served]
    assert all(np.array_equal(label, labels[0]) for label in labels)
    assert _post(url, paths[0]).status_code == 200


@pytest.mark.parametrize('waiting', range(0, 20))
def test_a_group_runs_in_powers_of_two_longest_first_in_order(waiting):
    from psanet.serve.batcher import power_of_two_runs
    runs = power_of_two_runs(list(range(waiting)))
    bits = [1 << b for b in reversed(range(waiting.bit_length())) if waiting >> b & 1]
    assert [len(run) for run in runs] == bits
    assert [item for run in runs for item in run] == list(range(waiting))


def test_concurrent_requests_of_one_size_share_runs(mini_model_server, images):
    from engine_helpers import dygraph_logits, mini_psanet_for_eval
    url, _ = mini_model_server
    paths, _ = images
    model = mini_psanet_for_eval(seed=1)  # the weights the server loaded
    batch = [paths[i % 2] for i in range(8)] + [paths[2]] * 4  # two sizes
    before = httpx.get(f'{url}/v1/stats').json()['runs_by_batch_size']
    answers = _sent_at_once(url, batch)
    after = httpx.get(f'{url}/v1/stats').json()['runs_by_batch_size']
    shared = {int(n): after.get(n, 0) - before.get(n, 0) for n in after}
    assert sum(n * runs for n, runs in shared.items()) == len(batch), shared
    assert any(n > 1 and runs for n, runs in shared.items()), shared
    assert all(n & (n - 1) == 0 for n, runs in shared.items() if runs), shared  # 1, 2, 4, 8
    assert max(int(a.headers['x-batch-size']) for a in answers) > 1
    for path, answer in zip(batch, answers):  # a batch adds its sums in another order
        assert_logits_agree(_png_labels(answer)[0], dygraph_logits(model, path),
                            MINI_PSANET_RTOL, path, class_axis=0)


def test_the_model_server_answers_as_the_dygraph_segmenter(mini_model_server, mini_weights,
                                                           images):
    url, _ = mini_model_server
    paths, _ = images
    seg = Segmenter.from_config(MINI_CONFIG, mini_weights, backend='dygraph')
    for path in paths[2:5]:
        content_type = 'image/jpeg' if path.endswith('.jpg') else 'image/png'
        assert np.array_equal(_png_labels(_post(url, path, content_type))[0], seg(path)), path
    assert httpx.get(f'{url}/v1/model').json()['explorer'] is True


def test_sigterm_answers_every_accepted_request_and_exits_0(mini_export, images, tmp_path):
    paths, big = images
    seg = Segmenter.from_export(mini_export, backend='paddle', cpu_threads=1)
    sizes = [big, paths[0]] * 4  # the big ones keep the model busy while all are read
    # One image a run: the answers are then Segmenter(path)'s, byte for byte.
    with running_server(['--config', mini_export, '--backend', 'paddle', '--cpu_threads', 1,
                         '--max_batch', 1, '--graceful_timeout_s', 60],
                        tmp_path / 'serve.log') as (process, url):
        sockets = _send_at_once(url, sizes)
        deadline = time.monotonic() + 60
        while httpx.get(f'{url}/v1/stats').json()['in_flight'] < len(sockets):
            assert time.monotonic() < deadline, 'the server did not read every request'
            time.sleep(0.02)  # until every request is read by the server: accepted
        process.send_signal(signal.SIGTERM)
        for answer, path in zip(_answers(sockets), sizes):
            assert np.array_equal(_png_labels(answer)[0], seg(path)), path
        finish(process, timeout=60)
        assert process.returncode == 0, read_text(tmp_path / 'serve.log')
    with pytest.raises(httpx.TransportError):
        httpx.get(f'{url}/health', timeout=5)
    assert 'Traceback' not in read_text(tmp_path / 'serve.log')


@pytest.mark.parametrize('flags, words', [
    (['--config', 'no/such/deploy.yaml'], ['no/such/deploy.yaml', 'does not exist']),
    (['--config', MINI_CONFIG], ['training config', '--model_path']),
    (['--config', MINI_CONFIG, '--max_batch', '0'], ['--max_batch must be >= 1']),
])
def test_a_wrong_start_is_one_error_line_and_exit_2(flags, words):
    done = run_process([sys.executable, SERVE_SCRIPT, *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith('error:')]
    assert len(lines) == 1 and 'Traceback' not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0]


@pytest.fixture(scope='module')
def onnx_export(mini_weights, tmp_path_factory):
    """deploy.yaml of the mini PSANet exported for the ONNX backends, with its INT8 model."""
    from conftest import onnx_tools_missing
    missing = onnx_tools_missing()
    if missing:
        pytest.skip(missing)
    from psanet.export import export_from_config
    root = tmp_path_factory.mktemp('serve_onnx')
    calib = root / 'calib'
    calib.mkdir()
    rng = np.random.RandomState(3)
    for i in range(3):
        cv2.imwrite(str(calib / f'{i}.png'), _image(rng, (96, 64)))
    return export_from_config(MINI_CONFIG, mini_weights, str(root / 'export'),
                              output_op='none', psa_impl='paddle', onnx=True,
                              quantize='int8', calib_images=str(calib), calib_num=3)


@pytest.mark.parametrize('backend, int8', [('onnxruntime', True), ('onnxruntime', False),
                                           ('openvino', True)])
def test_an_onnx_export_is_served_in_its_backend_as_the_segmenter_runs_it(
        onnx_export, images, tmp_path, backend, int8):
    import importlib.util
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f'{backend} is not installed (pip install {backend})')
    paths, _ = images
    seg = Segmenter.from_export(onnx_export, backend=backend, int8=int8, cpu_threads=1)
    flags = ['--config', onnx_export, '--backend', backend, '--cpu_threads', 1,
             '--max_batch', 1] + (['--int8'] if int8 else [])
    with running_server(flags, tmp_path / 'serve.log') as (_, url):
        model = httpx.get(f'{url}/v1/model').json()
        assert model['backend'] == backend
        for path in paths[:3]:
            assert np.array_equal(_png_labels(_post(url, path))[0], seg(path)), path
