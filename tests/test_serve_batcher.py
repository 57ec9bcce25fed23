"""The batcher on its own, with a model stand-in that records its runs and can be held: the
queue holds exactly --max_queue, a collection exactly --max_batch (3: not a power of two),
--max_wait_ms from both sides, deadlines (a request past its own leaves the queue and never
runs), the drain (one request a run, then 503 to what still waits or runs), the warm-up's
runs, and what every request gets back (its own rows of the output)."""
import asyncio
import threading
import time

import numpy as np
import pytest

from psanet.serve.batcher import (Batcher, DeadlineExceeded, QueueFull, Stopping, batch_sizes,
                                  power_of_two_runs)


class StandIn:
    """``run(batch)``: each row's id (its first value) times 10, held while ``hold`` is set or
    its index (0: the first run) is in ``held``; ``batches`` lists the ids of each run."""

    def __init__(self):
        self.batches, self.hold, self.entered = [], threading.Event(), threading.Event()
        self.held, self.lock = set(), threading.Lock()

    def run(self, batch):
        with self.lock:
            index = len(self.batches)
            self.batches.append([int(row[0, 0, 0]) for row in batch])
        self.entered.set()
        while self.hold.is_set() or index in self.held:
            time.sleep(0.005)
        return batch[:, 0, 0, 0] * 10


@pytest.fixture
def stand_in():
    """A StandIn, let go after the test whatever happened (its held thread would keep the
    process from exiting)."""
    model = StandIn()
    yield model
    model.held.clear()
    model.hold.clear()


def _input(i, size=4):
    return np.full((1, 3, size, size), float(i), np.float32)


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


async def _started(stand_in, **kwargs):
    kwargs = {'max_batch': 3, 'max_wait_s': 0.0, 'max_queue': 4, **kwargs}
    batcher = Batcher(stand_in.run, kwargs['max_batch'], kwargs['max_wait_s'],
                      kwargs['max_queue'], kwargs.get('observer'))
    await batcher.start(kwargs.get('warmup_shape'))
    return batcher


async def _until(predicate):
    while not predicate():
        await asyncio.sleep(0.005)


async def _one_running(stand_in, batcher):
    """Job 0 taken into a run that the stand-in holds."""
    stand_in.hold.set()
    first = batcher.submit(_input(0))
    await _until(stand_in.entered.is_set)
    return first


def test_the_queue_holds_max_queue_and_refuses_the_next(stand_in):
    async def main():
        batcher = await _started(stand_in, max_queue=4)
        first = await _one_running(stand_in, batcher)
        waiting = [batcher.submit(_input(i)) for i in range(1, 5)]  # 4 = max_queue
        assert batcher.waiting == 4 and batcher.full
        with pytest.raises(QueueFull, match='holds 4 requests'):
            batcher.submit(_input(5))
        stand_in.hold.clear()
        results = await asyncio.gather(first, *waiting)
        await batcher.stop()
        return results, stand_in.batches
    results, batches = _run(main())
    assert [float(output[0]) for output, _ in results] == [0, 10, 20, 30, 40]
    assert batches == [[0], [1, 2], [3], [4]]  # 3 collected (max_batch): runs of 2 and 1


def test_the_queue_one_below_full_is_not_full(stand_in):
    async def main():
        batcher = await _started(stand_in, max_queue=4)
        first = await _one_running(stand_in, batcher)
        waiting = [batcher.submit(_input(i)) for i in range(1, 4)]
        full = batcher.full
        stand_in.hold.clear()
        await asyncio.gather(first, *waiting)
        await batcher.stop()
        return full
    assert _run(main()) is False


@pytest.mark.parametrize('max_batch, waiting, runs', [
    (3, 7, [[1, 2], [3], [4, 5], [6], [7]]),
    (5, 7, [[1, 2, 3, 4], [5], [6, 7]]),
    (1, 3, [[1], [2], [3]]),
])
def test_a_collection_takes_max_batch_in_power_of_two_runs(stand_in, max_batch, waiting, runs):
    async def main():
        batcher = await _started(stand_in, max_batch=max_batch, max_queue=16)
        first = await _one_running(stand_in, batcher)
        jobs = [batcher.submit(_input(i)) for i in range(1, waiting + 1)]
        stand_in.hold.clear()
        results = await asyncio.gather(first, *jobs)
        await batcher.stop()
        return results, stand_in.batches
    results, batches = _run(main())
    assert batches[1:] == runs
    sizes = {i: len(run) for run in runs for i in run}
    assert [(float(out[0]), size) for out, size in results[1:]] == [
        (10.0 * i, sizes[i]) for i in range(1, waiting + 1)]


