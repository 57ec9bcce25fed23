"""``python -m psanet.launch``: ``paddle.distributed.launch`` with its master checked.

It takes exactly the arguments of Paddle's launcher and then runs it in this process
(the same process, signals and exit code), with two checks and one correction
(docs/training.md, "On a cluster"):

- an ``etcd://`` master (Paddle's elastic mode): what etcd3 0.12 and gRPC need is
  set, and the etcd must answer, so that one that is down or unreachable is one
  line instead of the launcher's traceback 2 to 22 s later;
- more than one node with Paddle's own (HTTP) master: its rendezvous has no
  timeout, so a node that never comes would leave the others waiting for ever. A
  watcher process kills this launcher (SIGKILL: it has no ranks yet, and a
  scheduler takes a SIGTERMed one for a preempted one) and says so in one line when
  its ranks have not started within ``PSANET_RENDEZVOUS_TIMEOUT`` seconds (300);
- with an ``etcd://`` master and ``--elastic_level 1``, a node whose own ranks failed
  restarts for certain (``restart_own_failure``), as every other node does.
"""
import glob
import os
import signal
import sys
import time

from psanet import compat  # first: it filters Paddle's ccache notice before paddle loads

__all__ = ['main']

ETCD_TIMEOUT = 5  # seconds for the etcd to answer its status request
RENDEZVOUS_TIMEOUT = 300  # default of PSANET_RENDEZVOUS_TIMEOUT
# etcd3 0.12's generated _pb2 files load only with the pure-Python protobuf (protobuf 4+
# refuses them: "Descriptors cannot be created directly"). The launcher forks its ranks while
# its etcd watch thread is inside gRPC, whose fork handlers then break a rank at start now
# and then ("epoll_wait error: Bad file descriptor"); the ranks exec at once and use no gRPC.
ETCD_ENVIRONMENT = {'PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION': 'python',
                    'GRPC_ENABLE_FORK_SUPPORT': 'false'}


def _launcher_args(argv):
    """The launcher's own flags, parsed by the launcher's parser (train.py's come after
    the script and are not looked at), with its ``PADDLE_*`` variables overriding them
    as in the launcher's ``Context``."""
    from paddle.distributed.launch.context.args_envs import env_args_mapping, parse_args
    saved = sys.argv
    sys.argv = ['launch'] + list(argv)
    try:
        args = parse_args()[0]
    finally:
        sys.argv = saved
    for variable, (name, kind) in env_args_mapping.items():
        if variable in os.environ:
            setattr(args, name, kind(os.environ[variable]))
    return args


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


def watch_rendezvous(launcher, args, timeout):
    """In a process of its own: SIGKILLs ``launcher`` and writes one line when the
    ranks it starts (their ``workerlog.*`` in ``--log_dir``) are not there in time."""
    child = os.fork()
    if child != 0:
        os.waitpid(child, 0)
        return
    if os.fork() != 0:  # the watcher is the grandchild: nobody has to reap it
        os._exit(0)
    os.setsid()  # not in the launcher's group: a signal to the job is not for it
    started, deadline = time.time(), time.monotonic() + timeout
    pattern = os.path.join(args.log_dir, 'workerlog.*')
    try:
        while time.monotonic() < deadline:
            os.kill(launcher, 0)
            if any(os.path.getmtime(path) >= started - 1 for path in glob.glob(pattern)):
                os._exit(0)  # this launch's ranks write (a reused --log_dir has old ones)
            time.sleep(0.5)
        os.kill(launcher, signal.SIGKILL)
        node = '?' if args.rank in (None, -1) else args.rank
        os.write(2, (f'error: node {node} of {args.nnodes}: not all {args.nnodes} nodes reached '
                     f'the master {args.master} within {timeout} s (PSANET_RENDEZVOUS_TIMEOUT); '
                     'this node\'s launcher is killed (SIGKILL). Check that every node runs the '
                     'same launch line with its own --rank, that --master is an address of the '
                     'first node that the others reach, and that its port is free there.\n'
                     ).encode())
    except OSError:  # the launcher has ended
        pass
    os._exit(0)


def restart_own_failure():
    """Makes Paddle's elastic launcher restart, not end, when its own pod fails
    (psanet.compat.ELASTIC_OWN_FAILURE).

    ``controllers/controller.py:ControllerBase.watch`` marks the launcher FAILED (a done
    state), deletes the job's heartbeat keys in the etcd and stops its pod, and counts on
    the etcd watch callback of ``controllers/master.py:ETCDMaster.register_heartbeat``
    (the deletion event) to make it RESTARTING before the next round's
    ``ETCDMaster.wait_peer_ready``. That callback comes from another thread and loses the
    race when the stopped pod held only dead ranks (stopping it takes no time), and it
    never comes when a peer node deleted the keys first (a delete of nothing sends no
    event): ``wait_peer_ready`` then skips its wait, counts no heartbeat and the launcher
    ends ("peer not ready", the failed rank's exit code). With ``--elastic_level`` 1 the
    failure is always followed by a restart, so the status is RESTARTING at once."""
    from paddle.distributed.launch.context.status import Status
    Status.fail = Status.restart  # ControllerBase.watch is its only caller


def _rendezvous_timeout():
    value = os.environ.get('PSANET_RENDEZVOUS_TIMEOUT', str(RENDEZVOUS_TIMEOUT))
    if not value.isdigit() or int(value) < 1:
        return None
    return int(value)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if any('etcd://' in arg for arg in argv + [os.environ.get('PADDLE_MASTER', '')]):
        # Before anything imports protobuf (Paddle does): the variable is read once.
        for name, value in ETCD_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
    if argv and argv[0] not in ('-h', '--help'):
        args = _launcher_args(argv)
        master = args.master or ''
        if master.startswith('etcd://'):
            problem = check_etcd(master)
            if problem is not None:
                print(f'error: {problem}', file=sys.stderr)
                return 2
            if args.elastic_level > 0 and compat.ELASTIC_OWN_FAILURE.needed():
                restart_own_failure()
        elif master and str(args.nnodes).split(':')[0] not in ('', '1'):
            timeout = _rendezvous_timeout()
            if timeout is None:
                print('error: PSANET_RENDEZVOUS_TIMEOUT must be a whole number of seconds above '
                      f'0, got {os.environ["PSANET_RENDEZVOUS_TIMEOUT"]!r}.', file=sys.stderr)
                return 2
            watch_rendezvous(os.getpid(), args, timeout)
    from paddle.distributed.launch.main import launch
    sys.argv = sys.argv[:1] + argv
    launch()  # exits with the launcher's code


if __name__ == '__main__':
    sys.exit(main())
