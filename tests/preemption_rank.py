"""One rank of the launched trainings of tests/test_preemption.py: train.py's work, watched.

    python -m paddle.distributed.launch --nproc_per_node 2 tests/preemption_rank.py OUT \
        TRAIN_PY_FLAGS...

The rank process forks: the child is the trainer, exactly train.py's
``exit_with(run_cli(train_from_config, **vars(parse_args())))`` (plus, when
training completes, its per-iteration losses in ``OUT/losses.<rank>.json``);
the parent ignores the signals the launcher sends to the rank's process group,
waits for the trainer and writes its exit code (negative: the signal that
ended it) to ``OUT/exit.<rank>`` and the moment to ``OUT/exit_time.<rank>``, then exits
as the trainer did. The trainer's
pid is in ``OUT/pid.<rank>``, for a test that signals one rank or reads its
DataLoader workers' signal masks. With ``PSANET_TEST_SLOW_SAVE=<seconds>`` each
checkpoint save takes that much longer and logs when it ended (``OUT/saved.<rank>``).

``--resume_each CHECKPOINT... -- FLAGS...`` trains once per checkpoint
(``none``: from scratch), resuming from it with ``--overwrite`` (each run
replaces the previous one's checkpoints in ``--save_dir``), all in one
launch, and writes ``losses.<rank>.<i>.json`` for each.
"""
import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _slow_saves(out, rank, seconds):
    """Each checkpoint save takes ``seconds`` longer, and the moment it ends is appended to
    ``OUT/saved.<rank>``: a test that no rank exits before rank 0 has written its stop."""
    import time
    from psanet.core import checkpoint
    save = checkpoint.save_checkpoint

    def slow_save(*args, **kwargs):
        time.sleep(seconds)
        result = save(*args, **kwargs)
        with open(os.path.join(out, f'saved.{rank}'), 'a') as f:
            f.write(f'{time.time()!r}\n')
        return result
    checkpoint.save_checkpoint = slow_save


def _train(out, rank, argv, suffix=''):
    import train  # train.py

    from psanet.cli import run_cli
    from psanet.core.train import train_from_config

    result = {}

    def work(**flags):
        result.update(train_from_config(**flags))

    if os.environ.get('PSANET_TEST_SLOW_SAVE'):
        _slow_saves(out, rank, float(os.environ['PSANET_TEST_SLOW_SAVE']))
    sys.argv = ['train.py'] + argv  # what the resume line repeats
    code = run_cli(work, **vars(train.parse_args(argv)))
    if result:
        with open(os.path.join(out, f'losses.{rank}{suffix}.json'), 'w') as f:
            json.dump({'start_iter': result['start_iter'], 'losses': result['losses']}, f)
    return code


def _trainer(out, rank, argv):
    from psanet.cli import exit_with
    if argv[0] != '--resume_each':
        exit_with(_train(out, rank, argv))
    split = argv.index('--')
    checkpoints, flags = argv[1:split], argv[split + 1:]
    for i, checkpoint in enumerate(checkpoints):
        resume = [] if checkpoint == 'none' else ['--resume_model', checkpoint, '--overwrite']
        code = _train(out, rank, flags + resume, f'.{i}')
        if code:
            exit_with(code)
    exit_with(0)


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    rank = os.environ.get('PADDLE_TRAINER_ID', '0')
    pid = os.fork()
    if pid == 0:
        os.chdir(ROOT)
        sys.path.insert(0, ROOT)
        _trainer(out, rank, argv)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    with open(os.path.join(out, f'pid.{rank}'), 'w') as f:
        f.write(str(pid))
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    with open(os.path.join(out, f'exit_time.{rank}'), 'w') as f:
        f.write(repr(time.time()))
    with open(os.path.join(out, f'exit.{rank}'), 'w') as f:
        f.write(str(code))
    os._exit(code if code >= 0 else 128 - code)


if __name__ == '__main__':
    main()