def test_max_wait_gathers_what_arrives_within_it_and_not_after():
    async def main(gap_s, max_wait_s):
        stand_in = StandIn()
        batcher = await _started(stand_in, max_batch=4, max_wait_s=max_wait_s)
        first = batcher.submit(_input(1))
        await asyncio.sleep(gap_s)
        second = batcher.submit(_input(2))
        await asyncio.gather(first, second)
        await batcher.stop()
        return stand_in.batches
    # A second request 0.1 s after the first shares its run when the first waits 1.5 s ...
    assert _run(main(0.1, 1.5)) == [[1, 2]]
    # ... and runs apart when the wait is shorter than the gap.
    assert _run(main(0.6, 0.05)) == [[1], [2]]


def test_a_request_past_its_deadline_in_the_queue_gets_deadline_exceeded_and_never_runs(
        stand_in):
    async def main():
        batcher = await _started(stand_in)
        first = await _one_running(stand_in, batcher)
        loop = asyncio.get_running_loop()
        late = batcher.submit(_input(7), deadline=loop.time() + 0.2)
        kept = batcher.submit(_input(8), deadline=loop.time() + 60)
        with pytest.raises(DeadlineExceeded, match='waited in the queue'):
            await late  # while the model still runs the first
        assert batcher.waiting == 1
        with pytest.raises(DeadlineExceeded, match='before it reached the queue'):
            batcher.submit(_input(9), deadline=loop.time() - 1)
        stand_in.hold.clear()
        await asyncio.gather(first, kept)
        await batcher.stop()
        return stand_in.batches
    assert _run(main()) == [[0], [8]]


def test_a_request_whose_deadline_passes_while_it_waits_for_company_never_runs(stand_in):
    async def main():
        batcher = await _started(stand_in, max_batch=4, max_wait_s=1.0)
        loop = asyncio.get_running_loop()
        late = batcher.submit(_input(1), deadline=loop.time() + 0.2)  # taken, then waits 1 s
        kept = batcher.submit(_input(2))
        with pytest.raises(DeadlineExceeded, match='waited for others to share its run'):
            await late
        await kept
        await batcher.stop()
        return stand_in.batches
    assert _run(main()) == [[2]]


def test_the_drain_runs_one_at_a_time_then_refuses_what_waits_or_runs(stand_in):
    async def main():
        batcher = await _started(stand_in, max_batch=3, max_queue=8)
        first = await _one_running(stand_in, batcher)
        waiting = [batcher.submit(_input(i)) for i in range(1, 5)]
        batcher.drain(1.0)
        assert batcher.state == 'stopping'
        stand_in.held.add(2)  # the third run, of request 2, is held past the deadline
        stand_in.hold.clear()
        await _until(lambda: batcher.waiting == 0)
        with pytest.raises(Stopping, match='stopping'):
            batcher.submit(_input(9))
        stand_in.held.clear()
        results = await asyncio.gather(first, *waiting, return_exceptions=True)
        await batcher.stop()
        return results, stand_in.batches
    results, batches = _run(main())
    assert batches == [[0], [1], [2]]  # one a run while draining
    assert [float(r[0][0]) for r in results[:2]] == [0, 10]
    # The run held past the bound is answered 503 then, as what still waits.
    assert isinstance(results[2], Stopping) and 'run did not end' in str(results[2])
    assert all(isinstance(r, Stopping) and 'did not reach' in str(r) for r in results[3:])


def test_the_warm_up_runs_each_batch_size_before_any_request(stand_in):
    async def main():
        stand_in.hold.set()
        batcher = await _started(stand_in, max_batch=6, warmup_shape=(3, 5, 7))
        await _until(stand_in.entered.is_set)
        job = batcher.submit(_input(1, 5))  # queued during the warm-up
        state = batcher.state
        stand_in.hold.clear()
        await job
        await batcher.stop()
        return state, batcher.state, stand_in.batches
    state_then, state_after, batches = _run(main())
    assert state_then == 'warming' and state_after == 'ready'
    assert [len(b) for b in batches] == [1, 2, 4, 1] and batches[-1] == [1]
    assert batch_sizes(6) == [1, 2, 4] and batch_sizes(8) == [1, 2, 4, 8]


def test_a_failed_run_answers_its_requests_and_the_next_run_is_served():
    async def main():
        calls = []

        def run(batch):
            calls.append(len(batch))
            if len(calls) == 1:
                raise RuntimeError('the backend failed')
            return batch[:, 0, 0, 0]
        batcher = Batcher(run, 2, 0.0, 4)
        await batcher.start()
        with pytest.raises(RuntimeError, match='backend failed'):
            await batcher.submit(_input(1))
        output, size = await batcher.submit(_input(2))
        await batcher.stop()
        return float(output[0]), size
    assert _run(main()) == (2.0, 1)


@pytest.mark.parametrize('waiting', range(0, 20))
def test_a_group_runs_in_powers_of_two_longest_first_in_order(waiting):
    runs = power_of_two_runs(list(range(waiting)))
    bits = [1 << b for b in reversed(range(waiting.bit_length())) if waiting >> b & 1]
    assert [len(run) for run in runs] == bits
    assert [item for run in runs for item in run] == list(range(waiting))
