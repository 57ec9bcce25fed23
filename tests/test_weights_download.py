"""--model_path / Segmenter.from_config as an http(s) URL: downloaded once into the cache,
checked by length and sha256, a failed download leaving nothing; served from 127.0.0.1."""
import hashlib
import http.server
import io
import os
import pickle
import tarfile
import threading
import zipfile

import numpy as np
import pytest

from psanet.errors import CheckpointError
from psanet.weights_download import CACHE_ENV, fetch_weights


class _Server:
    """http.server on 127.0.0.1 in a thread, serving ``files`` ({url path: bytes}); a path in
    ``truncate`` announces its full length but sends half, one in ``unannounced`` sends half
    with no Content-Length (the connection closed after it); one in ``html`` is sent as
    text/html. ``requests`` counts the GETs."""

    def __init__(self):
        self.files, self.requests = {}, []
        self.truncate, self.unannounced, self.html = set(), set(), set()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append(self.path)
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                if self.path in server.html:
                    self.send_header('Content-Type', 'text/html; charset=utf-8')
                if self.path in server.unannounced:
                    self.send_header('Connection', 'close')
                    self.close_connection = True
                else:
                    self.send_header('Content-Length', str(len(body)))
                self.end_headers()
                cut = self.path in server.truncate or self.path in server.unannounced
                self.wfile.write(body[:len(body) // 2] if cut else body)

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


def _pdparams(seed, size):
    """What paddle.save writes for a state_dict: a pickle (protocol 4) of a dict of arrays."""
    weight = np.frombuffer(np.random.RandomState(seed).bytes(size), np.uint8)
    return pickle.dumps({'conv.weight': weight, 'StructuredToParameterName@@': {}}, protocol=4)


WEIGHTS = _pdparams(0, 3 * (1 << 20) + 17)  # more than one read chunk
SHA = hashlib.sha256(WEIGHTS).hexdigest()
WEB_PAGE = (b'<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>'
            b'<form action="/login">...</form></body></html>\n')


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


def test_a_web_page_served_as_weights_is_refused_and_not_kept(server, cache):
    """A login or download page at a .pdparams URL: one line saying it is a web page, nothing
    in the cache, so that the next run asks the server again."""
    server.files['/x.pdparams'] = WEB_PAGE
    server.html.add('/x.pdparams')
    for attempt in (1, 2):
        with pytest.raises(CheckpointError) as error:
            fetch_weights(server.url('/x.pdparams'))
        message = str(error.value)
        assert "the download is a web page (it begins '<!DOCTYPE html>" in message, message
        assert 'not weights: pass the URL of the .pdparams file itself, not of a page that ' \
            'links to it; nothing was kept in the cache.' in message
        assert '\n' not in message
        assert _files_in(cache) == [] and server.requests == ['/x.pdparams'] * attempt
    # The page without its Content-Type, and any other file that is not a pickle: refused too.
    server.html.clear()
    server.files['/y.pdparams'] = b'PK\x03\x04 not weights'
    for path, begins in (('/x.pdparams', "'<!DOCTYPE html>"), ('/y.pdparams', "'PK\\x03\\x04")):
        with pytest.raises(CheckpointError, match='not weights') as error:
            fetch_weights(server.url(path))
        assert begins in str(error.value), str(error.value)
    assert _files_in(cache) == []


def test_weights_cut_short_without_a_content_length_are_not_kept(server, cache):
    """Without a Content-Length the length cannot be checked: the pickle must end where
    paddle.save ends it."""
    server.files['/cut.pdparams'] = WEIGHTS
    server.unannounced.add('/cut.pdparams')
    with pytest.raises(CheckpointError, match='the download is a pickle cut short, not '
                       'weights: run again') as error:
        fetch_weights(server.url('/cut.pdparams'))
    assert 'nothing was kept in the cache' in str(error.value)
    assert _files_in(cache) == []


def test_a_cached_entry_that_is_not_weights_is_downloaded_again(server, cache, caplog):
    """An entry an older version kept (a web page) is replaced, not loaded."""
    server.files['/w.pdparams'] = WEIGHTS
    path = fetch_weights(server.url('/w.pdparams'))
    with open(path, 'wb') as f:
        f.write(WEB_PAGE)
    with caplog.at_level('WARNING', logger='psanet'):
        assert fetch_weights(server.url('/w.pdparams')) == path
    assert 'is not weights' in caplog.text and 'downloading it again' in caplog.text
    with open(path, 'rb') as f:
        assert f.read() == WEIGHTS
    assert server.requests == ['/w.pdparams'] * 2 and _files_in(cache) == [
        os.path.basename(path)]


def test_the_checksum_is_part_of_the_cache_entry(server, cache):
    """A URL whose #sha256= the cached file does not have gets the file checked again: the
    cache never answers for a checksum it was not checked against."""
    server.files['/w.pdparams'] = WEIGHTS
    first = fetch_weights(server.url('/w.pdparams') + f'#sha256={SHA}')
    wrong = 'f' * 64
    with pytest.raises(CheckpointError, match=f'has sha256 {SHA}, the URL\'s #sha256= says '
                       f'{wrong}'):
        fetch_weights(server.url('/w.pdparams') + f'#sha256={wrong}')
    assert server.requests == ['/w.pdparams'] * 2
    # The server's file changes: the new checksum downloads it; the old URL keeps its own.
    changed = _pdparams(1, 1000)
    server.files['/w.pdparams'] = changed
    second = fetch_weights(server.url('/w.pdparams') +
                           f'#sha256={hashlib.sha256(changed).hexdigest()}')
    assert second != first and server.requests == ['/w.pdparams'] * 3
    with open(first, 'rb') as f, open(second, 'rb') as g:
        assert f.read() == WEIGHTS and g.read() == changed


def _member(name, kind, target=''):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize('member, named', [
    (_member('psanet/model.pdparams', tarfile.SYMTYPE, '/etc/passwd'),
     "a link (psanet/model.pdparams -> /etc/passwd)"),
    (_member('psanet/model.pdparams', tarfile.SYMTYPE, 'weights.bin'),
     "a link (psanet/model.pdparams -> weights.bin)"),
    (_member('psanet/model.pdparams', tarfile.LNKTYPE, 'psanet/weights.bin'),
     "a link (psanet/model.pdparams -> psanet/weights.bin)"),
    (_member('psanet/fifo', tarfile.FIFOTYPE), "a device or pipe (psanet/fifo)"),
])
def test_an_archive_with_a_link_is_refused_and_leaves_nothing(server, cache, tmp_path, member,
                                                              named):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode='w:gz') as archive:
        data = tarfile.TarInfo('psanet/weights.bin')
        data.size = len(WEIGHTS)
        archive.addfile(data, io.BytesIO(WEIGHTS))
        archive.addfile(member)
    server.files['/linked.tar.gz'] = buffer.getvalue()
    with pytest.raises(CheckpointError) as error:
        fetch_weights(server.url('/linked.tar.gz'))
    message = str(error.value)
    assert f'the archive holds {named}; it is not unpacked: pass an archive of plain ' \
           'files' in message, message
    assert _files_in(cache) == []


@pytest.mark.parametrize('pack', [_tar_gz, _zip])
def test_an_archive_with_an_absolute_path_is_refused_and_writes_nothing_there(server, cache,
                                                                              tmp_path, pack):
    outside = tmp_path / 'outside' / 'model.pdparams'
    name = '/abs.tar.gz' if pack is _tar_gz else '/abs.zip'
    server.files[name] = pack({str(outside): WEIGHTS})
    with pytest.raises(CheckpointError) as error:
        fetch_weights(server.url(name))
    message = str(error.value)
    assert f'the archive holds an absolute path ({outside}); it is not unpacked' in message, \
        message
    assert _files_in(cache) == [] and not os.path.exists(tmp_path / 'outside')


def test_a_zip_with_a_link_is_refused(server, cache):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, 'w') as archive:
        link = zipfile.ZipInfo('psanet/model.pdparams')
        link.external_attr = (0o120777 << 16)  # S_IFLNK, as zip -y stores a symlink
        archive.writestr(link, '/etc/passwd')
    server.files['/link.zip'] = buffer.getvalue()
    with pytest.raises(CheckpointError, match=r'the archive holds a link '
                       r'\(psanet/model.pdparams -> /etc/passwd\)'):
        fetch_weights(server.url('/link.zip'))
    assert _files_in(cache) == []


