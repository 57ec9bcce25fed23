"""Shared test setup: the repository root on sys.path, the paths every test file needs,
how the outputs of two backends are compared, and fixtures for expensive shared setup.

Test modules import these names (``from conftest import ROOT``) instead of
working the root out again; fixtures shared by several files live here too.

No test relies on an earlier one having run: what several tests need is a
fixture here or in their module. To check, run a file's tests in reverse order:
``PSANET_TEST_REVERSE=1 python -m pytest -p no:cacheprovider tests/test_x.py``.
"""
import contextlib
import glob
import importlib.util
import math
import os
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# psanet.Segmenter times its CPU backends on a first load when none is named and caches the
# choice under ~/.cache/psanet: for the suite (and every process it starts) the fixed order,
# and a cache of its own; the tests of the timing turn it on and name their cache.
os.environ['PSANET_TIME_BACKENDS'] = '0'
os.environ['PSANET_CACHE_DIR'] = os.path.join(
    tempfile.gettempdir(), f'psanet-test-cache-{os.getpid()}')
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MINI_CONFIG, = glob.glob(os.path.join(ROOT, 'configs', 'psanet', '*mini*.yml'))


INFER_SCRIPT = os.path.join(ROOT, 'deploy', 'python', 'infer.py')


# ---------------------------------------------------------------------------
# Subprocesses that cannot hang the suite
# ---------------------------------------------------------------------------

