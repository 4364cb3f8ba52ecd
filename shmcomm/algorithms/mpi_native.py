# SPDX-License-Identifier: Apache-2.0
"""Collectives across hosts through the MPI library itself (mpi4py on numpy views of the tensors' memory).

MPI has no 16-bit float reductions, so float16 and bfloat16 are widened to float32 for the reduction and rounded
back once. Scale factors use the core's kernels, so they follow the same rules as everywhere else."""
import functools
import itertools

import numpy as np

from shmcomm import dtypes, host_ops, ops
from shmcomm._native import ffi, lib
from shmcomm.buffers import empty_like, wrap

_NUMPY_OF = {lib.SMC_FLOAT32: np.float32, lib.SMC_FLOAT64: np.float64, lib.SMC_INT8: np.int8,
             lib.SMC_UINT8: np.uint8, lib.SMC_INT16: np.int16, lib.SMC_INT32: np.int32, lib.SMC_INT64: np.int64}


@functools.lru_cache(maxsize=None)
def mpi_op(op):
    from mpi4py import MPI

    return {ops.Average: MPI.SUM, ops.Sum: MPI.SUM, ops.Min: MPI.MIN, ops.Max: MPI.MAX, ops.Product: MPI.PROD}[op]


def _widened(raw, code):
    """float32 copy of 16-bit floats (their bits converted by the core's kernel)."""
    wide = np.empty(raw.nbytes // 2, dtype=np.float32)
    if code == lib.SMC_FLOAT16:
        wide[:] = raw.view(np.float16)
    else:  # bfloat16: the top half of a float32
        wide.view(np.uint32)[:] = raw.view(np.uint16).astype(np.uint32) << 16
    return wide


def _narrow_into(raw, wide, code):
    if code == lib.SMC_FLOAT16:
        raw.view(np.float16)[:] = wide
    else:  # round to nearest even, as the core does
        bits = wide.view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = np.isnan(wide)
        raw.view(np.uint16)[:] = np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def mpi_allreduce(mpi, raw, code, op, prescale, postscale, divisor):
    """In place on the uint8 array `raw` holding elements of type `code`."""
    from mpi4py import MPI

    scaled = prescale != 1.0 or postscale != 1.0 or divisor != 1  # the usual case is a plain sum: no extra calls
    if scaled:
        base = ffi.from_buffer(raw)
        count = raw.nbytes // host_ops.itemsize(code)
        host_ops.scale_raw(base, count, code, prescale, 1)
    if code in (lib.SMC_FLOAT16, lib.SMC_BFLOAT16):
        wide = _widened(raw, code)
        mpi.Allreduce(MPI.IN_PLACE, wide, op=mpi_op(op))
        _narrow_into(raw, wide, code)
    else:
        mpi.Allreduce(MPI.IN_PLACE, raw.view(_NUMPY_OF[code]), op=mpi_op(op))
    if scaled:
        host_ops.scale_raw(base, count, code, postscale, divisor)


def _bytes_of(buf):
    return np.frombuffer(ffi.buffer(buf.ptr, buf.nbytes), dtype=np.uint8) if buf.nbytes else np.empty(0, np.uint8)


def broadcast(mpi, x, output, root, what):
    src = wrap(x, what, writable=output is x)
    out, dst = (x, src) if output is x else host_ops.output_for(src, output, src.shape, what)
    if dst is not src and mpi.Get_rank() == root:
        ffi.memmove(dst.ptr, src.ptr, src.nbytes)
    mpi.Bcast(_bytes_of(dst), root=root)
    return out


def _agree_on_rows(mpi, src, shape, what, extra):
    """Every rank's (dtype, trailing shape, extra); a disagreement raises on every rank alike."""
    info = mpi.allgather((src.dtype_key(), tuple(shape[1:]), extra))
    if any(t[:2] != info[0][:2] for t in info):
        from shmcomm.exceptions import MismatchError

        raise MismatchError("%s: ranks disagree on the tensor: %s" % (what, "; ".join(
            "rank %d has %s[*, %s]" % (r, dtypes.NAMES.get(t[0], t[0]), ", ".join(map(str, t[1])))
            for r, t in enumerate(info))))
    return [t[2] for t in info]


def allgather(mpi, x, what):
    from mpi4py import MPI

    src = wrap(x, what)
    shape = tuple(src.shape) or (1,)
    rows = _agree_on_rows(mpi, src, shape, what, shape[0])
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * src.itemsize
    out = empty_like(src, (sum(rows),) + shape[1:])
    mpi.Allgatherv([_bytes_of(src), MPI.BYTE], [_bytes_of(wrap(out, what, True)), ([r * row_bytes for r in rows], None),
                                                 MPI.BYTE])
    return out


def alltoall(mpi, x, splits, what):
    from mpi4py import MPI

    src = wrap(x, what)
    shape = tuple(src.shape) or (1,)
    every = _agree_on_rows(mpi, src, shape, what, list(splits))
    got = np.array([s[mpi.Get_rank()] for s in every], dtype=np.int64)
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * src.itemsize
    out = empty_like(src, (int(got.sum()),) + shape[1:])
    mpi.Alltoallv([_bytes_of(src), ([s * row_bytes for s in splits], None), MPI.BYTE],
                  [_bytes_of(wrap(out, what, True)), ([int(g) * row_bytes for g in got], None), MPI.BYTE])
    return out, got


def allgather_bytes(mpi, payload, timeout_s):
    """host_ops.allgather_bytes across hosts (the engine's negotiation), within SHMCOMM_TIMEOUT: MPI's own allgather
    would wait forever for a rank that stopped."""
    import time

    from mpi4py import MPI

    from shmcomm.algorithms.agreement import poll
    from shmcomm.exceptions import TimeoutError

    deadline = time.monotonic() + timeout_s

    def late():
        return TimeoutError("negotiation: timed out after %.0f s waiting for the other ranks' messages across hosts "
                            "(a rank is stuck; SHMCOMM_TIMEOUT sets the limit)" % timeout_s)

    def gatherv(mine, every, sizes):
        displacements = [0] + list(itertools.accumulate(sizes[:-1]))
        request = mpi.Iallgatherv([mine, len(mine), MPI.BYTE], [every, (sizes, displacements), MPI.BYTE])
        poll([request], deadline, late)
    return host_ops.allgather_bytes_over(gatherv, mpi.Get_size(), payload)
