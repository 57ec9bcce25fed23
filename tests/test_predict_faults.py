"""predict.py / val.py inference under bad inputs: an image too large for the memory, a
--save_dir that is a file, unreadable images among good ones (the last one too), the psa_mask
op's own explanation of a failed allocation, and list files and folders whose outputs would
land outside --save_dir, over an input or over each other; a SIGTERM stopping predict.py
after the image it is on, and each rank of a launched run predicting its own share."""
import math
import os
import re
import signal
import sys

import cv2
import numpy as np
import paddle
import pytest
import yaml
from paddleseg.models.backbones import ResNet18_vd
from paddleseg.transforms import Normalize
from PIL import Image

from conftest import MINI_CONFIG, MINI_PSANET_RTOL, ROOT, autocast_state, run_process
from disk_helpers import digests
from engine_helpers import assert_saved_masks_agree, mini_psanet_for_eval
from psanet.cli import run_cli
from psanet.core import dist
from psanet.core import inference as infer
from psanet.deploy import attention_memory as memory
from psanet.core.predict import DygraphRunner, predict, predict_from_config
from psanet.core.val import evaluate_from_config
from psanet.contract import check_outputs, get_image_list
from psanet.errors import ConfigError, DatasetError, UnreadableImagesError
from psanet.export import export_from_config, export_model
from psanet.models import PSANet
from psanet.ops import psa_mask

with open(MINI_CONFIG) as f:
    MINI_MODEL = yaml.safe_load(f)['model']


@pytest.fixture(scope='module')
def mini(tmp_path_factory):
    """The mini PSANet, its weights file, and a folder for images."""
    root = tmp_path_factory.mktemp('predict_faults')
    model = mini_psanet_for_eval(seed=2)
    weights = str(root / 'model.pdparams')
    paddle.save(model.state_dict(), weights)
    return model, weights, root


def write_image(path, size, seed=0):
    """Smooth colour blobs of ``size`` (width, height), so the model sees structure."""
    small = np.random.RandomState(seed).randint(0, 256, (4, 6, 3)).astype('uint8')
    cv2.imwrite(str(path), cv2.resize(small, size, interpolation=cv2.INTER_CUBIC))
    return str(path)


def expected_attention(height, width, output_stride, shrink_factor, batch=1):
    """[N, h*w, h, w] of one PSA branch, from the definitions: ResNet_vd's output is
    ceil(size / stride), the branch shrinks it to (size - 1) // s + 1."""
    h = (math.ceil(height / output_stride) - 1) // shrink_factor + 1
    w = (math.ceil(width / output_stride) - 1) // shrink_factor + 1
    return [batch, h * w, h, w]


# --- The attention map estimate ------------------------------------------------------------

def op_outputs(model, x):
    """Shapes and bytes of every tensor the psa_mask layers return on ``x``."""
    seen = []

    def hook(layer, inputs, output):
        seen.append((list(output.shape), output.numel().item() * output.element_size()))

    handles = [layer.psa_mask.register_forward_post_hook(hook)
               for layer in model.head.branches]
    try:
        with paddle.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize('batch, height, width', [(2, 67, 90), (1, 40, 41)])
def test_estimate_equals_the_op_output(mini, batch, height, width):
    model = mini[0]
    seen = op_outputs(model, paddle.zeros([batch, 3, height, width]))
    assert len(seen) == 2  # bi-direction: collect and distribute
    estimate = model.attention_memory(height, width, batch)
    assert estimate.shapes == [shape for shape, _ in seen]
    assert estimate.map_bytes == max(size for _, size in seen)
    assert estimate.shape == expected_attention(height, width, 8, MINI_MODEL['shrink_factor'],
                                                   batch)


def test_estimate_follows_stride_shrink_and_branches():
    paddle.seed(0)
    model = PSANet(5, ResNet18_vd(output_stride=16), psa_type=0, mask_h=5, mask_w=5,
                   psa_channels=8, shrink_factor=3)
    model.eval()
    seen = op_outputs(model, paddle.zeros([1, 3, 100, 131]))
    assert [shape for shape, _ in seen] == [expected_attention(100, 131, 16, 3)]
    assert model.attention_memory(100, 131).map_bytes == seen[0][1]