def kill_group(process):
    """Kills ``process`` and every process of its group (DataLoader workers, a compiler)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


@contextlib.contextmanager
def started_process(args, **kwargs):
    """subprocess.Popen in a process group of its own, killed with its group when the
    block is left while it still runs (a failed assertion, a timeout)."""
    process = subprocess.Popen(args, start_new_session=True, **kwargs)
    try:
        yield process
    finally:
        if process.poll() is None:
            kill_group(process)
        for stream in (process.stdin, process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def finish(process, timeout, input=None):
    """``process.communicate(input, timeout)`` for a process started in a group of its own
    (``start_new_session=True``): past ``timeout`` the group is killed and the test fails."""
    try:
        return process.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)
        out, err = process.communicate()
        pytest.fail(f'{process.args} ran longer than {timeout} s; killed with its process '
                    f'group. stdout: {str(out)[-3000:]}\nstderr: {str(err)[-3000:]}')
    except BaseException:
        kill_group(process)
        raise


def run_process(args, timeout=600, check=False, capture_output=False, input=None, **kwargs):
    """subprocess.run in a process group of its own. Past ``timeout`` seconds the whole
    group is killed and the test fails, naming the command and what it printed."""
    if capture_output:
        kwargs['stdout'] = kwargs['stderr'] = subprocess.PIPE
    if input is not None:
        kwargs['stdin'] = subprocess.PIPE
    with started_process(args, **kwargs) as process:
        out, err = finish(process, timeout, input)
    done = subprocess.CompletedProcess(args, process.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def infer_in_process(capfd, *args):
    """deploy/python/infer.py's flag parsing and main call in this process (no start-up
    cost): (exit code, stdout, stderr); argparse's exit is returned as the code."""
    spec = importlib.util.spec_from_file_location('infer_script', INFER_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capfd.readouterr()
    try:
        code = script.main([str(a) for a in args])
    except SystemExit as error:
        code = error.code
    out, err = capfd.readouterr()
    return code, out, err


def pytest_collection_modifyitems(config, items):
    """PSANET_TEST_REVERSE=1 runs the collected tests last first (see the module docstring)."""
    if os.environ.get('PSANET_TEST_REVERSE') == '1':
        items.reverse()


def pytest_runtest_logreport(report):
    """PSANET_SKIPS_FILE=path appends a line per skipped test, its node id and reason apart
    by a tab: .ci/run reruns the tests that skip on its newest Python for want of a wheel
    (paddle2onnx) on a Python that has one."""
    path = os.environ.get('PSANET_SKIPS_FILE')
    if os.environ.get('PYTEST_XDIST_WORKER'):  # under xdist the controller writes them
        return
    if path and report.skipped and not hasattr(report, 'wasxfail'):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        with open(path, 'a') as f:
            f.write(f'{report.nodeid}\t{reason}\n')


# ---------------------------------------------------------------------------
# Comparing float32 outputs of two backends
# ---------------------------------------------------------------------------

FLOAT32_EPS = float(np.finfo(np.float32).eps)  # 1.19e-7


@contextlib.contextmanager
def autocast_state(on, dtype='float16'):
    """The dygraph tracer's autocast level and dtype set as amp_guard sets them (autocast
    itself does nothing on a CPU), put back after the block."""
    from paddle.base import core
    from paddle.base.framework import _dygraph_tracer
    tracer = _dygraph_tracer()
    saved = tracer._amp_level, tracer._amp_dtype
    tracer._amp_level = core.AmpLevel.O1 if on else core.AmpLevel.O0
    tracer._amp_dtype = dtype
    try:
        yield
    finally:
        tracer._amp_level, tracer._amp_dtype = saved


def reordered_sum_rtol(reduction_length):
    """Tolerance, relative to the largest output, for float32 results whose sums another
    backend adds in another order.

    oneDNN, onnxruntime, MKL on another instruction set, another thread count or
    batch size: each adds the K products of a dot product in an order of its own
    (blocked, vectorised, split over threads), and each order rounds differently.
    The rounding errors of the K - 1 additions add like a random walk, about
    sqrt(K) * eps of the output's magnitude whatever the order; the tolerance is
    four times that. Measured on the networks of these tests, whole-network
    differences stay below one layer's sqrt(K) * eps: the mini PSANet's logits
    (K = 4608) moved by 1.0e-6 .. 3.8e-6 of the largest under oneDNN, onnxruntime,
    two threads, and MKL/oneDNN held to AVX2 or SSE4.1 (MKL_ENABLE_INSTRUCTIONS,
    ONEDNN_MAX_CPU_ISA) on an AVX-512 machine, 6.3e-6 under oneDNN on another CPU;
    the tolerance from here is 3.2e-5.

    Args:
        reduction_length (int): K, the longest sum in the network (a conv's
            in_channels * kernel_h * kernel_w, a matmul's inner size).

    Returns:
        float: 4 * eps32 * sqrt(K).
    """
    return 4 * FLOAT32_EPS * math.sqrt(reduction_length)


# The longest sums: PSANet-mini's ResNet18 3x3 convolutions over 512 channels;
# TinySegNet's (engine_helpers) 3x3 convolution over 8 channels.
MINI_PSANET_RTOL = reordered_sum_rtol(3 * 3 * 512)  # 3.2e-5
TINY_SEGNET_RTOL = reordered_sum_rtol(3 * 3 * 8)    # 4.0e-6


def clear_margin_pixels(expected, atol, class_axis=1):
    """Pixels whose two largest values along ``class_axis`` are more than 2 * atol apart:
    any output within atol of ``expected`` has the same argmax there.

    Returns:
        np.ndarray: bool, ``expected``'s shape without the class axis.
    """
    top2 = np.sort(np.asarray(expected, np.float64), axis=class_axis)
    top2 = np.take(top2, [-2, -1], axis=class_axis)
    margin = np.take(top2, 1, axis=class_axis) - np.take(top2, 0, axis=class_axis)
    return margin > 2 * atol


def assert_logits_agree(actual, expected, rtol, what='output', scale=None, class_axis=1,
                        min_clear=0.9):
    """Asserts that a backend's output shows the user what the reference does.

    Float ``actual`` (logits or probabilities of ``expected``'s shape) must be within
    ``atol = rtol * scale`` of ``expected`` everywhere, NaN failing; ``actual`` may also
    be a class map (``expected``'s shape without the class axis), whose logits are then
    taken to be within atol. Either way the argmax must equal ``expected``'s on every
    pixel whose top-two margin exceeds 2 * atol (a near-tie may go either way), and at
    least ``min_clear`` of the pixels must be that clear, or the check says little.

    Args:
        actual (np.ndarray): the output under test.
        expected (np.ndarray): the reference logits (or probabilities).
        rtol (float): allowed difference relative to ``scale``, e.g. ``reordered_sum_rtol``.
        what (str, optional): names the comparison in the failure message.
        scale (float, optional): magnitude the tolerance is relative to. Default: the
            largest ``|expected|``.
        class_axis (int, optional): Default: 1 (NCHW).
        min_clear (float, optional): Default: 0.9.

    Returns:
        np.ndarray: the bool mask of clear pixels.
    """
    __tracebackhide__ = True
    expected = np.asarray(expected, np.float64)
    actual = np.asarray(actual)
    scale = float(np.abs(expected).max()) if scale is None else float(scale)
    atol = rtol * scale
    want_labels = expected.argmax(class_axis)
    if actual.shape == want_labels.shape and not np.issubdtype(actual.dtype, np.floating):
        got_labels = actual
    else:
        if actual.shape != expected.shape:
            raise AssertionError(f'{what}: shape {actual.shape}, expected {expected.shape}')
        diff = np.abs(actual.astype(np.float64) - expected)
        bad = ~(diff <= atol)
        if bad.any():
            worst = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(diff, nan=np.inf),
                                                        -1.0)), diff.shape)
            raise AssertionError(
                f'{what}: {int(bad.sum())} of {diff.size} values differ by more than '
                f'atol {atol:.3g} (rtol {rtol:.3g} x scale {scale:.4g}); the largest '
                f'difference {diff[worst]:.3g} at {tuple(int(i) for i in worst)}: got '
                f'{float(actual[worst]):.7g}, expected {expected[worst]:.7g}')
        got_labels = actual.argmax(class_axis)
    clear = clear_margin_pixels(expected, atol, class_axis)
    if clear.mean() < min_clear:
        raise AssertionError(
            f'{what}: only {clear.mean():.1%} of the pixels have a top-two margin above '
            f'2 * atol = {2 * atol:.3g}, fewer than {min_clear:.0%}: the argmax check would '
            'say little; use inputs further from ties')
    wrong = clear & (got_labels != want_labels)
    if wrong.any():
        first = tuple(int(i) for i in np.argwhere(wrong)[0])
        raise AssertionError(
            f'{what}: the class differs on {int(wrong.sum())} of {int(clear.sum())} pixels '
            f'whose top-two margin exceeds 2 * atol = {2 * atol:.3g}; first at {first}: got '
            f'{got_labels[first]}, expected {want_labels[first]}')
    return clear


