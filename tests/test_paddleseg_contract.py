"""PaddleSeg's contracts, checked against paddleseg's own code.

* PaddleSeg 2.8's deploy/python/infer.py flow (its ``DeployConfig``, a Paddle
  Inference predictor, its transforms and ``get_pseudo_color_map``), in a
  process that never imports psanet, runs our ``--psa_impl paddle`` argmax
  export and saves the class ids our deploy/python/infer.py saves, pixel for pixel.
* ``--aug_eval`` / ``--aug_pred`` by default give what
  ``paddleseg.core.infer.aug_inference`` gives for the same flags, on the
  same model and image.
"""
import json
import os
import subprocess
import sys

import cv2
import numpy as np
import paddle
import pytest
from PIL import Image

import engine_helpers as helpers
from conftest import (MINI_CONFIG, MINI_PSANET_RTOL, TINY_SEGNET_RTOL,
                      assert_logits_agree, infer_in_process, run_process)
from psanet.core import inference
from psanet.core.options import InferenceOptions


# PaddleSeg 2.8's deploy/python/infer.py, `--device cpu --print_detail False`, restated
# from its source: Predictor._init_base_config, _init_cpu_config, run, _preprocess and
# _save_imgs (without --with_argmax: the export's argmax is saved as it comes). Two
# lines differ, each for a Paddle 3.3 bug, as psanet.compat's records say.
# argv: deploy.yaml, save_dir, enable_mkldnn (True|False), batch_size, image paths...
PADDLESEG_INFER = r'''
import json
import os
import sys

import numpy as np
from paddle.inference import Config as PredictConfig
from paddle.inference import create_predictor
from paddleseg.deploy.infer import DeployConfig
from paddleseg.utils.visualize import get_pseudo_color_map

deploy_yaml, save_dir, enable_mkldnn, batch_size = sys.argv[1:5]
enable_mkldnn, batch_size, imgs_path = enable_mkldnn == 'True', int(batch_size), sys.argv[5:]
cfg = DeployConfig(deploy_yaml)

pred_cfg = PredictConfig(cfg.model, cfg.params)
pred_cfg.disable_glog_info()
# pred_cfg.enable_memory_optim(): fails predictor creation on Paddle 3.3 (Paddle #75496).
pred_cfg.switch_ir_optim(True)
pred_cfg.disable_gpu()
if enable_mkldnn:
    pred_cfg.set_mkldnn_cache_capacity(10)
    pred_cfg.enable_mkldnn()
pred_cfg.set_cpu_math_library_num_threads(1)
# oneDNN (on by default on Paddle 3.3's CPU) cannot run a saved bilinear_interp
# (Paddle #79749): its op placement pass goes.
if pred_cfg.mkldnn_enabled():
    pred_cfg.delete_pass('onednn_placement_pass')
predictor = create_predictor(pred_cfg)

input_handle = predictor.get_input_handle(predictor.get_input_names()[0])
output_handle = predictor.get_output_handle(predictor.get_output_names()[0])
os.makedirs(save_dir, exist_ok=True)
outputs = []
for i in range(0, len(imgs_path), batch_size):
    data = np.array([cfg.transforms({'img': img})['img'] for img in imgs_path[i:i + batch_size]])
    input_handle.reshape(data.shape)
    input_handle.copy_from_cpu(data)
    predictor.run()
    results = output_handle.copy_to_cpu()
    outputs.append([list(results.shape), str(results.dtype)])
    for k in range(results.shape[0]):
        result = get_pseudo_color_map(results[k])
        basename = os.path.splitext(os.path.basename(imgs_path[i + k]))[0]
        result.save(os.path.join(save_dir, f'{basename}.png'))
print(json.dumps({'mkldnn': pred_cfg.mkldnn_enabled(), 'outputs': outputs,
                  'output_op': cfg.dic['Deploy']['output_op'],
                  'psanet_imported': any(m.split('.')[0] == 'psanet' for m in sys.modules)}))
'''


