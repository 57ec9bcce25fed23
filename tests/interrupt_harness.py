"""Signals training runs at random moments of each phase and reports how each one ended.

    python tests/interrupt_harness.py --trials 20 --seed 0 --load 2

One process imports Paddle and the engine once, then forks one training run
per trial, each in a process group of its own and ended as train.py ends
(``exit_with(run_cli(train_from_config, ...))``): the toy model with DataLoader
workers, an evaluation and a checkpoint every 2 iterations and a new epoch
(so new workers) every 2. The run writes the phase it is in to a file (start-up,
step, between steps, workers starting, evaluation, checkpoint); each trial
targets one phase in turn, waits for a random number of its occurrences and a
random moment within it (``PHASE_DELAY``), and sends SIGTERM or SIGINT to
the run's main process or to its whole group (a terminal's Ctrl-C, a
scheduler). (A signal before train.py's ``run_cli`` meets Paddle's handler or
the default one; start-up here begins inside ``run_cli``.) A run must exit
with 128 + the signal within ``--bound`` seconds, print no traceback, end with
the one ``error:`` line (stopped in training: naming the checkpoint of the
step it stopped after, which must load and hold that iteration; after an
evaluation the signal abandoned, that evaluation's step), leave no
process of its group behind and no hidden temporary in its save_dir. A run
that does not exit in time has its Python stacks dumped (the phase that hung)
and its process group killed: the harness never hangs.
``--load N`` runs N busy-loop processes beside the trials.

Prints one line per trial and, with ``--json FILE``, writes the results there.
Exit code 0 when every trial ended as it should, else 1.
"""
import argparse
import faulthandler
import json
import os
import random
import re
import signal
import sys
import tempfile
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
PHASE_WIDTH = 32


def _write_phase(fd, phase):
    os.pwrite(fd, phase.ljust(PHASE_WIDTH).encode()[:PHASE_WIDTH], 0)


def _read_phase(path):
    try:
        with open(path, 'rb') as f:
            return f.read(PHASE_WIDTH).decode().strip() or 'launching'
    except OSError:
        return 'launching'


def _track_phases(phase_path):
    """Wraps the engine's steps so that the phase file names what the run is doing."""
    import paddle
    from psanet.core import checkpoint, train

    fd = os.open(phase_path, os.O_RDWR | os.O_CREAT, 0o644)

    def tracked(owner, name, phase, after=None):
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            before = _read_phase(phase_path)
            _write_phase(fd, phase)
            try:
                return inner(*args, **kwargs)
            finally:
                _write_phase(fd, after or before)
        setattr(owner, name, wrapper)

    tracked(paddle.io.DataLoader, '__iter__', 'workers-start')
    tracked(train, '_train_step', 'step', after='between-steps')
    tracked(train, '_evaluate', 'evaluate')
    tracked(checkpoint, 'save_checkpoint', 'checkpoint')
    tracked(checkpoint, 'prune_checkpoints', 'checkpoint-prune')
    return fd