# ---------------------------------------------------------------------------
# Shared data
# ---------------------------------------------------------------------------

def generate_dataset(tmp_path_factory, num_train, seed, size=(64, 32), num_val=2):
    """A small mini Cityscapes for one module's fixture to share (read-only)."""
    from psanet.data import generate_mini_cityscapes
    root = str(tmp_path_factory.mktemp('pristine') / 'mini')
    generate_mini_cityscapes(root, num_train, num_val, size, seed=seed)
    return root


def train_labels(root):
    return sorted(glob.glob(os.path.join(root, 'gtFine/train/*/*_gtFine_labelTrainIds.png')))


def train_images(root):
    return sorted(glob.glob(os.path.join(root, 'leftImg8bit/train/*/*_leftImg8bit.png')))


def cityscapes(root, mode='train'):
    """paddleseg's Cityscapes over ``root``, with Normalize only."""
    from paddleseg.datasets import Cityscapes
    from paddleseg.transforms import Normalize
    return Cityscapes(transforms=[Normalize()], dataset_root=root, mode=mode)


def copy_dataset(root, tmp_path):
    """A copy of ``root`` under ``tmp_path`` that a test may change."""
    import shutil
    copy = str(tmp_path / 'mini')
    shutil.copytree(root, copy)
    return copy


@pytest.fixture(scope='session')
def mini_cityscapes(tmp_path_factory):
    """A generated mini Cityscapes, 2 train + 3 val images of 64x32: read it, never
    change it (copy it first, with shutil.copytree)."""
    from psanet.data import generate_mini_cityscapes
    root = str(tmp_path_factory.mktemp('shared') / 'mini_cityscapes')
    generate_mini_cityscapes(root, num_train=2, num_val=3, size=(64, 32), seed=0)
    return root


