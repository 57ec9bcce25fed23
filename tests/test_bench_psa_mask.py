"""bench/bench_psa_mask.py runs (its --smoke mode, as CI runs it): each table it prints has its
row, every timing cell a number, and the pure-Paddle form in every installed backend equal to
the custom op, the exported branches and model to dygraph's (the bench stops otherwise)."""
import importlib.util
import re
import subprocess
import sys

from conftest import ROOT, run_process


def _table(text, first_header):
    """The rows (lists of cells) of the markdown table whose header starts with
    ``first_header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f'| {first_header}'))
    rows = []
    for line in lines[start + 2:]:
        if line.startswith('|'):
            rows.append([cell.strip() for cell in line.strip('|').split('|')])
        elif rows or not line.strip():  # the backends' own log lines come before the row
            break
    return rows


def _ms(cell):
    return float(re.match(r'[\d.]+', cell).group(0))


def test_the_smoke_run_prints_both_tables_with_numbers():
    result = run_process([sys.executable, 'bench/bench_psa_mask.py', '--smoke', '--threads', '2'],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]
    backends = _table(result.stdout, 'mask | map | output')
    assert len(backends) == 1 and backends[0][:2] == ['59x59', '16x32'], backends
    row = dict(zip(['mask', 'map', 'output', 'limit', 'custom', 'dygraph', 'Paddle Inference',
                    'onnxruntime', 'OpenVINO'], backends[0]))
    assert _ms(row['custom']) > 0 and _ms(row['dygraph']) > 0
    assert _ms(row['Paddle Inference']) > 0  # always installed with Paddle
    # Their columns need the export to ONNX and both backends (no wheels on Python 3.13).
    installed = all(importlib.util.find_spec(module) is not None
                    for module in ('paddle2onnx', 'onnxruntime', 'openvino'))
    for name in ('onnxruntime', 'OpenVINO'):
        assert (row[name] != '—') == installed, (name, row[name])
    assert "Every backend's output equals the custom op's exactly." in result.stdout
    floor = _table(result.stdout, 'mask | map | output | custom')
    assert len(floor) == 1 and floor[0][:3] == ['59x59', '16x32', '1 MiB'], floor
    cells = dict(zip(['custom', 'dygraph', 'Paddle Inference', 'onnxruntime', 'OpenVINO'],
                     floor[0][3:]))
    assert _ms(cells['custom']) == _ms(row['custom']), (cells, row)
    for name, cell in cells.items():
        if name in ('onnxruntime', 'OpenVINO') and not installed:
            assert cell == '—', (name, cell)
            continue
        if name == 'custom':
            continue
        # ms (its ratio to the custom op's ms); each ms rounded to 0.1, the ratio to 0.01
        ms, ratio = (float(v) for v in re.fullmatch(r'([\d.]+) \(([\d.]+)\)', cell).groups())
        custom = _ms(cells['custom'])
        assert abs(ms - ratio * custom) <= 0.051 * (1 + ratio) + 0.0051 * custom, \
            (name, cell, custom)
    branches = _table(result.stdout, 'mask | map | custom op: dygraph')
    assert len(branches) == 1 and branches[0][:2] == ['59x59', '16x32'], branches
    cells = branches[0][2:]  # dygraph; before, now, ratio for PI custom, PI pure, ORT, OpenVINO
    assert len(cells) == 1 + 4 * 3 and all(_ms(cell) > 0 for cell in cells[:7]), cells
    assert all((cell != '—') == installed for cell in cells[7:]), cells
    assert "Every output agrees with dygraph's" in result.stdout
    model = _table(result.stdout, 'backend | before | now')
    want = ['Paddle Inference, custom op, oneDNN on'] + (['onnxruntime', 'openvino']
                                                         if installed else [])
    assert [row[0] for row in model] == want, model
    assert all(_ms(cell) > 0 for row in model for cell in row[1:]), model
    assert "Every output within 1e-3 of the largest logit of dygraph's." in result.stdout
    kernel = _table(result.stdout, 'mask | map | grad_out + grad_x')
    assert len(kernel) == 1 and kernel[0][:2] == ['59x59', '32x64'], kernel
    read, write, limit, bwd, ratio = (_ms(cell) for cell in kernel[0][3:])
    # Cells are rounded to 0.1 ms and ratios to 0.01: the limit is the sum of its two parts,
    # the ratio the kernel's time over it.
    assert limit > 0 and bwd > 0 and abs(limit - (read + write)) <= 0.151
    assert abs(ratio * limit - bwd) <= 0.06 + 0.16 * ratio + 0.005 * limit
