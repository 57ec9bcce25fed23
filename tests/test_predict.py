"""psanet.core.predict and predict.py: both outputs for a file, a folder and a list; bad input."""
import os
import re
import shutil
import sys

import cv2
import numpy as np
import paddle
import pytest
from PIL import Image

import engine_helpers as helpers
from conftest import (MINI_CONFIG, ROOT, TINY_SEGNET_RTOL, assert_logits_agree,
                      clear_margin_pixels, run_process)
from psanet.core.checkpoint import save_checkpoint
from psanet.cli import run_cli
from psanet.contract import color_map, get_image_list, palette_for
from psanet.core.predict import predict_from_config
from psanet.errors import ConfigError, DatasetError

# predict_from_config runs the same TinySegNet as the references below, but on tensors
# of its own (batch, flips, windows, averaging order): its classes must be the reference
# argmax wherever the top two are clear of TINY_SEGNET_RTOL (see conftest).
RTOL = TINY_SEGNET_RTOL


@pytest.fixture
def setup(tmp_path):
    """A toy config, weights for it, and images in nested folders."""
    root = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=1, num_val=3)
    config = helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(root))
    paddle.seed(0)
    model = helpers.TinySegNet(3)
    save_checkpoint(str(tmp_path / 'weights'), model)
    images = tmp_path / 'images'
    os.makedirs(images / 'sub')
    cv2.imwrite(str(images / 'a.png'), cv2.imread(os.path.join(root, 'images', 'val_000.jpg')))
    shutil.copy(os.path.join(root, 'images', 'val_001.jpg'), images / 'sub' / 'b.jpg')
    return config, str(tmp_path / 'weights'), images, model