@pytest.mark.parametrize('pack', [_tar_gz, _zip])
def test_an_archive_with_two_weights_files_names_both_and_leaves_nothing(server, cache, pack):
    members = {f'docs/page_{i}.txt': b'x' for i in range(8)}  # listed before the weights
    members.update({'r50/model.pdparams': WEIGHTS, 'r101/model.pdparams': _pdparams(2, 100)})
    name = '/two.tar.gz' if pack is _tar_gz else '/two.zip'
    server.files[name] = pack(members)
    with pytest.raises(CheckpointError) as error:
        fetch_weights(server.url(name))
    message = str(error.value)
    assert 'holds 2 files named model.pdparams (r101/model.pdparams, r50/model.pdparams)' \
        in message, message
    assert 'pass an archive with one model.pdparams' in message
    assert _files_in(cache) == []


def test_an_archive_whose_weights_are_a_web_page_leaves_nothing(server, cache):
    server.files['/page.tar.gz'] = _tar_gz({'psanet/model.pdparams': WEB_PAGE})
    with pytest.raises(CheckpointError, match=r"psanet/model.pdparams in the archive is a web "
                       r"page \(it begins '<!DOCTYPE html>.*\), not weights"):
        fetch_weights(server.url('/page.tar.gz'))
    assert _files_in(cache) == []


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