TIPC_TXT = 'test_tipc/configs/psanet/train_infer_python.txt'


def tipc_env(output_dir=None):
    """The environment the TIPC scripts run in: `python:python` in the txt is the
    interpreter running the tests; TIPC_OUTPUT keeps logs out of the tree."""
    env = dict(os.environ)
    env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env.get('PATH', '')
    if output_dir is not None:
        env['TIPC_OUTPUT'] = str(output_dir)
    return env


@pytest.fixture(scope='session')
def tipc_lite_data():
    """test_tipc/prepare.sh lite_train_lite_infer, once per session: the mini Cityscapes
    in test_tipc/data/cityscapes (where the txt points) and the op built. Returns the
    script's output."""
    result = run_process(['bash', 'test_tipc/prepare.sh', TIPC_TXT, 'lite_train_lite_infer'],
                         cwd=ROOT, env=tipc_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=600)
    assert result.returncode == 0, result.stdout
    return result.stdout


def onnx_tools_missing():
    """Why the ONNX tests cannot run here, or '' when they can."""
    missing = [name for name in ('paddle2onnx', 'onnxruntime')
               if importlib.util.find_spec(name) is None]
    if not missing:
        return ''
    why = ('requirements-dev.txt leaves them out on Python 3.13: paddle2onnx 2.1.0 has no '
           'wheels for it' if sys.version_info >= (3, 13) else
           'pip install -r requirements-dev.txt installs them on this Python')
    return f'{" and ".join(missing)} not installed ({why})'


needs_onnx = pytest.mark.skipif(bool(onnx_tools_missing()), reason=onnx_tools_missing())


def read_text(path):
    """The text of a log that may not exist yet (''), undecodable bytes replaced."""
    try:
        with open(path, errors='replace') as f:
            return f.read()
    except OSError:
        return ''


def write_mini_train_config(path, root):
    """The mini config on the data at ``root`` with 64x32 crops (a step in a fraction of a
    second): what the launched trainings of the tests run."""
    mini = os.path.join(ROOT, 'configs', 'psanet',
                        'psanet_resnet18_os8_mini_cityscapes_128x64_100.yml')
    path.write_text(f'''_base_: {mini}
train_dataset:
  dataset_root: {root}
  transforms:
    - type: RandomPaddingCrop
      crop_size: [64, 32]
    - type: Normalize
val_dataset:
  dataset_root: {root}
''')
    return str(path)


# ---------------------------------------------------------------------------
# A served model: the mini PSANet's seeded weights and their export, once per session
# ---------------------------------------------------------------------------

@pytest.fixture(scope='session')
def mini_weights(tmp_path_factory):
    """model.pdparams of the mini config's PSANet with seeded weights (seed 1)."""
    import paddle
    from engine_helpers import mini_psanet_for_eval
    path = str(tmp_path_factory.mktemp('mini_weights') / 'model.pdparams')
    paddle.save(mini_psanet_for_eval(seed=1).state_dict(), path)
    return path


@pytest.fixture(scope='session')
def mini_export(mini_weights, tmp_path_factory):
    """deploy.yaml of the mini PSANet exported as export.py does by default (argmax out,
    the custom op, Paddle Inference)."""
    from psanet.export import export_from_config
    return export_from_config(MINI_CONFIG, mini_weights,
                              str(tmp_path_factory.mktemp('mini_export') / 'export'))


@pytest.fixture(scope='session')
def mini_model_server(mini_weights, tmp_path_factory):
    """``(url, log path)`` of serve.py on the mini config and ``mini_weights`` (the dygraph
    model, the explorer page), started once for the session as a user starts it."""
    from serve_helpers import running_server
    log = tmp_path_factory.mktemp('mini_model_server') / 'serve.log'
    with running_server(['--config', MINI_CONFIG, '--model_path', mini_weights,
                         '--max_batch', 4, '--max_wait_ms', 50],
                        log) as (_, url):
        yield url, str(log)
