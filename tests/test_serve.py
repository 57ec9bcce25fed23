"""serve.py as a user starts it: its class maps against psanet.Segmenter called directly (byte
for byte), over /v1/segment and over the Open Inference Protocol with Triton's own client
(tritonclient), dynamic batching against the dygraph model's logits, the model's contract on
GET, every bad request a 4xx with one line of JSON and the next request served, the queue full
(503 + Retry-After), deadlines on the real model (504, never run), a client that hangs up, and
SIGTERM under load (every accepted request answered, exit 0). tests/test_serve_ops.py holds
the operational checks with a stand-in for a slow backend."""
import concurrent.futures
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
from serve_helpers import (SERVE_SCRIPT, assert_refused, make_image, png_labels, post_image,
                           running_server, triton_image)

MAX_BODY, MAX_PIXELS = 3_000_000, 700_000
# width, height: two of one size, another size, one with a resize-free odd size.
SIZES = [(96, 64), (96, 64), (128, 64), (75, 41)]
BIG = (480, 320)  # under MAX_PIXELS; its run takes long enough to fill the queue


@pytest.fixture(scope='module')
def images(tmp_path_factory):
    """Image files: PNGs of SIZES, a JPEG, a grey PNG, an RGBA PNG, and a big PNG."""
    root = tmp_path_factory.mktemp('serve_images')
    rng = np.random.RandomState(0)
    paths = []
    for i, size in enumerate(SIZES):
        paths.append(str(root / f'image{i}.png'))
        cv2.imwrite(paths[-1], make_image(rng, size))
    paths.append(str(root / 'photo.jpg'))
    cv2.imwrite(paths[-1], make_image(rng, (96, 64)), [cv2.IMWRITE_JPEG_QUALITY, 90])
    paths.append(str(root / 'grey.png'))
    cv2.imwrite(paths[-1], cv2.cvtColor(make_image(rng, (64, 48)), cv2.COLOR_BGR2GRAY))
    paths.append(str(root / 'rgba.png'))
    Image.fromarray(np.dstack([make_image(rng, (64, 48)), np.full((48, 64), 200, np.uint8)]),
                    'RGBA').save(paths[-1])
    big = str(root / 'big.png')
    cv2.imwrite(big, make_image(rng, BIG))
    return paths, big


