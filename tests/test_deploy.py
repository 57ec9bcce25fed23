"""Deployment: deploy/python/infer.py end to end against the dygraph model, its failures
(missing model, missing op library, bad flags), the pure-Paddle export with no op
library in the process, undoing resize transforms, and the timing table."""
import os
import subprocess
import sys
import time

import cv2
import numpy as np
import paddle
import pytest
import yaml
from cityscapesscripts.helpers.labels import trainId2label
from PIL import Image

import psanet.models  # noqa: F401  (registers PSANet)
from psanet.deploy.deploy_config import DeployConfig
from psanet.deploy.predictor import PaddleRunner, PredictorOptions
from psanet.deploy.processing import postprocess, preprocess
from psanet.deploy.timing import StageTimer
from psanet.errors import DeployError
from conftest import INFER_SCRIPT as INFER, run_process
from conftest import MINI_PSANET_RTOL, ROOT, assert_logits_agree
from conftest import infer_in_process as conftest_infer_in_process
from engine_helpers import mini_psanet_for_eval, read_prediction_files
from psanet.export import ExportOptions, export_model

CITYSCAPES_COLORS = np.array([trainId2label[i].color for i in range(19)])
IMAGE_SIZE = (96, 64)  # width, height


def dygraph_logits(model, image_bgr):
    """The dygraph model's [19, H, W] logits, with Normalize written out here in numpy."""
    rgb = image_bgr[:, :, ::-1].astype('float32')
    x = ((rgb / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None]
    with paddle.no_grad():
        return model(paddle.to_tensor(np.ascontiguousarray(x)))[0].numpy()[0]


def assert_labels_agree(labels, logits, what):
    """The predictor (oneDNN or not, batched or not) adds the convolutions' sums in
    another order than dygraph: its class map must match the dygraph argmax wherever
    the top two logits are clear of MINI_PSANET_RTOL (see conftest)."""
    __tracebackhide__ = True
    assert_logits_agree(np.asarray(labels), logits, MINI_PSANET_RTOL, what, class_axis=0)


def run_infer(*args, env=None):
    """deploy/python/infer.py in a fresh process: (exit code, output)."""
    result = run_process([sys.executable, INFER] + [str(a) for a in args], cwd=ROOT,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=300)
    return result.returncode, result.stdout


def infer_in_process(capfd, *args):
    """(exit code, stdout + stderr) of deploy/python/infer.py run in this process."""
    code, out, err = conftest_infer_in_process(capfd, *args)
    return code, out + err


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
    """A model, its custom and pure-Paddle dynamic argmax exports, and three images."""
    root = tmp_path_factory.mktemp('deploy')
    model = mini_psanet_for_eval(seed=1)
    dirs = {impl: str(root / impl) for impl in ('custom', 'paddle')}
    for impl, save_dir in dirs.items():
        # 19 classes both times: the palette comes from deploy.yaml, not the class count.
        palette = 'cityscapes' if impl == 'custom' else 'default'
        export_model(model, [{'type': 'Normalize'}], save_dir,
                     ExportOptions(psa_impl=impl, palette=palette), num_classes=19)
    images = root / 'images'
    (images / 'sub').mkdir(parents=True)
    rng = np.random.RandomState(0)
    paths = [str(images / 'a.png'), str(images / 'sub' / 'b.jpg'), str(images / 'c.png')]
    for path in paths:
        # Smooth blobs rather than noise, so the jpg round trip keeps it an image.
        small = rng.randint(0, 256, (4, 6, 3)).astype('uint8')
        cv2.imwrite(path, cv2.resize(small, IMAGE_SIZE, interpolation=cv2.INTER_CUBIC))
    return model, dirs, str(images), paths


@pytest.mark.parametrize('impl, mkldnn, batch_size', [('custom', 'True', 2),
                                                      ('custom', 'False', 1),
                                                      ('paddle', 'True', 3)])
def test_infer_writes_the_dygraph_prediction(setup, tmp_path, capfd, impl, mkldnn, batch_size):
    model, dirs, image_dir, paths = setup
    save_dir = tmp_path / 'out'
    # One case as a real command line; the others in process, to save start-up time.
    run = run_infer if batch_size == 2 else lambda *a: infer_in_process(capfd, *a)
    code, output = run('--config', os.path.join(dirs[impl], 'deploy.yaml'), '--image_path',
                       image_dir, '--save_dir', save_dir, '--device', 'cpu', '--enable_mkldnn',
                       mkldnn, '--cpu_threads', 1, '--batch_size', batch_size,
                       '--benchmark', 'True')
    assert code == 0, output
    for stage in ('preprocess', 'inference', 'postprocess', 'total'):
        assert any(line.split()[:1] == [stage] for line in output.splitlines()), stage
    for path in paths:
        relative = os.path.relpath(path, image_dir)
        pseudo = save_dir / 'pseudo_color_prediction' / (os.path.splitext(relative)[0] + '.png')
        added = save_dir / 'added_prediction' / relative
        image = cv2.imread(path)
        # b.jpg's overlay is a JPEG, the others PNGs; the class ids a PNG each
        label = read_prediction_files(pseudo, added, path)
        assert_labels_agree(label, dygraph_logits(model, image), path)
        with Image.open(pseudo) as mask:
            colors = np.asarray(mask.getpalette()[:19 * 3]).reshape(19, 3)
        assert np.array_equal(colors, CITYSCAPES_COLORS) == (impl == 'custom')


def test_infer_exits_nonzero_on_a_missing_model(setup, tmp_path):
    _, dirs, image_dir, _ = setup
    code, output = run_infer('--config', tmp_path / 'nowhere' / 'deploy.yaml', '--image_path',
                             image_dir, '--save_dir', tmp_path / 'out')
    assert code != 0
    assert 'deploy config not found' in output
    # deploy.yaml present, model.json gone.
    broken = tmp_path / 'broken'
    broken.mkdir()
    for name in ('deploy.yaml', 'model.pdiparams'):
        os.symlink(os.path.join(dirs['custom'], name), broken / name)
    code, output = run_infer('--config', broken / 'deploy.yaml', '--image_path', image_dir,
                             '--save_dir', tmp_path / 'out')
    assert code != 0
    assert 'model file not found' in output and 'model.json' in output
    assert not (tmp_path / 'out').exists()


def env_without_op_library(tmp_path):
    """An environment where loading the psa_mask library fails: no cached or installed
    library is used and the JIT build finds no compiler."""
    env = dict(os.environ)
    env.update(PSANET_OPS_FORCE_JIT='1', PSANET_OPS_CACHE=str(tmp_path / 'empty_cache'),
               CXX=str(tmp_path / 'no-such-compiler'))
    return env


def test_infer_exits_nonzero_when_the_op_library_is_missing(setup, tmp_path):
    _, dirs, image_dir, _ = setup
    code, output = run_infer('--config', os.path.join(dirs['custom'], 'deploy.yaml'),
                             '--image_path', image_dir, '--save_dir', tmp_path / 'out',
                             env=env_without_op_library(tmp_path))
    assert code != 0
    assert 'library could not be loaded' in output
    assert '--psa_impl paddle' in output


PURE_PADDLE_SCRIPT = '''
import sys
import numpy as np
from psanet.deploy.deploy_config import DeployConfig
from psanet.deploy.predictor import PaddleRunner, PredictorOptions
runner = PaddleRunner(DeployConfig(sys.argv[1]),
                      PredictorOptions(enable_mkldnn=sys.argv[3] == 'True'))
np.save(sys.argv[2], runner.run(np.load(sys.argv[2] + '.in.npy')))
with open('/proc/self/maps') as f:
    print('LIBRARY_MAPPED' if 'psa_mask_op' in f.read() else 'NO_LIBRARY')
'''


@pytest.mark.parametrize('mkldnn', ['False', 'True'])
def test_pure_paddle_export_runs_without_the_op_library(setup, tmp_path, mkldnn):
    model, dirs, _, _ = setup
    x = np.random.RandomState(0).uniform(-1, 1, (1, 3, 48, 80)).astype('float32')
    out = str(tmp_path / 'out.npy')
    np.save(out + '.in.npy', x)
    env = env_without_op_library(tmp_path)
    env['PYTHONPATH'] = ROOT
    result = run_process([sys.executable, '-c', PURE_PADDLE_SCRIPT, dirs['paddle'], out,
                          mkldnn], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=300)
    assert result.returncode == 0, result.stdout
    assert 'NO_LIBRARY' in result.stdout
    with paddle.no_grad():
        want = model(paddle.to_tensor(x))[0].numpy()
    assert_labels_agree(np.load(out)[0], want[0], f'pure-Paddle export, mkldnn={mkldnn}')


@pytest.mark.parametrize('flags, message', [
    (['--precision', 'fp16'], 'runs fp32 only'),
    (['--use_trt', 'True'], '--use_trt needs --device gpu'),
    (['--cpu_threads', '0'], '--cpu_threads must be an integer >= 1'),
    (['--batch_size', '0'], '--batch_size must be an integer >= 1'),
    (['--enable_mkldnn', 'maybe'], 'expected True or False'),
])
def test_infer_rejects_bad_flags(setup, tmp_path, capfd, flags, message):
    _, dirs, image_dir, _ = setup
    code, output = infer_in_process(capfd, '--config', os.path.join(dirs['paddle'], 'deploy.yaml'),
                                    '--image_path', image_dir, '--save_dir', tmp_path / 'out',
                                    *flags)
    assert code != 0
    assert message in output


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason='checks the CPU-build message')
def test_gpu_on_a_cpu_build_says_so(setup):
    with pytest.raises(DeployError, match='paddlepaddle-gpu'):
        PaddleRunner(DeployConfig(setup[1]['paddle']), PredictorOptions(device='gpu'))


