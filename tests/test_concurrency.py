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


def _box_threads(ready):
    import shmcomm

    shmcomm.init()
    me, n = shmcomm.rank(), shmcomm.size()
    if me == 0:
        sums = shmcomm.SoftMemoryBox("sums", shape=(64,), dtype=np.int64, create=True)
        counter = shmcomm.SoftMemoryBox("counter", shape=(2,), dtype=np.int64, create=True)
        ready.set()
    else:
        ready.wait(30)
        sums = shmcomm.SoftMemoryBox("sums", timeout=30)
        counter = shmcomm.SoftMemoryBox("counter", timeout=30)
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