def _run_child(config, save_dir, phase_path, num_workers, log_path):
    """The forked trial: train.py's work and ending, output into ``log_path``."""
    os.setpgid(0, 0)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, 'w', buffering=1)
    sys.stderr = os.fdopen(2, 'w', buffering=1)
    code = 1
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        from psanet.cli import exit_with, run_cli
        from psanet.core.train import train_from_config
        fd = _track_phases(phase_path)

        def train(**kwargs):
            # Start-up begins where train.py's begins: in run_cli, its handlers installed.
            _write_phase(fd, 'start-up')
            return train_from_config(**kwargs)

        exit_with(run_cli(train, config=config, device='cpu', save_dir=save_dir,
                          iters=1000000, save_interval=2, log_iters=1000,
                          keep_checkpoint_max=2, num_workers=num_workers, do_eval=True,
                          seed=0))
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: B902  (a bug of the run: say so, never return into the loop)
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait(pid, deadline):
    """The child's wait status, or None if it has not exited by ``deadline``."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(left, 0.02))


def _check_ending(signum, status, log_text, save_dir):
    """What is wrong with how a run ended; an empty list when nothing is."""
    problems = []
    code = os.waitstatus_to_exitcode(status)
    if code != 128 + signum:
        problems.append(f'exit code {code}, expected {128 + signum}')
    if 'Traceback' in log_text or 'FatalError' in log_text:
        problems.append('a traceback or FatalError in the output')
    lines = [line for line in log_text.splitlines() if line.strip()]
    expected = 'stopped by SIGTERM' if signum == signal.SIGTERM else 'interrupted (Ctrl-C)'
    if not lines or not (lines[-1].startswith('error: ') and expected in lines[-1]):
        problems.append(f'the last line is {lines[-1] if lines else None!r}, not the '
                        f'"error: ... {expected}" line')
    stop = re.search(r'after iteration (\d+); its checkpoint is (\S+)$', lines[-1] if lines else '')
    if stop:  # stopped in training: the checkpoint of that step, whole
        problems += _check_stop_checkpoint(int(stop.group(1)), stop.group(2), save_dir)
    abandoned = re.findall(r'Evaluation at iter (\d+) abandoned for the stop', log_text)
    if abandoned and not (stop and int(stop.group(1)) == int(abandoned[-1])):
        # The signal ended the evaluation: the run stops after that step, not a step later.
        problems.append(f'the evaluation at iteration {abandoned[-1]} was abandoned, but the '
                        f'run stopped {"after iteration " + stop.group(1) if stop else "elsewhere"}')
    if os.path.isdir(save_dir):
        hidden = [name for name in os.listdir(save_dir) if name.startswith('.')]
        if hidden:
            problems.append(f'hidden files left in save_dir: {hidden}')
    return problems


def _check_stop_checkpoint(iteration, path, save_dir):
    from psanet.core import checkpoint
    if path != os.path.join(save_dir, f'iter_{iteration}'):
        return [f'the stop names checkpoint {path}, not iter_{iteration} of {save_dir}']
    try:
        _, optimizer_state, state = checkpoint.load_checkpoint(path)
    except Exception as error:  # noqa: B902  (any failure to load is the problem reported)
        return [f'the checkpoint {path} of the stop does not load: {error}']
    if state['iteration'] != iteration or not optimizer_state:
        return [f'the checkpoint {path} holds iteration {state["iteration"]} (want {iteration})'
                ' or no optimizer state']
    return []


def _busy_loops(count):
    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            end = time.monotonic() + 3600
            while time.monotonic() < end:
                pass
            os._exit(0)
        pids.append(pid)
    return pids


PHASES = ('start-up', 'step', 'between-steps', 'workers-start', 'evaluate', 'checkpoint')
# The signal comes this many seconds, at most, into its phase: starting two workers (two
# forks) takes tens of milliseconds under load, the other phases a few.
PHASE_DELAY = {'start-up': 0.5, 'workers-start': 0.08}


def _wait_for_phase(pid, phase_path, target, occurrences, give_up):
    """Polls the phase file until ``target`` began ``occurrences`` times; returns False if
    the run ended or ``give_up`` passed first."""
    seen, previous = 0, None
    while time.monotonic() < give_up:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return None
        phase = _read_phase(phase_path)
        if phase == target and previous != target:
            seen += 1
            if seen >= occurrences:
                return True
        previous = phase
        time.sleep(0.0005)
    return False


def run_trials(trials, seed, bound, max_delay, num_workers, load, work_dir, phases=PHASES,
               log=print):
    """Runs the trials; returns a list of dicts, one per trial."""
    sys.path[:0] = [TESTS, ROOT]
    import engine_helpers as helpers  # registers TinySegNet; imports Paddle and paddleseg
    import psanet.core.train  # noqa: F401  (imported once, before the forks)

    root = helpers.write_toy_dataset(os.path.join(work_dir, 'toy'), num_train=4, num_val=2)
    config = helpers.write_config(os.path.join(work_dir, 'toy.yml'),
                                  helpers.toy_config(root, iters=10))
    rng = random.Random(seed)
    loaders = _busy_loops(load)
    results = []
    try:
        for trial in range(trials):
            signum = rng.choice([signal.SIGTERM, signal.SIGINT])
            to_group = rng.random() < 0.5
            target = phases[trial % len(phases)]
            occurrences = rng.randint(1, 4)
            delay = rng.uniform(0.0, PHASE_DELAY.get(target, 0.005))
            save_dir = os.path.join(work_dir, f'run{trial}')
            phase_path = os.path.join(work_dir, f'run{trial}.phase')
            log_path = os.path.join(work_dir, f'run{trial}.log')
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(config, save_dir, phase_path, num_workers, log_path)
            try:
                os.setpgid(pid, pid)
            except OSError:
                pass  # the child did it first
            started = time.monotonic()
            if not _wait_for_phase(pid, phase_path, target,
                                   1 if target == 'start-up' else occurrences,
                                   started + max_delay):
                target += ' (not reached)'
            status = _wait(pid, time.monotonic() + delay)
            phase = _read_phase(phase_path)
            at = time.monotonic() - started
            result = {'trial': trial, 'signal': signal.Signals(signum).name, 'to_group': to_group,
                      'target': target, 'at': round(at, 3), 'phase': phase, 'problems': []}
            if status is not None:
                result['problems'].append('the run ended before the signal')
            else:
                sent = time.monotonic()
                if to_group:
                    os.killpg(pid, signum)
                else:
                    os.kill(pid, signum)
                status = _wait(pid, sent + bound)
                result['seconds'] = round(time.monotonic() - sent, 2)
                if status is None:
                    os.kill(pid, signal.SIGUSR1)  # faulthandler: the stacks where it hangs
                    time.sleep(2)
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    with open(log_path, errors='replace') as f:
                        text = f.read()
                    stacks = text[text.rfind('Current thread'):][:4000]
                    ignored = [line for line in text.splitlines() if 'Exception ignored' in line]
                    result['problems'].append(f'still running {bound} s after the signal, '
                                              f'sent while in {phase}; {ignored}; the main '
                                              f'thread\'s stack:\n{stacks}')
                else:
                    with open(log_path, errors='replace') as f:
                        text = f.read()
                    result['problems'] += _check_ending(signum, status, text, save_dir)
                    result['evaluation_abandoned'] = 'abandoned for the stop' in text
                    result['exit_code'] = os.waitstatus_to_exitcode(status)
                    if result['problems']:
                        result['problems'].append('output tail:\n' + text[-3000:])
            deadline = time.monotonic() + 10
            while _group_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _group_alive(pid):
                result['problems'].append('processes of the run were still alive 10 s after it '
                                          'ended (workers left behind)')
                os.killpg(pid, signal.SIGKILL)
            results.append(result)
            log(f"trial {trial:2d}: {result['signal']:7s} to {'group' if to_group else 'main '} "
                f"at {at:6.3f} s in {phase:16s} (target {target}) -> "
                + (f"exit {result.get('exit_code')} in {result.get('seconds')} s"
                   if not result['problems'] else 'PROBLEM: ' + result['problems'][0]))
    finally:
        for pid in loaders:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--trials', type=int, default=20)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--bound', type=float, default=30.0,
                        help='Seconds a run may take to exit after the signal.')
    parser.add_argument('--max_delay', type=float, default=20.0,
                        help='Seconds to wait for the targeted phase before signalling anyway.')
    parser.add_argument('--num_workers', type=int, default=2)
    parser.add_argument('--load', type=int, default=os.cpu_count() or 1,
                        help='Busy-loop processes beside the trials.')
    parser.add_argument('--phases', nargs='+', choices=PHASES, default=PHASES,
                        help='The phases to signal in, in turn.')
    parser.add_argument('--work_dir', default=None)
    parser.add_argument('--json', default=None, help='Write the results to this file.')
    args = parser.parse_args(argv)
    work_dir = args.work_dir or tempfile.mkdtemp(prefix='psanet-interrupts-')
    results = run_trials(args.trials, args.seed, args.bound, args.max_delay, args.num_workers,
                         args.load, work_dir, tuple(args.phases))
    failed = [r for r in results if r['problems']]
    print(f'{len(results) - len(failed)} of {len(results)} trials ended as they should '
          f'(work dir {work_dir})')
    for result in failed:
        print(f"\ntrial {result['trial']}:\n" + '\n'.join(result['problems']))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
