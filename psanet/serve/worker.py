"""The model in a process of its own, so that the server's event loop never waits on a run.

Paddle Inference holds the GIL for a whole run: in the server's process the
deadline timers, ``/health`` and SIGTERM would wait for it. The worker
(spawned, ignoring Ctrl-C and SIGTERM as the engine's DataLoader workers do:
the server handles them) loads the :class:`~.served_model.ServedModel` and
answers runs over a pipe; the server keeps its preprocessing, postprocessing
and what it says of the model (:meth:`ServedModel.front`), and talks to the
worker from its model thread, whose pipe reads and writes release the GIL.
A worker that dies ends its requests with :class:`WorkerDied`; one still
running at the drain's bound is killed (:meth:`ModelWorker.end`).
"""
import logging
import multiprocessing
import pickle
import signal
import traceback
from typing import Any, Callable, Optional, Tuple

__all__ = ['ModelWorker', 'WorkerDied']

_logger = logging.getLogger('psanet.serve')
# How long the worker has to leave once its pipe is closed before it is killed.
END_GRACE_S = 2.0


class WorkerDied(Exception):
    """The model's process ended (killed, out of memory, a crash): its run gives no answer."""


def _portable(error: BaseException) -> BaseException:
    """``error`` if it crosses the pipe as it is, else a RuntimeError of its type and text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # an exception type whose arguments do not rebuild it
        return RuntimeError(f'{type(error).__name__}: {error}')


def _serve_runs(conn: Any, load_args: Tuple[Any, ...]) -> None:
    """The worker process: loads the model, sends its front, then answers each request."""
    from psanet import interrupts
    from psanet.errors import UserError
    from .explore import forward
    from .served_model import load_served_model
    interrupts.worker_init()
    try:
        served = load_served_model(*load_args)
        conn.send(('loaded', served.front(None)))
    except Exception as error:  # the server names it (a UserError is one line)
        if not isinstance(error, UserError):
            traceback.print_exc()
        conn.send(('error', _portable(error)))
        return
    while True:
        try:
            kind, batch = conn.recv()
        except (EOFError, OSError):  # the server closed the pipe, or is gone
            return
        try:
            if kind == 'explore':
                result = forward(served.segmenter, served.model, batch)
            else:
                result = served.segmenter.run(batch)
        except Exception as error:  # the request answers it; the next one is served
            if not isinstance(error, UserError):
                traceback.print_exc()
            result, kind = _portable(error), 'error'
        else:
            kind = 'ok'
        try:
            conn.send((kind, result))
        except OSError:  # the server is gone (killed): nobody waits for the answer
            return


def _exit_reason(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return 'stopped answering'
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        why = ' (out of memory? see the kernel log)' if name == 'SIGKILL' else ''
        return f'was killed by {name}{why}'
    return f'exited with code {exitcode}'


class ModelWorker:
    """The model's process, seen from the server.

    Args:
        load_args (tuple): :func:`~.served_model.load_served_model`'s arguments (config,
            model_path, backend, device, int8, cpu_threads).

    :meth:`start` loads it and returns the front the server keeps; :meth:`run` and
    :meth:`explore` (from one thread at a time: the batcher's model thread) send a batch
    and wait for the answer; :meth:`end` stops it.
    """

    def __init__(self, load_args: Tuple[Any, ...]) -> None:
        self.load_args = load_args
        self.process: Any = None
        self._conn: Any = None
        self.restarts = 0

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def start(self, should_stop: Optional[Callable[[], Any]] = None) -> Any:
        """Spawns the worker and waits for its model: the ServedModel's front (its runs go to
        this worker), or None when ``should_stop()`` turned true meanwhile. The load's
        exception is raised here; a worker that dies loading raises a DeployError."""
        from psanet.errors import DeployError, UserError
        context = multiprocessing.get_context('spawn')  # no forked Paddle or CUDA state
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_serve_runs, args=(child, self.load_args),
                                       name='psanet-model', daemon=True)
        self.process.start()
        child.close()  # the worker's end: its death is then the pipe's end here
        while not self._conn.poll(0.1):
            if should_stop is not None and should_stop():
                self.end()
                return None
            if not self.process.is_alive():
                self.process.join()
                raise DeployError(f'the model worker (pid {self.process.pid}) '
                                  f'{_exit_reason(self.process.exitcode)} while it loaded the '
                                  'model: see the lines above; the server did not start.')
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            raise DeployError(self._death('while it loaded the model') + ': see the lines '
                              'above; the server did not start.') from None
        if kind == 'error':
            self.end()
            if isinstance(payload, UserError):
                raise payload
            raise RuntimeError(f'the model did not load in its worker: '
                               f'{type(payload).__name__}: {payload}')
        payload.segmenter.runner = self
        _logger.info('the model runs in worker process %d', self.process.pid)
        return payload

    def restart(self) -> Any:
        """A new worker in place of a dead one (ended first if it still runs)."""
        self.end()
        self.restarts += 1
        return self.start()

    def run(self, batch: Any) -> Any:
        """The model's output for ``batch`` (``Pipeline.run`` in the worker)."""
        return self._ask('run', batch)

    def explore(self, batch: Any) -> Any:
        """``(output, attention records)`` of one image (:func:`~.explore.forward`)."""
        return self._ask('explore', batch)

    def _ask(self, kind: str, batch: Any) -> Any:
        if self._conn is None or self._conn.closed:
            raise WorkerDied('the model worker is stopped')
        try:
            self._conn.send((kind, batch))
            answer, payload = self._conn.recv()
        except (EOFError, OSError):
            raise WorkerDied(self._death('during this run')) from None
        if answer == 'error':
            raise payload
        return payload

    def _death(self, when: str) -> str:
        self.process.join(END_GRACE_S)
        return (f'the model worker (pid {self.process.pid}) '
                f'{_exit_reason(self.process.exitcode)} {when}')

    def end(self, grace_s: float = END_GRACE_S) -> None:
        """Stops the worker (the model thread done with it): its pipe closed, it leaves after
        its run; SIGKILL if it still runs after ``grace_s`` (it ignores SIGTERM)."""
        if self.process is None:
            return
        if self._conn is not None:
            self._conn.close()
        self.process.join(grace_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def kill(self) -> None:
        """SIGKILL now (the drain's bound: the run in progress is abandoned); the model
        thread's wait then ends with WorkerDied."""
        if self.alive:
            self.process.kill()
