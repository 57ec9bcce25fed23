"""What the commands print: none of the upstream lines that look like something to fix
(paddleseg filling in config keys, its YAML dump, Paddle's PIR 'out tensor' line, an
unasked --cpu_threads warning, onnxruntime's 'Removing initializer', the hidden folder of
an export), counted in the commands' own output; and what they should print instead
(infer.py's progress bar and warm-up line, val.py's per-class table by name)."""
import glob
import os
import re
import subprocess
import sys

import cv2
import numpy as np
import pytest

from conftest import INFER_SCRIPT, MINI_CONFIG, ROOT, run_process
from psanet import compat

CONFIGS = sorted(glob.glob(os.path.join(ROOT, 'configs', 'psanet', '*.yml')))
NOISE = {
    'paddleseg fills in a config key': re.compile(r'Add the `\w+` in train_dataset class'),
    'paddleseg dumps the config as YAML': re.compile(re.escape(compat.BUILDER_MESSAGE)),
    "Paddle's PIR out tensor line": re.compile(re.escape(compat.PIR_OUT_TENSOR)),
    'an unasked --cpu_threads warning': re.compile(r'--cpu_threads \d+ is more than'),
    "onnxruntime's unused initializers": re.compile(re.escape(compat.ORT_UNUSED_INITIALIZER)),
    'the hidden folder an export is written in': re.compile(r'\.tmp-\d+'),
}


def _noise(output):
    """{what: count} of the NOISE lines in ``output`` that occur."""
    counts = {what: sum(bool(p.search(line)) for line in output.splitlines())
              for what, p in NOISE.items()}
    return {what: count for what, count in counts.items() if count}


def test_the_noise_patterns_match_the_lines_upstream_prints():
    # The counts below would be zero for any output if a pattern matched nothing.
    printed = [
        '2026-12-02 12:35:31 [WARNING]\tAdd the `num_classes` in train_dataset class to model '
        'config. We suggest you manually set `num_classes` in model config.',
        '2026-12-02 12:35:32 [INFO]\tUse the following config to build loss',
        'W1202 12:39:29.377015 22191 eager_utils.cc:3584] Paddle static graph(PIR) not support '
        'input out tensor for now!!!!!',
        '2026-12-02 12:39:48 [WARNING]\t--cpu_threads 10 is more than the 2 cores this process '
        'may use: using 2.',
        "\x1b[0;93m2026-12-02 12:46:32.50 [W:onnxruntime:, graph.cc:5809 CleanUnusedInitializers"
        "AndNodeArgs] Removing initializer 'p2o.pd_op.full.45.0'. It is not used by any node",
        '2026-12-02 12:46:31 [INFO]\tONNX model saved in /tmp/fh/.e.tmp-2195-cc35d2f5/model.onnx.',
    ]
    assert _noise('\n'.join(printed)) == {what: 1 for what in NOISE}


@pytest.mark.parametrize('config', CONFIGS, ids=os.path.basename)
def test_building_a_shipped_config_prints_no_paddleseg_fill_ins_nor_yaml(config, capsys):
    from psanet.core.config import ComponentBuilder, load_config
    builder = ComponentBuilder(load_config(config), weights_follow=True)
    _ = builder.model, builder.losses
    out = capsys.readouterr()
    assert _noise(out.out + out.err) == {}, out.out


def _images(folder, count=3):
    os.makedirs(folder)
    rng = np.random.RandomState(0)
    for i in range(count):
        small = rng.randint(0, 256, (4, 8, 3)).astype('uint8')
        cv2.imwrite(os.path.join(folder, f'{i}.png'),
                    cv2.resize(small, (128, 64), interpolation=cv2.INTER_CUBIC))
    return folder


def _run(*args):
    result = run_process([sys.executable, *[str(a) for a in args]], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=600)
    assert result.returncode == 0, result.stdout
    return result.stdout


def test_export_and_infer_print_none_of_the_noise(tmp_path):
    from psanet.export import onnx_tools_installed
    images = _images(str(tmp_path / 'images'))
    export = tmp_path / 'export'
    onnx = onnx_tools_installed()
    flags = ['--psa_impl', 'paddle', '--onnx', '--quantize', 'int8', '--calib_images',
             images] if onnx else []
    out = _run('export.py', '--config', MINI_CONFIG, '--save_dir', export, *flags)
    assert 'Exported the model' in out, out  # the output was read
    assert (export / ('model_int8.onnx' if onnx else 'model.json')).is_file()
    assert _noise(out) == {}, out
    out = _run(INFER_SCRIPT, '--config', export / 'deploy.yaml', '--image_path', images,
               '--save_dir', tmp_path / 'infer', '--benchmark', 'True')
    assert _noise(out) == {}, out
    # what it says instead: the warm-up, then a bar that ends at 3 of 3 images
    lines = out.replace('\r', '\n').splitlines()
    warmup = [i for i, line in enumerate(lines) if 'untimed warm-up runs' in line]
    bar = [i for i, line in enumerate(lines) if re.match(r'^3/3 \[=+\] - \d+s \d+m?s/image$',
                                                          line)]
    assert warmup and bar and warmup[0] < bar[0], out


def test_val_prints_each_class_by_name_with_its_own_numbers(tmp_path, mini_cityscapes):
    import paddle
    from engine_helpers import mini_psanet_for_eval
    from psanet.core.val import format_report
    from psanet.visualize.charts import class_names
    weights = tmp_path / 'model.pdparams'
    paddle.save(mini_psanet_for_eval(seed=2).state_dict(), str(weights))
    out = _run('val.py', '--config', MINI_CONFIG, '--model_path', weights, '--device', 'cpu',
               '--opts', f'val_dataset.dataset_root={mini_cityscapes}')
    assert _noise(out) == {}, out
    names = class_names(19)
    rows = {m.group(1).strip(): [float(v) for v in m.groups()[1:]] for m in
            re.finditer(r'^  (\w[\w ]*?)\s+(\d\.\d{4})\s+(\d\.\d{4})\s+(\d\.\d{4})$', out, re.M)}
    assert list(rows) == names, out
    # against format_report of a result whose every number says its class and column
    result = {'num_images': 1, 'miou': 0, 'acc': 0, 'kappa': 0, 'mdice': 0,
              'class_iou': np.arange(19) / 100, 'class_precision': np.arange(19) / 100 + .2,
              'class_recall': np.arange(19) / 100 + .5}
    table = format_report(result)[1].splitlines()
    assert table[0] == '[EVAL] Per class:'
    for i, (name, row) in enumerate(zip(names, table[2:])):
        assert row.split() == name.split() + [f'{i / 100:.4f}', f'{i / 100 + .2:.4f}',
                                              f'{i / 100 + .5:.4f}'], row


def test_a_missing_image_is_our_line_alone(tmp_path):
    # OpenCV's own "can't open/read file" warning would come first, on the C-level stderr:
    # a subprocess sees it where capsys would not.
    missing = str(tmp_path / 'missing.png')
    code = ('from psanet.deploy.processing import preprocess\n'
            'from psanet.errors import DeployError\n'
            'try:\n'
            f'    preprocess([{missing!r}], None)\n'
            'except DeployError as error:\n'
            '    print("error:", error)\n')
    done = run_process([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f'error: image {missing} does not exist (cwd {ROOT}): check ' \
                                  'the path.'
    assert 'imread' not in done.stderr and "can't open" not in done.stderr, done.stderr
