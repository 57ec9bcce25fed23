"""psanet.core.train and train.py: learning, exact resume, NaN stop, logs, samplers, bad input."""
import dataclasses
import glob
import json
import os
import sys

import cv2
import numpy as np
import paddle
import pytest

import engine_helpers as helpers
from conftest import MINI_CONFIG, ROOT, copy_dataset, run_process
from psanet.cli import run_cli
from psanet.core import checkpoint as ckpt
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.data_loader import SampleReader, TrainBatchSampler
from psanet.core.device import to_plain_batchnorm
from psanet.core.options import EvalOptions, TrainOptions
from psanet.core.train import iteration_seed, train_from_config
from psanet.core.val import evaluate
from psanet.errors import DatasetError, TrainingError


def _build(config_path, seed=0):
    paddle.seed(seed)
    builder = ComponentBuilder(load_config(config_path))
    return builder, builder.model, builder.dataset('train'), builder.optimizer, builder.losses


@pytest.fixture
def toy(tmp_path):
    root = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=4, val_is_train=True)
    return root


def test_training_lowers_loss_and_overfits(tmp_path, toy):
    path = helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(toy, iters=40,
                                                                         batch_size=4))
    builder, model, dataset, optimizer, losses = _build(path)
    result = helpers.train_in_folder(model, dataset, optimizer, losses, TrainOptions(
        iters=40, batch_size=4, save_dir=str(tmp_path / 'out'), save_interval=40, log_iters=10,
        seed=0))
    history = result['losses']
    assert len(history) == 40
    assert np.mean(history[-5:]) < 0.5 * np.mean(history[:5])
    metrics = evaluate(model, builder.dataset('val'), EvalOptions(print_detail=False))
    assert metrics['miou'] >= 0.8, metrics['class_iou']
    assert [i for i, _ in ckpt.list_checkpoints(str(tmp_path / 'out'))] == [40]


class _FailAt:
    """A loss that raises (or returns NaN) on its n-th call, i.e. at iteration n."""

    def __init__(self, loss, at_call, mode):
        self.loss, self.at_call, self.mode, self.calls = loss, at_call, mode, 0

    def __call__(self, logit, label):
        self.calls += 1
        value = self.loss(logit, label)
        if self.calls == self.at_call:
            if self.mode == 'crash':
                raise RuntimeError('simulated crash')
            return value * float('nan')
        return value


def _with_failure(losses, at_call, mode):
    return {'types': [_FailAt(losses['types'][0], at_call, mode)] + list(losses['types'][1:]),
            'coef': losses['coef']}


@pytest.mark.parametrize('num_workers', [0, 2])
def test_resume_after_a_crash_repeats_the_uninterrupted_losses(tmp_path, toy, num_workers):
    # 4 images, batch 2: 2 iterations per epoch, so iteration 3 resumes mid-epoch.
    config = helpers.toy_config(toy, iters=7, batch_size=2, train_transforms=[
        {'type': 'ResizeStepScaling', 'min_scale_factor': 0.75, 'max_scale_factor': 1.25,
         'scale_step_size': 0.25},
        {'type': 'RandomPaddingCrop', 'crop_size': [48, 24]},
        {'type': 'RandomHorizontalFlip'}, {'type': 'Normalize'}])
    path = helpers.write_config(tmp_path / 'toy.yml', config)
    options = dict(iters=7, batch_size=2, save_interval=3, log_iters=1, seed=11,
                   evaluation=EvalOptions(num_workers=num_workers))

    _, model, dataset, optimizer, losses = _build(path)
    full = helpers.train_in_folder(model, dataset, optimizer, losses,
                                   TrainOptions(save_dir=str(tmp_path / 'full'), **options))
    assert len(full['losses']) == 7

    _, model, dataset, optimizer, losses = _build(path)
    with pytest.raises(RuntimeError, match='simulated crash'):
        helpers.train_in_folder(model, dataset, optimizer, _with_failure(losses, 4, 'crash'),
                                TrainOptions(save_dir=str(tmp_path / 'cut'), **options))
    assert [i for i, _ in ckpt.list_checkpoints(str(tmp_path / 'cut'))] == [3]

    _, model, dataset, optimizer, losses = _build(path, seed=99)  # weights come from the checkpoint
    resumed = helpers.train_in_folder(model, dataset, optimizer, losses, TrainOptions(
        save_dir=str(tmp_path / 'cut'), resume_model=str(tmp_path / 'cut' / 'iter_3'),
        **dict(options, seed=None)))
    assert resumed['start_iter'] == 3
    # Both runs are this machine's kernels on the same float32 bits (a checkpoint stores
    # them exactly; the batches are seeded per epoch and sample), so they agree to the
    # last bit whatever the CPU; the tolerances here (8 eps32 on the losses, 80 on the
    # weights) leave room for no more than a last-bit difference over four steps.
    np.testing.assert_allclose(resumed['losses'], full['losses'][3:], rtol=1e-6)
    # Different epochs saw differently shuffled and augmented batches.
    assert len(set(np.round(full['losses'], 6))) == 7
    final_full = ckpt.load_checkpoint(str(tmp_path / 'full' / 'iter_7'))[0]
    final_resumed = ckpt.load_checkpoint(str(tmp_path / 'cut' / 'iter_7'))[0]
    for key, value in final_full.items():
        np.testing.assert_allclose(final_resumed[key].numpy(), value.numpy(), rtol=1e-5,
                                   atol=1e-7, err_msg=key)


