# SPDX-License-Identifier: Apache-2.0
"""Hierarchical 2D-torus allreduce (Mikami et al., Sony, arXiv:1811.05233).

The ranks form an X-by-Y grid: a row is X ranks of one host, a column the ranks with the same place in their row.
  1. reduce-scatter along the row: rank (x, y) ends with the row's sum of slice x (1/X of the buffer), over
     shared memory;
  2. allreduce along the column, on that slice only: all X ranks of a host drive the network at once, each with
     M/X bytes, instead of one rank with all M;
  3. all-gather along the row: every rank copies the finished slices out, over shared memory again.
It moves the bytes a ring moves, in 2(X-1) + 2(Y-1) steps instead of 2(XY-1). Scale factors are applied once: the
prescale in step 1, the postscale and the average's divisor on the slice in step 2. Counts that do not divide by X
give the first (count % X) ranks of a row one element more."""
import numpy as np

from shmcomm import host_ops, ops
from shmcomm._native import error_for, ffi, lib
from shmcomm.algorithms import shares
from shmcomm.exceptions import ShmCommError


class Torus:
    """Steps 1-3 over a row communicator (shared memory) and a column allreduce (shared memory or MPI).

    Up to `small_bytes` the cost is latency, not bandwidth: the row then allreduces the whole buffer in one
    shared-memory step, the first column (one rank per host) allreduces all of it (`column_small`), and the row
    takes the result from its first rank. A single exchange per host pair crosses the network, not X of them
    competing for the host's cores and NIC for no gain in a message this small."""

    def __init__(self, row, column_allreduce, column_small, small_bytes=0):
        self.row = row
        self.column_allreduce = column_allreduce  # fn(slice_array, code, op, postscale, divisor), in place
        self.column_small = column_small          # fn(ptr, nbytes, code, op, postscale, divisor), in place
        self.small_bytes = small_bytes
        self._scratch = np.empty(0, dtype=np.uint8)

    def allreduce(self, src_ptr, dst_ptr, count, code, esize, op, prescale, postscale, divisor, what):
        row = self.row
        nbytes = count * esize
        if nbytes <= self.small_bytes:
            # Latency-bound: straight to the core and to MPI, every Python layer here costs microseconds. The tags
            # only need to be equal on every rank of the row. The row's sum goes to scratch, so that a failure
            # leaves the output (often the input itself) as it was.
            scratch = self._scratch_ptr(nbytes)
            rc = lib.smc_allreduce(row.handle, src_ptr, scratch, count, code, ops.C_OP[op], prescale, 1.0, 1, count)
            if rc != 0:
                raise error_for(rc, what)
            failure = None
            if row.rank == 0:
                failure = _attempt(self.column_small, scratch, nbytes, code, op, postscale, divisor)
            if row.size > 1:
                rc = lib.smc_broadcast(row.handle, scratch, dst_ptr, nbytes, 0, nbytes | (_FAILED if failure else 0))
                _raise_row_failure(failure, rc, what, "rank %d, the first of this host" % row.ranks[0])
            elif failure is None:
                ffi.memmove(dst_ptr, scratch, nbytes)
            if failure is not None:
                raise failure
            return
        counts = shares(count, row.size)
        mine = counts[row.rank]
        piece_ptr = self._scratch_ptr(mine * esize)
        piece = self._scratch[:mine * esize]
        host_ops.reducescatter_raw(row, src_ptr, piece_ptr, counts, code, op, prescale, 1.0, 1, what)
        failure = _attempt(self.column_allreduce, piece, code, op, postscale, divisor)
        sizes = ffi.new("uint64_t[]", [c * esize for c in counts])
        # After a failure the slices are not sums: gather them somewhere harmless (the row may all have failed, and
        # then no mismatch stops the copy).
        target = dst_ptr if failure is None else ffi.new("char[]", nbytes)
        rc = lib.smc_allgatherv(row.handle, piece_ptr, mine * esize, target, sizes, _FAILED if failure else 0)
        _raise_row_failure(failure, rc, what, "another rank of this host")
        if failure is not None:
            raise failure

    def _scratch_ptr(self, nbytes):
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return ffi.from_buffer(self._scratch)


# A row step's tag with this bit set says "my cross-host step failed": every rank of the row then sees a mismatch
# at once, instead of waiting for a result that will not come until the timeout.
_FAILED = 1 << 63


def _attempt(fn, *args):
    """Runs a cross-host step; returns its exception instead of raising it, so the row can be told first."""
    try:
        fn(*args)
    except BaseException as error:  # KeyboardInterrupt too: the rest of the row must not be left waiting
        return error
    return None


def _raise_row_failure(failure, rc, what, where):
    if failure is not None or rc == 0:
        return
    if rc == lib.SMC_ERR_MISMATCH:  # the row agreed on the sizes in its first step: only a failure flag differs
        raise ShmCommError("%s: the cross-host step failed on %s (its own error says why); this allreduce did not "
                           "complete" % (what, where))
    raise error_for(rc, what)


def smb_column(column):
    """A column on shared memory (a logical grid on one host): fn(slice_array, ...), the big path's column."""
    def run(piece, code, op, postscale, divisor):
        run_small(ffi.from_buffer(piece), piece.nbytes, code, op, postscale, divisor)

    def run_small(ptr, nbytes, code, op, postscale, divisor):
        host_ops.allreduce_raw(column, ptr, nbytes // host_ops.itemsize(code), code, op, 1.0, postscale,
                               "torus column", divisor=divisor)
    return run, run_small


def mpi_column(mpi_comm):
    """A column across hosts: a ring over MPI, which carries every dtype."""
    from shmcomm.algorithms.ring import ring_allreduce

    def run(piece, code, op, postscale, divisor):
        ring_allreduce(mpi_comm, piece, code, op, 1.0, postscale, divisor)
    return run


def mpi_column_small(mpi_comm):
    """A column across hosts for small buffers: the MPI library's own allreduce (recursive doubling: log2(Y)
    exchanges where a ring takes 2(Y-1)), called directly when MPI reduces the type itself and nothing is scaled."""
    from mpi4py import MPI

    from shmcomm.algorithms.mpi_native import mpi_allreduce, mpi_op, numpy_type

    def run(ptr, nbytes, code, op, postscale, divisor):
        kind = numpy_type(code)
        if kind is not None and postscale == 1.0 and divisor == 1:
            mpi_comm.Allreduce(MPI.IN_PLACE, np.frombuffer(ffi.buffer(ptr, nbytes), dtype=kind), op=mpi_op(op))
        elif nbytes:
            mpi_allreduce(mpi_comm, np.frombuffer(ffi.buffer(ptr, nbytes), dtype=np.uint8), code, op, 1.0, postscale,
                          divisor)
    return run
