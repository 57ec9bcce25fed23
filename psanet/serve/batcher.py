"""Dynamic batching: one thread runs the model, fed by a bounded queue.

A request puts its preprocessed ``[1, 3, H, W]`` input on the queue and awaits a
future. The batcher takes the first waiting input, then up to ``max_batch`` in all
within ``max_wait_s``; inputs of one shape are concatenated into runs (as
Triton's dynamic batcher does), each request gets its slice of the output. Runs
hold a power of two of inputs (7 waiting: runs of 4, 2 and 1), so that an image
size meets at most log2(max_batch) + 1 batch shapes: a backend keeps kernels and
buffers per input shape (Paddle Inference's oneDNN cache), and its memory stops
growing once those few have run; the warm-up runs each of them once before the
first request. A full queue refuses at once (:class:`QueueFull`), so memory stays
bounded. A request whose deadline passes while it waits leaves the queue with
:class:`DeadlineExceeded` and never runs. :meth:`Batcher.drain` (SIGTERM) runs one
request at a time, then at its bound refuses what still waits or runs (:class:`Stopping`)
and kills the model's worker (:mod:`.worker`) if a run is in progress. A worker that dies
fails its run's requests, refuses the queue (:class:`Restarting`) and is restarted.
Other work for the model thread (the explorer's forward) goes through the same queue,
alone.
"""
import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import time
from typing import Any, Counter, Deque, List, Optional

import numpy as np

__all__ = ['Batcher', 'QueueFull', 'DeadlineExceeded', 'Stopping', 'Restarting',
           'batch_sizes']

_logger = logging.getLogger('psanet.serve')


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests already."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before its run began."""


class Stopping(Exception):
    """The server is stopping (or never got ready) and runs nothing more."""


class Restarting(Exception):
    """The model's worker died and is being restarted: nothing runs meanwhile."""


def power_of_two_runs(items: List[Any]) -> List[List[Any]]:
    """``items`` in consecutive runs whose lengths are powers of two, the longest first."""
    runs, start = [], 0
    while start < len(items):
        size = 1 << ((len(items) - start).bit_length() - 1)
        runs.append(items[start:start + size])
        start += size
    return runs


def batch_sizes(max_batch: int) -> List[int]:
    """Every batch size the batcher forms: the powers of two up to ``max_batch``."""
    return [1 << b for b in range(max_batch.bit_length())]


class _Observer:
    """What the batcher reports (psanet.serve.prometheus.ServerMetrics); nothing by default."""

    def queue_wait(self, seconds):
        pass

    def model_run(self, seconds, batch_size):
        pass

    def timed_out(self):
        pass

    def rejected(self, reason):
        pass


@dataclasses.dataclass(eq=False)
class _Job:
    future: asyncio.Future
    batch: Optional[np.ndarray] = None  # [1, 3, H, W], or None for a call
    call: Any = None                    # a function run alone in the model thread
    deadline: Optional[float] = None    # loop time; None: none
    queued_at: float = 0.0
    timer: Optional[asyncio.TimerHandle] = None