def test_estimate_under_fp16_autocast_counts_the_float32_softmax(mini):
    # CPU Paddle has no fp16 autocast: set its state as amp_guard does on a GPU. softmax is
    # on Paddle's fp16 black list, so the half map, its float32 copy and the float32
    # softmax coexist.
    with autocast_state(True, 'float16'):
        estimate = mini[0].attention_memory(67, 90)
    elements = math.prod(expected_attention(67, 90, 8, MINI_MODEL['shrink_factor']))
    assert estimate.dtype == 'float16' and estimate.map_bytes == 2 * elements
    assert estimate.peak_bytes == (2 + 4 + 4) * elements


def test_available_memory_is_the_hosts():
    with open('/proc/meminfo') as f:
        total = int(next(line for line in f if line.startswith('MemTotal:')).split()[1]) * 1024
    assert 0 < memory.available_memory(paddle.CPUPlace()) <= total


# --- Refusing an input too large, before the backbone runs ---------------------------------

def peak_bytes(shape, element_bytes=4):
    """The map and its softmax, alive together (psa_softmax is on in the mini config)."""
    return 2 * math.prod(shape) * element_bytes


@pytest.fixture
def little_memory(monkeypatch):
    """Memory for the attention of a 128x96 input but not of a 256x192 one; _main_logit
    (every model run) recorded."""
    small = peak_bytes(expected_attention(96, 128, 8, MINI_MODEL['shrink_factor']))
    large = peak_bytes(expected_attention(192, 256, 8, MINI_MODEL['shrink_factor']))
    available = 2 * small + 1
    assert available < large
    monkeypatch.setattr(memory, 'available_memory', lambda place=None: available)
    runs = []
    real = infer._main_logit

    def spy(model, x):
        runs.append(list(x.shape))
        return real(model, x)

    monkeypatch.setattr(infer, '_main_logit', spy)
    return available, runs


def _cli(capsys, *args, **kwargs):
    capsys.readouterr()
    code = run_cli(predict_from_config, *args, device='cpu', **kwargs)
    err = capsys.readouterr().err
    assert 'Traceback' not in err
    return code, err


def test_too_large_an_image_is_refused_with_a_crop_that_fits(mini, tmp_path, capsys,
                                                             little_memory):
    model, weights, _ = mini
    available, runs = little_memory
    image = write_image(tmp_path / 'big.png', (256, 192))
    out = tmp_path / 'out'
    code, err = _cli(capsys, MINI_CONFIG, weights, image, save_dir=str(out))
    assert code == 2 and runs == []
    line, = [line for line in err.splitlines() if line.startswith('error:')]
    shape = expected_attention(192, 256, 8, MINI_MODEL['shrink_factor'])
    assert 'a 256x192 network input' in line and str(shape) in line
    assert f'{peak_bytes(shape) / 1024:.1f} KiB' in line
    assert f'only {available / 1024:.1f} KiB of host memory is available' in line
    crop_w, crop_h, stride_w, stride_h = map(int, re.search(
        r'--is_slide --crop_size (\d+) (\d+) --stride (\d+) (\d+)', line).groups())
    assert crop_w < 256 or crop_h < 192
    assert not out.exists()

    # The suggested windows run, under the same memory, and give a whole prediction.
    predict_from_config(MINI_CONFIG, weights, image, save_dir=str(out), device='cpu',
                        is_slide=True, crop_size=[crop_w, crop_h], stride=[stride_w, stride_h])
    assert runs and all(h <= crop_h and w <= crop_w for _, _, h, w in runs)
    with Image.open(out / 'pseudo_color_prediction' / 'big.png') as mask:
        assert mask.size == (256, 192)


