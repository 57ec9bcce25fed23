"""README.md: its "Next steps" block runs as written on the Quick start's outputs, and the
README stays a short map (under 250 lines).

The block runs in a folder laid out as a checkout after ``scripts/quickstart.sh``: the
scripts, configs and tools linked from this checkout, a mini Cityscapes at 256x128 in
``data/mini_cityscapes``, the session's seeded mini weights as the trained best model and
their export as the Quick start's export. The paths faked so are read from quickstart.sh
first, so that the script and the README cannot drift apart unseen. The Python commands run
in this process (their flags parsed by the scripts' own argparse, no Paddle start-up);
``serve.py ... &`` runs as a real server on a free port (the one change made to a line:
curl is pointed at that port), curl is the real curl, ``kill %1`` sends it SIGTERM.
"""
import contextlib
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import time

import cv2
import numpy as np
import pytest
from PIL import Image

from conftest import ROOT, finish, generate_dataset, started_process
from serve_helpers import free_port

README = os.path.join(ROOT, 'README.md')
QUICKSTART = os.path.join(ROOT, 'scripts', 'quickstart.sh')
MAX_README_LINES = 250
SERVE_DEFAULT = '127.0.0.1:8000'
LINKED = ('configs', 'tools', 'deploy', 'train.py', 'val.py', 'predict.py', 'export.py',
          'serve.py')


def next_steps_block(text):
    """The first fenced block after the ``### Next steps`` heading."""
    match = re.search(r'^### Next steps\n.*?^```\n(.*?)^```', text, re.M | re.S)
    assert match, 'README.md has no "### Next steps" heading followed by a ``` block'
    return match.group(1)


def commands(block):
    """The block's commands: continuation lines joined, comment lines dropped."""
    joined = block.replace('\\\n', ' ')
    return [line.strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith('#')]


def expand(line, variables):
    def value(match):
        name = match.group(1) or match.group(2)
        assert name in variables, f'${name} is not set above its use: {line}'
        return variables[name]
    return re.sub(r'\$(?:\{(\w+)\}|(\w+))', value, line)


def quickstart_paths():
    """The Quick start's output folder, best model, export folder and data folder, as
    scripts/quickstart.sh writes them."""
    script = open(QUICKSTART).read()
    out = re.search(r'^OUT=\$\{OUT:-([^}]+)\}$', script, re.M).group(1)
    data = re.search(r'^DATA=(\S+)$', script, re.M).group(1)
    model = re.search(r'^MODEL=\$OUT/(\S+)$', script, re.M).group(1)
    export = re.search(r'python export\.py .*--save_dir "\$OUT/([^"]+)"', script).group(1)
    assert re.search(r'make_mini_cityscapes\.py --out "\$DATA"', script)
    assert re.search(r'--save_dir "\$OUT/train"', script)
    return out, os.path.join(out, model), os.path.join(out, export), data


@pytest.fixture(scope='module')
def quickstart_checkout(tmp_path_factory, mini_weights, mini_export):
    """A folder laid out as this checkout after the Quick start (module docstring)."""
    root = tmp_path_factory.mktemp('quickstart_checkout')
    for name in LINKED:
        os.symlink(os.path.join(ROOT, name), root / name)
    _, model, export, data = quickstart_paths()
    # the Quick start's generator flags, but one val and one train image
    mini = generate_dataset(tmp_path_factory, num_train=1, seed=0, size=(256, 128), num_val=1)
    (root / data).parent.mkdir(parents=True)
    os.symlink(mini, root / data)
    (root / model).parent.mkdir(parents=True)
    shutil.copy(mini_weights, root / model)
    shutil.copytree(os.path.dirname(mini_export), root / export)
    return root


def run_in_process(argv, capfd):
    """``python <argv>`` in this process: (exit code, stdout)."""
    capfd.readouterr()
    saved = sys.argv
    sys.argv = list(argv)
    try:
        if argv[0] == '-c':
            sys.argv = ['-c', *argv[2:]]
            exec(compile(argv[1], '<string>', 'exec'), {'__name__': '__main__'})
        else:
            runpy.run_path(argv[0], run_name='__main__')
        code = 0
    except SystemExit as stop:
        code = stop.code or 0
    finally:
        sys.argv = saved
    out, err = capfd.readouterr()
    return code, out + err


def run_beside(args, root, server, timeout=300):
    """``args`` as a process while ``server`` runs: (exit code, output); a server that
    exits meanwhile fails the test at once with its log (curl would retry for minutes)."""
    deadline = time.monotonic() + timeout
    with started_process(args, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True) as process:
        while process.poll() is None:
            assert server.poll() is None, (
                f'serve.py exited {server.returncode}: '
                f'{(root / "serve.log").read_text(errors="replace")[-3000:]}')
            assert time.monotonic() < deadline, f'{args} ran longer than {timeout} s'
            time.sleep(0.5)
        return process.returncode, process.stdout.read()


