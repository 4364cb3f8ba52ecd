# SPDX-License-Identifier: Apache-2.0
"""Runs under mpiexec on pretend hosts (tests/test_crossing.py): a small allreduce of a numpy array takes the quick
call across hosts (csrc/py/quick_crossing.c) and gives the very bits of the full path, for every dtype, op and scale;
ranks on different paths agree; a mismatch and a refusal raise on every rank as on the full path, and the job goes
on; sizes and algorithms that are not the torus's small path keep to the full path. Prints "quick ok" on every rank
that passed."""
import numpy as np
from mpi4py import MPI

import shmcomm
from shmcomm import basics, quick_path

shmcomm.init()
me, n = shmcomm.rank(), shmcomm.size()
comm, world, mpi = basics.communicator(), quick_path.world, MPI.COMM_WORLD
assert world.crossing_allreduce, "rank %d: no quick call across hosts (are the rounds compiled?)" % me
QUICK, FULL_TORUS = world.crossing_allreduce, comm.torus.allreduce


def refuse(*args, **kwargs):
    raise AssertionError("rank %d: the full path ran" % me)


def quick(call):
    """call() where the full path's torus refuses to run: a result came from the quick call."""
    comm.torus.allreduce = refuse
    try:
        return call()
    finally:
        comm.torus.allreduce = FULL_TORUS


def full(call):
    """call() with the quick call closed."""
    world.crossing_allreduce = None
    try:
        return call()
    finally:
        world.crossing_allreduce = QUICK


def data(dtype, rank, shape=(3, 5)):
    values = np.random.default_rng(7 + rank).integers(-4, 5, size=shape)
    if np.issubdtype(dtype, np.unsignedinteger):
        values = np.abs(values) + 1
    return values.astype(dtype) if np.issubdtype(dtype, np.integer) else (values * 0.37).astype(dtype)


OPS = {"Sum": shmcomm.Sum, "Average": shmcomm.Average, "Min": shmcomm.Min, "Max": shmcomm.Max,
       "Product": shmcomm.Product}
for dtype in (np.float32, np.float64, np.int32, np.int64, np.int16, np.int8, np.uint8):
    every = [data(dtype, r) for r in range(n)]
    for name, op in OPS.items():
        for pre, post in ((1.0, 1.0), (0.5, 3.0)):
            x = every[me]
            got = quick(lambda: shmcomm.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post))
            want = full(lambda: shmcomm.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post))
            case = (np.dtype(dtype).name, name, pre, post)
            assert got.dtype == x.dtype and got.shape == x.shape, case
            assert got.tobytes() == want.tobytes(), case  # the very same bits
            if np.issubdtype(dtype, np.floating) and name != "Product":
                scaled = [e.astype(np.float64) * pre for e in every]
                exact = {"Sum": np.sum, "Average": np.mean, "Min": np.min, "Max": np.max}[name](scaled, axis=0) * post
                assert np.allclose(got, exact, rtol=1e-5, atol=1e-5), case
            into = np.empty_like(x)
            assert quick(lambda: shmcomm.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post,
                                                   output=into)) is into and into.tobytes() == want.tobytes(), case
            inplace = x.copy()
            assert quick(lambda: shmcomm.allreduce_(inplace, op=op, prescale_factor=pre, postscale_factor=post)) \
                is inplace and inplace.tobytes() == want.tobytes(), case
assert (quick(lambda: shmcomm.allreduce(np.full(4, me + 1, np.int32), op=shmcomm.Sum)) == n * (n + 1) // 2).all()

# Ranks on different paths: rank 0 the full one, the others the quick call.
x = data(np.float32, me)
everyone = quick(lambda: shmcomm.allreduce(x, op=shmcomm.Average))
mixed = full(lambda: shmcomm.allreduce(x, op=shmcomm.Average)) if me == 0 else \
    quick(lambda: shmcomm.allreduce(x, op=shmcomm.Average))
assert mixed.tobytes() == everyone.tobytes()

# A mismatch raises on every rank, names what the ranks passed, leaves the input alone; the job goes on.
odd = np.ones(16 if me == n - 1 else (4, 4), np.float32)
try:
    shmcomm.allreduce_(odd, op=shmcomm.Sum)
    raise AssertionError("rank %d: no mismatch" % me)
except shmcomm.MismatchError as error:
    assert "ranks disagree" in str(error) and "rank %d passed float32[16]" % (n - 1) in str(error), error
assert (odd == 1).all()
# An output that does not fit on rank 1: its own error there, the others hear rank 1's reason.
bad = np.empty(3 if me == 1 else 4, np.float32)
try:
    shmcomm.allreduce(np.ones(4, np.float32), output=bad)
    raise AssertionError("rank %d: no refusal" % me)
except shmcomm.PeerArgumentError as error:
    assert me != 1 and "rank 1" in str(error), error
except shmcomm.InvalidArgumentError as error:
    assert me == 1, error
assert (quick(lambda: shmcomm.allreduce(np.ones(4, np.float32), op=shmcomm.Sum)) == n).all()

# The full path for what is not the torus's small path: larger inputs, float16, other algorithms.
assert comm.quick_call.max_bytes == comm.torus.small_bytes > 0
big = np.ones(comm.torus.small_bytes // 4 + 1, np.float32)
assert (shmcomm.allreduce(big, op=shmcomm.Sum) == n).all()
assert (shmcomm.allreduce(np.ones(8, np.float16), op=shmcomm.Sum) == n).all()
calls = []
mpi_allreduce = comm.across.allreduce
comm.across.allreduce = lambda *args: calls.append(args) or mpi_allreduce(*args)
comm.algorithm = "mpi"
assert comm.quick_call.max_bytes == 0
assert (shmcomm.allreduce(np.ones(8, np.float32), op=shmcomm.Sum) == n).all() and len(calls) == 1
comm.algorithm, comm.across.allreduce = "auto", mpi_allreduce
assert comm.quick_call.max_bytes == comm.torus.small_bytes
mpi.Barrier()
print("quick ok", flush=True)
shmcomm.shutdown()
