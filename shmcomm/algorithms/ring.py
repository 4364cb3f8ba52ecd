# SPDX-License-Identifier: Apache-2.0
"""Ring allreduce over an MPI transport's point-to-point steps, with the core's kernels doing the arithmetic.

The buffer is cut into one chunk per rank. Reduce-scatter: in N-1 steps each rank sends a chunk to its right
neighbour and adds the chunk arriving from its left into its own copy, so after the last step rank r holds the
complete sum of chunk (r+1) % N. All-gather: N-1 more steps pass the finished chunks around. Each rank sends
2(N-1)/N of the buffer whatever N is, which is why rings carry large messages well; it also takes 2(N-1) steps, which
is why they carry small ones badly. MPI moves bytes only, so every dtype the core reduces (float16 and bfloat16
included) works, and every rank ends with the same bits: each chunk is reduced in one place, then copied."""
import numpy as np

from shmcomm.transport import memory
from shmcomm.vocabulary.description import shares
from shmcomm.transport import kernels

_TAG = 0x5A1  # its own: other messages on the same communicator (the agreement's) must never match


def ring_allreduce(transport, raw, code, op, prescale=1.0, postscale=1.0, divisor=1):
    """Reduces the elements held in the uint8 array `raw` (of type `code`, op a core op) in place across the
    transport (transport.mpi.Mpi)."""
    n, me = transport.size, transport.rank
    esize = kernels.itemsize(code)
    count = raw.nbytes // esize
    base = memory.address(raw)
    kernels.scale(base, count, code, prescale)
    counts = shares(count, n)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    scratch = np.empty(max(counts) * esize, dtype=np.uint8)
    scratch_ptr = memory.address(scratch)
    right, left = (me + 1) % n, (me - 1) % n

    def chunk(c):
        return raw[starts[c] * esize:(starts[c] + counts[c]) * esize]

    for step in range(n - 1):
        send, recv = (me - step) % n, (me - step - 1) % n
        transport.sendrecv(chunk(send), right, scratch[:counts[recv] * esize], left, _TAG)
        if counts[recv]:
            mine = base + int(starts[recv]) * esize
            kernels.reduce_pair(mine, mine, scratch_ptr, counts[recv], code, op, "ring allreduce")
    done = (me + 1) % n
    kernels.scale(base + int(starts[done]) * esize, counts[done], code, postscale, divisor)
    for step in range(n - 1):
        send, recv = (me + 1 - step) % n, (me - step) % n
        transport.sendrecv(chunk(send), right, chunk(recv), left, _TAG)
    return raw