def test_too_large_a_scale_is_refused_with_a_scale_that_fits(mini, tmp_path, capsys,
                                                             little_memory):
    _, weights, _ = mini
    _, runs = little_memory
    image = write_image(tmp_path / 'small.png', (128, 96))
    code, err = _cli(capsys, MINI_CONFIG, weights, image, save_dir=str(tmp_path / 'out'),
                     aug_eval=True, scales=[1.0, 2.0])
    assert code == 2 and runs == []  # not even scale 1.0 ran
    assert 'a 256x192 network input' in err
    scale = float(re.search(r'--scales no larger than ([0-9.]+)', err).group(1))
    assert 1.0 <= scale < 2.0
    predict_from_config(MINI_CONFIG, weights, image, save_dir=str(tmp_path / 'out'),
                        device='cpu', aug_eval=True, scales=[1.0, scale])
    assert runs


def test_val_refuses_too_large_images_too(mini, mini_cityscapes, monkeypatch, capsys):
    """val.py goes through the same inference: its 64x32 images against too little memory."""
    _, weights, _ = mini
    shape = expected_attention(32, 64, 8, MINI_MODEL['shrink_factor'])
    available = peak_bytes(shape) - 1
    monkeypatch.setattr(memory, 'available_memory', lambda place=None: available)
    opts = [f'val_dataset.dataset_root={mini_cityscapes}']
    capsys.readouterr()
    code = run_cli(evaluate_from_config, MINI_CONFIG, weights, device='cpu', opts=opts)
    err = capsys.readouterr().err
    line, = [line for line in err.splitlines() if line.startswith('error:')]
    assert code == 2 and 'Traceback' not in err
    assert 'a 64x32 network input' in line and str(shape) in line
    crop_w, crop_h, stride_w, stride_h = map(int, re.search(
        r'--is_slide --crop_size (\d+) (\d+) --stride (\d+) (\d+)', line).groups())
    result = evaluate_from_config(MINI_CONFIG, weights, device='cpu', opts=opts, is_slide=True,
                                  crop_size=[crop_w, crop_h], stride=[stride_w, stride_h])
    assert result['num_images'] == 3


def test_an_allocation_failure_in_the_op_names_its_size(monkeypatch):
    x = paddle.rand([2, 3 * 5, 6, 7])

    def fail(*args, **kwargs):
        raise MemoryError('(ResourceExhausted) Fail to alloc memory of 14112 size.')

    shape = [2, 6 * 7, 6, 7]
    size = f'{math.prod(shape) * 4 / 2 ** 30:.1f} GiB'
    monkeypatch.setattr(paddle._C_ops, '_run_custom_op', fail)
    with pytest.raises(MemoryError, match=re.escape(f'{shape} float32 needs {size}')) as caught:
        psa_mask(x, 'collect', (3, 5), impl='custom')
    assert 'Fail to alloc memory' in str(caught.value) and 'smaller inputs' in str(caught.value)
    monkeypatch.setattr(paddle, 'index_select', fail)
    with pytest.raises(MemoryError, match=re.escape(f'{shape} float32 needs {size}')):
        psa_mask(x, 'distribute', (3, 5), impl='paddle')


def test_an_allocation_failure_while_running_is_a_user_error(mini, monkeypatch):
    model = mini[0]

    def fail(*args, **kwargs):
        raise MemoryError('(ResourceExhausted) Fail to alloc memory of 99 size.')

    monkeypatch.setattr(paddle._C_ops, '_run_custom_op', fail)
    with pytest.raises(infer.InferenceMemoryError) as caught:
        infer.inference(model, paddle.zeros([1, 3, 64, 96]))
    message = str(caught.value)
    assert 'running the model on a 96x64 input ran out of memory' in message
    assert 'psa_mask' in message and '--is_slide --crop_size' in message


# --- --save_dir that is a file --------------------------------------------------------------

