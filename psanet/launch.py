"""``python -m psanet.launch``: ``paddle.distributed.launch`` with its flags checked.

It takes exactly the arguments of Paddle's launcher and runs it in this process once
:func:`check` and :func:`check_here` have found nothing that cannot work: a launch that
would fail, hang or train the wrong thing ends in one ``error:`` line before anything
starts. Around Paddle's launcher it adds what an ``etcd://`` master needs, a watcher that
ends a multi-node rendezvous that does not meet within ``PSANET_RENDEZVOUS_TIMEOUT``
seconds, and a stopped run's resume line (docs/training.md, "Multi-card and multi-node").
"""
import contextlib
import errno
import glob
import io
import ipaddress
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from argparse import Namespace
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, cast

from psanet import compat  # first: it filters Paddle's ccache notice before paddle loads
from psanet.errors import ConfigError
from psanet.interrupts import STOP_NOTE

__all__ = ['main', 'check', 'check_here', 'Launch']

ETCD_TIMEOUT = 5  # seconds for the etcd to answer its status request
RENDEZVOUS_TIMEOUT = 300  # default of PSANET_RENDEZVOUS_TIMEOUT
MASTER_PROBE_TIMEOUT = 3  # seconds for a rendezvous server on the master's port to answer
# etcd3 0.12's generated _pb2 files load only with the pure-Python protobuf (protobuf 4+
# refuses them: "Descriptors cannot be created directly"). The launcher forks its ranks while
# its etcd watch thread is inside gRPC, whose fork handlers then break a rank at start now
# and then ("epoll_wait error: Bad file descriptor"); the ranks exec at once and use no gRPC.
ETCD_ENVIRONMENT = {'PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION': 'python',
                    'GRPC_ENABLE_FORK_SUPPORT': 'false'}
EXAMPLE = ('python -m psanet.launch --nproc_per_node 2 train.py --config CONFIG '
           '--device cpu')


@dataclass(frozen=True)
class Launch:
    """A checked launch line: ``args`` as Paddle's ``Context`` takes them (its parser, then the
    ``PADDLE_*`` variables); ``nnodes`` the largest number of nodes; ``etcd`` whether the
    master is an ``etcd://`` one; ``rendezvous_timeout`` None: no watcher (one node, or etcd)."""
    args: Namespace
    nnodes: int
    etcd: bool
    restart_own_failure: bool
    rendezvous_timeout: Optional[float]


def _flag(args, name):
    """How the user gave the launcher's ``name``: ``--name VALUE`` or the variable
    that overrides it."""
    from paddle.distributed.launch.context.args_envs import env_args_mapping
    for variable, (attribute, _) in env_args_mapping.items():
        if attribute == name and variable in os.environ:
            return f'{variable}={os.environ[variable]} (it overrides --{name})'
    if name == 'rank' and int(os.environ.get('PADDLE_TRAINER_ID', -1)) >= 0:
        return f'PADDLE_TRAINER_ID={os.environ["PADDLE_TRAINER_ID"]} (it overrides --rank)'
    return f'--{"gpus/--devices" if name == "devices" else name} {getattr(args, name)}'


def _parse(argv):
    """The launcher's flags, parsed by the launcher's parser (train.py's come after the
    script and are not looked at), with its ``PADDLE_*`` variables overriding them as
    in the launcher's ``Context``. None after ``--help`` (the help is printed)."""
    from paddle.distributed.launch.context.args_envs import env_args_mapping, parse_args
    saved, sys.argv = sys.argv, ['launch'] + list(argv)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args, unknown = parse_args()
    except SystemExit as ended:
        if not ended.code:
            return None
        problem = said.getvalue().strip().splitlines()[-1].split('error: ', 1)[-1]
        if 'training_script' in problem:
            raise ConfigError(f'no training script: give it after the launcher\'s flags, '
                              f'e.g. {EXAMPLE}') from None
        raise ConfigError(f'{problem}: python -m psanet.launch --help lists the launcher\'s '
                          'flags') from None
    finally:
        sys.argv = saved
    if unknown:
        raise ConfigError(
            f'unrecognized launcher flag{"s" * (len(unknown) > 1)} {" ".join(unknown)}: '
            'python -m psanet.launch --help lists the launcher\'s flags; train.py\'s flags '
            'go after the training script.')
    mapping = cast(Dict[str, Tuple[str, Callable[[str], Any]]], env_args_mapping)
    for variable, (name, kind) in mapping.items():
        if variable in os.environ:
            try:
                setattr(args, name, kind(os.environ[variable]))
            except ValueError:
                raise ConfigError(f'{variable}={os.environ[variable]!r} (it sets --{name}) '
                                  f'is not a {kind.__name__}: fix or unset it.') from None
    return args


