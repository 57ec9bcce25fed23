"""Trained weights from an http(s) URL: downloaded once into a cache, checked, then a local file.

A ``.pdparams`` URL or a PaddleSeg-style archive holding one ``model.pdparams``;
``#sha256=<hex>`` at the end checks the download. The file is renamed into
``$PSANET_WEIGHTS_CACHE`` (default ``~/.cache/psanet/weights``) only once its length, its
checksum and its format (a whole pickle, not a web page) are right; a later call with the
same URL downloads nothing. Imports neither paddle nor the engine.
"""
import hashlib
import http.client
import os
import pickletools
import re
import stat
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
# The PROTO opcode, first in every pickle of protocol 2 or later (what paddle.save writes).
_PROTO = b'\x80'


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


def _not_weights(path):
    """``(what the file is, the fix)`` when ``path`` is not weights paddle.load reads (a web
    page, another format, a pickle cut short), else None. The pickle's opcodes are walked,
    never run."""
    with open(path, 'rb') as f:
        head = f.read(64)
        begins = repr(head[:16])[1:] if head else 'nothing'
        if head.lstrip()[:1] == b'<':
            return (f'a web page (it begins {begins})', 'pass the URL of the .pdparams file '
                    'itself, not of a page that links to it')
        if head[:1] != _PROTO or len(head) < 2 or head[1] < 2:
            return (f'not a pickle as paddle.save writes (it begins {begins})',
                    'pass the URL of a .pdparams file written by paddle.save')
        f.seek(0)
        try:
            for _ in pickletools.genops(f):
                pass
        except ValueError:
            return ('a pickle cut short', 'run again, or download the file elsewhere and pass '
                                          'its local path')
    return None


def _check_weights(path, flag, url, subject):
    found = _not_weights(path)
    if found is not None:
        raise CheckpointError(f'{flag} {url}: {subject} is {found[0]}, not weights: {found[1]}; '
                              'nothing was kept in the cache.')


def _unpack(archive, folder, flag, url):
    try:
        if archive.endswith('.zip'):
            with zipfile.ZipFile(archive) as opened:
                _check_members(((info.filename, _zip_link(opened, info), False)
                                for info in opened.infolist()), flag, url)
                opened.extractall(folder)
        else:
            with tarfile.open(archive) as opened:
                _check_members(((m.name, m.linkname if m.issym() or m.islnk() else None,
                                 not (m.isfile() or m.isdir())) for m in opened.getmembers()),
                               flag, url)
                # The members are checked above; the 'data' filter (where tarfile has it)
                # also drops modes no download should set.
                extra = {'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}
                opened.extractall(folder, **extra)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as error:
        raise CheckpointError(f'{flag} {url} is not a readable archive ({error}): pass the '
                              'URL of a .zip or .tar.gz holding model.pdparams, or of the '
                              '.pdparams file itself.') from error
    os.remove(archive)


def _zip_link(opened, info):
    """The target of a symbolic link a zip stores (``zip -y``: S_IFLNK in the Unix mode, the
    target as the data), or None."""
    if not stat.S_ISLNK(info.external_attr >> 16):
        return None
    return opened.read(info).decode('utf-8', 'replace')


def _check_members(members, flag, url):
    """Refuses an archive with a member that is a link, a device or pipe, or a path that is
    absolute or leaves the archive's folder; ``members`` are ``(name, link target or None,
    special)``."""
    for name, target, special in members:
        parts = name.replace('\\', '/').split('/')
        if target is not None:
            what = f'a link ({name} -> {target})'
        elif special:
            what = f'a device or pipe ({name})'
        elif name.startswith(('/', '\\')) or re.match(r'^[A-Za-z]:', name):
            what = f'an absolute path ({name})'
        elif '..' in parts:
            what = f'a path outside itself ({name})'
        else:
            continue
        raise CheckpointError(f'{flag} {url}: the archive holds {what}; it is not unpacked: '
                              'pass an archive of plain files.')


def _weights_below(folder):
    """The paths of the files named model.pdparams below ``folder``, relative to it."""
    return sorted(os.path.relpath(os.path.join(root, WEIGHTS_FILE), folder)
                  for root, _, files in os.walk(folder) if WEIGHTS_FILE in files)


def _weights_in(folder, flag, url):
    found = _weights_below(folder)
    if len(found) == 1:
        return os.path.join(folder, found[0])
    if found:
        what = f'{len(found)} files named {WEIGHTS_FILE} ({", ".join(found)})'
    else:
        held = sorted(os.path.relpath(os.path.join(root, name), folder)
                      for root, _, files in os.walk(folder) for name in files)
        what = f'no {WEIGHTS_FILE} (it holds {", ".join(held[:5]) or "nothing"})'
    raise CheckpointError(f'{flag} {url}: the archive holds {what}: pass an archive with one '
                          f'{WEIGHTS_FILE}, or the URL of the weights file itself.')


def fetch_weights(url, flag='--model_path', logger=None):
    """The local path (in the cache) of the weights at ``url``, downloaded the first time;
    ``flag`` is what the URL was given as, for the messages.

    Raises:
        CheckpointError: a malformed #sha256=, an HTTP or network error, a download cut short
            or with another checksum, a file that is not weights (a web page), an archive with
            links, or without one model.pdparams; each leaves nothing in the cache.
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
        found = _weights_below(folder)
        if len(found) != 1 or not _cached(os.path.join(folder, found[0]), logger):
            def unpack(temporary):
                archive = os.path.join(temporary, name)
                _download(address, sha256, archive, flag, logger)
                _unpack(archive, temporary, flag, url)
                weights = _weights_in(temporary, flag, url)
                _check_weights(weights, flag, url,
                               f'{os.path.relpath(weights, temporary)} in the archive')
            write_folder(folder, unpack)
        return _weights_in(folder, flag, url)
    if not _cached(entry, logger):
        def download(temporary):
            _download(address, sha256, temporary, flag, logger)
            _check_weights(temporary, flag, url, 'the download')
        write_file_whole(entry, download, durable=True)
    return entry


def _cached(path, logger):
    """True when the cache holds the weights file ``path`` whole; one that is not (left by an
    older version, or damaged since) is logged, to be downloaded again over."""
    if not os.path.isfile(path):
        return False
    bad = _not_weights(path)
    if bad is not None:
        logger.warning(f'The cached {path} is not weights ({bad[0]}): downloading it again.')
    return bad is None
