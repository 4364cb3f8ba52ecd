# SPDX-License-Identifier: Apache-2.0
"""Where a collective's waiters yield their core: only on a CPU that a peer last ran on. Elsewhere a yield could
only hand the core to an unrelated busy process for a scheduler slice, so the waiter polls instead. Ranks packed on
one CPU move apart."""
import os

import numpy as np
import pytest

import multiproc

CPUS = sorted(os.sched_getaffinity(0))


def _waits(placement):
    import shmcomm
    from shmcomm import basics

    shmcomm.init()
    me, shm = shmcomm.rank(), basics.communicator().shm
    os.sched_setaffinity(0, {CPUS[0]} if placement == "same" else {CPUS[me]})
    x = np.full(256, me + 1, np.float32)
    for _ in range(20):  # every rank posts from its CPU before the counting starts
        shmcomm.allreduce(x, op=shmcomm.Sum)
    beside, apart, _ = shm.waits()
    for _ in range(200):
        assert (shmcomm.allreduce(x, op=shmcomm.Sum) == 3).all()
    after = shm.waits()
    shmcomm.shutdown()
    return after[0] - beside, after[1] - apart, after[2]


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to place the ranks apart")
@pytest.mark.parametrize("placement", ["same", "apart"])
def test_a_waiter_yields_only_where_a_peer_shares_its_cpu(placement):
    """Both ranks pinned to one CPU: every step's wait yields. Pinned to two: none does, every wait polls."""
    for beside, apart, moved in multiproc.run(2, _waits, placement, timeout=120):
        assert moved == 0  # pinned: the only CPU allowed, or one of its own
        if placement == "same":
            assert beside > 0 and apart == 0, (beside, apart)
        else:
            assert beside == 0 and apart > 0, (beside, apart)


def _packed_then_free():
    import shmcomm
    from shmcomm import basics

    shmcomm.init()
    me, shm = shmcomm.rank(), basics.communicator().shm
    os.sched_setaffinity(0, {CPUS[0]})
    x = np.full(256, me + 1, np.float32)
    for _ in range(20):  # both ranks post from the one CPU
        shmcomm.allreduce(x, op=shmcomm.Sum)
    os.sched_setaffinity(0, set(CPUS[:2]))  # free to run on either, but left where they are
    for _ in range(200):
        assert (shmcomm.allreduce(x, op=shmcomm.Sum) == 3).all()
    moved = shm.waits()[2]
    shmcomm.shutdown()
    return moved


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to place the ranks apart")
def test_ranks_packed_on_one_cpu_move_apart():
    """Both ranks run on one CPU and may then run on two: the higher moves to the other, the lower stays."""
    moved0, moved1 = multiproc.run(2, _packed_then_free, timeout=120)
    assert moved0 == 0 and moved1 >= 1, (moved0, moved1)