@pytest.fixture(scope='module')
def export_server(mini_export, tmp_path_factory):
    log = tmp_path_factory.mktemp('export_server') / 'serve.log'
    with running_server(['--config', mini_export, '--backend', 'paddle', '--cpu_threads', 1,
                         '--max_batch', 4, '--max_wait_ms', 30, '--max_queue', 2,
                         '--max_body_bytes', MAX_BODY, '--max_pixels', MAX_PIXELS], log) as (
            process, url):
        yield process, url, str(log)


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
        labels, palette = png_labels(post_image(url, path, content_type))
        assert labels.dtype == np.uint8 and labels.shape == want.shape, path
        assert np.array_equal(labels, want), path
        assert [palette[3 * i:3 * i + 3] for i in range(19)] == _cityscapes_palette()
        with open(path, 'rb') as f:  # multipart, as curl -F image=@file sends it
            multipart = httpx.post(f'{url}/v1/segment', files={'image': f}, timeout=120)
        assert np.array_equal(png_labels(multipart)[0], want), path
        answer = post_image(url, path, 'application/octet-stream', format='json').json()
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
    assert_refused(post(b'plain text, not pixels'), 400, 'not an image')
    assert_refused(post(png[:len(png) // 2]), 400, 'truncated')
    assert_refused(post(jpeg[:len(jpeg) // 2], 'image/jpeg'), 400, 'truncated')
    assert_refused(post(png, 'application/json'), 415, 'application/json', 'image/png')
    assert_refused(post(png, None), 415, 'Content-Type')
    assert_refused(post(b''), 400, 'empty')
    assert_refused(httpx.post(segment, files={'picture': png}, timeout=60), 400, '"image"')
    assert_refused(post(png, params={'format': 'xml'}), 400, 'format=json')
    assert_refused(post(b'\0' * (MAX_BODY + 1)), 413, str(MAX_BODY), '--max_body_bytes')
    chunks = iter([b'\0' * 1_000_000] * 4)  # chunked: no Content-Length to refuse it by
    assert_refused(post(chunks), 413, str(MAX_BODY))
    wide = tmp_path / 'wide.png'
    cv2.imwrite(str(wide), np.zeros((800, 1000, 3), np.uint8))  # 800000 pixels, small file
    assert_refused(post_image(url, wide), 413, '1000x800', str(MAX_PIXELS), '--max_pixels')
    assert_refused(httpx.get(f'{url}/nothing'), 404)
    assert_refused(httpx.post(f'{url}/v1/explore', content=png,
                               headers={'Content-Type': 'image/png'}), 409, '--model_path')
    # Clients that hang up: half a body, and a whole request whose answer nobody reads.
    _raw_request(url, f'POST /v1/segment HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n'
                      f'Content-Length: {len(png)}', png[:100]).close()
    _raw_request(url, f'POST /v1/segment HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n'
                      f'Content-Length: {len(png)}', png).close()
    want = png_labels(post_image(url, paths[0]))[0]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: post_image(url, paths[0]), range(2)))
    for answer in answers:
        assert np.array_equal(png_labels(answer)[0], want)
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
        assert_refused(answer, 503, '--max_queue')
        assert answer.headers['retry-after'] == '1'
    labels = [png_labels(a)[0] for a in served]
    assert all(np.array_equal(label, labels[0]) for label in labels)
    assert post_image(url, paths[0]).status_code == 200


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
        assert_logits_agree(png_labels(answer)[0], dygraph_logits(model, path),
                            MINI_PSANET_RTOL, path, class_axis=0)


def test_the_model_server_answers_as_the_dygraph_segmenter(mini_model_server, mini_weights,
                                                           images):
    url, _ = mini_model_server
    paths, _ = images
    seg = Segmenter.from_config(MINI_CONFIG, mini_weights, backend='dygraph')
    for path in paths[2:5]:
        content_type = 'image/jpeg' if path.endswith('.jpg') else 'image/png'
        assert np.array_equal(png_labels(post_image(url, path, content_type))[0], seg(path)), path
    assert httpx.get(f'{url}/v1/model').json()['explorer'] is True


def test_sigterm_answers_every_accepted_request_and_exits_0(mini_export, images, tmp_path):
    paths, big = images
    seg = Segmenter.from_export(mini_export, backend='paddle', cpu_threads=1)
    sizes = [big, paths[0], paths[1], big, paths[0], paths[1]]  # the big ones: a queue
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
            assert np.array_equal(png_labels(answer)[0], seg(path)), path
        finish(process, timeout=60)
        assert process.returncode == 0, read_text(tmp_path / 'serve.log')
    with pytest.raises(httpx.TransportError):
        httpx.get(f'{url}/health', timeout=5)
    assert 'Traceback' not in read_text(tmp_path / 'serve.log')


def test_a_wrong_start_is_one_error_line_and_exit_2():
    # One start as a user runs it; test_serve_ops checks every other flag in-process.
    flags = ['--config', 'no/such/deploy.yaml']
    words = ['no/such/deploy.yaml', 'does not exist']
    done = run_process([sys.executable, SERVE_SCRIPT, *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith('error:')]
    assert len(lines) == 1 and 'Traceback' not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0]


def _triton(url):
    import tritonclient.http as triton
    return triton, triton.InferenceServerClient(url.split('//')[1], network_timeout=120)


@pytest.fixture(scope='module')
def export_seg(mini_export):
    """The Segmenter of the export the export server runs, run as it runs it."""
    return Segmenter.from_export(mini_export, backend='paddle', cpu_threads=1)


def test_the_open_inference_protocol_answers_as_the_segmenter(export_server, export_seg,
                                                              images):
    _, url, _ = export_server
    paths, _ = images
    triton, client = _triton(url)
    seg = export_seg
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready('psanet') and client.is_model_ready('psanet', '1')
    assert not client.is_model_ready('other')
    server = client.get_server_metadata()
    assert server['name'] == 'psanet' and 'binary_tensor_data' in server['extensions']
    for version in ('', '1'):
        meta = client.get_model_metadata('psanet', version)
        assert meta['name'] == 'psanet' and meta['platform'] == 'paddle'
        assert meta['inputs'] == [{'name': 'image', 'datatype': 'UINT8', 'shape': [-1, -1, 3]},
                                  {'name': 'image_file', 'datatype': 'BYTES', 'shape': [1]}]
        assert meta['outputs'] == [{'name': 'class_map', 'datatype': 'INT32',
                                    'shape': [-1, -1]}]
    for path in paths[:5]:  # four PNGs and a JPEG: as cv2.imread reads them
        image, want = cv2.imread(path), seg(path)
        for binary in (True, False):  # the binary tensor data extension, and JSON
            out = triton.InferRequestedOutput('class_map', binary_data=binary)
            result = client.infer('psanet', [triton_image(triton, image, binary)],
                                  outputs=[out], request_id='r1')
            label = result.as_numpy('class_map')
            assert label.dtype == np.int32 and np.array_equal(label, want), (path, binary)
            assert result.get_response()['id'] == 'r1'
        batch = client.infer('psanet', [triton_image(triton, image, batch=True)],
                             model_version='1').as_numpy('class_map')
        assert batch.shape == (1, *want.shape) and np.array_equal(batch[0], want)
        with open(path, 'rb') as f:
            file = triton.InferInput('image_file', [1], 'BYTES')
            file.set_data_from_numpy(np.array([f.read()], dtype=np.object_))
        assert np.array_equal(client.infer('psanet', [file]).as_numpy('class_map'), want)


@pytest.mark.parametrize('case, status, words', [
    ('unknown model', '404', ['unknown model', "'psanet'"]),
    ('unknown version', '404', ['version 1 only']),
    ('unknown input', '400', ['unknown input', '"image"']),
    ('float input', '400', ["is UINT8, not 'FP32'"]),
    ('four channels', '400', ['[H, W, 3]']),
    ('two inputs', '400', ['one input']),
    ('unknown output', '400', ['unknown output', 'class_map']),
])
def test_a_wrong_inference_request_is_a_4xx_the_client_reads(export_server, images, case,
                                                              status, words):
    _, url, _ = export_server
    triton, client = _triton(url)
    image = cv2.imread(images[0][0])
    tensor = triton_image(triton, image)
    model, version, inputs, outputs = 'psanet', '', [tensor], None
    if case == 'unknown model':
        model = 'psa'
    elif case == 'unknown version':
        version = '2'
    elif case == 'unknown input':
        inputs = [triton.InferInput('picture', list(image.shape), 'UINT8')]
        inputs[0].set_data_from_numpy(image)
    elif case == 'float input':
        inputs = [triton.InferInput('image', list(image.shape), 'FP32')]
        inputs[0].set_data_from_numpy(image.astype(np.float32))
    elif case == 'four channels':
        inputs = [triton_image(triton, np.dstack([image, image[:, :, :1]]))]
    elif case == 'two inputs':
        inputs = [tensor, triton_image(triton, image)]
    elif case == 'unknown output':
        outputs = [triton.InferRequestedOutput('logits')]
    with pytest.raises(triton.InferenceServerException) as refused:
        client.infer(model, inputs, model_version=version, outputs=outputs)
    assert refused.value.status() == status, refused.value
    for word in words:
        assert word in refused.value.message()


def _runs_and_timeouts(url):
    from prometheus_client.parser import text_string_to_metric_families
    samples = {s.name: s.value for f in text_string_to_metric_families(
        httpx.get(f'{url}/metrics', timeout=30).text) for s in f.samples}
    return samples['psanet_model_run_seconds_count'], samples['psanet_timed_out_total']


def test_a_deadline_on_the_real_model_504s_what_cannot_begin_in_time(export_server, images,
                                                                     export_seg):
    _, url, _ = export_server
    paths, _ = images
    triton, client = _triton(url)
    seg = export_seg
    runs, timeouts = _runs_and_timeouts(url)
    assert_refused(post_image(url, paths[0], headers={'X-Request-Timeout-S': '0.000001'}), 504,
                   'did not run')
    with pytest.raises(triton.InferenceServerException) as late:
        client.infer('psanet', [triton_image(triton, cv2.imread(paths[1]))], timeout=1)
    assert late.value.status() == '504'
    assert _runs_and_timeouts(url) == (runs, timeouts + 2)  # neither ran
    answer = post_image(url, paths[0], headers={'X-Request-Timeout-S': '600'})
    assert np.array_equal(png_labels(answer)[0], seg(paths[0]))
    label = client.infer('psanet', [triton_image(triton, cv2.imread(paths[1]))],
                         timeout=600_000_000).as_numpy('class_map')
    assert np.array_equal(label, seg(paths[1]))
    assert _runs_and_timeouts(url) == (runs + 2, timeouts + 2)


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
        cv2.imwrite(str(calib / f'{i}.png'), make_image(rng, (96, 64)))
    return export_from_config(MINI_CONFIG, mini_weights, str(root / 'export'),
                              output_op='none', psa_impl='paddle', onnx=True,
                              quantize='int8', calib_images=str(calib), calib_num=3)


# Each backend once (the FP32 and INT8 models of one backend are the Segmenter's concern).
@pytest.mark.parametrize('backend, int8', [('onnxruntime', True), ('openvino', True)])
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
            assert np.array_equal(png_labels(post_image(url, path))[0], seg(path)), path
