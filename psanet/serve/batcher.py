"""Dynamic batching: one thread runs the model, fed by a bounded asyncio queue.

A request puts its preprocessed ``[1, 3, H, W]`` input on the queue and awaits a
future. The batcher takes the first waiting input, then up to ``max_batch`` in all
within ``max_wait_s``; inputs of one shape are concatenated into runs (as
Triton's dynamic batcher does), each request gets its slice of the output. Runs
hold a power of two of inputs (7 waiting: runs of 4, 2 and 1), so that an image
size meets at most log2(max_batch) + 1 batch shapes: a backend keeps kernels and
buffers per input shape (Paddle Inference's oneDNN cache), and its memory stops
growing once those few have run. A full queue refuses at once
(:class:`QueueFull`), so memory stays bounded. Other work
for the model thread (the explorer's forward) goes through the same queue, alone.
"""
import asyncio
import collections
import concurrent.futures
import dataclasses

import numpy as np

__all__ = ['Batcher', 'QueueFull']


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests already."""


def power_of_two_runs(items):
    """``items`` in consecutive runs whose lengths are powers of two, the longest first."""
    runs, start = [], 0
    while start < len(items):
        size = 1 << ((len(items) - start).bit_length() - 1)
        runs.append(items[start:start + size])
        start += size
    return runs


@dataclasses.dataclass
class _Job:
    future: asyncio.Future
    batch: np.ndarray = None  # [1, 3, H, W], or None for a call
    call: object = None       # a function run alone in the model thread


class Batcher:
    """Runs ``run(batch) -> output`` in one thread on batches of waiting requests.

    Args:
        run (callable): ``[N, 3, H, W]`` float32 -> an output of N rows.
        max_batch (int): Most inputs in one run.
        max_wait_s (float): How long the first input waits for others.
        max_queue (int): Most requests waiting; more are refused.
    """

    def __init__(self, run, max_batch, max_wait_s, max_queue):
        self._run, self.max_batch, self.max_wait_s = run, max_batch, max_wait_s
        self.max_queue = max_queue
        self.runs = collections.Counter()  # batch size -> runs
        self._queue = self._task = self._executor = None

    async def start(self):
        self._queue = asyncio.Queue(self.max_queue)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, 'psanet-model')
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def stop(self):
        """Ends the loop (the server has answered its requests) and the model thread."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._executor.shutdown(wait=True)

    @property
    def waiting(self):
        return self._queue.qsize() if self._queue is not None else 0

    @property
    def full(self):
        return self._queue is not None and self._queue.full()

    def submit(self, batch):
        """A future of ``(output rows of batch, the run's batch size)``."""
        return self._put(_Job(asyncio.get_running_loop().create_future(), batch=batch))

    def submit_call(self, function):
        """A future of ``function()``, run alone in the model thread."""
        return self._put(_Job(asyncio.get_running_loop().create_future(), call=function))

    def _put(self, job):
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            raise QueueFull(f'the queue holds {self.max_queue} requests (--max_queue)') from None
        return job.future

    async def _serve(self):
        while True:
            jobs = await self._collect()
            calls = [job for job in jobs if job.call is not None]
            groups = collections.defaultdict(list)
            for job in jobs:
                if job.call is None:
                    groups[job.batch.shape].append(job)
            for group in groups.values():
                for run in power_of_two_runs(group):
                    await self._run_group(run)
            for job in calls:
                await self._in_thread([job], job.call)

    async def _collect(self):
        """The first waiting job, and those arriving within max_wait_s, up to max_batch; a
        call ends the collection (it runs alone)."""
        jobs = [await self._queue.get()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        while jobs[-1].call is None and len(jobs) < self.max_batch:
            left = deadline - loop.time()
            if left <= 0 and self._queue.empty():
                break
            try:
                jobs.append(self._queue.get_nowait() if left <= 0 else
                            await asyncio.wait_for(self._queue.get(), left))
            except asyncio.TimeoutError:
                break
        return jobs

    async def _run_group(self, group):
        batch = group[0].batch if len(group) == 1 else np.concatenate([j.batch for j in group])
        output = await self._in_thread(group, self._run, batch)
        if output is None:
            return
        self.runs[len(group)] += 1
        for i, job in enumerate(group):
            if not job.future.done():  # a client gone: its future was cancelled
                job.future.set_result((output[i:i + 1], len(group)))

    async def _in_thread(self, jobs, function, *args):
        """``function(*args)`` in the model thread; its exception goes to every job."""
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._executor, function,
                                                                      *args)
        except Exception as error:  # the requests answer it; the loop serves the next
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(error)
            return None
        if jobs[0].call is not None and not jobs[0].future.done():
            jobs[0].future.set_result(result)
        return result
