"""TIPC: the lite chain (prepare.sh, then train -> eval -> export -> infer with oneDNN on
and off) passes and logs one line per step; failing steps, blank lines in the txt and
modes whose inputs are missing make the scripts exit non-zero with the reason."""
import os
import re
import subprocess

import pytest

from conftest import ROOT, TIPC_TXT as TXT, run_process, tipc_env

PREPARE = 'test_tipc/prepare.sh'
CHAIN = 'test_tipc/test_train_inference_python.sh'


def bash(script, txt, mode, output_dir, timeout=600):
    result = run_process(['bash', script, txt, mode], cwd=ROOT, env=tipc_env(output_dir),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=timeout)
    return result.returncode, result.stdout


def status_lines(output_dir):
    with open(os.path.join(output_dir, 'psanet', 'results_python.log')) as f:
        return [line for line in f.read().splitlines() if line.strip()]


def test_txt_has_paddleseg_line_layout():
    with open(os.path.join(ROOT, TXT)) as f:
        lines = f.read().splitlines()
    assert len(lines) == 52 and all(line.strip() for line in lines)
    # The parser reads by line number: spot-check the anchors of PaddleSeg's layout.
    anchors = {0: '===========================train_params===========================',
               22: '===========================eval_params===========================',
               26: '===========================export_params===========================',
               35: '===========================infer_params==========================='}
    for number, text in anchors.items():
        assert lines[number] == text, number
    keys = {1: 'model_name', 6: '--iters', 15: 'norm_train', 23: 'eval', 29: 'norm_export',
            39: 'inference', 41: '--enable_mkldnn', 46: '--config', 47: '--image_path',
            49: '--benchmark', 50: '--save_dir'}
    for number, key in keys.items():
        assert lines[number].split(':', 1)[0] == key, number


def test_lite_train_lite_infer_passes(tipc_lite_data, tmp_path):
    assert 'prepared lite_train_lite_infer' in tipc_lite_data
    code, output = bash(CHAIN, TXT, 'lite_train_lite_infer', tmp_path)
    assert code == 0, output
    lines = status_lines(tmp_path)
    assert lines[0] == '------------------------ lite_train_lite_infer ------------------------'
    steps = lines[1:]
    # train, eval, export, infer with oneDNN on, infer with oneDNN off
    assert len(steps) == 5, steps
    assert all('Run successfully' in line for line in steps), steps
    for step, script in zip(steps, ['train.py', 'val.py', 'export.py', 'infer.py', 'infer.py']):
        assert script in step
    assert '--enable_mkldnn=True' in steps[3] and '--enable_mkldnn=False' in steps[4]
    val_images = sorted(os.listdir(os.path.join(ROOT, 'test_tipc/data/cityscapes/leftImg8bit/val')))
    for mkldnn in ('True', 'False'):
        name = f'python_infer_cpu_usemkldnn_{mkldnn}_threads_2_precision_fp32_batchsize_1'
        with open(tmp_path / 'psanet' / f'{name}.log') as f:
            log = f.read()
        assert re.search(r'^inference\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+$', log, re.M), log
        pseudo = tmp_path / 'psanet' / f'{name}_results' / 'pseudo_color_prediction'
        assert sorted(os.listdir(pseudo)) == val_images


def test_a_failing_step_fails_the_chain(tipc_lite_data, tmp_path):
    txt = tmp_path / 'failing.txt'
    with open(os.path.join(ROOT, TXT)) as f:
        lines = f.read().splitlines()
    lines[2] = 'python:false'  # every step's interpreter fails at once
    txt.write_text('\n'.join(lines) + '\n')
    code, output = bash(CHAIN, str(txt), 'lite_train_lite_infer', tmp_path)
    assert code != 0
    assert 'step(s) failed' in output
    steps = status_lines(tmp_path)[1:]
    # train, eval, export, two inferences: all fail, then the summary line.
    assert len(steps) == 6 and all('Run failed' in line for line in steps[:5]), steps
    assert '5 step(s) failed' in steps[5]
    assert not [line for line in steps if '\x1b' in line], steps  # no ANSI colour codes
    assert '\x1b[33m Run failed with command' in output  # coloured on the console only


def test_blank_lines_and_unknown_modes_are_refused(tmp_path):
    txt = tmp_path / 'blank.txt'
    with open(os.path.join(ROOT, TXT)) as f:
        txt.write_text(f.read().replace('##\n', '##\n\n', 1))
    code, output = bash(CHAIN, str(txt), 'lite_train_lite_infer', tmp_path)
    assert code == 2 and 'blank lines' in output
    for script in (PREPARE, CHAIN):
        code, output = bash(script, TXT, 'cpp_infer', tmp_path)
        assert code == 2 and 'unknown mode' in output


def test_whole_modes_say_what_they_need(tmp_path):
    data = os.path.join(ROOT, 'test_tipc/data/cityscapes')
    if os.path.isdir(data) and not os.path.isfile(os.path.join(data, 'mini_cityscapes.json')):
        pytest.skip('the real Cityscapes is in test_tipc/data/cityscapes')
    code, output = bash(PREPARE, TXT, 'whole_train_whole_infer', tmp_path)
    assert code == 1 and 'needs the real Cityscapes' in output
    weights = os.path.join(ROOT, 'test_tipc/output/psanet/model.pdparams')
    if not os.path.isfile(weights):
        code, output = bash(PREPARE, TXT, 'whole_infer', tmp_path)
        assert code == 1 and 'needs trained weights' in output