def test_a_batch_of_two_sizes_is_refused(setup):
    _, dirs, _, paths = setup
    other = os.path.join(os.path.dirname(paths[0]), '..', 'other.png')
    cv2.imwrite(other, np.zeros((40, 56, 3), 'uint8'))
    transforms = DeployConfig(dirs['paddle']).build_transforms()
    with pytest.raises(DeployError, match='--batch_size 1'):
        preprocess([paths[0], other], transforms)


def test_resize_in_the_transforms_is_undone(setup, tmp_path, capfd):
    model, dirs, image_dir, paths = setup
    deploy_dir = tmp_path / 'resized'
    deploy_dir.mkdir()
    with open(os.path.join(dirs['paddle'], 'deploy.yaml')) as f:
        deploy = yaml.safe_load(f)
    deploy['Deploy']['transforms'] = [{'type': 'Resize', 'target_size': [64, 32]},
                                      {'type': 'Normalize'}]
    for key in ('model', 'params'):
        deploy['Deploy'][key] = os.path.join(dirs['paddle'], deploy['Deploy'][key])
    with open(deploy_dir / 'deploy.yaml', 'w') as f:
        yaml.safe_dump(deploy, f)
    code, output = infer_in_process(capfd, '--config', deploy_dir / 'deploy.yaml',
                                    '--image_path', paths[0], '--save_dir', tmp_path / 'out')
    assert code == 0, output
    image = cv2.imread(paths[0])
    small = cv2.resize(image.astype('float32'), (64, 32), interpolation=cv2.INTER_LINEAR)
    # Nearest-neighbour resizing picks pixels, so resizing the logits class by class
    # gives the logits of the resized class map.
    logits = cv2.resize(dygraph_logits(model, small).transpose(1, 2, 0), IMAGE_SIZE,
                        interpolation=cv2.INTER_NEAREST).transpose(2, 0, 1)
    with Image.open(tmp_path / 'out' / 'pseudo_color_prediction' / 'a.png') as mask:
        assert_labels_agree(np.asarray(mask), logits, 'resized input')


