"""Starting serve.py as a user does, on a free loopback port, for the server's tests; and a
stand-in for a slow backend: ``python tests/serve_helpers.py GATE_DIR <serve.py flags>`` runs
serve.py with every model run (in its worker process) held while GATE_DIR/closed exists and
logged in GATE_DIR/runs."""
import contextlib
import ctypes
import json
import os
import socket
import subprocess
import sys
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SERVE_SCRIPT = os.path.join(ROOT, 'serve.py')


def make_image(rng, size):
    """A smooth BGR image of ``size`` (width, height) from a few random pixels."""
    import cv2
    small = rng.randint(0, 256, (4, 6, 3)).astype('uint8')
    return cv2.resize(small, size, interpolation=cv2.INTER_CUBIC)


def triton_image(triton, image, binary=True, batch=False):
    """tritonclient's input ``image`` of a BGR image: UINT8 RGB ``[H, W, 3]`` (``[1, H, W,
    3]`` with ``batch``), as binary tensor data or JSON."""
    import numpy as np
    rgb = np.ascontiguousarray(image[:, :, ::-1])
    rgb = rgb[None] if batch else rgb
    tensor = triton.InferInput('image', list(rgb.shape), 'UINT8')
    tensor.set_data_from_numpy(rgb, binary_data=binary)
    return tensor


def png_labels(response):
    """The class ids of a 200 palette-PNG answer, and its palette."""
    import io
    import numpy as np
    from PIL import Image
    assert response.status_code == 200, (response.status_code, response.text)
    assert response.headers['content-type'] == 'image/png'
    with Image.open(io.BytesIO(response.content)) as png:
        assert png.mode == 'P'
        return np.asarray(png), png.getpalette()


def assert_refused(response, status, *words):
    """A refusal: ``status``, one line of JSON ``{"error": ...}`` holding ``words``."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers['content-type'] == 'application/json'
    assert '\n' not in response.text and 'Traceback' not in response.text
    message = response.json()['error']
    for word in words:
        assert word in message, message
    return message


def post_image(url, path_or_bytes, content_type='image/png', headers=None, client=None,
               **params):
    """POST /v1/segment with a file's bytes as the body."""
    import httpx
    body = path_or_bytes
    if isinstance(path_or_bytes, (str, os.PathLike)):
        with open(path_or_bytes, 'rb') as f:
            body = f.read()
    return (client or httpx).post(f'{url}/v1/segment', content=body, params=params,
                                  timeout=120,
                                  headers={'Content-Type': content_type, **(headers or {})})


def free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


class Gate:
    """The slow backend's switch (``close``: runs wait; ``open``) and its log of runs."""

    def __init__(self, folder):
        self.folder = str(folder)
        os.makedirs(self.folder, exist_ok=True)
        self._closed = os.path.join(self.folder, 'closed')
        self._log = os.path.join(self.folder, 'runs')

    def close(self):
        open(self._closed, 'w').close()

    def open(self):
        if os.path.exists(self._closed):
            os.remove(self._closed)

    def hold_gil(self, seconds):
        """From now on each run also holds the worker's GIL for ``seconds`` (0: not), as
        Paddle Inference holds it for a whole run."""
        with open(os.path.join(self.folder, 'hold_gil'), 'w') as f:
            f.write(str(int(seconds)))

    def events(self):
        """``[(event, [N, 3, H, W])]``: 'enter' when a run begins, 'done' when it returns."""
        if not os.path.exists(self._log):
            return []
        with open(self._log) as f:
            return [tuple(json.loads(line)) for line in f if line.endswith('\n')]

    def runs(self):
        """The batch shapes of the runs done, in order."""
        return [shape for event, shape in self.events() if event == 'done']

    def entered(self):
        """How many runs have begun in all."""
        return sum(event == 'enter' for event, _ in self.events())

    def wait_entered(self, count, timeout=120):
        """Until ``count`` runs have begun in all."""
        deadline = time.monotonic() + timeout
        while self.entered() < count:
            assert time.monotonic() < deadline, f'no run {count} began: {self.events()}'
            time.sleep(0.02)


def _hold_runs(folder):
    """Pipeline.run held at the gate: the model worker's runs (the server spawns it with this
    file as its main module, ``__mp_main__``)."""
    sys.path.insert(0, ROOT)
    from psanet.deploy.pipeline import Pipeline
    gate, run = Gate(folder), Pipeline.run

    def log(event, batch):
        with open(gate._log, 'a') as f:
            f.write(json.dumps([event, list(batch.shape)]) + '\n')

    def gated_run(self, batch):
        log('enter', batch)
        while os.path.exists(gate._closed):
            time.sleep(0.01)
        hold = os.path.join(gate.folder, 'hold_gil')
        if os.path.exists(hold):
            with open(hold) as f:
                ctypes.PyDLL(None).sleep(int(f.read()))  # PyDLL: the GIL stays held
        output = run(self, batch)
        log('done', batch)
        return output

    Pipeline.run = gated_run


def _gated_serve(argv):
    sys.path.insert(0, ROOT)
    import serve
    from psanet.cli import exit_with
    exit_with(serve.main(argv))


@contextlib.contextmanager
def running_server(args, log_path, start_timeout=180, gate=None, wait_for='/ready',
                   scheme='http', verify=True):
    """``(process, url)`` of ``python serve.py *args --port <free>`` (held at ``gate``, a
    :class:`Gate`, if given), once ``wait_for`` answers 200; killed with its group when the
    block is left while it still runs."""
    import httpx
    from conftest import kill_group, read_text, started_process
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    command = [sys.executable, SERVE_SCRIPT] if gate is None else \
        [sys.executable, os.path.abspath(__file__), gate.folder]
    with open(log_path, 'wb') as log, started_process(
            [*command, *map(str, args), '--port', str(port)], cwd=ROOT,
            env=env, stdout=log, stderr=subprocess.STDOUT) as process:
        url = f'{scheme}://127.0.0.1:{port}'
        deadline = time.monotonic() + start_timeout
        while True:
            if process.poll() is not None:
                raise AssertionError(f'serve.py exited {process.returncode} while starting: '
                                     f'{read_text(log_path)[-3000:]}')
            try:
                if httpx.get(f'{url}{wait_for}', timeout=5, verify=verify).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                kill_group(process)
                raise AssertionError(f'serve.py did not answer {wait_for} in {start_timeout} s: '
                                     f'{read_text(log_path)[-3000:]}')
            time.sleep(0.2)
        yield process, url


if __name__ == '__main__':
    _gated_serve(sys.argv[2:])
elif __name__ == '__mp_main__' and len(sys.argv) > 1 and os.path.isdir(sys.argv[1]):
    _hold_runs(sys.argv[1])