def test_save_dir_that_is_a_file(mini, tmp_path, capsys):
    _, weights, _ = mini
    image = write_image(tmp_path / 'a.png', (96, 64))
    taken = tmp_path / 'taken.txt'
    taken.write_text('keep me')
    for save_dir, words in ((taken, 'is a file, not a folder'),
                            (taken / 'below', f'{taken} is a file, not a folder')):
        code, err = _cli(capsys, MINI_CONFIG, weights, image, save_dir=str(save_dir))
        assert code == 2 and words in err and f'--save_dir {save_dir}' in err
        assert taken.read_text() == 'keep me'
        capsys.readouterr()
        assert run_cli(export_from_config, MINI_CONFIG, None, save_dir=str(save_dir)) == 2
        assert words in capsys.readouterr().err
    with pytest.raises(ConfigError, match='is a file'):
        export_model(mini[0], [{'type': 'Normalize'}], str(taken))
    assert taken.read_text() == 'keep me'


def test_predict_py_save_dir_that_is_a_file(mini, tmp_path):
    _, weights, _ = mini
    taken = tmp_path / 'taken.png'
    write_image(taken, (96, 64))
    before = taken.read_bytes()
    done = run_process([sys.executable, os.path.join(ROOT, 'predict.py'), '--config',
                        MINI_CONFIG, '--model_path', weights, '--image_path', str(taken),
                        '--save_dir', str(taken), '--device', 'cpu'], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f'error: --save_dir {taken} is a file, not a folder: pass a folder (it is created '
        'when missing) or move the file away.']
    assert taken.read_bytes() == before


# --- Unreadable images among good ones ------------------------------------------------------

def test_unreadable_images_are_skipped_and_reported(mini, tmp_path, capsys):
    model, weights, _ = mini
    images = tmp_path / 'images'
    images.mkdir()
    good = [write_image(images / name, (96, 64), seed) for seed, name in
            enumerate(['a.png', 'c.jpg', 'e.png'])]
    bad = [str(images / 'b.png'), str(images / 'd.jpg')]
    (images / 'b.png').write_bytes(b'not an image')
    (images / 'd.jpg').write_bytes(b'')
    out = tmp_path / 'out'
    capsys.readouterr()
    code = run_cli(predict_from_config, MINI_CONFIG, weights, str(images), save_dir=str(out),
                   device='cpu')
    captured = capsys.readouterr()
    assert code == 2 and 'Traceback' not in captured.err
    for path in bad:  # one line each as it is skipped
        assert len([line for line in captured.out.splitlines()
                    if f'cannot read image {path}' in line]) == 1
    summary, = [line for line in captured.err.splitlines() if line.startswith('error:')]
    assert summary.startswith(f'error: 3 of 5 images written to {out}; 2 images cannot be read')
    assert all(path in summary for path in bad)
    assert_saved_masks_agree(out, good, model, MINI_PSANET_RTOL)
    for path in good:
        name = os.path.basename(path)
        assert (out / 'added_prediction' / name).is_file()
    assert sorted(os.listdir(out / 'added_prediction')) == ['a.png', 'c.jpg', 'e.png']

    # From Python: the error carries what was written and what was not.
    with pytest.raises(UnreadableImagesError) as caught:
        predict_from_config(MINI_CONFIG, weights, str(images), save_dir=str(tmp_path / 'again'),
                            device='cpu')
    assert caught.value.unreadable == bad and len(caught.value.written) == 3


def test_the_bar_ends_full_when_the_last_image_cannot_be_read(mini, tmp_path, capsys):
    _, weights, _ = mini
    images = tmp_path / 'images'
    images.mkdir()
    write_image(images / 'a.png', (96, 64))
    (images / 'z.png').write_bytes(b'not an image')
    code, err = _cli(capsys, MINI_CONFIG, weights, str(images), save_dir=str(tmp_path / 'out'))
    assert code == 2
    bars = err.replace('\b', '').replace('\r', '\n')
    assert re.search(r'^2/2 \[=+\] - \d+s', bars, re.M), repr(err)


