"""Two CPU processes (paddle.distributed.launch): synced training, global loss, samplers, eval.

One launch runs a worker script that trains, samples and evaluates, and
dumps what each rank saw; the test compares the ranks with each other and
with a single-process evaluation in this process.
"""
import json
import os
import sys

import numpy as np
import paddle
import pytest

import engine_helpers as helpers
from conftest import ROOT, TINY_SEGNET_RTOL, clear_margin_pixels, run_process
from psanet.core.checkpoint import save_checkpoint
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.options import EvalOptions
from psanet.core.val import evaluate
from psanet.core.weights import load_model_weights

TESTS = os.path.join(ROOT, 'tests')

WORKER = r'''
import json, os, sys
sys.path[:0] = [{tests!r}, {repo!r}]
import numpy as np
import paddle
import engine_helpers  # registers TinySegNet
from psanet.core import dist
from psanet.core.weights import load_model_weights
from psanet.core.config import ComponentBuilder, load_config
from psanet.core.data_loader import SampleReader, TrainBatchSampler
from psanet.core.options import EvalOptions, TrainOptions
from psanet.core.val import evaluate

out, config, weights = sys.argv[1:4]
paddle.set_device('cpu')
dist.init_parallel()
rank = dist.rank()
paddle.seed(100 + rank)  # different initial weights: DataParallel must make them equal
builder = ComponentBuilder(load_config(config))
model = builder.model
train_dataset = builder.dataset('train')
read = []  # (the reader's epoch, index) of every training sample this rank read
original = SampleReader.__getitem__

def recording(self, index):
    if self.dataset is train_dataset:
        read.append((self.epoch, int(index)))
    return original(self, index)

SampleReader.__getitem__ = recording
result = engine_helpers.train_in_folder(
    model, train_dataset, builder.optimizer, builder.losses,
    TrainOptions(iters=4, batch_size=2, save_dir=os.path.join(out, 'train'), save_interval=4,
                 log_iters=1),
    val_dataset=builder.dataset('val'))
SampleReader.__getitem__ = original
np.savez(os.path.join(out, 'params_%d.npz' % rank),
         **{{k: v.numpy() for k, v in model.named_parameters()}})
sampler = TrainBatchSampler(list(range(8)), batch_size=2, seed=5)
orders = []
for epoch in range(3):
    sampler.set_epoch(epoch)
    orders.append([i for batch in sampler for i in batch])
load_model_weights(model, weights)
metrics = evaluate(model, builder.dataset('val'), EvalOptions(print_detail=False))
with open(os.path.join(out, 'rank_%d.json' % rank), 'w') as f:
    json.dump({{'world_size': dist.world_size(), 'losses': result['losses'],
               'local_losses': result['local_losses'], 'orders': orders,
               'train_eval_areas': result['evals'][-1][1]['areas'].tolist(),
               'seed': result['seed'], 'read': read,
               'miou': metrics['miou'], 'areas': metrics['areas'].tolist()}}, f)
'''


def near_ties(model, dataset):
    """Scored pixels whose top two logits are within TINY_SEGNET_RTOL (see conftest).

    Another process may run the convolutions with other threads, so in another order:
    each of these pixels may change class there, moving each entry of the areas
    (intersection, prediction, label) by at most one; no other pixel may.
    """
    model.eval()
    count = 0
    with paddle.no_grad():
        for index in range(len(dataset)):
            sample = dataset[index]
            logits = model(paddle.to_tensor(sample['img'][None]))[0].numpy()
            clear = clear_margin_pixels(logits, TINY_SEGNET_RTOL * np.abs(logits).max())
            count += int((~clear[0] & (np.asarray(sample['label']).reshape(clear.shape[1:])
                                       != 255)).sum())
    return count


def assert_areas_agree(got, want, slack, what):
    difference = np.abs(np.asarray(got, np.int64) - np.asarray(want, np.int64)).max()
    assert difference <= slack, f'{what}: areas differ by {difference}, {slack} near-ties'


