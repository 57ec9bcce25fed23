"""--model_path / Segmenter.from_config as an http(s) URL: downloaded once into the cache,
checked by length and sha256, a failed download leaving nothing; served from 127.0.0.1."""
import hashlib
import http.server
import io
import os
import tarfile
import threading
import zipfile

import numpy as np
import pytest

from psanet.errors import CheckpointError
from psanet.weights_download import CACHE_ENV, fetch_weights


class _Server:
    """http.server on 127.0.0.1 in a thread, serving ``files`` ({url path: bytes}); a path in
    ``truncate`` announces its full length but sends half. ``requests`` counts the GETs."""

    def __init__(self):
        self.files, self.truncate, self.requests = {}, set(), []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append(self.path)
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header('Content-Length', str(len(body)))
                self.end_headers()
                self.wfile.write(body[:len(body) // 2] if self.path in server.truncate
                                 else body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path):
        return f'http://127.0.0.1:{self.httpd.server_port}{path}'

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    served = _Server()
    yield served
    served.close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / 'cache'
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


def _files_in(folder):
    return sorted(os.path.relpath(os.path.join(root, name), folder)
                  for root, _, names in os.walk(folder) for name in names) \
        if os.path.isdir(folder) else []


WEIGHTS = os.urandom(3 * (1 << 20) + 17)  # more than one read chunk
SHA = hashlib.sha256(WEIGHTS).hexdigest()


def test_a_url_downloads_once_checked_with_a_progress_bar(server, cache, capfd):
    server.files['/r50/model.pdparams'] = WEIGHTS
    url = server.url('/r50/model.pdparams') + f'#sha256={SHA}'
    path = fetch_weights(url)
    with open(path, 'rb') as f:
        assert f.read() == WEIGHTS
    assert os.path.dirname(path) == str(cache)
    err = capfd.readouterr().err
    assert '3.0 MiB/3.0 MiB [' + '=' * 30 + ']' in err, err  # the bar's last state
    assert fetch_weights(url) == path
    assert server.requests == ['/r50/model.pdparams']  # the second call downloaded nothing
    assert _files_in(cache) == [os.path.basename(path)]


def test_without_a_checksum_the_log_gives_it(server, cache, caplog):
    server.files['/w.pdparams'] = WEIGHTS
    with caplog.at_level('INFO', logger='psanet'):
        fetch_weights(server.url('/w.pdparams'))
    assert f'add #sha256={SHA} to the URL' in caplog.text


def test_a_truncated_download_is_one_error_and_leaves_nothing(server, cache):
    server.files['/cut.pdparams'] = WEIGHTS
    server.truncate.add('/cut.pdparams')
    with pytest.raises(CheckpointError) as error:
        fetch_weights(server.url('/cut.pdparams'))
    message = str(error.value)
    assert f'cut short ({len(WEIGHTS) // 2} of the {len(WEIGHTS)} bytes' in message, message
    assert 'nothing was kept in the cache' in message and '\n' not in message
    assert _files_in(cache) == []


def test_a_wrong_checksum_is_one_error_and_leaves_nothing(server, cache):
    server.files['/w.pdparams'] = WEIGHTS
    wrong = '0' * 64
    with pytest.raises(CheckpointError) as error:
        fetch_weights(server.url('/w.pdparams') + f'#sha256={wrong}')
    message = str(error.value)
    assert f'has sha256 {SHA}, the URL\'s #sha256= says {wrong}' in message, message
    assert _files_in(cache) == []
    # the same file with the right checksum is then downloaded and kept
    assert os.path.isfile(fetch_weights(server.url('/w.pdparams') + f'#sha256={SHA}'))


@pytest.mark.parametrize('fragment, expected', [
    ('#md5=abc', 'must be sha256=<64 hex digits>'),
])
def test_a_malformed_fragment_is_refused_before_any_request(server, cache, fragment, expected):
    with pytest.raises(CheckpointError, match=expected):
        fetch_weights(server.url('/w.pdparams') + fragment)
    assert server.requests == []


def test_http_errors_and_no_server_are_one_line(server, cache):
    with pytest.raises(CheckpointError, match=r'the server answered HTTP 404 .*check the URL'):
        fetch_weights(server.url('/missing.pdparams'))
    port = server.httpd.server_port
    server.close()
    with pytest.raises(CheckpointError, match='cannot be downloaded'):
        fetch_weights(f'http://127.0.0.1:{port}/w.pdparams')
    assert _files_in(cache) == []


def _tar_gz(members):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode='w:gz') as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _zip(members):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, 'w') as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