def test_sigterm_stops_predict_after_the_image_it_is_on(mini, tmp_path, capsys, monkeypatch):
    model, weights, _ = mini
    images = tmp_path / 'images'
    images.mkdir()
    paths = [write_image(images / f'{name}.png', (96, 64), seed) for seed, name in
             enumerate('abc')]
    runs = []
    real = DygraphRunner.run

    def run(self, batch):  # the signal arrives while the first image runs
        if not runs:
            os.kill(os.getpid(), signal.SIGTERM)
        runs.append(len(batch))
        return real(self, batch)

    monkeypatch.setattr(DygraphRunner, 'run', run)
    out = tmp_path / 'out'
    code, err = _cli(capsys, MINI_CONFIG, weights, str(images), save_dir=str(out))
    assert code == 143 and runs == [1]
    assert err.strip().splitlines()[-1].startswith('error: stopped by SIGTERM')
    assert sorted(os.listdir(out / 'pseudo_color_prediction')) == ['a.png']
    assert sorted(os.listdir(out / 'added_prediction')) == ['a.png']
    assert_saved_masks_agree(out, paths[:1], model, MINI_PSANET_RTOL)


def test_each_rank_predicts_its_share(mini, tmp_path, monkeypatch):
    model = mini[0]
    images = tmp_path / 'images'
    images.mkdir()
    paths = [write_image(images / f'{name}.png', (96, 64), seed) for seed, name in
             enumerate('abcde')]
    monkeypatch.setattr(dist, 'world_size', lambda: 2)
    monkeypatch.setattr(dist, 'rank', lambda: 1)
    out = tmp_path / 'out'
    written = predict(model, [Normalize()], get_image_list(str(images)), str(out))
    assert [os.path.basename(p) for p, _ in written] == ['b.png', 'd.png']
    assert sorted(os.listdir(out / 'pseudo_color_prediction')) == ['b.png', 'd.png']
    assert_saved_masks_agree(out, [paths[1], paths[3]], model, MINI_PSANET_RTOL)


def test_predict_checks_the_inference_flags(mini, tmp_path, capsys):
    _, weights, _ = mini
    image = write_image(tmp_path / 'a.png', (96, 64))
    code, err = _cli(capsys, MINI_CONFIG, weights, image, save_dir=str(tmp_path / 'out'),
                     scales=[0.5])
    assert code == 2 and '--aug_pred' in err
    code, err = _cli(capsys, MINI_CONFIG, weights, image, save_dir=str(tmp_path / 'out'),
                     crop_size=[64, 64])
    assert code == 2 and '--is_slide' in err
    assert not (tmp_path / 'out').exists()


# --- Outputs stay inside --save_dir, never over an input, never over each other -------------

def _tree_digests(root, leave_out):
    """Digests of every file under ``root`` except those under ``leave_out``."""
    return {path: digest for path, digest in digests(root).items()
            if not path.startswith(os.path.relpath(leave_out, root) + os.sep)}


def _expected_overlay(image_path, mask_path):
    """The overlay of one image, recomputed in numpy from the image and its saved mask
    (0.6 image + 0.4 the class colour, as PaddleSeg's visualize does)."""
    image = cv2.imread(image_path).astype(np.float64)
    with Image.open(mask_path) as mask:
        palette = np.asarray(mask.getpalette(), np.float64).reshape(-1, 3)
        colour = palette[np.asarray(mask)][..., ::-1]
    return np.clip(np.round(0.6 * image + 0.4 * colour), 0, 255)


def test_a_list_entry_with_dot_dot_is_predicted_into_save_dir_not_over_the_input(mini, tmp_path,
                                                                                  capsys):
    _, weights, _ = mini
    (tmp_path / 'images').mkdir()
    street = write_image(tmp_path / 'images' / 'street.png', (96, 64))
    (tmp_path / 'lists' / 'a').mkdir(parents=True)
    listing = tmp_path / 'lists' / 'a' / 'list.txt'
    listing.write_text('../../images/street.png\n')
    # An output kept as added_prediction/../../images/street.png would be the input itself.
    save_dir = tmp_path / 'lists' / 'a' / 'out' / 'deeper'
    before = _tree_digests(tmp_path, save_dir)
    code, err = _cli(capsys, MINI_CONFIG, weights, str(listing), save_dir=str(save_dir))
    assert code == 0, err
    assert _tree_digests(tmp_path, save_dir) == before  # nothing outside save_dir changed
    assert sorted(digests(save_dir)) == ['added_prediction/street.png',
                                         'pseudo_color_prediction/street.png']
    got = cv2.imread(str(save_dir / 'added_prediction' / 'street.png')).astype(np.float64)
    want = _expected_overlay(street, str(save_dir / 'pseudo_color_prediction' / 'street.png'))
    assert np.abs(got - want).max() <= 1


