"""``python -m psanet.launch``: ``paddle.distributed.launch`` with its etcd master checked first.

It takes exactly the arguments of Paddle's launcher and then becomes it (``exec``:
the same process, signals and exit code). For an ``etcd://`` master (Paddle's
elastic mode) it first sets what etcd3 0.12 and gRPC need in the launcher and
checks that the etcd answers, so that an etcd that is down or unreachable is one
line instead of the launcher's traceback 2 to 22 s later (docs/training.md, "On
a cluster").
"""
import os
import sys

from psanet import compat  # noqa: F401  (filters Paddle's ccache notice before paddle loads)

__all__ = ['main']

ETCD_TIMEOUT = 5  # seconds for the etcd to answer its status request
# etcd3 0.12's generated _pb2 files load only with the pure-Python protobuf (protobuf 4+
# refuses them: "Descriptors cannot be created directly"). The launcher forks its ranks while
# its etcd watch thread is inside gRPC, whose fork handlers then break a rank at start now
# and then ("epoll_wait error: Bad file descriptor"); the ranks exec at once and use no gRPC.
ETCD_ENVIRONMENT = {'PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION': 'python',
                    'GRPC_ENABLE_FORK_SUPPORT': 'false'}


def _launcher_args(argv):
    """The launcher's own flags, parsed by the launcher's parser (train.py's come after
    the script and are not looked at)."""
    from paddle.distributed.launch.context.args_envs import parse_args
    saved = sys.argv
    sys.argv = ['launch'] + list(argv)
    try:
        return parse_args()[0]
    finally:
        sys.argv = saved


def check_etcd(master, timeout=ETCD_TIMEOUT):
    """None when the etcd of ``etcd://host:port`` answers, else the error line's text."""
    try:
        import etcd3
    except ImportError:
        return (f'--master {master} needs the etcd3 client in this environment: pip install '
                'etcd3==0.12.0 (requirements-dev.txt).')
    host, _, port = master[len('etcd://'):].rpartition(':')
    if not host or not port.isdigit():
        return f'--master {master} is not etcd://HOST:PORT: give the etcd\'s client address.'
    try:
        etcd3.client(host=host, port=int(port), timeout=timeout).status()
    except (etcd3.exceptions.ConnectionFailedError,
            etcd3.exceptions.ConnectionTimeoutError) as error:
        what = ('did not answer within %d s' % timeout
                if isinstance(error, etcd3.exceptions.ConnectionTimeoutError) else
                'refused the connection')
        return (f'no etcd answers at {host}:{port} ({what}): start it there (docs/training.md, '
                f'"On a cluster") or fix --master {master}; nothing was started or written.')
    return None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if any('etcd://' in arg for arg in argv + [os.environ.get('PADDLE_MASTER', '')]):
        # Before anything imports protobuf (Paddle does): the variable is read once.
        for name, value in ETCD_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
    if argv and argv[0] not in ('-h', '--help'):
        master = _launcher_args(argv).master or os.environ.get('PADDLE_MASTER') or ''
        if master.startswith('etcd://'):
            problem = check_etcd(master)
            if problem is not None:
                print(f'error: {problem}', file=sys.stderr)
                return 2
    os.execv(sys.executable, [sys.executable, '-m', 'paddle.distributed.launch'] + argv)


if __name__ == '__main__':
    sys.exit(main())
