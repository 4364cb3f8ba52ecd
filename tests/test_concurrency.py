# SPDX-License-Identifier: Apache-2.0
"""Concurrency: shmcomm.torch collectives called from several Python threads of every rank at once, through the
engine (each thread names its tensors, as Horovod requires of tensors in flight together); Soft Memory Box operations
from several threads of several processes at once. No deadlock (every run is bounded), results exact."""
import threading

import numpy as np
import pytest

import multiproc

THREADS = 4
ROUNDS = 60


def _in_threads(worker, errors):
    """worker(t) in THREADS threads at once; every thread must end within 120 s, none with an error."""
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads), "a thread is still running after 120 s"
    assert not errors, errors


def _torch_threads():
    import torch

    import shmcomm.torch as hvd

    hvd.init()
    me, n = hvd.rank(), hvd.size()
    errors = []

    def worker(t):
        try:
            for k in range(ROUNDS):
                x = torch.full((17 + t,), float(me * 100 + t * 10 + k % 7))
                got = hvd.allreduce(x, name="t%d.sum.%d" % (t, k), op=hvd.Sum)
                want = sum(r * 100 + t * 10 + k % 7 for r in range(n))
                assert torch.equal(got, torch.full_like(x, float(want))), (t, k, got)
                h = hvd.allreduce_async(torch.full((5,), float(me)), name="t%d.avg.%d" % (t, k))
                b = hvd.broadcast(torch.full((3,), float(me + k)), root_rank=k % n, name="t%d.bc.%d" % (t, k))
                g = hvd.allgather(torch.full((1 + me, 2), float(me)), name="t%d.ag.%d" % (t, k))
                assert torch.equal(b, torch.full((3,), float(k % n + k))), (t, k, b)
                assert torch.equal(g, torch.cat([torch.full((1 + r, 2), float(r)) for r in range(n)])), (t, k)
                assert torch.allclose(hvd.synchronize(h), torch.full((5,), (n - 1) / 2.0)), (t, k)
        except BaseException as error:  # reported by the main thread
            errors.append((t, repr(error)))

    _in_threads(worker, errors)
    return True


def test_torch_collectives_from_several_threads_at_once():
    pytest.importorskip("torch")
    assert multiproc.run(3, _torch_threads, timeout=240, env={"SHMCOMM_TIMEOUT": "60"}) == [True] * 3


def _boxes(ready, **shapes):
    """The boxes {name: (count, dtype)}: rank 0 creates them, the others attach once it has."""
    import shmcomm

    if shmcomm.rank() == 0:
        boxes = [shmcomm.SoftMemoryBox(name, shape=(count,), dtype=dtype, create=True)
                 for name, (count, dtype) in shapes.items()]
        ready.set()
        return boxes
    ready.wait(30)
    return [shmcomm.SoftMemoryBox(name, timeout=30) for name in shapes]


def _box_threads(ready):
    import shmcomm

    shmcomm.init()
    me, n = shmcomm.rank(), shmcomm.size()
    sums, counter = _boxes(ready, sums=(64, np.int64), counter=(2, np.int64))
    errors = []

    def worker(t):
        try:
            for k in range(ROUNDS):
                sums.accumulate(np.full(64, 1 + t, np.int64))  # atomic against every writer
                with counter.locked():  # a read-modify-write under the box lock, held across two operations
                    value = counter.read()
                    counter.write(value + np.array([1, me + 1], np.int64))
                assert sums.read().min() >= 0
        except BaseException as error:
            errors.append((t, repr(error)))

    _in_threads(worker, errors)
    shmcomm.barrier()
    total = n * ROUNDS * sum(1 + t for t in range(THREADS))
    assert sums.read().tolist() == [total] * 64
    assert counter.read().tolist() == [n * THREADS * ROUNDS, THREADS * ROUNDS * sum(r + 1 for r in range(n))]
    shmcomm.barrier()
    sums.close()
    counter.close()
    return True


def test_box_operations_from_threads_and_processes_at_once():
    assert multiproc.run(3, _box_threads, multiproc.Event(), timeout=240) == [True] * 3


# A pause between the read and the write of every box update (SHMCOMM_TEST_RACE_PAUSE_US): without the lock, updates
# that overlap it are lost every run, not once in a while.
RACE_PAUSE = {"SHMCOMM_TEST_RACE_PAUSE_US": "2000"}


def _updates_in_the_pause(ready):
    import shmcomm

    shmcomm.init()
    me, n = shmcomm.rank(), shmcomm.size()
    sums, centre = _boxes(ready, race_sums=(16, np.int64), race_centre=(16, np.float64))
    shmcomm.barrier()
    errors, rounds, kept = [], 5, {}

    def worker(t):
        try:
            x = np.full(16, 1000.0 * (me * THREADS + t + 1))
            for k in range(rounds):
                sums.accumulate(np.full(16, 1 + t, np.int64))
                d = x.copy()
                centre.exchange(d, 0.5)  # x + c is kept: halvings of integers, exact in float64
                x -= d
            kept[t] = x
        except BaseException as error:
            errors.append((t, repr(error)))

    _in_threads(worker, errors)
    shmcomm.barrier()
    total = n * rounds * sum(1 + t for t in range(THREADS))
    mine = np.sum(list(kept.values()), axis=0)
    together = shmcomm.allreduce(mine, op=shmcomm.Sum) + centre.read()
    everyone = 1000.0 * sum(range(1, n * THREADS + 1))
    got = sums.read().tolist(), bool(np.allclose(together, everyone, rtol=1e-12)), sums.version, centre.version
    shmcomm.barrier()
    sums.close()
    centre.close()
    return got == ([total] * 16, True, n * THREADS * rounds, n * THREADS * rounds), (got, together.tolist())


def test_box_updates_keep_every_update_with_a_pause_inside_the_lock():
    """Accumulates and exchanges from 4 threads of each of 3 ranks, each holding the box lock across a pause between
    its read and its write: every update lands and the exchanges keep x + c, so a lock that does not exclude fails
    this every run."""
    got = multiproc.run(3, _updates_in_the_pause, multiproc.Event(), timeout=120, env=RACE_PAUSE)
    assert [ok for ok, _ in got] == [True] * 3, got