@pytest.mark.parametrize('name, pack', [('psanet.tar.gz', _tar_gz), ('psanet.zip', _zip)])
def test_an_archive_is_unpacked_once_and_its_model_pdparams_returned(server, cache, name,
                                                                     pack):
    body = pack({'psanet_r50/model.pdparams': WEIGHTS, 'psanet_r50/README': b'x'})
    server.files['/' + name] = body
    url = server.url('/' + name) + f'#sha256={hashlib.sha256(body).hexdigest()}'
    path = fetch_weights(url)
    assert path.endswith(os.path.join('psanet_r50', 'model.pdparams'))
    with open(path, 'rb') as f:
        assert f.read() == WEIGHTS
    assert fetch_weights(url) == path and server.requests == ['/' + name]
    # one folder holding the members; the archive itself is not kept
    assert [f.split(os.sep, 1)[1] for f in _files_in(cache)] == [
        os.path.join('psanet_r50', 'README'), os.path.join('psanet_r50', 'model.pdparams')]


def test_an_archive_without_weights_or_escaping_itself_leaves_nothing(server, cache):
    server.files['/empty.tar.gz'] = _tar_gz({'notes.txt': b'x'})
    with pytest.raises(CheckpointError, match=r'holds no model.pdparams \(it holds notes.txt\)'):
        fetch_weights(server.url('/empty.tar.gz'))
    server.files['/evil.tar.gz'] = _tar_gz({'../model.pdparams': WEIGHTS})
    with pytest.raises(CheckpointError, match='a path outside'):
        fetch_weights(server.url('/evil.tar.gz'))
    assert _files_in(cache) == [] and not os.path.exists(cache.parent / 'model.pdparams')


def test_model_path_url_loads_the_weights_into_the_model(server, cache, tmp_path):
    # The engine's loader, as val.py / predict.py / export.py call it, against the weights
    # written by paddle.save and read back from the served bytes.
    import paddle
    from psanet.core.weights import load_model_weights, resolve_weights_path
    paddle.seed(1)
    source = paddle.nn.Linear(4, 3)
    paddle.save(source.state_dict(), str(tmp_path / 'model.pdparams'))
    server.files['/model.pdparams'] = (tmp_path / 'model.pdparams').read_bytes()
    url = server.url('/model.pdparams')
    paddle.seed(2)
    target = paddle.nn.Linear(4, 3)
    assert not np.allclose(target.weight.numpy(), source.weight.numpy())
    assert resolve_weights_path(url).startswith(str(cache))
    load_model_weights(target, url)
    np.testing.assert_array_equal(target.weight.numpy(), source.weight.numpy())
    np.testing.assert_array_equal(target.bias.numpy(), source.bias.numpy())
    assert server.requests == ['/model.pdparams']


def test_segmenter_from_config_takes_a_url(server, cache, tmp_path):
    import paddle
    from conftest import MINI_CONFIG
    from engine_helpers import mini_psanet_for_eval
    from psanet import Segmenter
    model = mini_psanet_for_eval(seed=3)
    paddle.save(model.state_dict(), str(tmp_path / 'model.pdparams'))
    server.files['/mini/model.pdparams'] = (tmp_path / 'model.pdparams').read_bytes()
    image = np.random.RandomState(0).randint(0, 255, (64, 128, 3)).astype('uint8')
    seg = Segmenter.from_config(MINI_CONFIG, server.url('/mini/model.pdparams'),
                                backend='dygraph', device='cpu')
    x = ((image[:, :, ::-1].astype('float32') / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None]
    with paddle.no_grad():
        expected = model(paddle.to_tensor(np.ascontiguousarray(x)))[0].numpy()[0].argmax(0)
    np.testing.assert_array_equal(seg(image), expected)


def test_a_local_backbone_pretrained_file_loads_offline(tmp_path, monkeypatch):
    # model.backbone.pretrained given a local file (an ImageNet backbone copied onto a
    # machine without network) loads it through paddleseg, with no request made.
    import paddle
    import urllib.request
    from paddleseg.models.backbones import ResNet18_vd
    from conftest import MINI_CONFIG
    from psanet.core.config import ComponentBuilder, load_config

    def no_network(*args, **kwargs):
        raise AssertionError('a request was made')
    monkeypatch.setattr(urllib.request, 'urlopen', no_network)
    paddle.seed(5)
    backbone = ResNet18_vd(output_stride=8)
    path = tmp_path / 'resnet18_vd_imagenet.pdparams'
    paddle.save(backbone.state_dict(), str(path))
    cfg = load_config(MINI_CONFIG, opts=[f'model.backbone.pretrained={path}'])
    model = ComponentBuilder(cfg).model
    loaded = model.backbone.state_dict()
    for key, value in backbone.state_dict().items():
        np.testing.assert_array_equal(loaded[key].numpy(), value.numpy(), err_msg=key)


def test_the_download_module_loads_no_paddle():
    import subprocess
    import sys
    from conftest import ROOT, run_process
    code = ('import sys, psanet.weights_download; '
            'print(sorted(m for m in sys.modules if m.split(".")[0] == "paddle"))')
    result = run_process([sys.executable, '-c', code], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == '[]', result.stdout