def paddleseg_lr(step, iters, learning_rate, end_lr=0.0, power=0.9, warmup_iters=0,
                 warmup_start_lr=0.0):
    """The learning rate after ``step`` scheduler steps, as PaddleSeg 2.8's config builds
    it, written out: PolynomialDecay over ``iters - warmup_iters`` steps (cycle off),
    behind a LinearWarmup from ``warmup_start_lr`` to ``learning_rate`` when
    ``warmup_iters`` is set."""
    if step < warmup_iters:
        return warmup_start_lr + (learning_rate - warmup_start_lr) * step / warmup_iters
    decay_steps = max(iters - warmup_iters, 1)
    done = min(step - warmup_iters, decay_steps)
    return (learning_rate - end_lr) * (1 - done / decay_steps) ** power + end_lr


def logged_lrs(log):
    """{iteration: the lr of its [TRAIN] line}, the last line of each iteration kept."""
    lrs = {}
    for line in log.splitlines():
        if '[TRAIN]' in line:
            iteration = int(line.split('iter: ')[1].split('/')[0])
            lrs[iteration] = float(line.split('lr: ')[1].split(',')[0])
    return lrs


@pytest.mark.parametrize('warmup', [None, {'warmup_iters': 2, 'warmup_start_lr': 0.01}],
                         ids=['poly', 'warmup'])
def test_learning_rate_follows_paddleseg_schedule_across_a_resume(tmp_path, toy, warmup):
    """Iteration i steps with the rate after i - 1 scheduler steps (the logged lr), and
    iter_i's scheduler state is i steps in, before and after a resume."""
    iters, learning_rate = 6, 0.1
    config = helpers.toy_config(toy, iters=iters, batch_size=2, learning_rate=learning_rate)
    config['lr_scheduler'].update(warmup or {})
    path = helpers.write_config(tmp_path / 'toy.yml', config)
    save_dir = str(tmp_path / 'out')
    options = dict(iters=iters, batch_size=2, save_dir=save_dir, save_interval=3, log_iters=1,
                   seed=0)
    _, model, dataset, optimizer, losses = _build(path)
    with pytest.raises(RuntimeError, match='simulated crash'):
        helpers.train_in_folder(model, dataset, optimizer, _with_failure(losses, 5, 'crash'),
                                TrainOptions(**options))
    _, model, dataset, optimizer, losses = _build(path)
    resumed = helpers.train_in_folder(
        model, dataset, optimizer, losses,
        TrainOptions(**dict(options, resume_model=os.path.join(save_dir, 'iter_3'))))
    assert resumed['start_iter'] == 3

    def expected(step):
        return paddleseg_lr(step, iters, learning_rate, **(warmup or {}))

    with open(os.path.join(save_dir, 'train.log')) as f:
        lrs = logged_lrs(f.read())
    assert sorted(lrs) == list(range(1, iters + 1))
    for iteration, lr in lrs.items():  # printed with 6 decimals
        assert lr == pytest.approx(expected(iteration - 1), abs=6e-7), iteration
    for iteration in (3, 6):
        with open(os.path.join(save_dir, f'iter_{iteration}', ckpt.STATE_FILE)) as f:
            scheduler = json.load(f)['lr_scheduler']
        assert scheduler['last_epoch'] == iteration
        assert scheduler['last_lr'] == pytest.approx(expected(iteration), rel=1e-9)