def _node_count(args):
    """(min, max) of ``--nnodes N`` or ``--nnodes MIN:MAX``."""
    text = str(args.nnodes)
    parts = text.split(':')
    if len(parts) > 2 or not all(part.strip().isdigit() for part in parts) or \
            not 1 <= int(parts[0]) <= int(parts[-1]):
        raise ConfigError(f'{_flag(args, "nnodes")} is not a number of nodes: give a whole '
                          'number from 1 (or MIN:MAX, 1 <= MIN <= MAX, with an etcd:// '
                          'master).')
    return int(parts[0]), int(parts[-1])


def _endpoint(args, master, scheme='', example=49178):
    """(host, port) of ``scheme`` HOST:PORT, the port a number from 1 to 65535."""
    host, colon, port = master[len(scheme):].rpartition(':')
    if not colon or not host:
        raise ConfigError(f'{_flag(args, "master")} has no port: give {scheme}HOST:PORT, e.g. '
                          f'{master.rstrip(":")}:{example}.')
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f'{_flag(args, "master")}: its port {port!r} is not a number from '
                          f'1 to 65535: give the port it listens on, e.g. {example}.')
    return host, int(port)


def _check_master(args):
    master = args.master
    if master.startswith('etcd://'):
        _endpoint(args, master, 'etcd://', 2379)
        return
    host, _ = _endpoint(args, master)
    if ':' in host:
        raise ConfigError(f'{_flag(args, "master")}: {host} is not an IPv4 address or a host '
                          'name (Paddle\'s rendezvous takes IPv4): give the first node\'s IPv4 '
                          'address.')


def _rendezvous_timeout():
    value = os.environ.get('PSANET_RENDEZVOUS_TIMEOUT', str(RENDEZVOUS_TIMEOUT))
    if not value.strip().isdigit() or int(value) < 1:
        raise ConfigError(f'PSANET_RENDEZVOUS_TIMEOUT={value!r} is not a whole number of '
                          f'seconds above 0: give one (the default is {RENDEZVOUS_TIMEOUT}) '
                          'or unset it.')
    return int(value)


def _check_script(args):
    script = args.training_script
    if script.endswith('.py') or os.sep in script:
        found = os.path.isfile(script)
    else:  # Paddle runs any other script as a command
        found = shutil.which(script) is not None
    if not found:
        raise ConfigError(f'the training script {script} does not exist (in {os.getcwd()}): '
                          'run from the repository root or give its path.')


def check(argv: Sequence[str]) -> Optional[Launch]:
    """Checks a launch line (the launcher's flags, the script, the variables that
    override the flags) without touching the network; returns its :class:`Launch`, or
    None after ``--help``. Raises :class:`~psanet.errors.ConfigError` naming the
    problem and the fix."""
    args = _parse(argv)
    if args is None:
        return None
    _, nnodes = _node_count(args)
    if not -1 <= args.rank < nnodes:
        raise ConfigError(f'{_flag(args, "rank")} is not a node of {_flag(args, "nnodes")}: '
                          f'give each node its own --rank from 0 to {nnodes - 1} (or leave '
                          'it out).')
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ConfigError(f'{_flag(args, "nproc_per_node")} starts no process: give 1 or '
                          'more.')
    if args.master:
        _check_master(args)
    timeout = _rendezvous_timeout()
    _check_script(args)
    etcd = bool(args.master) and args.master.startswith('etcd://')
    return Launch(args=args, nnodes=nnodes, etcd=etcd,
                  restart_own_failure=etcd and args.elastic_level > 0,
                  rendezvous_timeout=None if etcd or nnodes == 1 or not args.master
                  else timeout)


def check_here(launch: Launch) -> None:
    """Checks what the launch needs of this machine: the devices ``--devices`` /
    ``--gpus`` names, and with more than one node and an HTTP master on this machine,
    that its rendezvous server can start. Raises :class:`~psanet.errors.ConfigError`."""
    args = launch.args
    if args.devices:
        _check_devices(args)
    if launch.rendezvous_timeout is not None:
        _check_master_port(args)


def _check_devices(args):
    from paddle.distributed.launch.context.device import Device, DeviceType
    from paddle.base import core
    device = Device.parse_device()
    asked = [label.strip() for label in args.devices.split(',')]
    if device.dtype == DeviceType.CPU:
        why = ('no GPU is visible here' if core.is_compiled_with_cuda() else
               'this Paddle is built for the CPU')
        raise ConfigError(f'{_flag(args, "devices")} asks for GPUs, and {why}: on the CPU '
                          'give --nproc_per_node N instead of it (N processes, gloo).')
    missing = [label for label in asked if label not in device.labels]
    if missing:
        raise ConfigError(f'{_flag(args, "devices")} names {",".join(missing)}, which this '
                          f'machine does not have: its visible {device.dtype} devices are '
                          f'{",".join(device.labels)}.')


