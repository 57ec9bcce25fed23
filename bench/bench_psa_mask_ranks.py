"""Ranks sharing one machine: time per step with the op on every hardware thread, or on Paddle's.

``PSA_MASK_NUM_THREADS`` = the CPU count runs the PSA mask op on every hardware
thread in every process; by default the op takes the thread count the process
gives Paddle, which is 1 in a rank that
``paddle.distributed.launch`` starts (``import paddle`` sets
``OMP_NUM_THREADS=1`` when it is unset). For each workload and rank count it
starts that many processes at once (released together once all are warm),
each timing its own steps, and prints a markdown table of per-step medians:

* ``op``: ``psa_mask`` forward + backward at the Cityscapes training shape
  (collect, 59x59 window on the 32x64 map, batch 2 per rank);
* ``train``: one training step of the mini PSANet (configs/psanet/*mini*.yml,
  SGD with momentum) on random 256x512 crops, batch 2 per rank, where the op
  runs on a 16x32 map.

    python bench/bench_psa_mask_ranks.py [--ranks 1 2] [--steps 10 3] [--rounds 2]
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = ('op', 'train')
# Lines a worker prints for the parent; paddleseg prints to stdout as well.
READY = 'psanet-bench: ready'
RESULT = 'psanet-bench result: '
SETTINGS = ('before', 'now')


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--ranks', type=int, nargs='+', default=[1, 2],
                        help='processes running at once; default 1 2')
    parser.add_argument('--workloads', nargs='+', default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument('--steps', type=int, nargs=2, default=[10, 3], metavar=('OP', 'TRAIN'),
                        help='timed steps per process of each workload; default 10 3')
    parser.add_argument('--rounds', type=int, default=2,
                        help='before/now alternations; the table shows the median round')
    parser.add_argument('--batch', type=int, default=2, help='batch per rank')
    parser.add_argument('--worker', choices=WORKLOADS, help=argparse.SUPPRESS)
    return parser.parse_args()


# ------------------------------------------------------------------ worker

def op_step(batch):
    import paddle

    from psanet.ops import psa_mask
    paddle.seed(0)
    x = paddle.randn([batch, 59 * 59, 32, 64], 'float32')
    x.stop_gradient = False
    grad_y = paddle.randn([batch, 32 * 64, 32, 64], 'float32')

    def step():
        y = psa_mask(x, 'collect', 59)
        paddle.grad([y], [x], grad_outputs=[grad_y])
    return step


def train_step(batch):
    import paddle
    import paddle.nn.functional as F
    from paddleseg.cvlibs import Config, SegBuilder

    import psanet.models  # noqa: F401  (registers PSANet)
    config, = glob.glob(os.path.join(ROOT, 'configs', 'psanet', '*mini*.yml'))
    cfg = Config(config)
    cfg.dic['model']['pretrained'] = None
    cfg.dic['model']['backbone']['pretrained'] = None
    paddle.seed(0)
    model = SegBuilder(cfg).model
    model.train()
    optimizer = paddle.optimizer.Momentum(0.01, momentum=0.9, parameters=model.parameters())
    image = paddle.randn([batch, 3, 256, 512], 'float32')
    label = paddle.randint(0, model.num_classes, [batch, 256, 512], 'int64')

    def step():
        logits = model(image)
        loss = sum(F.cross_entropy(logit, label, axis=1) for logit in logits)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
    return step


def worker(args):
    sys.path.insert(0, ROOT)
    step = (op_step if args.worker == 'op' else train_step)(args.batch)
    step()
    step()
    from psanet.ops import psa_mask_cpu_threads
    print(READY, flush=True)
    sys.stdin.readline()  # every rank is warm: go
    times = []
    for _ in range(args.steps[WORKLOADS.index(args.worker)]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(RESULT + json.dumps({'ms': statistics.median(times) * 1e3,
                               'threads': psa_mask_cpu_threads()}), flush=True)


# ------------------------------------------------------------------ parent

def environment(setting):
    env = dict(os.environ)
    env.pop('OMP_NUM_THREADS', None)  # as a launched rank has it: import paddle sets 1
    env.pop('PSA_MASK_NUM_THREADS', None)
    if setting == 'before':
        env['PSA_MASK_NUM_THREADS'] = str(os.cpu_count())
    return env


def read_line(process, prefix, command):
    """The rest of the first line of the worker's stdout that starts with prefix."""
    for line in process.stdout:
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    raise RuntimeError(f'a worker stopped early: run {" ".join(command)} to see why.')


def run_ranks(args, workload, setting, ranks):
    """(mean over ranks of each one's median ms per step, op threads of rank 0)."""
    steps = args.steps[WORKLOADS.index(workload)]
    command = [sys.executable, os.path.abspath(__file__), '--worker', workload,
               '--steps', str(steps), str(steps), '--batch', str(args.batch)]
    workers = [subprocess.Popen(command, env=environment(setting), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
               for _ in range(ranks)]
    try:
        for process in workers:
            read_line(process, READY, command)
        for process in workers:  # all warm: release them together
            process.stdin.write('go\n')
            process.stdin.flush()
        results = [json.loads(read_line(process, RESULT, command)) for process in workers]
    except BaseException:
        for process in workers:
            process.kill()
        raise
    finally:
        for process in workers:
            process.wait()
    return statistics.mean(r['ms'] for r in results), results[0]['threads']


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    print(f'{os.cpu_count()} CPUs; before: PSA_MASK_NUM_THREADS={os.cpu_count()} in every rank; '
          f'now: the op follows Paddle (OMP_NUM_THREADS unset, so 1). Median ms per step '
          f'({args.steps[0]} op, {args.steps[1]} train steps after 2 untimed), mean over '
          f'ranks, median of {args.rounds} rounds.\n')
    header = ['workload', 'ranks', 'op threads before', 'ms/step before', 'op threads now',
              'ms/step now', 'now / before']
    print('| ' + ' | '.join(header) + ' |')
    print('|' + '---|' * len(header))
    notes = []
    for workload in args.workloads:
        for ranks in args.ranks:
            samples = {setting: [] for setting in SETTINGS}
            threads = {}
            for round_ in range(args.rounds):
                # Alternate which goes first, so that a drift in the machine's load
                # favours neither.
                for setting in SETTINGS[::1 if round_ % 2 == 0 else -1]:
                    ms, threads[setting] = run_ranks(args, workload, setting, ranks)
                    samples[setting].append(ms)
            before, now = (statistics.median(samples[s]) for s in SETTINGS)
            print(f'| {workload} | {ranks} | {threads["before"]} | {before:.1f} | '
                  f'{threads["now"]} | {now:.1f} | {now / before:.2f} |', flush=True)
            notes.append(f'{workload}, {ranks} rank(s), each round: ' + '; '.join(
                f'{setting} ' + ' '.join(f'{ms:.1f}' for ms in samples[setting])
                for setting in SETTINGS))
    print('\nop: psa_mask collect 59x59 on 32x64, forward + paddle.grad, batch '
          f'{args.batch} per rank. train: mini PSANet step on 256x512, batch {args.batch} '
          'per rank.')
    for note in notes:
        print('- ' + note)


if __name__ == '__main__':
    main()