def test_nan_loss_stops_naming_iteration_and_last_checkpoint(tmp_path, toy):
    path = helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(toy, iters=6))
    _, model, dataset, optimizer, losses = _build(path)
    save_dir = str(tmp_path / 'out')
    with pytest.raises(TrainingError) as info:
        helpers.train_in_folder(model, dataset, optimizer, _with_failure(losses, 3, 'nan'),
                                TrainOptions(iters=6, batch_size=2, save_dir=save_dir,
                                             save_interval=2, log_iters=1, seed=0))
    message = str(info.value)
    assert 'nan' in message and 'iteration 3' in message
    assert os.path.join(save_dir, 'iter_2') in message
    assert [i for i, _ in ckpt.list_checkpoints(save_dir)] == [2]


def test_logs_vdl_eval_best_model_and_keep_checkpoint_max(tmp_path, toy, monkeypatch):
    path = helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(toy, iters=8))
    builder, model, dataset, optimizer, losses = _build(path)
    save_dir = str(tmp_path / 'out')
    figures = []
    from psanet.core import train_log
    real_figures = train_log.log_evaluation_figures

    def log_figures(writer, evaluated, names, step):
        figures.append((step, evaluated))
        return real_figures(writer, evaluated, names, step)

    monkeypatch.setattr(train_log, 'log_evaluation_figures', log_figures)
    result = helpers.train_in_folder(model, dataset, optimizer, losses, TrainOptions(
        iters=8, batch_size=2, save_dir=save_dir, save_interval=2, log_iters=4,
        keep_checkpoint_max=2, use_vdl=True, seed=0), val_dataset=builder.dataset('val'))
    assert [i for i, _ in ckpt.list_checkpoints(save_dir)] == [6, 8]
    assert [i for i, _ in result['evals']] == [2, 4, 6, 8]
    best = max(result['evals'], key=lambda e: e[1]['miou'])
    assert result['best_iter'] == best[0]
    with open(os.path.join(save_dir, 'best_model', ckpt.STATE_FILE)) as f:
        assert json.load(f) == {'iteration': best[0], 'miou': best[1]['miou']}
    assert os.path.isfile(os.path.join(save_dir, 'best_model', ckpt.WEIGHTS_FILE))
    with open(os.path.join(save_dir, 'train.log')) as f:
        log = f.read()
    train_lines = [l for l in log.splitlines() if '[TRAIN]' in l]
    assert len(train_lines) == 2
    for field in ('epoch: 2', 'iter: 4/8', 'loss: ', 'loss_0: ', 'loss_1: ', 'lr: ', 'batch_cost: ',
                  'reader_cost: ', 'ips: ', 'samples/sec', 'ETA '):
        assert field in train_lines[0], field
    # The logged loss is the mean of the iterations since the last line, printed with
    # 4 decimals: 5e-5 of rounding.
    logged = float(train_lines[0].split('loss: ')[1].split(',')[0])
    assert logged == pytest.approx(np.mean(result['losses'][:4]), abs=1e-4)
    # Iterations 4 and 8 step with the rate after 3 and 7 of the 8 scheduler steps.
    assert logged_lrs(log) == pytest.approx({4: paddleseg_lr(3, 8, 0.1),
                                             8: paddleseg_lr(7, 8, 0.1)}, abs=6e-7)
    assert 'mIoU' in log and 'BatchNorm: plain BatchNorm (one process).' in log
    assert any(name.startswith('vdlrecords') for name in os.listdir(save_dir))
    # --use_vdl draws the figures of every evaluation, from the evaluation's own result.
    assert [(step, id(evaluated)) for step, evaluated in figures] == \
        [(step, id(evaluated)) for step, evaluated in result['evals']]


def test_augmentation_is_seeded_per_epoch_and_sample(tmp_path, toy):
    config = helpers.toy_config(toy, train_transforms=[
        {'type': 'ResizeStepScaling', 'min_scale_factor': 0.5, 'max_scale_factor': 2.0,
         'scale_step_size': 0.1},
        {'type': 'RandomPaddingCrop', 'crop_size': [40, 20]},
        {'type': 'RandomDistort', 'brightness_range': 0.5}, {'type': 'Normalize'}])
    _, _, dataset, _, _ = _build(helpers.write_config(tmp_path / 'toy.yml', config))
    reader = SampleReader(dataset, seed=3, num_classes=3)

    def sample(epoch, index):
        reader.set_epoch(epoch)
        return reader[index]['img']

    np.testing.assert_array_equal(sample(1, 2), sample(1, 2))  # same seed, same bits
    assert not np.array_equal(sample(1, 2), sample(2, 2))
    other_seed = SampleReader(dataset, seed=4, num_classes=3)
    other_seed.set_epoch(1)
    assert not np.array_equal(sample(1, 2), other_seed[2]['img'])


