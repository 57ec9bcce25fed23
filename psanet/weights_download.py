"""Trained weights from an http(s) URL: downloaded once into a cache, checked, then a local file.

``--model_path`` (val.py, predict.py, export.py, tools/visualize_attention.py) and
``Segmenter.from_config`` take ``https://host/model.pdparams``, or a PaddleSeg-style archive
(.zip, .tar.gz, .tgz, .tar) holding one ``model.pdparams``; ``#sha256=<hex>`` at the end of
the URL checks the download. The file is written whole into ``$PSANET_WEIGHTS_CACHE``
(default ``~/.cache/psanet/weights``) and renamed in only once its length (the server's
Content-Length) and checksum are right; an archive is unpacked the same way, as one folder.
A later call with the same URL finds it there and downloads nothing. Imports neither
paddle nor the engine.
"""
import hashlib
import http.client
import os
import re
import tarfile
import urllib.error
import urllib.request
import zipfile
from urllib.parse import unquote, urlparse

from psanet.errors import CheckpointError
from psanet.files import write_file_whole, write_folder
from psanet.log import ProgressBar, get_logger

__all__ = ['CACHE_ENV', 'WEIGHTS_FILE', 'is_url', 'weights_cache_dir', 'fetch_weights']

CACHE_ENV = 'PSANET_WEIGHTS_CACHE'
WEIGHTS_FILE = 'model.pdparams'
ARCHIVES = ('.tar.gz', '.tgz', '.tar', '.zip')
CHUNK = 1 << 20
_SHA256 = re.compile(r'^sha256=([0-9a-fA-F]{64})$')


def is_url(path):
    """True for an http(s) URL (what :func:`fetch_weights` takes)."""
    return isinstance(path, str) and urlparse(path).scheme in ('http', 'https')


