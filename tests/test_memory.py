"""psanet.deploy.attention_memory: what an input's attention takes, as the model says it; the
largest window and scale that fit, worked out, against the searches that try every size one
step at a time; the host's available memory as /proc/meminfo gives it (a file with known
numbers stands in); and the record of the free-GPU-memory API."""
import math
import re

import numpy as np
import paddle
import pytest
from paddleseg.models.backbones import ResNet18_vd

from conftest import autocast_state
from psanet import compat
from psanet.deploy import attention_memory
from psanet.deploy.attention_memory import (AttentionCost, _shorten, largest_crop, largest_scale,
                                            scaled_size)
from psanet.errors import DeployError
from psanet.models import PSANet


def small_psanet(output_stride, shrink_factor, psa_type=2, psa_softmax=True):
    paddle.seed(0)
    model = PSANet(5, ResNet18_vd(output_stride=output_stride), psa_type=psa_type, mask_h=5,
                   mask_w=5, psa_channels=8, shrink_factor=shrink_factor,
                   psa_softmax=psa_softmax, enable_auxiliary_loss=False)
    model.eval()
    return model


def fits(model, height, width, batch, budget):
    return model.attention_memory(height, width, batch).peak_bytes <= budget


def crop_by_search(model, height, width, batch, budget, start=None):
    """From the input scaled by the 4th root of budget / peak, rounded down to whole map
    positions, the longer side (the height on a tie) shortened by a position until the
    model's own estimate fits. ``start`` (a list) receives the first window tried."""
    need = model.attention_memory(height, width, batch)
    unit = need.input_unit
    factor = min(1.0, (budget / need.peak_bytes) ** 0.25)
    crop_h = max(unit, int(height * factor) // unit * unit)
    crop_w = max(unit, int(width * factor) // unit * unit)
    if start is not None:
        start[:] = [crop_w, crop_h]
    while not fits(model, crop_h, crop_w, batch, budget):
        if crop_h == unit and crop_w == unit:
            return None
        if crop_h >= crop_w and crop_h > unit or crop_w == unit:
            crop_h -= unit
        else:
            crop_w -= unit
    return crop_w, crop_h


@pytest.mark.parametrize('output_stride, shrink_factor, psa_type', [(8, 2, 2), (16, 3, 0)])
def test_the_cost_of_any_size_is_the_models_own_estimate(output_stride, shrink_factor,
                                                         psa_type):
    """One AttentionCost (what deploy.yaml records) gives every size's peak as the model's
    plan of that size does."""
    model = small_psanet(output_stride, shrink_factor, psa_type=psa_type)
    cost = AttentionCost.of(model.attention_memory(64, 64))
    for batch, height, width in [(1, 1, 1), (1, 64, 64), (2, 67, 90), (3, 129, 17),
                                 (1, 1000, 333)]:
        assert cost.peak_bytes(batch, height, width) == \
            model.attention_memory(height, width, batch).peak_bytes, (batch, height, width)


def crop_case(start, crop):
    """Which way the search ended: nothing fits, the first window, a side cut."""
    return 'none' if crop is None else 'first' if list(crop) == start else 'cut'


def scale_by_search(model, height, width, batch, budget):
    """Scales 1.00, 0.99, ... 0.01 in turn, the first the model's estimate fits."""
    scale = 1.0
    while scale >= 0.01:
        if fits(model, *scaled_size(height, width, scale), batch, budget):
            return scale
        scale = round(scale - 0.01, 2)
    return None


MODELS = [(8, 2), (16, 3), (8, 1)]  # (output stride, shrink factor)


def cases(seed, count):
    """(height, width, batch, budget): sizes from 50 to 700 pixels, budgets from below one
    map position's to above the whole image's, and budgets right at and one byte under
    a number of positions' peak, where rounding decides."""
    rng = np.random.RandomState(seed)
    for _ in range(count):
        height, width = (int(v) for v in rng.randint(50, 701, size=2))
        batch = int(rng.choice([1, 2]))
        yield height, width, batch, float(10 ** rng.uniform(-6, 0.5))
        cells = int(rng.randint(1, 200))
        yield height, width, batch, ('cells', cells, 0)
        yield height, width, batch, ('cells', cells, -1)


def budget_of(model, height, width, batch, budget):
    """A budget as bytes: a share of the whole input's peak, or a number of positions' peak
    (from the model's estimate of an input ``cells`` positions wide) plus ``extra``."""
    if isinstance(budget, tuple):
        _, cells, extra = budget
        unit = model.attention_memory(height, width, batch).input_unit
        return model.attention_memory(unit, cells * unit, batch).peak_bytes + extra
    return budget * model.attention_memory(height, width, batch).peak_bytes


@pytest.mark.parametrize('output_stride, shrink_factor', MODELS)
def test_largest_crop_is_what_the_search_finds(output_stride, shrink_factor):
    model = small_psanet(output_stride, shrink_factor)
    found = set()
    for height, width, batch, budget in cases(output_stride * 10 + shrink_factor, 150):
        budget = budget_of(model, height, width, batch, budget)
        cost = AttentionCost.of(model.attention_memory(height, width, batch))
        start = []
        expected = crop_by_search(model, height, width, batch, budget, start)
        assert largest_crop(cost, batch, height, width, budget) == expected, (
            height, width, batch, budget)
        found.add(crop_case(start, expected))
    assert found == {'none', 'first', 'cut'}  # every way out was met


def test_shortening_is_the_search_in_steps():
    """Every start up to 30 x 30 positions, every number of positions that fit: the form
    against one-position steps on the longer side (rows on a tie)."""
    ways = set()
    for rows in range(1, 31):
        for cols in range(1, 31):
            for cells in range(0, rows * cols + 2):
                r, c, expected = rows, cols, None
                while cells >= 1:
                    if r * c <= cells:
                        expected = (r, c)
                        break
                    if r >= c and r > 1 or c == 1:
                        r -= 1
                    else:
                        c -= 1
                assert _shorten(rows, cols, cells) == expected, (rows, cols, cells)
                if expected and expected != (rows, cols):
                    ways.add('one side' if expected[0] == rows or expected[1] == cols else 'both')
    assert ways == {'one side', 'both'}


@pytest.mark.parametrize('output_stride, shrink_factor', MODELS)
def test_largest_scale_is_what_the_search_finds(output_stride, shrink_factor):
    model = small_psanet(output_stride, shrink_factor)
    found = set()
    for height, width, batch, budget in cases(output_stride * 10 + shrink_factor + 1, 150):
        budget = budget_of(model, height, width, batch, budget)
        cost = AttentionCost.of(model.attention_memory(height, width, batch))
        expected = scale_by_search(model, height, width, batch, budget)
        assert largest_scale(cost, batch, height, width, budget) == expected, (
            height, width, batch, budget)
        found.add('none' if expected is None else 'whole' if expected == 1.0 else 'smaller')
    assert found == {'none', 'whole', 'smaller'}


@pytest.mark.parametrize('autocast, psa_softmax', [(True, True), (False, False)])
def test_the_closed_forms_follow_the_bytes_per_element(autocast, psa_softmax):
    """fp16 autocast (a half map, its float32 copy and the softmax: 10 bytes an element) and
    no softmax (the map alone: 4) change what fits; the forms read it from the plan."""
    model = small_psanet(8, 2, psa_type=0, psa_softmax=psa_softmax)
    with autocast_state(autocast, 'float16'):
        plan = model.attention_memory(300, 410)
        assert plan.peak_bytes_per_element == (10 if autocast else 4)
        cost = AttentionCost.of(plan)
        for budget in (1e4, 3e5, 7e6):
            assert largest_crop(cost, 1, 300, 410, budget) == crop_by_search(model, 300, 410, 1,
                                                                             budget)
            assert largest_scale(cost, 1, 300, 410, budget) == scale_by_search(model, 300, 410,
                                                                               1, budget)


def test_a_crop_fits_and_one_more_position_would_not():
    """The window the form gives is the largest of its shape: one map position more on
    either side no longer fits (so the search's answer is no smaller than needed)."""
    model = small_psanet(8, 2)
    plan = model.attention_memory(512, 1024)
    budget = plan.peak_bytes / 50
    crop_w, crop_h = largest_crop(AttentionCost.of(plan), 1, 512, 1024, budget)
    unit = plan.input_unit
    assert fits(model, crop_h, crop_w, 1, budget)
    assert not fits(model, crop_h, crop_w + unit, 1, budget)
    assert math.isclose(crop_w / crop_h, 2, rel_tol=0.25)  # about the input's aspect


def test_free_gpu_memory_record_matches_this_paddle():
    """FREE_GPU_MEMORY: fails once paddle.cuda.mem_get_info exists where the record says
    not, or is gone where it says it is there."""
    has_api = hasattr(getattr(paddle, 'cuda', None), 'mem_get_info')
    assert has_api == (not compat.FREE_GPU_MEMORY.needed())


def test_free_gpu_memory_reads_what_cuda_reports(monkeypatch):
    """The GPU reading runs on CPU builds too, with CUDA's answer stood in: it returns the
    free bytes of the device it is asked about."""
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return (123 * 2 ** 20, 456 * 2 ** 20)

    if compat.FREE_GPU_MEMORY.needed():
        monkeypatch.setattr(paddle.base.core, 'gpu_memory_available', lambda: 77 * 2 ** 20,
                            raising=False)
        assert compat.free_gpu_memory(0) == 77 * 2 ** 20
    else:
        monkeypatch.setattr(paddle.cuda, 'mem_get_info', mem_get_info)
        assert compat.free_gpu_memory(1) == 123 * 2 ** 20 and asked == [1]


@pytest.mark.parametrize('batch, height, width', [(1, 1024, 2048), (2, 900, 600)])
def test_the_runtime_refuses_a_batch_that_does_not_fit_naming_windows_that_do(
        monkeypatch, batch, height, width):
    """An export's check (deploy.yaml's cost, no model): refused with one memory byte short
    of the model's own estimate, passed with it; the windows it names fit half the memory
    by the model's estimate and keep about the input's aspect."""
    model = small_psanet(8, 2)
    cost = AttentionCost.of(model.attention_memory(64, 64))
    need = model.attention_memory(height, width, batch).peak_bytes
    for available in (need - 1, need // 30):
        monkeypatch.setattr(attention_memory, 'host_memory_available', lambda: available)
        with pytest.raises(DeployError) as caught:
            attention_memory.check_batch_memory(cost, (batch, 3, height, width))
        crop_w, crop_h = map(int, re.search(r'"crop_size": \[(\d+), (\d+)\]',
                                            str(caught.value)).groups())
        assert fits(model, crop_h, crop_w, batch, available / 2)
        assert math.isclose(crop_w / crop_h, width / height, rel_tol=0.3)
    monkeypatch.setattr(attention_memory, 'host_memory_available', lambda: need)
    attention_memory.check_batch_memory(cost, (batch, 3, height, width))


MEMINFO = """MemTotal:       32768000 kB
MemFree:         1048576 kB
MemAvailable:   12345678 kB
Buffers:          204800 kB
"""


def test_the_hosts_available_memory_is_memavailable_in_bytes(tmp_path, monkeypatch):
    """/proc/meminfo counts in KiB (the kernel's "kB"): MemAvailable 12345678 kB is
    12641974272 bytes, 11.8 GiB, which the runtime's refusal names; without MemAvailable
    (kernels before 3.14) or the file, the memory is unknown and nothing is refused."""
    meminfo = tmp_path / 'meminfo'
    meminfo.write_text(MEMINFO)
    monkeypatch.setattr(attention_memory, 'MEMINFO', str(meminfo))
    assert attention_memory.host_memory_available() == 12641974272
    assert attention_memory.available_memory(paddle.CPUPlace()) == 12641974272
    # A 3184 x 3184 input at 16 pixels a position: 199 x 199 positions, 199**4 * 8 bytes =
    # 12545913608 fit; 3185 x 3185: 200 x 200, 200**4 * 8 = 12800000000 do not.
    cost = AttentionCost(input_unit=16, bytes_per_element=8)
    with pytest.raises(DeployError, match=r'a 3185x3185 network input .* needs 11\.9 GiB .*'
                       r'but only 11\.8 GiB of host memory is available'):
        attention_memory.check_batch_memory(cost, (1, 3, 3185, 3185))
    attention_memory.check_batch_memory(cost, (1, 3, 3184, 3184))
    meminfo.write_text(MEMINFO.replace('MemAvailable:   12345678 kB\n', ''))
    assert attention_memory.host_memory_available() is None
    attention_memory.check_batch_memory(cost, (1, 3, 4096, 4096))
    monkeypatch.setattr(attention_memory, 'MEMINFO', str(tmp_path / 'missing'))
    assert attention_memory.host_memory_available() is None
