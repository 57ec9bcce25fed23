"""serve.py's options, checked whole before anything loads: numbers finite and in range, the
server's packages installed, the config's kind, the token and certificate files, and the
address bound (the socket is kept for uvicorn, so nothing else takes the port meanwhile)."""
import dataclasses
import errno
import math
import os
import socket
from typing import List, Optional, Tuple

from psanet.errors import ConfigError

__all__ = ['ServeOptions', 'SERVER_PACKAGES', 'check_packages', 'read_token', 'check_tls',
           'bind']

# module -> pip's name: what `pip install -r requirements-serve.txt` brings.
SERVER_PACKAGES = {'fastapi': 'fastapi', 'starlette': 'starlette', 'uvicorn': 'uvicorn',
                   'python_multipart': 'python-multipart', 'prometheus_client': 'prometheus-client'}

# name -> (smallest, largest, what it is): every numeric flag's range.
RANGES = {
    'port': (1, 65535, 'a TCP port'),
    'max_batch': (1, 1024, 'a number of requests'),
    'max_wait_ms': (0, 60_000, 'a finite number of milliseconds'),
    'max_queue': (1, 1_000_000, 'a number of requests'),
    'max_body_bytes': (1, 2 ** 31, 'a number of bytes'),
    'max_pixels': (1, 2 ** 31, 'a number of pixels'),
    'graceful_timeout_s': (0, 3600, 'a number of seconds'),
    'request_timeout_s': (0.001, 86_400, 'a finite number of seconds'),
    'cpu_threads': (1, 1024, 'a number of threads'),
}


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """serve.py's flags (docs/deploy.md, "Serving"). ``backend``, ``device`` and
    ``cpu_threads`` None take the API's defaults (``psanet.Segmenter``); ``request_timeout_s``
    None: no deadline unless a request sets one; ``warmup_size`` None: the size the export or
    its transforms fix, if any."""
    config: str
    model_path: Optional[str] = None
    backend: Optional[str] = None
    device: Optional[str] = None
    int8: bool = False
    cpu_threads: Optional[int] = None
    host: str = '127.0.0.1'
    port: int = 8000
    max_batch: int = 8
    max_wait_ms: float = 5.0
    max_queue: int = 64
    max_body_bytes: int = 20 * 2 ** 20
    max_pixels: int = 2048 * 2048
    graceful_timeout_s: int = 30
    request_timeout_s: Optional[float] = None
    warmup_size: Optional[Tuple[int, int]] = None
    model_name: str = 'psanet'
    auth_token_file: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_keyfile: Optional[str] = None

    def __post_init__(self):
        for name, (low, high, what) in RANGES.items():
            value = getattr(self, name)
            if value is None and name in ('request_timeout_s', 'cpu_threads'):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and low <= value <= high):
                raise ConfigError(f'--{name} must be {what} from {low} to {high}, got '
                                  f'{value}.')
        if self.warmup_size is not None:
            width, height = self.warmup_size
            if not (1 <= width and 1 <= height and width * height <= self.max_pixels):
                raise ConfigError(f'--warmup_size {width} {height}: the width and height must '
                                  f'be >= 1 and their product at most --max_pixels '
                                  f'({self.max_pixels}).')
        if not self.model_name or '/' in self.model_name or self.model_name.strip() != \
                self.model_name:
            raise ConfigError(f'--model_name {self.model_name!r}: give a name without "/" or '
                              'spaces at its ends (the Open Inference Protocol routes carry it '
                              'in their paths).')
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ConfigError('--ssl_certfile and --ssl_keyfile go together: give both (the '
                              'certificate and its private key) or neither.')


def check_packages() -> None:
    """One line naming the server's missing packages and the pip command, or nothing."""
    missing = []
    for module in SERVER_PACKAGES:
        try:
            __import__(module)
        except ImportError as error:  # this one, or one it imports (fastapi: starlette)
            name = SERVER_PACKAGES.get(getattr(error, 'name', None) or module,
                                       getattr(error, 'name', None) or module)
            if name not in missing:
                missing.append(name)
    if missing:
        raise ConfigError(f'serve.py needs {", ".join(missing)}, not installed here: '
                          'pip install -r requirements-serve.txt')


def _read_text(path, flag):
    try:
        with open(path, 'rb') as f:
            return f.read().decode('utf-8')
    except OSError as error:
        raise ConfigError(f'{flag} {path} cannot be read ({error.strerror}).') from None
    except UnicodeDecodeError:
        raise ConfigError(f'{flag} {path} is not text: give a file holding the token on one '
                          'line.') from None


def read_token(path: str) -> str:
    """The bearer token in ``path``: one line, no spaces."""
    token = _read_text(path, '--auth_token_file').strip()
    if not token or any(c.isspace() for c in token):
        raise ConfigError(f'--auth_token_file {path} must hold one token on one line, without '
                          f'spaces; it holds {"nothing" if not token else "more than that"}.')
    return token


def check_tls(certfile: str, keyfile: str) -> None:
    """The certificate and key load as a pair (ssl's own check), named if not."""
    import ssl
    for flag, path in (('--ssl_certfile', certfile), ('--ssl_keyfile', keyfile)):
        if not os.path.isfile(path):
            raise ConfigError(f'{flag} {path} does not exist (cwd {os.getcwd()}).')
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError, ValueError) as error:
        raise ConfigError(f'--ssl_certfile {certfile} and --ssl_keyfile {keyfile} do not load as '
                          f'a certificate and its key ({error}): give PEM files of one pair.') \
            from None


def bind(host: str, port: int) -> List[socket.socket]:
    """Sockets bound to every address ``host`` resolves to (not yet listening)."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as error:
        reason = error.strerror if isinstance(error, socket.gaierror) else 'not a host name'
        raise ConfigError(f'--host {host} does not resolve ({reason}): give an address of this '
                          'machine, e.g. 127.0.0.1 or 0.0.0.0.') from None
    sockets, seen, unavailable = [], set(), []
    try:
        for family, kind, proto, _, address in addresses:
            if address[:2] in seen:
                continue
            seen.add(address[:2])
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as error:
                sock.close()
                if error.errno != errno.EADDRNOTAVAIL:  # a port in use, a privileged port
                    raise ConfigError(_bind_error(host, port, address[0], error)) from None
                unavailable.append((address[0], error))  # e.g. localhost's ::1 without IPv6
                continue
            sockets.append(sock)
        if not sockets:
            raise ConfigError(_bind_error(host, port, *unavailable[0]))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _bind_error(host, port, address, error):
    if error.errno == errno.EADDRINUSE:
        return (f'port {port} is in use on {address} (--host {host}): choose another --port, or '
                'stop what listens there.')
    if error.errno == errno.EADDRNOTAVAIL:
        return (f'--host {host} ({address}) is not an address of this machine: give one of its '
                'addresses, 127.0.0.1 or 0.0.0.0.')
    if error.errno == errno.EACCES:
        return (f'port {port} needs privileges to bind: choose a port from 1024 up, or run as a '
                'user allowed to bind it.')
    return f'cannot listen on {address}:{port} (--host {host}): {error.strerror}.'
