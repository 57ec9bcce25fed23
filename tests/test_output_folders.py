"""Outputs are checked before any work and written whole: train.py, val.py, predict.py,
export.py and tools/convert_checkpoint.py refuse a path they cannot write before building the
model, a failed re-export leaves the previous export as it was, a re-export keeps every file
of the user's (hidden ones and folders too) and no stale export file, export folders get a
plain mkdir's mode, a killed export's temporaries are cleaned by the next, and a folder that
cannot be swapped (the current folder, a mount point) is refused up front."""
import importlib.util
import os
import subprocess
import sys

import paddle
import pytest
import yaml

from conftest import MINI_CONFIG, needs_onnx
from engine_helpers import mini_psanet_for_eval
from psanet import export as export_module
from psanet.cli import run_cli
from psanet.contract import DEPLOY_FILE
from psanet.core.weights import convert_reproduction_file
from psanet.core.predict import predict_from_config
from psanet.core.train import train_from_config
from psanet.core.val import evaluate_from_config
from psanet.deploy.deploy_config import DeployConfig
from psanet.export import ExportOptions, export_from_config, export_model
from disk_helpers import digests, small_tmpfs

# A folder no process can write into, root included (sysfs refuses new entries).
UNWRITABLE = '/sys/psanet-test-output'


@pytest.fixture(scope='module')
def weights(tmp_path_factory):
    path = str(tmp_path_factory.mktemp('weights') / 'model.pdparams')
    paddle.save(mini_psanet_for_eval(seed=2).state_dict(), path)
    return path


def _one_error_line(capsys, code):
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith('error: '), err
    return lines[0], out


def _unusable(tmp_path):
    taken = tmp_path / 'taken.txt'
    taken.write_text('keep me')
    return taken, [(str(taken), 'is a file, not a folder'),
                   (str(taken / 'below'), f'{taken} is a file, not a folder'),
                   (UNWRITABLE, 'cannot be written: /sys:')]


def test_val_refuses_an_unusable_save_dir_before_evaluating(tmp_path, capsys, weights,
                                                           mini_cityscapes):
    taken, cases = _unusable(tmp_path)
    opts = [f'val_dataset.dataset_root={mini_cityscapes}',
            f'train_dataset.dataset_root={mini_cityscapes}']
    for save_dir, words in cases:
        code = run_cli(evaluate_from_config, MINI_CONFIG, weights, device='cpu',
                       save_dir=save_dir, opts=opts)
        line, out = _one_error_line(capsys, code)
        assert line.startswith(f'error: --save_dir {save_dir} ') and words in line, line
        assert 'Loaded weights' not in out and '[EVAL]' not in out
    assert taken.read_text() == 'keep me'
    # The same folder that can be written: evaluation runs.
    assert run_cli(evaluate_from_config, MINI_CONFIG, weights, device='cpu',
                   save_dir=str(tmp_path / 'ok'), opts=opts) == 0
    assert '[EVAL]' in capsys.readouterr().out


def test_train_refuses_an_unusable_save_dir_as_the_other_jobs_do(tmp_path, capsys):
    taken, cases = _unusable(tmp_path)
    for save_dir, words in cases:
        code = run_cli(train_from_config, MINI_CONFIG, device='cpu', save_dir=save_dir)
        line, out = _one_error_line(capsys, code)
        assert line.startswith(f'error: --save_dir {save_dir} ') and words in line, line
        assert 'Training' not in out
    assert taken.read_text() == 'keep me'


def test_predict_and_export_refuse_an_unwritable_save_dir_before_any_work(tmp_path, capsys,
                                                                         weights,
                                                                         mini_cityscapes):
    image = os.path.join(mini_cityscapes, 'leftImg8bit', 'val')
    code = run_cli(predict_from_config, MINI_CONFIG, weights, image, save_dir=UNWRITABLE,
                   device='cpu')
    line, out = _one_error_line(capsys, code)
    assert f'--save_dir {UNWRITABLE} cannot be written' in line and 'Predicting' not in out
    code = run_cli(export_from_config, MINI_CONFIG, weights, save_dir=UNWRITABLE + '/exp')
    line, out = _one_error_line(capsys, code)
    assert f'--save_dir {UNWRITABLE}/exp cannot be written' in line
    assert 'Loaded weights' not in out