def test_postprocess_takes_the_output_shapes_of_paddleseg_exports():
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 19, (2, 8, 12)).astype('int32')         # argmax: [N, H, W]
    scores = rng.uniform(-1, 1, (2, 19, 8, 12)).astype('float32')  # softmax, none: [N, C, H, W]
    for output, output_op, want in ((ids, 'argmax', ids), (scores, 'softmax', scores.argmax(1)),
                                    (scores, 'none', scores.argmax(1))):
        labels = postprocess(output, output_op)
        assert len(labels) == 2 and all(label.dtype == np.uint8 for label in labels)
        np.testing.assert_array_equal(np.stack(labels), want)
    # [N, 1, H, W]: an argmax export made before the exports kept PaddleSeg's shape.
    with pytest.raises(DeployError, match=r'\[N, H, W\] class ids, got shape \[2, 1, 8, 12\].*'
                       'export it again'):
        postprocess(ids[:, None], 'argmax')
    with pytest.raises(DeployError, match=r'\[N, C, H, W\] scores, got shape \[2, 8, 12\]'):
        postprocess(ids, 'none')


def test_deploy_config_errors(tmp_path):
    (tmp_path / 'deploy.yaml').write_text('model: model.json\n')
    with pytest.raises(DeployError, match='no `Deploy:` section'):
        DeployConfig(str(tmp_path))
    (tmp_path / 'deploy.yaml').write_text('Deploy:\n  params: model.pdiparams\n')
    with pytest.raises(DeployError, match='Deploy.model is missing'):
        DeployConfig(str(tmp_path / 'deploy.yaml'))