def weights_cache_dir():
    """``$PSANET_WEIGHTS_CACHE``, else ``~/.cache/psanet/weights``."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser('~'), '.cache',
                                                     'psanet', 'weights')


def _split(url, flag):
    """``(URL without its fragment, expected sha256 or None)``."""
    address, _, fragment = url.partition('#')
    if not fragment:
        return address, None
    match = _SHA256.match(fragment)
    if match is None:
        raise CheckpointError(f'{flag} {url}: the part after # must be sha256=<64 hex digits> '
                              f'(the file\'s sha256sum), got #{fragment}: fix it or drop it.')
    return address, match.group(1).lower()


def _mib(count):
    return f'{count / (1 << 20):.1f} MiB'


def _download(address, sha256, target, flag, logger):
    """Streams ``address`` into the file ``target``, checking its length and checksum."""
    fix = ('nothing was kept in the cache: run again, or download the file elsewhere and '
           f'pass its local path to {flag}.')
    try:
        response = urllib.request.urlopen(address, timeout=60)
    except urllib.error.HTTPError as error:
        raise CheckpointError(f'{flag} {address}: the server answered HTTP {error.code} '
                              f'{error.reason}: check the URL; {fix}') from error
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, 'reason', error)
        raise CheckpointError(f'{flag} {address} cannot be downloaded ({reason}): {fix}') \
            from error
    expected = response.headers.get('Content-Length')
    expected = int(expected) if expected and expected.isdigit() else None
    digest, received = hashlib.sha256(), 0
    logger.info(f'Downloading {address}' + (f' ({_mib(expected)})' if expected else '') +
                f' into {weights_cache_dir()} ...')
    bar = ProgressBar(expected, unit='MiB', label=_mib) if expected else None
    try:
        with response, open(target, 'wb') as out:
            while True:
                chunk = response.read(CHUNK)
                if not chunk:
                    break
                out.write(chunk)
                digest.update(chunk)
                received += len(chunk)
                if bar is not None:
                    bar.update(min(received, expected))
    except (http.client.HTTPException, OSError) as error:
        raise CheckpointError(f'{flag} {address}: the download broke off after '
                              f'{received} bytes ({type(error).__name__}: {error}); {fix}') \
            from error
    finally:
        if bar is not None:
            bar.close()
    if expected is not None and received != expected:
        raise CheckpointError(f'{flag} {address}: the download was cut short ({received} of '
                              f'the {expected} bytes the server announced); {fix}')
    found = digest.hexdigest()
    if sha256 is not None and found != sha256:
        raise CheckpointError(f'{flag} {address}: the download has sha256 {found}, the URL\'s '
                              f'#sha256= says {sha256}: it is another file, or it was damaged '
                              f'on the way; {fix}')
    logger.info(f'Downloaded {address}: {received} bytes, sha256 {found}' +
                (' (as the URL says).' if sha256 else
                 f' (add #sha256={found} to the URL to check it next time).'))


def _unpack(archive, folder, flag, url):
    try:
        if archive.endswith('.zip'):
            with zipfile.ZipFile(archive) as opened:
                names = opened.namelist()
                _check_members(names, flag, url)
                opened.extractall(folder)
        else:
            with tarfile.open(archive) as opened:
                members = opened.getmembers()
                _check_members([f'/{m.name} (a link)' if m.issym() or m.islnk() else m.name
                                for m in members], flag, url)
                # The members are checked above; the 'data' filter (where tarfile has it)
                # also refuses device files and drops modes no download should set.
                extra = {'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}
                opened.extractall(folder, **extra)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as error:
        raise CheckpointError(f'{flag} {url} is not a readable archive ({error}): pass the '
                              'URL of a .zip or .tar.gz holding model.pdparams, or of the '
                              '.pdparams file itself.') from error
    os.remove(archive)


def _check_members(names, flag, url):
    for name in names:
        parts = name.replace('\\', '/').split('/')
        if name.startswith('/') or '..' in parts:
            raise CheckpointError(f'{flag} {url}: the archive holds a link or a path outside '
                                  f'itself ({name!r}); it is not unpacked: pass an archive '
                                  'of plain files.')


def _weights_in(folder, flag, url):
    found = sorted(os.path.join(root, name) for root, _, files in os.walk(folder)
                   for name in files if name == WEIGHTS_FILE)
    if len(found) == 1:
        return found[0]
    held = sorted(os.path.relpath(os.path.join(root, name), folder)
                  for root, _, files in os.walk(folder) for name in files)
    what = 'no' if not found else f'{len(found)} files named'
    raise CheckpointError(f'{flag} {url}: the archive holds {what} {WEIGHTS_FILE} (it holds '
                          f'{", ".join(held[:5]) or "nothing"}): pass an archive with one '
                          f'{WEIGHTS_FILE}, or the URL of the weights file itself.')


def fetch_weights(url, flag='--model_path', logger=None):
    """The local path of the weights at ``url``, downloaded into the cache the first time.

    Args:
        url (str): http(s) URL of a .pdparams file or of an archive holding one
            ``model.pdparams``; ``#sha256=<hex>`` checks the download.
        flag (str, optional): What the URL was given as, for the messages.
            Default: '--model_path'.
        logger (logging.Logger, optional): Default: the 'psanet' logger.

    Returns:
        str: a .pdparams file in the cache.

    Raises:
        CheckpointError: a malformed #sha256=, an HTTP or network error, a download cut
            short or with another checksum, an archive without one model.pdparams; each
            leaves nothing in the cache.
    """
    logger = logger or get_logger()
    address, sha256 = _split(url, flag)
    name = os.path.basename(unquote(urlparse(address).path)) or 'weights'
    name = re.sub(r'[^A-Za-z0-9._-]', '_', name)
    key = hashlib.sha256(url.encode()).hexdigest()[:12]
    cache = weights_cache_dir()
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f'the weights cache {cache} cannot be made ({error}): set '
                              f'{CACHE_ENV} to a folder this user can write.') from error
    entry = os.path.join(cache, f'{key}-{name}')
    if name.endswith(ARCHIVES):
        folder = entry + '.d'
        if not os.path.isdir(folder):
            def unpack(temporary):
                archive = os.path.join(temporary, name)
                _download(address, sha256, archive, flag, logger)
                _unpack(archive, temporary, flag, url)
                _weights_in(temporary, flag, url)
            write_folder(folder, unpack)
        return _weights_in(folder, flag, url)
    if not os.path.isfile(entry):
        write_file_whole(entry, lambda temporary: _download(address, sha256, temporary, flag,
                                                            logger), durable=True)
    return entry