def test_the_converter_refuses_a_destination_it_cannot_write(tmp_path, capsys):
    src = str(tmp_path / 'not-read.pdparams')  # the destination is checked first
    for dst, words in ((UNWRITABLE + '/model.pdparams', 'cannot be written: /sys:'),
                       (str(tmp_path), 'is a folder: pass the path of the file to write')):
        code = run_cli(convert_reproduction_file, src, dst, MINI_CONFIG)
        line, _ = _one_error_line(capsys, code)
        assert line.startswith(f'error: --dst {dst} ') and words in line, line



@pytest.fixture(scope='module')
def first_export(tmp_path_factory):
    """An argmax export with the custom op, and a file of the user's beside it."""
    model = mini_psanet_for_eval(seed=2)
    folder = tmp_path_factory.mktemp('exports') / 'mix'
    export_model(model, [{'type': 'Normalize'}], str(folder), ExportOptions(output_op='argmax'))
    (folder / 'notes.txt').write_text('mine')
    return model, folder


def test_onnx_without_paddle2onnx_is_refused_before_anything_is_written(first_export,
                                                                        monkeypatch):
    model, folder = first_export
    before = digests(folder)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *args: None
                        if name in ('paddle2onnx', 'onnxruntime') else real_find_spec(name, *args))
    with pytest.raises(export_module.ConfigError,
                       match='--onnx needs paddle2onnx and onnxruntime, which are not installed: '
                       'pip install paddle2onnx onnxruntime'):
        export_model(model, [{'type': 'Normalize'}], str(folder),
                     ExportOptions(output_op='none', psa_impl='paddle', onnx=True))
    assert digests(folder) == before


def test_a_failed_re_export_leaves_the_previous_export_whole(first_export, monkeypatch):
    model, folder = first_export
    before = digests(folder)

    def broken_converter(save_dir):
        raise RuntimeError('paddle2onnx failed (simulated)')

    monkeypatch.setattr(export_module, 'export_onnx', broken_converter)
    monkeypatch.setattr(export_module, '_check_onnx_tools', lambda: None)  # also without them
    with pytest.raises(RuntimeError, match='simulated'):
        export_model(model, [{'type': 'Normalize'}], str(folder),
                     ExportOptions(output_op='none', psa_impl='paddle', onnx=True))
    assert digests(folder) == before
    assert DeployConfig(str(folder / DEPLOY_FILE)).output_op == 'argmax'
    assert sorted(os.listdir(folder.parent)) == ['mix']  # no temporary left beside it


def test_a_re_export_replaces_the_export_and_keeps_other_files(first_export, tmp_path):
    model, folder = first_export
    again = tmp_path / 'again'
    export_model(model, [{'type': 'Normalize'}], str(again), ExportOptions(output_op='argmax'))
    (again / 'notes.txt').write_text('mine')
    export_model(model, [{'type': 'Normalize'}], str(again),
                 ExportOptions(output_op='softmax', psa_impl='paddle'))
    with open(again / DEPLOY_FILE) as f:
        deploy = yaml.safe_load(f)['Deploy']
    assert deploy['output_op'] == 'softmax' and deploy['psa_impl'] == 'paddle'
    assert (again / 'notes.txt').read_text() == 'mine'
    assert sorted(os.listdir(tmp_path)) == ['again']


def _users_files(folder):
    """A git repository, a dotfile, a file and a subfolder of the user's in ``folder``."""
    (folder / 'notes.txt').write_text('mine')
    (folder / '.env').write_text('TOKEN=keep')
    (folder / 'sub').mkdir()
    (folder / 'sub' / 'data.txt').write_text('sub data')
    subprocess.run(['git', 'init', '-q', str(folder)], check=True)
    return {name: data for name, data in digests(folder).items()
            if name.split(os.sep)[0] not in ('model.json', 'model.pdiparams', 'model.onnx',
                                                'deploy.yaml')}