def test_to_plain_batchnorm_shares_parameters():
    layer = paddle.nn.Sequential(paddle.nn.Conv2D(3, 4, 1), paddle.nn.SyncBatchNorm(4))
    weight, mean = layer[1].weight, layer[1]._mean
    converted = to_plain_batchnorm(layer)
    assert converted is layer and type(layer[1]) is paddle.nn.BatchNorm2D
    assert layer[1].weight is weight and layer[1]._mean is mean
    assert layer(paddle.randn([2, 3, 5, 5])).shape == [2, 4, 5, 5]


def test_sampler_reshuffles_every_epoch_and_resumes_mid_epoch():
    dataset = list(range(10))
    sampler = TrainBatchSampler(dataset, batch_size=3)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        epochs.append([i for batch in sampler for i in batch])
    assert all(len(e) == 9 and len(set(e)) == 9 for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3
    sampler.set_epoch(1)
    assert [i for batch in sampler for i in batch] == epochs[1]  # an epoch's order is fixed
    sampler.set_epoch(1, start_batch=2)
    assert [i for batch in sampler for i in batch] == epochs[1][6:]


@pytest.mark.parametrize('num_workers', [0, 2])
def test_train_reshuffles_and_reseeds_every_epoch(tmp_path, monkeypatch, num_workers):
    root = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=8, num_val=1)
    config = helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(root))
    _, model, dataset, optimizer, losses = _build(config)
    read = []  # (the reader's epoch, index) of each sample, in the order the steps take them
    original = SampleReader.__getitem__

    def recording(self, index):  # in the worker processes too (they are forks)
        sample = original(self, index)
        sample['read'] = [self.epoch, int(index)]
        return sample

    def collate(samples):
        batch = real_collate(samples)
        batch['read'] = np.array([s['read'] for s in samples], 'int64')
        return batch

    def step(run, state, data, epoch):
        read.extend(tuple(int(v) for v in pair) for pair in np.asarray(data['read']))
        return real_step(run, state, data, epoch)

    from psanet.core import data_loader as loader_module
    from psanet.core import train as train_module
    real_step, real_collate = train_module._train_step, loader_module.collate
    monkeypatch.setattr(SampleReader, '__getitem__', recording)
    monkeypatch.setattr(loader_module, 'collate', collate)
    monkeypatch.setattr(train_module, '_train_step', step)
    # 8 images, batch 2: 4 iterations an epoch, 12 iterations are 3 epochs.
    helpers.train_in_folder(model, dataset, optimizer, losses, TrainOptions(
        iters=12, batch_size=2, save_dir=str(tmp_path / 'out'), save_interval=12, seed=3,
        evaluation=EvalOptions(num_workers=num_workers)))
    epochs = [read[e * 8:(e + 1) * 8] for e in range(3)]
    assert [[e for e, _ in epoch] for epoch in epochs] == [[e] * 8 for e in range(3)]
    orders = [[i for _, i in epoch] for epoch in epochs]
    assert all(sorted(order) == list(range(8)) for order in orders)
    assert len({tuple(order) for order in orders}) == 3  # every epoch its own order


def _epoch_order(seed, epoch=0, rank=0):
    sampler = TrainBatchSampler(list(range(16)), batch_size=2, seed=seed, num_replicas=2,
                                rank=rank)
    sampler.set_epoch(epoch)
    return [i for batch in sampler for i in batch]


def test_seed_changes_the_data_order_and_dropout_seeds_differ_per_rank():
    assert _epoch_order(seed=1) == _epoch_order(seed=1)
    assert _epoch_order(seed=1) != _epoch_order(seed=2)
    for seed in (1, 2):  # the ranks still split one permutation
        orders = [_epoch_order(seed, rank=r) for r in range(2)]
        assert sorted(orders[0] + orders[1]) == list(range(16))
    assert iteration_seed(3, 5, rank=0) == iteration_seed(3, 5, rank=0)
    assert len({iteration_seed(3, 5, rank=r) for r in range(4)} |
               {iteration_seed(3, 6, rank=0), iteration_seed(4, 5, rank=0)}) == 6


def _corrupt(path):
    with open(path, 'wb') as f:
        f.write(b'not an image')


