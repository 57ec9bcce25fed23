"""The data tools refuse a file where a folder belongs in one line, and leave the file alone."""
import os
import sys

import pytest

from conftest import ROOT, run_process
from psanet.data import check_dataset_config, generate_mini_cityscapes
from psanet.errors import DatasetError

CONTENT = 'my notes, not a dataset\n'


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / 'notes.txt'
    path.write_text(CONTENT)
    return str(path)


def run_tool(script, *args):
    done = run_process([sys.executable, os.path.join(ROOT, 'tools', script)] + list(args),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith('error: '), done.stderr
    return lines[0]


def test_make_mini_cityscapes_out_is_a_file(a_file):
    line = run_tool('make_mini_cityscapes.py', '--out', a_file, '--num_train', '1',
                    '--num_val', '1')
    assert line == f'error: --out {a_file} is a file, not a folder: choose a folder path ' \
                   '(it is made if missing).'
    with open(a_file) as f:
        assert f.read() == CONTENT


def test_mini_cityscapes_below_a_file(a_file):
    below = os.path.join(a_file, 'mini')
    with pytest.raises(OSError, match=f'--out {below} cannot be made: {a_file} is a file'):
        generate_mini_cityscapes(below, num_train=1, num_val=1, size=(64, 32))
    with open(a_file) as f:
        assert f.read() == CONTENT


def test_prepare_cityscapes_root_is_a_file(a_file):
    line = run_tool('prepare_cityscapes.py', '--root', a_file)
    assert line.startswith(f'error: dataset root {a_file} is a file, not a folder'), line
    assert 'leftImg8bit/ and gtFine/' in line
    with open(a_file) as f:
        assert f.read() == CONTENT


@pytest.mark.parametrize('kind', ['Cityscapes', 'Dataset'])
def test_dataset_root_in_a_config_is_a_file(a_file, kind):
    with pytest.raises(DatasetError, match=f'{a_file} is a file, not a folder'):
        check_dataset_config({'type': kind, 'dataset_root': a_file, 'mode': 'train'})


@pytest.mark.parametrize('flag', ['--num_train', '--num_val'])
def test_make_mini_cityscapes_needs_an_image_per_split(tmp_path, flag):
    line = run_tool('make_mini_cityscapes.py', '--out', str(tmp_path / 'mini'), flag, '0')
    assert line == (f'error: {flag} must be a positive int (training and evaluation need an '
                    'image each), got 0')
    assert not os.path.exists(tmp_path / 'mini')


def test_make_mini_cityscapes_refuses_a_size_it_cannot_draw(tmp_path):
    line = run_tool('make_mini_cityscapes.py', '--out', str(tmp_path / 'mini'), '--size',
                    '200000', '100000')
    assert line == ('error: size (width, height) must be at most (4096, 2048) (twice '
                    'Cityscapes), got (200000, 100000)')
    assert not os.path.exists(tmp_path / 'mini')