@needs_onnx
def test_a_re_export_keeps_the_users_files_and_drops_the_old_exports(tmp_path):
    from engine_helpers import TinySegNet
    model = TinySegNet(3)
    model.eval()
    folder = tmp_path / 'export'
    export_model(model, [{'type': 'Normalize'}], str(folder),
                 ExportOptions(output_op='none', psa_impl='paddle', onnx=True))
    assert (folder / 'model.onnx').is_file()
    mine = _users_files(folder)
    assert '.git/HEAD' in mine and '.env' in mine and 'sub/data.txt' in mine
    export_model(model, [{'type': 'Normalize'}], str(folder), ExportOptions(psa_impl='paddle'))
    after = digests(folder)
    export = {'model.json', 'model.pdiparams', 'deploy.yaml'}
    assert set(after) == export | set(mine)  # no model.onnx that deploy.yaml does not name
    assert {name: after[name] for name in mine} == mine
    assert DeployConfig(str(folder)).onnx is None
    assert sorted(os.listdir(tmp_path)) == ['export']


def test_a_stale_export_file_written_by_hand_goes(first_export, tmp_path):
    model, _ = first_export
    folder = tmp_path / 'export'
    export_model(model, [{'type': 'Normalize'}], str(folder), ExportOptions(psa_impl='paddle'))
    (folder / 'model.onnx').write_bytes(b'not from this export')
    mine = _users_files(folder)
    export_model(model, [{'type': 'Normalize'}], str(folder), ExportOptions(psa_impl='paddle'))
    after = digests(folder)
    assert set(after) == {'model.json', 'model.pdiparams', 'deploy.yaml'} | set(mine)
    assert {name: after[name] for name in mine} == mine


def _mode(path):
    return os.stat(path).st_mode & 0o777


def test_export_and_checkpoint_folders_get_a_plain_mkdirs_mode(first_export, tmp_path):
    from psanet.core.checkpoint import save_checkpoint
    model, _ = first_export
    old = os.umask(0o022)
    try:
        os.mkdir(tmp_path / 'plain')
        export_model(model, [{'type': 'Normalize'}], str(tmp_path / 'export'),
                     ExportOptions(psa_impl='paddle'))
        save_checkpoint(str(tmp_path / 'iter_1'), model, state={'iteration': 1})
    finally:
        os.umask(old)
    assert _mode(tmp_path / 'plain') == 0o755
    assert _mode(tmp_path / 'export') == 0o755 and _mode(tmp_path / 'iter_1') == 0o755
    assert _mode(tmp_path / 'export' / 'model.json') == 0o644


def _dead_pid():
    done = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_a_killed_exports_temporaries_are_cleaned_by_the_next(first_export, tmp_path):
    model, _ = first_export
    folder = tmp_path / 'export'
    export_model(model, [{'type': 'Normalize'}], str(folder), ExportOptions(psa_impl='paddle'))
    dead, live = _dead_pid(), os.getppid()
    left = tmp_path / f'.export.tmp-{dead}-0a1b2c3d'      # killed while writing
    retired = tmp_path / f'.export.old.tmp-{dead}-0a1b2c3e'  # killed after the swap
    other = tmp_path / f'.export.tmp-{live}-0a1b2c3f'      # a live process's
    for path in (left, retired / 'previous', other):
        path.mkdir(parents=True)
        (path / 'model.pdiparams').write_bytes(b'partial')
    export_model(model, [{'type': 'Normalize'}], str(folder), ExportOptions(psa_impl='paddle'))
    assert sorted(os.listdir(tmp_path)) == sorted(['export', other.name])
    assert DeployConfig(str(folder)).params.endswith('model.pdiparams')