def test_stage_timer_reports_per_image_times(monkeypatch):
    clock = iter(np.cumsum([0.0, 0.010, 0.0, 0.030, 0.0, 0.002,      # batch of 2
                            0.0, 0.004, 0.0, 0.008, 0.0, 0.001]))     # batch of 1
    monkeypatch.setattr(time, 'perf_counter', lambda: float(next(clock)))
    timer = StageTimer()
    for batch_size in (2, 1):
        for stage in ('preprocess', 'inference', 'postprocess'):
            with timer.stage(stage):
                pass
        timer.end_batch(batch_size)
    rows = timer.summary()
    # Sums and quantiles of a few float64 times: equal up to their last bits.
    per_image = {'preprocess': [5.0, 4.0], 'inference': [15.0, 8.0],
                 'postprocess': [1.0, 1.0], 'total': [21.0, 13.0]}
    for stage, values in per_image.items():
        mean, p50, p90 = rows[stage]
        assert mean == pytest.approx(np.mean(values))
        assert p50 == pytest.approx(np.median(values))
        assert p90 == pytest.approx(values[1] + 0.9 * (values[0] - values[1]))


@pytest.mark.parametrize('height, width', [(8, 12), (12, 8), (6, 14)])
def test_a_class_map_is_resized_back_to_the_image_with_rows_and_columns_kept(height, width):
    """An argmax export's class map, half the image after a Resize: each class id comes back
    as a 2 x 2 block in place (numpy's repeat), not transposed or stretched."""
    rng = np.random.RandomState(height)
    small = rng.randint(0, 19, (1, height // 2, width // 2)).astype('int32')
    want = small[0].repeat(2, axis=0).repeat(2, axis=1)
    info = [[('resize', (height, width))]]
    for sizes in (None, [(height, width)]):  # the Segmenter passes the image size too
        label, = postprocess(small, 'argmax', info, sizes)
        np.testing.assert_array_equal(label, want)
