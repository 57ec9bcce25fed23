"""Starting serve.py as a user does, on a free loopback port, for the server's tests."""
import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx

from conftest import ROOT, kill_group, read_text, started_process

SERVE_SCRIPT = os.path.join(ROOT, 'serve.py')


def free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(args, log_path, start_timeout=180):
    """``(process, url)`` of ``python serve.py *args --port <free>``, once ``/ready`` answers;
    killed with its group when the block is left while it still runs."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    with open(log_path, 'wb') as log, started_process(
            [sys.executable, SERVE_SCRIPT, *map(str, args), '--port', str(port)], cwd=ROOT,
            env=env, stdout=log, stderr=subprocess.STDOUT) as process:
        url = f'http://127.0.0.1:{port}'
        deadline = time.monotonic() + start_timeout
        while True:
            if process.poll() is not None:
                raise AssertionError(f'serve.py exited {process.returncode} while starting: '
                                     f'{read_text(log_path)[-3000:]}')
            try:
                if httpx.get(f'{url}/ready', timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                kill_group(process)
                raise AssertionError(f'serve.py did not get ready in {start_timeout} s: '
                                     f'{read_text(log_path)[-3000:]}')
            time.sleep(0.2)
        yield process, url