def test_a_folder_that_cannot_be_swapped_is_refused_up_front(tmp_path, capsys, weights,
                                                             monkeypatch):
    with small_tmpfs(tmp_path / 'volume', 1 << 20) as volume:
        code = run_cli(export_from_config, MINI_CONFIG, weights, save_dir=volume)
        line, out = _one_error_line(capsys, code)
        assert f'--save_dir {volume} is a mount point' in line, line
        assert 'Loaded weights' not in out and os.listdir(volume) == []
        assert os.listdir(tmp_path) == ['volume']
    here = tmp_path / 'here'
    here.mkdir()
    monkeypatch.chdir(here)
    code = run_cli(export_from_config, MINI_CONFIG, weights, save_dir='.')
    line, out = _one_error_line(capsys, code)
    assert '--save_dir . is the current folder' in line and 'inference_model' in line, line
    assert os.listdir(here) == [] and sorted(os.listdir(tmp_path)) == ['here', 'volume']


def test_a_missing_check_image_path_is_named_before_the_export(tmp_path, capsys, weights):
    save_dir = tmp_path / 'export'
    code = run_cli(export_from_config, MINI_CONFIG, weights, save_dir=str(save_dir),
                   check_image_path=str(tmp_path / 'missing.png'))
    line, out = _one_error_line(capsys, code)
    assert line.startswith(f'error: --check_image_path {tmp_path / "missing.png"} does not '
                           'exist'), line
    assert not save_dir.exists() and 'Loaded weights' not in out


def _dead_pid():
    """The pid of a process that has exited (and been waited for)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_folder_a_killed_writer_left_only_as_previous_is_renamed_back(tmp_path):
    """A writer killed between moving the old folder aside and swapping the new one in leaves
    the only copy as .<name>.old.tmp-<pid>-*/previous: the next writer puts it back (here
    one that then fails, so the folder it leaves is that copy), never deletes it."""
    from psanet.files import write_folder
    left = tmp_path / f'.export.old.tmp-{_dead_pid()}-0a1b2c3d' / 'previous'
    left.mkdir(parents=True)
    (left / 'deploy.yaml').write_text('the only copy')

    def fail(folder):
        raise RuntimeError('the new export fails')
    with pytest.raises(RuntimeError, match='the new export fails'):
        write_folder(str(tmp_path / 'export'), fail)
    assert os.listdir(tmp_path) == ['export']
    assert (tmp_path / 'export' / 'deploy.yaml').read_text() == 'the only copy'


def test_a_live_writers_temporaries_stay(tmp_path):
    from psanet.files import write_folder
    live = tmp_path / f'.export.old.tmp-{os.getppid()}-0a1b2c3d' / 'previous'
    live.mkdir(parents=True)
    write_folder(str(tmp_path / 'export'), lambda folder: None)
    assert sorted(os.listdir(tmp_path)) == [live.parent.name, 'export']


# The first bytes of each format's files (their specifications' signatures).
MAGIC = {'.png': b'\x89PNG\r\n\x1a\n', '.jpg': b'\xff\xd8\xff', '.jpeg': b'\xff\xd8\xff',
         '.bmp': b'BM'}


@pytest.mark.parametrize('extension', sorted(MAGIC))
def test_each_overlay_is_written_in_its_images_format(tmp_path, extension):
    """The overlay keeps the image's name and so its format: the bytes are that format's,
    the pseudo-colour mask a PNG either way."""
    import numpy as np
    from psanet.contract import color_map, save_prediction
    image = np.random.RandomState(0).randint(0, 256, (6, 10, 3)).astype('uint8')
    label = np.arange(60, dtype='uint8').reshape(6, 10) % 3
    pseudo, added = save_prediction(label, image, f'a{extension}', str(tmp_path),
                                    color_map(3))
    with open(added, 'rb') as f:
        assert f.read(8).startswith(MAGIC[extension]), added
    with open(pseudo, 'rb') as f:
        assert f.read(8) == MAGIC['.png'], pseudo