def _check_master_port(args):
    """On the machine of ``--master``, where a node starts the rendezvous server if the
    address is its own or 127.0.0.1: that it is, and that the port is one this user can
    take, or a rendezvous server's already. A host name elsewhere is resolved (a node
    that does not start the server reaches it by name)."""
    from paddle.distributed.launch.context.node import Node
    host, port = _endpoint(args, args.master)
    try:
        address = str(ipaddress.IPv4Address(host))
    except ValueError:
        try:
            address = socket.gethostbyname(host)
        except OSError:
            raise ConfigError(f'{_flag(args, "master")}: the host name {host} has no address '
                              'here: give the first node\'s IP address.') from None
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
            error = 0
        except OSError as failed:
            error = failed.errno or 0
    if error == errno.EADDRNOTAVAIL:
        return  # another machine's address: its node starts the server
    own = Node().ip
    if host not in ('127.0.0.1', own):
        raise ConfigError(
            f'{_flag(args, "master")}: {host} is this machine, but Paddle starts the '
            f'rendezvous server only when --master is 127.0.0.1 or {own} (what the host name '
            f'{socket.gethostname()} resolves to), so no node would start it: give --master '
            f'{own}:{port} if the other nodes reach that address.')
    if error == errno.EACCES:
        raise ConfigError(f'{_flag(args, "master")}: port {port} needs root on this machine '
                          '(ports below 1024): give one from 1024 to 65535.')
    if error and not _rendezvous_server_at(host, port):
        raise ConfigError(f'{_flag(args, "master")}: port {port} on this machine is taken by '
                          'a program that is not a rendezvous server: give a free port.')


def _rendezvous_server_at(host, port):
    """True when Paddle's rendezvous server (another node's launcher on this machine)
    answers its health check at host:port."""
    try:
        with urllib.request.urlopen(f'http://{host}:{port}/healthy',
                                    timeout=MASTER_PROBE_TIMEOUT) as answer:
            return json.loads(answer.read()).get('/healthy') == 'ok'
    except (OSError, ValueError, AttributeError):
        return False


def check_etcd(master: str, timeout: float = ETCD_TIMEOUT) -> Optional[str]:
    """None when the etcd of ``etcd://host:port`` answers, else the error line's text."""
    try:
        import etcd3
    except ImportError:
        return (f'--master {master} needs the etcd3 client in this environment: pip install '
                'etcd3==0.12.0 (requirements-dev.txt).')
    host, _, port = master[len('etcd://'):].rpartition(':')
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


def ranks_started(log_dir: str, since: float) -> bool:
    """True once a rank of this launch has written its ``workerlog.*`` in ``log_dir``
    (modified at ``since`` or later: a reused --log_dir holds older ones)."""
    for path in glob.glob(os.path.join(log_dir, 'workerlog.*')):
        with contextlib.suppress(OSError):
            if os.path.getmtime(path) >= since - 1:
                return True
    return False


def watch_rendezvous(launcher: int, args: Namespace, timeout: float) -> None:
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
    try:
        while time.monotonic() < deadline:
            os.kill(launcher, 0)
            if ranks_started(args.log_dir, started):
                os._exit(0)
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


def restart_own_failure() -> None:
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
    # ControllerBase.watch is its only caller.
    Status.fail = Status.restart  # type: ignore[method-assign]


def _stop_note():
    """The file this launcher's ranks leave their stop lines in (PSANET_STOP_NOTE)."""
    path = os.path.join(tempfile.gettempdir(), f'psanet-launch-{os.getpid()}.stop')
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # an older launcher's of the same process id
    return path


def _print_stop_note(path):
    with contextlib.suppress(OSError):
        with open(path) as f:
            text = f.read()
        os.unlink(path)
        sys.stderr.write(text)
        sys.stderr.flush()


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any('etcd://' in arg for arg in argv + [os.environ.get('PADDLE_MASTER', '')]):
        # Before anything imports protobuf (Paddle does): the variable is read once.
        for name, value in ETCD_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
    try:
        launch = check(argv)
        if launch is None:
            return 0
        check_here(launch)
    except ConfigError as error:
        print(f'error: {error}', file=sys.stderr)
        return 2
    if launch.etcd:
        problem = check_etcd(launch.args.master)
        if problem is not None:
            print(f'error: {problem}', file=sys.stderr)
            return 2
        if launch.restart_own_failure and compat.ELASTIC_OWN_FAILURE.needed():
            restart_own_failure()
    if launch.rendezvous_timeout is not None:
        watch_rendezvous(os.getpid(), launch.args, launch.rendezvous_timeout)
    note = os.environ[STOP_NOTE] = _stop_note()
    from paddle.distributed.launch.main import launch as paddle_launch
    sys.argv = sys.argv[:1] + argv
    try:
        paddle_launch()  # exits with the launcher's code
    finally:
        _print_stop_note(note)
    return 0


if __name__ == '__main__':
    sys.exit(main())
