# SPDX-License-Identifier: Apache-2.0
"""Where a collective's waiters yield their core: only on a CPU that a peer last ran on. Elsewhere a yield could
only hand the core to an unrelated busy process for a scheduler slice, so the waiter polls instead."""
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
    beside, apart = shm.waits()
    for _ in range(200):
        assert (shmcomm.allreduce(x, op=shmcomm.Sum) == 3).all()
    after = shm.waits()
    shmcomm.shutdown()
    return after[0] - beside, after[1] - apart


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to place the ranks apart")
@pytest.mark.parametrize("placement", ["same", "apart"])
def test_a_waiter_yields_only_where_a_peer_shares_its_cpu(placement):
    """Both ranks pinned to one CPU: every step's wait yields. Pinned to two: none does, every wait polls."""
    for beside, apart in multiproc.run(2, _waits, placement, timeout=120):
        if placement == "same":
            assert beside > 0 and apart == 0, (beside, apart)
        else:
            assert beside == 0 and apart > 0, (beside, apart)