def test_two_processes(tmp_path):
    root = helpers.write_toy_dataset(str(tmp_path / 'toy'), num_train=8, num_val=5)
    config = helpers.write_config(tmp_path / 'toy.yml', helpers.toy_config(root))
    paddle.seed(7)
    builder = ComponentBuilder(load_config(config))
    model = builder.model
    save_checkpoint(str(tmp_path / 'weights'), model)
    expected = evaluate(model, builder.dataset('val'), EvalOptions(print_detail=False))
    slack = near_ties(model, builder.dataset('val'))

    worker = tmp_path / 'worker.py'
    worker.write_text(WORKER.format(tests=TESTS, repo=ROOT))
    out = tmp_path / 'out'
    os.makedirs(out)
    done = run_process(
        [sys.executable, '-m', 'paddle.distributed.launch', '--nproc_per_node', '2',
         '--log_dir', str(tmp_path / 'log'), str(worker), str(out), config,
         str(tmp_path / 'weights')],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    logs = ''.join(open(tmp_path / 'log' / name).read()[-3000:]
                   for name in sorted(os.listdir(tmp_path / 'log')) if name.startswith('worker'))
    assert done.returncode == 0, logs
    ranks = [json.load(open(out / f'rank_{r}.json')) for r in range(2)]
    assert [r['world_size'] for r in ranks] == [2, 2]

    # The parameters are identical on both ranks after training, BatchNorm's running
    # statistics included: per process on CPU (no SyncBatchNorm), they are copied from
    # rank 0 at each checkpoint. Exact: both ranks apply the same all-reduced gradients
    # (the same bits on every rank) to the same weights.
    params = [np.load(out / f'params_{r}.npz') for r in range(2)]
    assert params[0].files and params[0].files == params[1].files
    assert any(key.endswith('_mean') for key in params[0].files)
    for key in params[0].files:
        np.testing.assert_array_equal(params[0][key], params[1][key], err_msg=key)

    # The evaluation during training is that of the saved best model (rank 0's), and
    # both ranks drew (without --seed) and saved rank 0's seed.
    best = ComponentBuilder(load_config(config)).model
    load_model_weights(best, str(out / 'train' / 'best_model'))
    saved = evaluate(best, builder.dataset('val'), EvalOptions(print_detail=False))
    best_slack = near_ties(best, builder.dataset('val'))
    for rank in ranks:
        assert_areas_agree(rank['train_eval_areas'], saved['areas'], best_slack,
                           'evaluation during training')
    assert ranks[0]['seed'] == ranks[1]['seed']
    with open(out / 'train' / 'iter_4' / 'train_state.json') as f:
        assert json.load(f)['seed'] == ranks[0]['seed']

    # The logged loss is the mean of the two ranks' own losses, the same on both ranks.
    local = np.array([r['local_losses'] for r in ranks])
    assert not np.allclose(local[0], local[1])
    # The mean of two float32 losses in float32 (all-reduce) against float64: 1 ulp (1e-7).
    np.testing.assert_allclose(ranks[0]['losses'], local.mean(0), rtol=1e-6)
    assert ranks[0]['losses'] == ranks[1]['losses']

    # Each epoch: the ranks' indices are disjoint and cover the data; epochs reshuffle.
    for epoch in range(3):
        first, second = (r['orders'][epoch] for r in ranks)
        assert not set(first) & set(second)
        assert sorted(first + second) == list(range(8))
    assert len({tuple(order) for order in ranks[0]['orders']}) == 3

    # Through train() itself: 8 images, 2 ranks x batch 2, so 4 iterations are 2 epochs;
    # each epoch the ranks read disjoint halves in a new order, the readers at that epoch.
    for epoch in range(2):
        read = [[i for e, i in r['read'][epoch * 4:(epoch + 1) * 4]] for r in ranks]
        assert [[e for e, _ in r['read'][epoch * 4:(epoch + 1) * 4]] for r in ranks] == \
            [[epoch] * 4] * 2
        assert sorted(read[0] + read[1]) == list(range(8))
    assert [i for _, i in ranks[0]['read'][:4]] != [i for _, i in ranks[0]['read'][4:]]
    assert all(len(r['read']) == 8 for r in ranks)

    # Distributed evaluation of 5 images on 2 ranks equals single-process evaluation,
    # and each rank's mIoU is PaddleSeg's formula over its areas.
    for rank in ranks:
        assert_areas_agree(rank['areas'], expected['areas'], slack, 'distributed evaluation')
        intersect, pred, label = np.asarray(rank['areas'], np.float64)
        union = pred + label - intersect
        iou = np.divide(intersect, union, out=np.zeros_like(union), where=union > 0)
        assert rank['miou'] == pytest.approx(iou.mean(), abs=1e-12)

    # Only rank 0 writes logs and checkpoints.
    assert os.listdir(out / 'train') and 'iter_4' in os.listdir(out / 'train')
    worker_logs = {n: open(tmp_path / 'log' / n).read() for n in os.listdir(tmp_path / 'log')
                   if n.startswith('workerlog')}
    assert '[TRAIN]' in worker_logs['workerlog.0'] and '[TRAIN]' not in worker_logs['workerlog.1']
    assert 'plain BatchNorm per process (2 CPU processes' in worker_logs['workerlog.0']