def test_absolute_list_entries_of_the_same_name_keep_their_folders(mini, tmp_path, capsys):
    _, weights, _ = mini
    for name in ('a', 'b'):
        (tmp_path / 'x' / name).mkdir(parents=True)
    first = write_image(tmp_path / 'x' / 'a' / 'img.png', (96, 64), seed=1)
    second = write_image(tmp_path / 'x' / 'b' / 'img.png', (96, 64), seed=2)
    listing = tmp_path / 'lists' / 'list.txt'
    listing.parent.mkdir()
    listing.write_text(f'{first}\n{second}\n')
    out = tmp_path / 'out'
    code, err = _cli(capsys, MINI_CONFIG, weights, str(listing), save_dir=str(out))
    assert code == 0, err
    for image, relative in ((first, 'a/img.png'), (second, 'b/img.png')):
        got = cv2.imread(str(out / 'added_prediction' / relative)).astype(np.float64)
        want = _expected_overlay(image, str(out / 'pseudo_color_prediction' / relative))
        assert np.abs(got - want).max() <= 1, relative


def test_two_images_that_would_write_one_output_are_refused_before_any_work(mini, tmp_path,
                                                                            capsys):
    _, weights, _ = mini
    images = tmp_path / 'images'
    images.mkdir()
    write_image(images / 'x.png', (96, 64))
    write_image(images / 'x.jpg', (96, 64), seed=1)
    out = tmp_path / 'out'
    code, err = _cli(capsys, MINI_CONFIG, weights, str(images), save_dir=str(out))
    line, = err.strip().splitlines()
    assert code == 2 and str(images / 'x.jpg') in line and str(images / 'x.png') in line
    assert 'would both write ' + str(out / 'pseudo_color_prediction' / 'x.png') in line, line
    assert not out.exists()


def test_an_output_over_an_input_is_refused(tmp_path):
    images = tmp_path / 'images'
    (images / 'added_prediction').mkdir(parents=True)
    write_image(images / 'added_prediction' / 'a.png', (96, 64))
    listing = get_image_list(str(images / 'added_prediction'))
    with pytest.raises(ConfigError, match='would overwrite the input image'):
        check_outputs(listing, str(images))


def test_a_weights_file_as_image_path_is_one_line(mini, capsys):
    _, weights, _ = mini
    code, err = _cli(capsys, MINI_CONFIG, weights, weights, save_dir='unused')
    assert code == 2 and err.strip().splitlines() == [
        f'error: --image_path {weights} is neither an image (.jpg, .jpeg, .png, .bmp) nor a '
        'text file listing images: pass an image, a folder of images, or a list file.']


def test_list_lines_with_spaces_and_with_labels(tmp_path):
    (tmp_path / 'my images').mkdir()
    spaced = write_image(tmp_path / 'my images' / 'street view.png', (96, 64))
    plain = write_image(tmp_path / 'plain.png', (96, 64))
    listing = tmp_path / 'list.txt'
    listing.write_text('my images/street view.png\nplain.png labels/plain.png\n')
    assert get_image_list(str(listing)) == [(spaced, 'my images/street view.png'),
                                            (plain, 'plain.png')]
    listing.write_text('my photos/a b.png\n')
    with pytest.raises(DatasetError, match='line 1: neither `my photos/a b.png` nor `my` is an '
                       'image file'):
        get_image_list(str(listing))