def test_unreadable_image_during_training_is_a_dataset_error(tmp_path):
    root = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=6)
    path = helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(root, iters=6))
    _, model, dataset, optimizer, losses = _build(path)
    bad = os.path.join(root, 'images', 'train_003.jpg')
    _corrupt(bad)
    with pytest.raises(DatasetError, match=f'image {bad} cannot be read'):
        helpers.train_in_folder(model, dataset, optimizer, losses, TrainOptions(
            iters=6, batch_size=2, save_dir=str(tmp_path / 'out'), seed=0))


def test_label_out_of_range_during_training_is_a_dataset_error(tmp_path):
    root = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=6)
    path = helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(root, iters=6))
    _, model, dataset, optimizer, losses = _build(path)
    bad = os.path.join(root, 'labels', 'train_004.png')
    label = cv2.imread(bad, cv2.IMREAD_UNCHANGED)
    label[5, 5] = 7
    cv2.imwrite(bad, label)
    with pytest.raises(DatasetError, match=r'has values \[7\] outside \[0, 3\)'):
        helpers.train_in_folder(model, dataset, optimizer, losses, TrainOptions(
            iters=6, batch_size=2, save_dir=str(tmp_path / 'out'), seed=0))


def _cli_error(capsys, **kwargs):
    code = run_cli(train_from_config, device='cpu', **kwargs)
    err = capsys.readouterr().err
    assert code == 2 and 'Traceback' not in err, err
    assert err.count('error: ') == 1, err
    return err[err.index('error: '):]


def _cityscapes_config(tmp_path, root):
    config = helpers.toy_config(root, iters=2, num_classes=19, dataset_type='Cityscapes')
    return helpers.write_config(tmp_path / 'city.yml', config)


def test_bad_dataset_inputs_are_one_line_errors(tmp_path, capsys, mini_cityscapes):
    save_dir = str(tmp_path / 'out')
    missing = str(tmp_path / 'no_such_dataset')
    path = _cityscapes_config(tmp_path, missing)
    assert missing in _cli_error(capsys, config=path, save_dir=save_dir)

    root = copy_dataset(mini_cityscapes, tmp_path)
    path = _cityscapes_config(tmp_path, root)
    label = sorted(glob.glob(os.path.join(root, 'gtFine', 'train', '*',
                                          '*_gtFine_labelTrainIds.png')))[0]
    os.rename(label, label + '.moved')
    assert 'have no' in _cli_error(capsys, config=path, save_dir=save_dir)
    os.rename(label + '.moved', label)

    cv2.imwrite(label, np.full((32, 64), 20, np.uint8))
    assert f'label {label} has values [20]' in _cli_error(capsys, config=path, save_dir=save_dir)

    toy = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=2)
    path = helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(toy, iters=2))
    bad = os.path.join(toy, 'images', 'train_000.jpg')
    _corrupt(bad)
    assert f'image {bad} cannot be read' in _cli_error(capsys, config=path, save_dir=save_dir)


def test_bad_config_inputs_are_one_line_errors(tmp_path, capsys, toy):
    save_dir = str(tmp_path / 'out')
    config = helpers.toy_config(toy, iters=2)
    assert 'does not exist' in _cli_error(capsys, config=str(tmp_path / 'nope.yml'),
                                          save_dir=save_dir)
    typo = dict(config, iter=5)
    message = _cli_error(capsys, config=helpers.write_config(tmp_path / 'a.yml', typo),
                         save_dir=save_dir)
    assert "unknown top-level keys 'iter' (did you mean 'iters'?)" in message
    ignored = dict(config, to_static_training=True)
    message = _cli_error(capsys, config=helpers.write_config(tmp_path / 'static.yml', ignored),
                         save_dir=save_dir)
    assert 'sets to_static_training, which this engine does not support' in message
    path = helpers.write_config(tmp_path / 'b.yml', config)
    message = _cli_error(capsys, config=path, save_dir=save_dir, opts=['modle.num_classes=3'])
    assert 'modle is not in' in message
    wrong_type = dict(config, model=dict(config['model'], type='TinySegNett'))
    message = _cli_error(capsys, config=helpers.write_config(tmp_path / 'c.yml', wrong_type),
                         save_dir=save_dir)
    assert "model.type 'TinySegNett' is not a registered component (models/backbones): " \
        'did you mean TinySegNet' in message
    wrong_arg = dict(config, model=dict(config['model'], num_clases=3))
    message = _cli_error(capsys, config=helpers.write_config(tmp_path / 'd.yml', wrong_arg),
                         save_dir=save_dir)
    assert 'cannot build model' in message and 'num_clases' in message
    one_coef = dict(config, loss={'types': [{'type': 'CrossEntropyLoss'}], 'coef': [1]})
    message = _cli_error(capsys, config=helpers.write_config(tmp_path / 'e.yml', one_coef),
                         save_dir=save_dir)
    assert 'the model returns 2 logits' in message
    message = _cli_error(capsys, config=path, save_dir=save_dir,
                         resume_model=str(tmp_path / 'iter_9'))
    assert '--resume_model' in message