def _expected_logits(model, path):
    image = cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB).astype(np.float32)
    x = paddle.to_tensor(((image / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None])
    model.eval()
    with paddle.no_grad():
        return model(x)[0].numpy()


def _check_outputs(save_dir, relative, image_path, model):
    """The class ids of the pseudo-colour PNG; the overlay keeps the input's name, so a .jpg's
    is a JPEG (helpers.read_prediction_files)."""
    pred = helpers.read_prediction_files(
        os.path.join(save_dir, 'pseudo_color_prediction', os.path.splitext(relative)[0] + '.png'),
        os.path.join(save_dir, 'added_prediction', relative), image_path)
    assert_logits_agree(pred[None], _expected_logits(model, image_path), RTOL, relative)


def test_predict_file_folder_and_list(tmp_path, setup):
    config, weights, images, model = setup
    out = str(tmp_path / 'file')
    predict_from_config(config, weights, str(images / 'a.png'), save_dir=out, device='cpu')
    _check_outputs(out, 'a.png', images / 'a.png', model)

    out = str(tmp_path / 'folder')
    written = predict_from_config(config, weights, str(images), save_dir=out, device='cpu')
    assert len(written) == 2
    _check_outputs(out, 'a.png', images / 'a.png', model)
    _check_outputs(out, os.path.join('sub', 'b.jpg'), images / 'sub' / 'b.jpg', model)

    listing = images / 'list.txt'
    listing.write_text('sub/b.jpg\n\na.png ignored_second_column\n')
    out = str(tmp_path / 'list')
    predict_from_config(config, weights, str(listing), save_dir=out, device='cpu')
    _check_outputs(out, os.path.join('sub', 'b.jpg'), images / 'sub' / 'b.jpg', model)
    _check_outputs(out, 'a.png', images / 'a.png', model)


def test_predict_shows_paddleseg_progress_bar(tmp_path, setup, capfd):
    config, weights, images, _ = setup
    capfd.readouterr()
    predict_from_config(config, weights, str(images), save_dir=str(tmp_path / 'out'),
                        device='cpu')
    out, err = capfd.readouterr()
    # paddleseg.utils.progbar.Progbar's last update for the 2 images, and no line per image.
    assert re.search(r'^2/2 \[=+\] - \d+s \d+(s|ms|us)/step$',
                     err.replace('\b', '').replace('\r', '\n'), re.M), repr(err)
    assert 'a.png' not in out + err


def _softmax(logits):
    exp = np.exp(logits - logits.max(1, keepdims=True))
    return exp / exp.sum(1, keepdims=True)


def test_predict_augmented_and_sliding_window(tmp_path, setup):
    config, weights, images, model = setup
    # Random classifier weights: the freshly built model predicts one class everywhere,
    # which would make any averaging look right.
    weight = model.classifier.weight
    weight.set_value(np.random.default_rng(0).normal(size=weight.shape).astype(np.float32))
    save_checkpoint(weights, model)
    image = ((cv2.cvtColor(cv2.imread(str(images / 'a.png')), cv2.COLOR_BGR2RGB)
              .astype(np.float32) / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None]
    model.eval()

    def logits(array):
        with paddle.no_grad():
            return model(paddle.to_tensor(np.ascontiguousarray(array)))[0].numpy()

    assert len(np.unique(logits(image).argmax(1))) > 1
    # By default the logits are averaged (paddleseg 2.8's aug_inference); with
    # aug_combine='softmax', their softmax.
    expected = {
        None: (logits(image) + logits(image[..., ::-1])[..., ::-1]) / 2,
        'softmax': (_softmax(logits(image)) + _softmax(logits(image[..., ::-1]))[..., ::-1]) / 2,
    }
    # Some pixels clear in both references take another class in each: each run below
    # can only pass with its own combination.
    logit_mean, prob_mean = expected[None], expected['softmax']
    assert ((logit_mean.argmax(1) != prob_mean.argmax(1)) &
            clear_margin_pixels(logit_mean, RTOL * np.abs(logit_mean).max()) &
            clear_margin_pixels(prob_mean, RTOL * np.abs(prob_mean).max())).any()
    for aug_combine, want in expected.items():
        out = str(tmp_path / f'aug_{aug_combine}')
        predict_from_config(config, weights, str(images / 'a.png'), save_dir=out, device='cpu',
                            aug_eval=True, flip_horizontal=True, scales=[1.0],
                            aug_combine=aug_combine)
        assert not np.array_equal(want.argmax(1), logits(image).argmax(1))
        got = np.asarray(Image.open(os.path.join(out, 'pseudo_color_prediction', 'a.png')))
        assert_logits_agree(got[None], want, RTOL, f'flip-averaged, aug_combine={aug_combine}')
    # 3 x 3 overlapping windows on the 64x32 image; TinySegNet's zero padding makes
    # every window's logits differ from the whole image's, so the placement matters.
    out = str(tmp_path / 'slide')
    predict_from_config(config, weights, str(images / 'a.png'), save_dir=out, device='cpu',
                        is_slide=True, crop_size=[32, 16], stride=[16, 8])
    expected = helpers.slide_reference(logits, image, (32, 16), (16, 8))
    assert not np.array_equal(expected.argmax(1), logits(image).argmax(1))
    got = np.asarray(Image.open(os.path.join(out, 'pseudo_color_prediction', 'a.png')))
    assert_logits_agree(got[None], expected, RTOL, 'window-averaged logits')


def test_palettes():
    from cityscapesscripts.helpers.labels import trainId2label
    colors = np.asarray(color_map(19, cityscapes=True)).reshape(-1, 3)
    for train_id in range(19):
        assert tuple(colors[train_id]) == trainId2label[train_id].color
    custom = np.asarray(color_map(3, [1, 2, 3, 4, 5, 6])).reshape(-1, 3)
    np.testing.assert_array_equal(custom[:2], [[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ConfigError, match='custom_color'):
        color_map(3, [1, 2])
    # predict.py and export.py (deploy.yaml) pick the palette by the dataset, not the count.
    from paddleseg.datasets import Cityscapes, Dataset
    assert palette_for(Cityscapes) == 'cityscapes'
    assert palette_for(Dataset) == palette_for(None) == 'default'


def test_bad_image_inputs(tmp_path, setup, capsys):
    config, weights, images, _ = setup
    with pytest.raises(ConfigError, match='does not exist'):
        get_image_list(str(tmp_path / 'nothing'))
    listing = images / 'bad_list.txt'
    listing.write_text('a.png\nmissing.jpg\n')
    with pytest.raises(DatasetError, match='line 2: `missing.jpg` is not an image file'):
        get_image_list(str(listing))
    empty = tmp_path / 'empty'
    os.makedirs(empty)
    with pytest.raises(DatasetError, match='no images'):
        get_image_list(str(empty))
    broken = images / 'broken.png'
    broken.write_bytes(b'not a png')
    code = run_cli(predict_from_config, config, weights, str(broken),
                   save_dir=str(tmp_path / 'out'), device='cpu')
    err = capsys.readouterr().err
    assert code == 2 and f'image {broken} cannot be read' in err and 'Traceback' not in err


def test_predict_py_runs(tmp_path, mini_cityscapes):
    """predict.py on the real PSANet mini config with freshly initialised weights."""
    from psanet.core.config import ComponentBuilder, load_config
    root = mini_cityscapes
    opts = [f'val_dataset.dataset_root={root}', f'train_dataset.dataset_root={root}']
    model = ComponentBuilder(load_config(MINI_CONFIG, opts=opts)).model
    save_checkpoint(str(tmp_path / 'weights'), model)
    images = os.path.join(root, 'leftImg8bit', 'val')
    out = str(tmp_path / 'out')
    done = run_process([sys.executable, os.path.join(ROOT, 'predict.py'), '--config',
                        MINI_CONFIG, '--model_path', str(tmp_path / 'weights'),
                        '--image_path', images, '--save_dir', out, '--device', 'cpu',
                        '--opts'] + opts,
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for image in get_image_list(images):
        relative = image[1]
        assert os.path.isfile(os.path.join(out, 'added_prediction', relative))
        mask = Image.open(os.path.join(out, 'pseudo_color_prediction', relative))
        assert mask.mode == 'P' and mask.size == (64, 32)
