"""bench/bench_deploy.py runs: its CI smoke run (the mini config, 2 images, every installed
backend, INT8 included) prints a row per backend with its agreement with the dygraph model,
and the line naming the API's default backend (its own timing, and the fixed order) reads
its figures from that table; a missing --model_path is one line."""
import os
import re
import sys

import pytest

from conftest import ROOT, run_process
from psanet.deploy import backends
from psanet.deploy.quantize import check_quantize_tools, quantiser_too_old
from psanet.export import onnx_tools_installed

BENCH = os.path.join(ROOT, 'bench', 'bench_deploy.py')
PADDLE_ROWS = ['dygraph, custom op'] + [
    f'Paddle Inference, {impl} op, oneDNN {state}'
    for impl in ('custom', 'paddle') for state in ('off', 'on')]


def _int8_installed():
    try:
        check_quantize_tools()
    except Exception:
        return False
    return quantiser_too_old() is None


def _expected_rows():
    """The rows an installed backend must have; what is not installed, its `not run:`."""
    rows, not_run = list(PADDLE_ROWS), []
    if not onnx_tools_installed():
        return rows, ['the ONNX rows and INT8']
    int8 = _int8_installed()
    if not int8:
        not_run.append('INT8')
    for backend in ('onnxruntime', 'openvino'):
        if not backends.installed(backend):
            not_run.append(f'{backend} (pip install {backend})')
            continue
        rows.append(f'{backend}, ONNX, pure-Paddle op')
        if int8:
            rows.append(f'{backend}, INT8 ONNX')
    return rows, not_run


def _table(out):
    """{backend: cells} of the bench's markdown table, the header's names as keys."""
    lines = [line for line in out.splitlines() if line.startswith('|')]
    header = [cell.strip() for cell in lines[0].strip('|').split('|')]
    assert set(lines[1].strip('|').split('|')) == {'---'}, lines[1]
    table = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip('|').split('|')]
        assert len(cells) == len(header), line
        table[cells[0]] = dict(zip(header, cells))
    return table


def _percent(cell):
    match = re.fullmatch(r'(\d+\.\d{3})%', cell)
    assert match, cell
    return float(match.group(1)) / 100


@pytest.fixture(scope='module')
def smoke(mini_weights):
    """(stdout, the weights) of `bench_deploy.py --smoke` on the mini config's seeded
    weights."""
    done = run_process([sys.executable, BENCH, '--smoke', '--model_path', mini_weights],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, mini_weights


def test_every_installed_backend_has_its_row_and_agrees_with_dygraph(smoke):
    out, weights = smoke
    table = _table(out)
    rows, not_run = _expected_rows()
    assert list(table) == rows
    for name, cells in table.items():
        agreement = _percent(cells['pixels as dygraph'])
        diff = float(cells['max abs logit diff'])
        assert float(cells['images/s']) > 0, name
        assert re.fullmatch(r'\d+\.\d\dx', cells['speed-up vs dygraph']), name
        if name == 'dygraph, custom op':
            assert (agreement, diff) == (1.0, 0.0)
        elif 'INT8' in name:
            # 8-bit steps move the logits (the INT8 model really ran) by a few per cent of
            # their range; a pixel changes class only near a tie of its two best logits.
            assert 0.75 <= agreement < 1.0 and 1e-3 < diff < 5.0, (name, agreement, diff)
        else:
            # float32 in another order: the logits within reordered-sum rounding.
            assert agreement >= 0.999 and diff < 1e-3, (name, agreement, diff)
    for what in not_run:
        assert re.search(rf'^not run: {re.escape(what)}', out, re.M), (what, out)
    title, = [line for line in out.splitlines() if line.startswith('PSANet ')]
    assert title.startswith(f'PSANet psanet_resnet18_os8_mini_cityscapes_128x64_100.yml, '
                            f'weights {weights}, '), title
    assert re.search(r', 2 generated images of 64x32, batch 1, 1 CPU thread\(s\), 1 warm-up '
                     r'batches, 1 rounds, ', title), title


def test_the_default_backend_line_reads_the_table(smoke):
    """The line names what the API's timing picked (its log line, printed before: the
    fastest of its own times) and the fixed order's first, each with its time over the
    fastest row of the same model in the table (by images/s, all rows timing the same
    images)."""
    out, _ = smoke
    table = _table(out)
    deploy_like = type('Export', (), {'onnx': 'model.onnx', 'onnx_int8': 'model_int8.onnx',
                                      'path': 'deploy.yaml'})()
    lines = re.findall(r'^default (float|INT8) backend \(psanet.Segmenter, CPU, timed\): '
                       r'(\w+), (\d+\.\d\d)x the time of the fastest measured \((\w+)\) of '
                       r'(.*); without the timing \(PSANET_TIME_BACKENDS=0\): (\w+), '
                       r'(\d+\.\d\d)x$', out, re.M)
    timed = re.findall(r'\[INFO\]\tbackend (\w+) for \S+/paddle( \(INT8\))? at 1x3x32x64, 1 '
                       r'thread\(s\), the fastest timed: (.*) \(median of \d run\(s\) each '
                       r'after 1 warm-up; remembered in \S+\)\.$', out, re.M)
    if not onnx_tools_installed():  # one candidate: nothing timed
        assert timed == []
        assert lines == [('float', 'paddle', '1.00', 'paddle', 'paddle', 'paddle', '1.00')]
        return
    assert [line[0] for line in lines] == (['float', 'INT8'] if _int8_installed() else ['float'])
    assert [bool(int8) for _, int8, _ in timed] == [line[0] == 'INT8' for line in lines]
    for line, (logged, _, logged_times) in zip(lines, timed):
        precision, chosen, ratio, fastest, candidates, fixed, fixed_ratio = line
        int8 = precision == 'INT8'
        ms = {name: float(value) for name, value in re.findall(r'(\w+) (\d+\.\d) ms',
                                                               logged_times)}
        assert chosen == logged == min(ms, key=ms.get)
        assert fixed == backends.default_backend(deploy_like, int8=int8)
        rows = {name: float(cells['images/s']) for name, cells in table.items()
                if ('INT8' in name) == int8 and (
                    name.startswith(('onnxruntime', 'openvino')) or
                    name == 'Paddle Inference, paddle op, oneDNN on')}
        names = {name.split(',')[0].replace('Paddle Inference', 'paddle'): speed
                 for name, speed in rows.items()}
        assert candidates.split(', ') == sorted(names) == sorted(ms)
        assert fastest == max(names, key=names.get)
        assert float(ratio) == pytest.approx(names[fastest] / names[chosen], abs=0.006)
        assert float(fixed_ratio) == pytest.approx(names[fastest] / names[fixed], abs=0.006)


def test_a_missing_model_path_is_one_line_before_any_work(tmp_path):
    done = run_process([sys.executable, BENCH, '--model_path', str(tmp_path / 'missing')],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ''
    assert done.stderr.strip().splitlines() == [
        f'error: --model_path {tmp_path / "missing"} does not exist (cwd {ROOT}): pass a '
        'model.pdparams file or a checkpoint folder such as output/best_model.']