def test_train_py_end_to_end_and_exit_code(tmp_path, mini_cityscapes):
    """The real PSANet mini config through train.py, on 64x32 mini Cityscapes."""
    root = mini_cityscapes
    config = {'_base_': MINI_CONFIG, 'batch_size': 2, 'iters': 4,
              'train_dataset': {'dataset_root': root, 'transforms': [
                  {'type': 'RandomHorizontalFlip'}, {'type': 'Normalize'}]},
              'val_dataset': {'dataset_root': root}}
    path = helpers.write_config(tmp_path / 'psanet.yml', config)
    save_dir = str(tmp_path / 'out')
    command = [sys.executable, os.path.join(ROOT, 'train.py'), '--config', path, '--device',
               'cpu', '--save_dir', save_dir, '--save_interval', '2', '--log_iters', '2',
               '--batch_size', '1', '--do_eval', '--seed', '0', '--precision', 'fp16']
    done = run_process(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '[TRAIN] epoch: 2, iter: 4/4' in done.stdout
    assert 'fp16 is ignored on CPU' in done.stdout
    assert sorted(os.listdir(save_dir)) == ['best_model', 'iter_2', 'iter_4', 'train.log']
    bad = run_process(command[:-4] + ['--opts', 'iters=oops'], cwd=ROOT, capture_output=True,
                      text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.startswith('error: ') and 'Traceback' not in bad.stderr, bad.stderr
    assert 'iters must be a positive integer' in bad.stderr


def test_train_from_config_hands_train_the_config_and_the_flags(tmp_path, toy, monkeypatch):
    """The one options object train() gets, in its run folder: the config's schedule (a flag
    overrides it, the LR scheduler follows), sync_bn, the flags, and evaluations as
    test_config says, in the training's precision, stored once."""
    from psanet.core import train as train_module
    from psanet.core.options import InferenceOptions
    config = helpers.toy_config(toy, iters=7, batch_size=2)
    config['sync_bn'] = False
    config['test_config'] = {'is_slide': True, 'crop_size': [32, 16], 'stride': [16, 8]}
    path = helpers.write_config(tmp_path / 'toy.yml', config)
    handed = []
    monkeypatch.setattr(train_module, 'train', lambda *args, **kwargs: handed.append(
        (args, kwargs)) or {})
    train_from_config(path, device='cpu', save_dir=str(tmp_path / 'out'), batch_size=3,
                      precision='fp16', amp_level='O2', log_iters=5, seed=4, num_workers=1)
    ((_, _, optimizer, _, folder, val_dataset), _), = handed
    options = folder.options
    assert val_dataset is None and options.do_eval is False  # no --do_eval
    assert folder.path == str(tmp_path / 'out')
    assert (options.iters, options.batch_size, options.log_iters, options.seed) == (7, 3, 5, 4)
    assert optimizer._learning_rate.decay_steps == 7
    assert options.sync_bn is False and options.save_dir == str(tmp_path / 'out')
    assert options.config == path and options.device == 'cpu'
    assert options.evaluation.inference == InferenceOptions(
        is_slide=True, crop_size=(32, 16), stride=(16, 8), precision='fp16', amp_level='O2')
    assert (options.precision, options.amp_level, options.num_workers) == ('fp16', 'O2', 1)
    assert options.evaluation.num_workers == 1
    stored = {f.name for f in dataclasses.fields(options)}
    assert not stored & {'precision', 'amp_level', 'num_workers'}, stored
    handed.clear()
    train_from_config(path, device='cpu', save_dir=str(tmp_path / 'out9'), iters=9)
    ((_, _, optimizer, _, folder, _), _), = handed
    options = folder.options
    assert (options.iters, options.batch_size) == (9, 2)
    assert optimizer._learning_rate.decay_steps == 9  # the scheduler follows --iters
