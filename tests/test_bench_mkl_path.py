"""bench/bench_mkl_path.py runs (its --smoke mode, as CI runs it): a row for each kind of work,
each cell a time, the ratio the two times' quotient, the CPU named as psanet sees it."""
import re
import subprocess
import sys

from conftest import ROOT, run_process
from psanet import amd_cpu_with_avx2


def test_the_smoke_run_prints_every_row_with_both_paths():
    result = run_process([sys.executable, 'bench/bench_mkl_path.py', '--smoke', '--threads', '2'],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    amd = amd_cpu_with_avx2()
    assert ('(AMD with AVX2; psanet sets MKL_DEBUG_CPU_TYPE)' if amd else
            '(not AMD with AVX2; psanet leaves MKL_DEBUG_CPU_TYPE)') in result.stdout
    rows = [line.strip('|').split('|') for line in result.stdout.splitlines()
            if line.startswith('| ') and not line.startswith('| work')]
    assert [row[0].strip() for row in rows] == ['PSA product', 'conv 3x3 fwd+bwd',
                                                'training step', 'Paddle Inference'], rows
    for row in rows:
        own, avx2, ratio = (float(cell) for cell in row[2:])
        assert own > 0 and avx2 > 0, row
        # each time rounded to 0.1 ms, the ratio to 0.01, from the unrounded times
        assert abs(ratio * avx2 - own) <= 0.051 * (1 + ratio) + 0.0051 * avx2, row
    assert re.search(r'\| training step \| psanet_resnet18_os8_mini_\S+, 64x32 \|',
                     result.stdout), result.stdout