def written_paths(args):
    """What a command names as its output: --save_dir folders, curl's -o file."""
    return [args[i + 1] for i, arg in enumerate(args[:-1]) if arg in ('--save_dir', '-o')]


def check_content(args, output, variables, root):
    """What the block's comments promise, read from what each command wrote or printed."""
    image = cv2.imread(str(root / variables['IMAGE']))
    if args[:2] == ['python', 'val.py']:
        assert re.search(r'mIoU: \d\.\d{4}', output), output[-2000:]
    if args[:2] == ['python', '-c']:
        assert output.strip().splitlines()[-1] == str(image.shape[:2]), output[-2000:]
    if args[0] == 'curl':
        label = Image.open(root / written_paths(args)[0])
        assert label.mode == 'P' and label.size == (image.shape[1], image.shape[0])
        assert np.asarray(label).max() < 19
    if args[:2] == ['python', 'predict.py']:
        name = os.path.basename(variables['IMAGE'])
        for folder in ('pseudo_color_prediction', 'added_prediction'):
            written = [f for _, _, files in os.walk(root / written_paths(args)[0] / folder)
                       for f in files]
            assert written == [name], (folder, written)


def test_next_steps_run_as_written(quickstart_checkout, monkeypatch, capfd):
    root = quickstart_checkout
    monkeypatch.chdir(root)
    monkeypatch.setenv('PYTHONPATH', ROOT)
    # serve.py's default port is the one the block's curl asks
    serve = runpy.run_path(os.path.join(ROOT, 'serve.py'))
    parsed = serve['parse_args'](['--config', 'x.yml'])
    assert f'{parsed.host}:{parsed.port}' == SERVE_DEFAULT
    variables, server, port = {}, None, None
    with open(README) as f:
        block = next_steps_block(f.read())
    lines = commands(block)
    assert len(lines) >= 6, lines
    with contextlib.ExitStack() as stack:  # a server still running at a failure is killed
        for line in lines:
            if shlex.split(line, comments=True) == ['.', '.venv/bin/activate']:
                continue  # the tests run in the environment already
            assignment = re.fullmatch(r'(\w+)=(\S+)', line)
            if assignment:
                variables[assignment.group(1)] = expand(assignment.group(2), variables)
                continue
            args = shlex.split(expand(line, variables), comments=True)
            if args[0] == 'python' and args[-1] == '&':
                assert server is None, 'a second background server'
                port = free_port()
                log = stack.enter_context(open(root / 'serve.log', 'wb'))
                server = stack.enter_context(started_process(
                    [sys.executable, *args[1:-1], '--port', str(port)], cwd=root,
                    stdout=log, stderr=subprocess.STDOUT))
                continue
            if args == ['kill', '%1']:
                assert server is not None, 'kill %1 without a server started with &'
                server.send_signal(signal.SIGTERM)
                finish(server, 120)
                assert server.returncode == 0, (root / 'serve.log').read_text()[-3000:]
                server = None
                continue
            if args[0] == 'python':
                code, output = run_in_process(args[1:], capfd)
            elif args[0] == 'curl':
                assert server is not None, 'curl without a server started with &'
                args = [a.replace(SERVE_DEFAULT, f'127.0.0.1:{port}') for a in args]
                code, output = run_beside(args, root, server)
            else:
                pytest.fail(f'the test does not know how to run this line: {line}')
            assert code == 0, f'{line}\nexited {code}:\n{output[-3000:]}'
            for path in written_paths(args):
                assert os.path.exists(root / path), f'{line}\ndid not write {path}'
            check_content(args, output, variables, root)
        assert server is None, 'a server started with & is not stopped by the block'


def test_next_steps_use_the_quickstart_outputs():
    """The block's paths are the Quick start's: its output folder, model and data."""
    out, model, export, data = quickstart_paths()
    with open(README) as f:
        block = next_steps_block(f.read())
    assert f'MODEL={model}\n' in block
    assert f"'{export}'" in block or f'{export}/deploy.yaml' in block
    assert f'IMAGE={data}/' in block
    for line in commands(block):
        for path in written_paths(shlex.split(line, comments=True)):
            assert path.startswith(out + '/'), f'{path}: not under the Quick start\'s {out}/'


def test_readme_is_a_short_map():
    with open(README) as f:
        lines = f.read().splitlines()
    assert len(lines) < MAX_README_LINES, (
        f'README.md has {len(lines)} lines: move long explanations to docs/')