class Batcher:
    """Runs ``run(batch) -> output`` in one thread on batches of waiting requests.

    Args:
        run (callable): ``[N, 3, H, W]`` float32 -> an output of N rows.
        max_batch (int): Most inputs in one run.
        max_wait_s (float): How long the first input waits for others.
        max_queue (int): Most requests waiting; more are refused.
        observer (optional): Gets the queue waits, runs, timeouts and refusals
            (:class:`psanet.serve.prometheus.ServerMetrics`).
        on_failure (callable, optional): Called with the exception of a failed warm-up or
            worker restart, and 'warm-up' or 'restart'.
        worker (ModelWorker, optional): The process ``run`` runs in (``alive``, ``kill()``,
            ``restart()``): killed at the drain's bound with a run in progress, restarted
            (and warmed up again) when it dies.

    ``state`` is 'warming' until the warm-up ran (:meth:`start`), then 'ready';
    'restarting' while a dead worker is replaced; 'stopping' after :meth:`drain`; 'failed'
    when the warm-up or a restart failed. ``worker_error`` says why the worker last died.
    """

    def __init__(self, run, max_batch, max_wait_s, max_queue, observer=None, on_failure=None,
                 worker=None):
        self._run, self.max_batch, self.max_wait_s = run, max_batch, max_wait_s
        self.max_queue = max_queue
        self._observer = observer or _Observer()
        self._on_failure, self._worker = on_failure, worker
        self.runs: Counter[int] = collections.Counter()  # batch size -> runs
        self.state = 'warming'
        self.warmup_s = self.worker_error = self._warmup_shape = None
        self._waiting: Deque[_Job] = collections.deque()
        self._arrived = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, 'psanet-model')
        self._task: Optional[asyncio.Task] = None
        self._running: List[_Job] = []  # the jobs of the run in progress
        self._draining = self._closed = False

    async def start(self, warmup_shape: Optional[tuple] = None) -> None:
        """Starts the model thread; with ``warmup_shape`` ``(3, H, W)`` it first runs one batch
        of each size it can form (:func:`batch_sizes`), the queue filling meanwhile."""
        self._task = asyncio.get_running_loop().create_task(self._serve(warmup_shape))

    async def stop(self) -> None:
        """Ends the loop (the server has answered its requests) and the model thread (a run
        still in progress: its worker killed)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            if self._running and self._worker is not None:
                self._worker.kill()
            self._executor.shutdown(wait=True, cancel_futures=True)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def full(self) -> bool:
        return self.waiting >= self.max_queue

    def submit(self, batch: np.ndarray, deadline: Optional[float] = None) -> asyncio.Future:
        """A future of ``(output rows of batch, the run's batch size)``; ``deadline`` (loop
        time) past while it waits: DeadlineExceeded."""
        return self._put(_Job(asyncio.get_running_loop().create_future(), batch=batch,
                              deadline=deadline))

    def submit_call(self, function: Any, deadline: Optional[float] = None) -> asyncio.Future:
        """A future of ``function()``, run alone in the model thread."""
        return self._put(_Job(asyncio.get_running_loop().create_future(), call=function,
                              deadline=deadline))

    def drain(self, grace_s: float) -> None:
        """SIGTERM: from now on one request a run; in ``grace_s`` what still waits or runs gets
        Stopping (the worker of a run in progress killed), and so does whatever is submitted
        after that."""
        if self._draining:
            return
        self._draining, self.state = True, 'stopping'
        loop = asyncio.get_running_loop()
        loop.call_later(grace_s, self._close)
        self._arrived.set()  # a collection waiting for company stops waiting

    def _close(self):
        self._closed = True
        while self._waiting:
            self._refuse(self._waiting.popleft(), 'stopping', Stopping(
                'the server is stopping and did not reach this request within '
                '--graceful_timeout_s: send it again (to another replica)'))
        if self._running and not all(job.future.done() for job in self._running):
            for job in self._running:
                self._refuse(job, 'stopping', Stopping(
                    'the server is stopping and this request\'s run did not end within '
                    '--graceful_timeout_s: it was abandoned; send it again (to another '
                    'replica)'))
            if self._worker is not None:
                _logger.warning('the run in progress did not end within --graceful_timeout_s: '
                                'its %d request(s) got 503 and the model worker is killed',
                                len(self._running))
                self._worker.kill()

    def _refuse(self, job, reason, error):
        if job.timer is not None:
            job.timer.cancel()
        if not job.future.done():
            self._observer.rejected(reason)
            job.future.set_exception(error)

    def _put(self, job):
        loop = asyncio.get_running_loop()
        if self._closed or self.state == 'failed':
            self._observer.rejected('stopping')
            raise Stopping('the server is stopping: send the request again (to another '
                           'replica)')
        if self.state == 'restarting':
            self._observer.rejected('restarting')
            raise Restarting(self._restarting_message())
        if job.deadline is not None and loop.time() >= job.deadline:
            self._observer.timed_out()
            raise DeadlineExceeded('its deadline passed before it reached the queue')
        if self.full:
            self._observer.rejected('queue_full')
            raise QueueFull(f'the queue holds {self.max_queue} requests (--max_queue)')
        job.queued_at = loop.time()
        if job.deadline is not None:
            job.timer = loop.call_at(job.deadline, self._expire, job)
        self._waiting.append(job)
        self._arrived.set()
        return job.future

    def _expire(self, job):
        """The deadline of a job still in the queue: out of it, 504."""
        try:
            self._waiting.remove(job)
        except ValueError:  # taken into a run already
            return
        if not job.future.done():
            self._observer.timed_out()
            job.future.set_exception(DeadlineExceeded(
                'its deadline passed while it waited in the queue'))

    def _fail(self, error, stage):
        """The server stops: serve() names the error."""
        self.state = 'failed'
        self._close()
        if self._on_failure is not None:
            self._on_failure(error, stage)

    async def _serve(self, warmup_shape):
        self._warmup_shape = warmup_shape
        if warmup_shape is not None:
            try:
                await self._warm_up(warmup_shape)
            except Exception as error:
                self._fail(error, 'warm-up')
                return
        if self.state == 'warming':
            self.state = 'ready'
        while True:
            jobs = await self._collect()
            if jobs[0].call is not None:  # alone
                jobs = self._runnable(jobs)
                if jobs:
                    await self._in_thread(jobs, jobs[0].call)
            else:
                groups = collections.defaultdict(list)
                for job in jobs:
                    groups[job.batch.shape].append(job)
                for group in groups.values():
                    for run in power_of_two_runs(group):
                        await self._run_group(run)
            if self._worker is not None and not self._worker.alive and not self._draining:
                if not await self._restart():
                    return

    def _restarting_message(self):
        return (f'{self.worker_error}; the server is restarting it and runs nothing meanwhile: '
                'send the request again in a few seconds')

    async def _restart(self):
        """A dead worker replaced and warmed up; False (the server stops) when that failed."""
        self.state = 'restarting'
        self.worker_error = self.worker_error or 'the model worker died'
        _logger.error('%s: its requests got 503; restarting it', self.worker_error)
        while self._waiting:
            self._refuse(self._waiting.popleft(), 'restarting',
                         Restarting(self._restarting_message()))
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._worker.restart)
            if self._warmup_shape is not None:
                await self._warm_up(self._warmup_shape)
        except Exception as error:
            self._fail(error, 'restart')
            return False
        if self.state == 'restarting':
            self.state = 'ready'
        _logger.info('the model worker is back (restart %d)', self._worker.restarts)
        return True

    async def _warm_up(self, shape):
        loop = asyncio.get_running_loop()
        rng = np.random.RandomState(0)
        start = time.perf_counter()
        for size in batch_sizes(self.max_batch):
            batch = rng.uniform(-1, 1, (size, *shape)).astype('float32')
            await loop.run_in_executor(self._executor, self._run, batch)
        self.warmup_s = time.perf_counter() - start
        _logger.info('warm-up: one run of each batch size %s at %s took %.2f s',
                     batch_sizes(self.max_batch), 'x'.join(map(str, shape)), self.warmup_s)

    async def _collect(self):
        """Jobs for the next runs: the first waiting one, then those waiting or arriving
        within max_wait_s, up to max_batch (one while draining); a call runs alone."""
        loop = asyncio.get_running_loop()
        while not self._waiting:
            self._arrived.clear()
            await self._arrived.wait()
        jobs = [self._take()]
        if jobs[0].call is not None:
            return jobs
        wait_until = loop.time() + self.max_wait_s
        while len(jobs) < (1 if self._draining else self.max_batch):
            if self._waiting:
                if self._waiting[0].call is not None:
                    break
                jobs.append(self._take())
                continue
            left = wait_until - loop.time()
            if left <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except asyncio.TimeoutError:
                break
        return jobs

    def _take(self):
        job = self._waiting.popleft()
        if job.timer is not None:
            job.timer.cancel()
        return job

    def _runnable(self, jobs):
        """The jobs still to run: not given up by their client, their deadline not past."""
        now, kept = asyncio.get_running_loop().time(), []
        for job in jobs:
            if job.future.done():  # a client gone: its future was cancelled
                continue
            if job.deadline is not None and now >= job.deadline:
                self._observer.timed_out()
                job.future.set_exception(DeadlineExceeded(
                    'its deadline passed while it waited for others to share its run'))
                continue
            self._observer.queue_wait(now - job.queued_at)
            kept.append(job)
        return kept

    async def _run_group(self, group):
        group = self._runnable(group)
        if not group:
            return
        batch = group[0].batch if len(group) == 1 else np.concatenate([j.batch for j in group])
        start = time.perf_counter()
        output = await self._in_thread(group, self._run, batch)
        if output is None:
            return
        self.runs[len(group)] += 1
        self._observer.model_run(time.perf_counter() - start, len(group))
        for i, job in enumerate(group):
            if not job.future.done():
                job.future.set_result((output[i:i + 1], len(group)))

    async def _in_thread(self, jobs, function, *args):
        """``function(*args)`` in the model thread; its exception goes to every job."""
        self._running = jobs
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._executor, function,
                                                                      *args)
        except Exception as error:  # the requests answer it; the loop serves the next
            died = self._worker is not None and not self._worker.alive
            if died:
                self.worker_error = str(error)
            for job in jobs:
                if not job.future.done():
                    if died:
                        self._observer.rejected('worker_died')
                    job.future.set_exception(error)
            return None
        finally:
            self._running = []
        if jobs[0].call is not None and not jobs[0].future.done():
            jobs[0].future.set_result(result)
        return result
