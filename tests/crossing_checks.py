# SPDX-License-Identifier: Apache-2.0
"""Runs under mpiexec (tests/test_crossing.py): the agreement's rounds over MPI's exchanges in C (transport/crossing.py)
and over the MPI transport's exchange in Python give the same verdicts and the same bits, for every kind of header
and two data types; and a rank that does not come makes the others time out, after which their transport refuses
every call. Prints "crossing ok" on every rank that passed."""
import time

import numpy as np
from mpi4py import MPI

from shmcomm._native import ffi, lib
from shmcomm.algorithms.agreement import FAILED, HALVING_BYTES, HEADER_BYTES, MISMATCH, OK, Agreement
from shmcomm.vocabulary.exceptions import BrokenCommunicatorError, TimeoutError
from shmcomm.transport import crossing
from shmcomm.transport.mpi import Mpi

world = MPI.COMM_WORLD
me, n = world.rank, world.size
CAPACITY = 128 << 10


def agreement(compiled, timeout_s=30.0):
    """An agreement whose rounds exchange in C (the compiled module) or through the MPI transport in Python."""
    built = crossing.load()
    assert built is not None, "the compiled exchanges could not be had (transport/crossing.py says why)"
    if not compiled:
        crossing._loaded = False  # as without mpicc
    try:
        a = Agreement(Mpi(world.Dup(), timeout_s), capacity=CAPACITY)
    finally:
        crossing._loaded = built
    assert (a._rounds.module is not None) == compiled
    return a


def run(a, sig, status, culprit, data, code, op):
    nbytes = data.nbytes
    ffi.memmove(a.message(nbytes) + HEADER_BYTES, ffi.from_buffer(data), nbytes)
    verdict = a.allreduce(sig, status, culprit, nbytes, code, op) if nbytes else a.agree(sig, status, culprit)
    return verdict, bytes(a._send[HEADER_BYTES:HEADER_BYTES + nbytes])


values = np.random.default_rng(1000 + me).standard_normal(1000).astype(np.float32)
counts = np.arange(CAPACITY // 4, dtype=np.int32) * (me + 1) - 7 * me
# From HALVING_BYTES, among 4 ranks or more after the fold, the rounds halve: an odd count, and the whole capacity.
wide = np.random.default_rng(2000 + me).standard_normal(CAPACITY // 4).astype(np.float32)
odd = np.random.default_rng(3000 + me).standard_normal(8195).astype(np.float64)
assert odd.nbytes >= HALVING_BYTES and values.nbytes < HALVING_BYTES
cases = [  # (what, sig, status, culprit, data, core dtype, core op, expected verdict)
    ("float32 sum", 5, OK, 0, values, lib.SMC_FLOAT32, lib.SMC_SUM, (OK, 0)),
    ("int32 max, the whole capacity", 5, OK, 0, counts, lib.SMC_INT32, lib.SMC_MAX, (OK, 0)),
    ("a signature that differs on the last rank", 6 if me == n - 1 else 5, OK, 0, values, lib.SMC_FLOAT32,
     lib.SMC_SUM, (MISMATCH, 0)),
    ("a failed step on rank 1", 5, FAILED if me == 1 else OK, 2 if me == 1 else 0, values, lib.SMC_FLOAT32,
     lib.SMC_SUM, (FAILED, 2)),
    ("another path (byte count) on rank 0", 5, OK, 0, values[:999] if me == 0 else values, lib.SMC_FLOAT32,
     lib.SMC_SUM, (MISMATCH, 0)),
    ("headers only", 9, OK, 0, values[:0], lib.SMC_FLOAT32, lib.SMC_SUM, (OK, 0)),
    ("halving: float32 sum, the whole capacity", 5, OK, 0, wide, lib.SMC_FLOAT32, lib.SMC_SUM, (OK, 0)),
    ("halving: float64 min of an odd count", 5, OK, 0, odd, lib.SMC_FLOAT64, lib.SMC_MIN, (OK, 0)),
    ("halving: a signature that differs on the last rank", 6 if me == n - 1 else 5, OK, 0, wide, lib.SMC_FLOAT32,
     lib.SMC_SUM, (MISMATCH, 0)),
    ("halving: a failed step on the last rank", 5, FAILED if me == n - 1 else OK, n if me == n - 1 else 0, wide,
     lib.SMC_FLOAT32, lib.SMC_SUM, (FAILED, n)),
    ("halving: another path (byte count) on rank 0", 5, OK, 0, odd[:-1] if me == 0 else odd, lib.SMC_FLOAT64,
     lib.SMC_SUM, (MISMATCH, 0)),
    ("halving on rank 0 only", 5, OK, 0, odd if me == 0 else odd[:100], lib.SMC_FLOAT64, lib.SMC_SUM, (MISMATCH, 0)),
]
compiled, python = agreement(True), agreement(False)
for what, sig, status, culprit, data, code, op, expected in cases:
    got_c = run(compiled, sig, status, culprit, data, code, op)
    got_p = run(python, sig, status, culprit, data, code, op)
    assert got_c[0] == got_p[0] == expected, (what, got_c[0], got_p[0], expected)
    assert got_c[1] == got_p[1], what  # the very same bits
if n > 1:  # and the sum is the sum, by doubling and by halving
    for data in (values, wide):
        total = np.frombuffer(run(compiled, 5, OK, 0, data, lib.SMC_FLOAT32, lib.SMC_SUM)[1], dtype=np.float32)
        every = np.array(world.allgather(data))
        assert np.allclose(total, every.sum(axis=0), rtol=1e-5, atol=1e-5)
    least = np.frombuffer(run(compiled, 5, OK, 0, odd, lib.SMC_FLOAT64, lib.SMC_MIN)[1], dtype=np.float64)
    assert np.array_equal(least, np.array(world.allgather(odd)).min(axis=0))

# A rank that does not come: every other rank times out within its deadline, and its transport is refused after.
late = agreement(True, timeout_s=1.0)
world.Barrier()
if n > 1 and me == 1:
    world.Barrier()  # the others have timed out: take what they sent, so that nothing is left in flight at the end
    until = time.monotonic() + 1.0
    while time.monotonic() < until:
        if late.transport.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG):
            late.transport.comm.Recv(bytearray(HEADER_BYTES + CAPACITY), MPI.ANY_SOURCE, MPI.ANY_TAG)
        else:
            time.sleep(0.01)
elif n > 1:
    started = time.monotonic()
    try:
        late.agree(3)
        raise AssertionError("rank %d: no timeout without rank 1" % me)
    except TimeoutError as error:
        assert "timed out" in str(error), error
    assert time.monotonic() - started < 5.0
    try:
        late.agree(3)
        raise AssertionError("rank %d: a transport whose wait was abandoned was used again" % me)
    except BrokenCommunicatorError:
        pass
    world.Barrier()
print("crossing ok", flush=True)