def run_paddleseg_infer(deploy_yaml, save_dir, enable_mkldnn, batch_size, images, cwd):
    result = run_process([sys.executable, '-c', PADDLESEG_INFER, deploy_yaml, save_dir,
                          enable_mkldnn, str(batch_size)] + images, cwd=cwd,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_our_infer(capfd, *args):
    """deploy/python/infer.py in this process; it must succeed."""
    code, out, err = infer_in_process(capfd, *args)
    assert code == 0, out + err


@pytest.fixture(scope='module')
def argmax_export(tmp_path_factory):
    """export.py's default (argmax) export of the mini PSANet with the pure-Paddle op,
    and three images of one size."""
    from psanet.export import export_from_config
    root = tmp_path_factory.mktemp('paddleseg_deploy')
    _, model = helpers.build_config_model(seed=1)
    weights = str(root / 'model.pdparams')
    paddle.save(model.state_dict(), weights)
    save_dir = str(root / 'export')
    export_from_config(MINI_CONFIG, weights, save_dir, psa_impl='paddle')
    rng = np.random.RandomState(0)
    images = []
    for name in ('a.png', 'b.jpg', 'c.png'):
        # Smooth blobs, so that the model sees something like an image.
        small = rng.randint(0, 256, (4, 6, 3)).astype('uint8')
        images.append(str(root / name))
        cv2.imwrite(images[-1], cv2.resize(small, (96, 64), interpolation=cv2.INTER_CUBIC))
    return os.path.join(save_dir, 'deploy.yaml'), images, root


def test_paddleseg_deploy_flow_saves_what_our_infer_saves(argmax_export, tmp_path, capfd):
    deploy_yaml, images, root = argmax_export
    batch_size = 2  # 3 images: a batch of 2, then of 1
    ours = {}
    for enable_mkldnn in ('False', 'True'):
        theirs = tmp_path / f'paddleseg_mkldnn_{enable_mkldnn}'
        report = run_paddleseg_infer(deploy_yaml, str(theirs), enable_mkldnn, batch_size,
                                     images, cwd=str(tmp_path))
        assert not report['psanet_imported']
        # paddleseg.deploy.export's contract: int32 class ids [N, H, W].
        assert report['output_op'] == 'argmax'
        assert report['outputs'] == [[[2, 64, 96], 'int32'], [[1, 64, 96], 'int32']]
        # Ours with the same oneDNN setting (Paddle 3.3 turns it on unless told not to,
        # so PaddleSeg's `--enable_mkldnn False` runs oneDNN too): the same predictor.
        mkldnn = str(report['mkldnn'])
        if mkldnn not in ours:
            ours[mkldnn] = tmp_path / f'ours_mkldnn_{mkldnn}'
            run_our_infer(capfd, '--config', deploy_yaml, '--image_path', str(root),
                          '--save_dir', ours[mkldnn], '--device', 'cpu', '--enable_mkldnn',
                          mkldnn, '--cpu_threads', 1, '--batch_size', batch_size)
        classes = set()
        for image in images:
            name = os.path.splitext(os.path.basename(image))[0] + '.png'
            with Image.open(theirs / name) as mask:
                assert mask.mode == 'P'
                want = np.asarray(mask)
            with Image.open(ours[mkldnn] / 'pseudo_color_prediction' / name) as mask:
                got = np.asarray(mask)
            np.testing.assert_array_equal(got, want, err_msg=f'{name}, {enable_mkldnn}')
            classes.update(np.unique(want).tolist())
        assert len(classes) > 1, 'one class everywhere would make any two runs agree'


def test_paddleseg_deploy_config_reads_every_output_op(argmax_export, tmp_path):
    from paddleseg.deploy.infer import DeployConfig as PaddleSegDeployConfig
    from paddleseg.transforms import Compose, Normalize

    from psanet.deploy.deploy_config import DeployConfig
    from psanet.export import ExportOptions, export_model
    model = helpers.mini_psanet_for_eval(1)
    paths = {'argmax': argmax_export[0]}
    for output_op in ('softmax', 'none'):
        save_dir = str(tmp_path / output_op)
        export_model(model, [{'type': 'Normalize'}], save_dir,
                     ExportOptions(output_op=output_op, psa_impl='paddle'))
        paths[output_op] = os.path.join(save_dir, 'deploy.yaml')
    for output_op, path in paths.items():
        theirs, ours = PaddleSegDeployConfig(path), DeployConfig(path)
        assert os.path.isfile(theirs.model) and os.path.isfile(theirs.params)
        assert (theirs.model, theirs.params) == (ours.model, ours.params)
        assert isinstance(theirs.transforms, Compose)
        assert [type(t) for t in theirs.transforms.transforms] == [Normalize]
        assert theirs.dic['Deploy']['output_op'] == output_op
        assert theirs.dic['Deploy']['output_dtype'] == \
            ('int32' if output_op == 'argmax' else 'float32')


# --- aug_inference ----------------------------------------------------------------------------

def _tiny_segnet():
    paddle.seed(0)
    model = helpers.TinySegNet(3)
    # Random classifier weights: the freshly built model predicts one class everywhere.
    weight = model.classifier.weight
    weight.set_value(np.random.default_rng(0).normal(size=weight.shape).astype(np.float32))
    model.eval()
    return model


# (model, its tolerance, input [N, C, H, W], trans_info, aug_inference options). The
# same operations in the same order, except that paddleseg's sliding windows add in
# float64: the two agree within the model's tolerance (see conftest).
AUG_CASES = {
    'psanet scales, horizontal flip, resize undone': (
        lambda: helpers.mini_psanet_for_eval(2), MINI_PSANET_RTOL, (1, 3, 64, 128), [('resize', [80, 150])],
        dict(scales=[0.75, 1.0, 1.25], flip_horizontal=True)),
    'tinysegnet both flips, windows, padding undone': (
        _tiny_segnet, TINY_SEGNET_RTOL, (1, 3, 32, 64), [('padding', [30, 60])],
        dict(scales=1.0, flip_horizontal=True, flip_vertical=True, is_slide=True,
             crop_size=(32, 16), stride=(16, 8))),
}


@pytest.mark.parametrize('case', sorted(AUG_CASES))
def test_aug_inference_is_paddleseg_aug_inference(case):
    from paddleseg.core.infer import aug_inference as paddleseg_aug_inference
    build, rtol, shape, trans_info, options = AUG_CASES[case]
    model = build()
    x = paddle.to_tensor(np.random.RandomState(3).uniform(-1, 1, shape).astype('float32'))
    with paddle.no_grad():
        _, want = paddleseg_aug_inference(model, x, trans_info, **options)
        got = inference.aug_inference(model, x, trans_info, InferenceOptions(**options))
    assert list(got.shape) == list(want.shape)
    assert_logits_agree(got.numpy(), want.numpy(), rtol, case)
