# SPDX-License-Identifier: Apache-2.0
"""The MPI transport: the ranks of an MPI communicator (mpi4py on numpy views of the tensors' memory).

MPI checks no arguments and has no timeouts. The arguments are the algorithms' business: they run the agreement
(algorithms/agreement.py) before they hand a collective to this transport, so `tag` is not checked here. The timeouts
are this module's: every wait that can outlast a peer that stopped has the deadline of SHMCOMM_TIMEOUT (deadline.py),
and a transport whose wait was abandoned refuses every later collective (BrokenCommunicatorError), since its messages
are out of step from then on."""
import itertools
import time

import numpy as np

from shmcomm._native import ffi, lib
from shmcomm.vocabulary.exceptions import SystemError, TimeoutError
from shmcomm.transport import PointToPoint, allgather_bytes_over, kernels
from shmcomm.transport.deadline import Watchdog, poll, spin

_NUMPY_OF = {lib.SMC_FLOAT32: np.float32, lib.SMC_FLOAT64: np.float64, lib.SMC_INT8: np.int8,
             lib.SMC_UINT8: np.uint8, lib.SMC_INT16: np.int16, lib.SMC_INT32: np.int32, lib.SMC_INT64: np.int64}


def _bytes(ptr, nbytes):
    return np.frombuffer(ffi.buffer(ptr, nbytes), dtype=np.uint8) if nbytes else np.empty(0, np.uint8)


def choose_thread_level(serialized):
    """Before MPI's first import: HOROVOD_MPI_THREADS_DISABLE asks for MPI_THREAD_SERIALIZED instead of mpi4py's
    MPI_THREAD_MULTIPLE. shmcomm calls MPI from one thread at a time (the caller's, or the engine's while it runs);
    only the watchdog's cancel needs MULTIPLE, and it polls instead below that (deadline.Watchdog)."""
    import mpi4py

    if serialized:
        mpi4py.rc.thread_level = "serialized"


class Mpi(PointToPoint):
    """A transport over the MPI communicator `comm`; `ranks` are its members' job ranks (MPI.COMM_WORLD's).

    The deadline bounds the agreement's exchanges, the engine's negotiation and barriers, and also the data phases
    after a successful agreement (allreduce, reduce-scatter, broadcast, allgatherv, alltoallv, the ring's steps):
    these are MPI's nonblocking collectives, waited for as MPI's blocking calls would (spinning, yielding the core).
    Every rank has arrived by then, but one stopped mid-way (SIGSTOP, a debugger, a hung thread holding the GIL) would
    otherwise hold the others in MPI for ever; the communicator then names the ranks holding the job up (rollcall.py).
    MPI has no 16-bit float reductions, so float16 and bfloat16 are widened to float32, scaled and reduced there, and
    rounded back once (kernels.widened); scale factors use the core's kernels, as everywhere else."""

    carrier = "mpi"

    def __init__(self, comm, timeout_s, what="across hosts", ranks=None):
        from mpi4py import MPI

        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.ranks = comm.allgather(MPI.COMM_WORLD.Get_rank()) if ranks is None else list(ranks)
        # Process sets across hosts: communicators made from a duplicate of this one (`groups`, set at init by whoever
        # makes the job's; no other call uses it), which needs MPI to take calls from several threads at once.
        self.groups = None
        self.threads_multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.timeout_s = timeout_s
        self.what = what
        # 1 while usable, for C callers that cannot ask `broken` (csrc/py/quick_crossing.h); `broken` keeps it
        self.usable_flag = ffi.new("int *", 1)
        self.broken = None  # why calls are refused: a wait was abandoned, its messages are still pending
        self._owned = False  # a communicator subset() made, freed by close()
        self._byte = MPI.BYTE
        self._ops = {lib.SMC_SUM: MPI.SUM, lib.SMC_MIN: MPI.MIN, lib.SMC_MAX: MPI.MAX, lib.SMC_PROD: MPI.PROD}
        self._watchdog = Watchdog()

    @property
    def broken(self):
        return self._broken

    @broken.setter
    def broken(self, why):
        self._broken = why
        self.usable_flag[0] = 0 if why else 1

    def deadline(self):
        return time.monotonic() + self.timeout_s

    def subset(self, ranks, key, what):
        """A transport over `ranks` (job ranks of this communicator, this rank among them), from
        MPI_Comm_create_group on `groups`, which only they call, tagged by `key` (an int the same on all of them).
        MPI waits there for every one of them with no deadline: the caller bounds it (bootstrap._within). Groups made
        at once by overlapping sets are told apart by their tags; two keys that share a tag are found out after."""
        from mpi4py import MPI

        world = self.groups.Get_group()
        group = world.Incl([self.ranks.index(r) for r in ranks])
        world.Free()
        try:
            comm = self.groups.Create_group(group, key % (self.groups.Get_attr(MPI.TAG_UB) + 1))
        finally:
            group.Free()
        subset = Mpi(comm, self.timeout_s, what, ranks)
        subset._owned = True
        keys = subset.allgather_bytes(b"%d" % key)  # within the deadline
        if len(set(keys)) != 1:
            subset.close()
            raise SystemError("%s: MPI paired this group with another made at the same time (keys %s); make the "
                              "sets one after the other" % (what, b", ".join(keys).decode()))
        return subset

    def close(self):
        """Frees a communicator subset() made (the job's own are MPI's to end)."""
        if self._owned and not self.broken:
            self._owned = False
            self.comm.Free()

    def _bounded(self, request, deadline, late):
        """Polls `request` to `deadline`; a late one is still pending, so the transport is refused from then on."""
        try:
            poll([request], deadline, late)
        except TimeoutError as error:
            self.broken = str(error)
            raise

    # ---- steps (after the agreement) ----
    def allreduce(self, src, dst, count, dtype, op, prescale, postscale, divisor, tag, what):
        """MPI's own allreduce, in place on dst. 16-bit floats are scaled, reduced and divided in float32 and rounded
        once, as the core does."""
        from mpi4py import MPI

        self.usable(what)
        esize = kernels.itemsize(dtype)
        raw = _bytes(src, count * esize)
        if dtype in kernels.HALF:
            work, work_dtype = kernels.widened(raw, dtype), lib.SMC_FLOAT32
        else:
            if dst != src:
                ffi.memmove(dst, src, count * esize)
            work, work_dtype = _bytes(dst, count * esize).view(_NUMPY_OF[dtype]), dtype
        work_ptr = ffi.from_buffer(work)
        kernels.scale(work_ptr, count, work_dtype, prescale)
        self._data_phase(self.comm.Iallreduce(MPI.IN_PLACE, work, op=self._ops[op]), what)
        kernels.scale(work_ptr, count, work_dtype, postscale, divisor)
        if dtype in kernels.HALF:
            kernels.narrow_into(_bytes(dst, count * esize), work, dtype)

    def reducescatter(self, src, dst, counts, dtype, op, prescale, postscale, divisor, tag, what):
        """MPI_Reduce_scatter, with allreduce's rules for 16-bit floats."""
        self.usable(what)
        esize = kernels.itemsize(dtype)
        total, mine = sum(counts), counts[self.rank]
        if dtype in kernels.HALF:
            work, out, work_dtype = (kernels.widened(_bytes(src, total * esize), dtype),
                                     np.empty(mine, dtype=np.float32), lib.SMC_FLOAT32)
        else:
            work = _bytes(src, total * esize).view(_NUMPY_OF[dtype]).copy()  # the input stays as it was
            out, work_dtype = _bytes(dst, mine * esize).view(_NUMPY_OF[dtype]), dtype
        kernels.scale(ffi.from_buffer(work), total, work_dtype, prescale)
        self._data_phase(self.comm.Ireduce_scatter(work, out, list(counts), op=self._ops[op]), what)
        kernels.scale(ffi.from_buffer(out), mine, work_dtype, postscale, divisor)
        if dtype in kernels.HALF:
            kernels.narrow_into(_bytes(dst, mine * esize), out, dtype)

    def broadcast(self, src, dst, nbytes, root, tag, what):
        self.usable(what)
        if dst != src and self.rank == root:
            ffi.memmove(dst, src, nbytes)
        self._data_phase(self.comm.Ibcast(_bytes(dst, nbytes), root=root), what)

    def allgatherv(self, src, nbytes, dst, sizes, tag, what):
        self.usable(what)
        self._data_phase(self.comm.Iallgatherv([_bytes(src, nbytes), self._byte],
                                               [_bytes(dst, sum(sizes)), (list(sizes), None), self._byte]), what)

    def alltoallv(self, src, send_sizes, dst, recv_sizes, tag, what):
        self.usable(what)
        self._data_phase(self.comm.Ialltoallv([_bytes(src, sum(send_sizes)), (list(send_sizes), None), self._byte],
                                              [_bytes(dst, sum(recv_sizes)), (list(recv_sizes), None), self._byte]),
                         what)

    def barrier(self, what="barrier"):
        self.usable(what)
        self._bounded(self.comm.Ibarrier(), self.deadline(), lambda: self._late_all(what))

    def allgather_bytes(self, payload):
        """Every rank's bytes (the engine's negotiation), within SHMCOMM_TIMEOUT: MPI's own allgather would wait
        forever for a rank that stopped."""
        self.usable("negotiation")
        deadline = self.deadline()

        def late():
            return TimeoutError("negotiation: timed out after %.0f s waiting for the other ranks' messages across "
                                "hosts (a rank is stuck; SHMCOMM_TIMEOUT sets the limit)" % self.timeout_s)

        def gatherv(mine, every, sizes):
            displacements = [0] + list(itertools.accumulate(sizes[:-1]))
            request = self.comm.Iallgatherv([mine, len(mine), self._byte], [every, (sizes, displacements), self._byte])
            self._bounded(request, deadline, late)
        return allgather_bytes_over(gatherv, self.size, payload)

    def allgather_rows(self, row):
        """Every rank's int64 row (a description after a disagreement), within the deadline; None if that fails."""
        from mpi4py import MPI

        every = np.zeros((self.size, row.size), dtype=np.int64)
        try:
            request = self.comm.Iallgather([row, MPI.INT64_T], [every, MPI.INT64_T])
            poll([request], self.deadline(), lambda: TimeoutError("late"))
        except (TimeoutError, MPI.Exception):
            self.broken = "a rank did not take part in describing a disagreement"
            return None
        return every

    # ---- point to point ----
    def exchange(self, peer, send, send_bytes, recv, deadline, tag, late):
        """Sends send[:send_bytes] to `peer` and/or receives into `recv` from it (either may be None), by `deadline`:
        a late receive is cancelled and raises late(). The receive is posted before the send, so a peer doing the
        same never waits for buffer space."""
        incoming = self.comm.Irecv([recv, recv.nbytes, self._byte], peer, tag) if recv is not None else None
        outgoing = self.comm.Isend([send, send_bytes, self._byte], peer, tag) if send is not None else None
        if incoming is not None:
            self._watchdog.wait(incoming, deadline, late)
        if outgoing is not None and not outgoing.Test():
            # The peer posted its receive before it sent (or before it handed back a fold), so this completes as
            # soon as the bytes are through. (Sends are not cancelled: not every MPI can.) A small one has mostly
            # gone by now: the Test above spares the poll's setup.
            poll([outgoing], deadline, late)

    def sendrecv(self, send, dest, recv, source, tag, what="ring allreduce"):
        """One ring step: send to `dest` while receiving from `source` (uint8 arrays)."""
        incoming = self.comm.Irecv([recv, self._byte], source, tag)
        outgoing = self.comm.Isend([send, self._byte], dest, tag)
        self._data_phase([incoming, outgoing], what, "ranks %d and %d" % (self.ranks[source], self.ranks[dest]))

    def _data_phase(self, requests, what, peers="the other ranks"):
        """Waits for a data phase's requests as MPI's blocking call would, until SHMCOMM_TIMEOUT."""
        def late():
            return TimeoutError("%s: timed out after %.0f s in the data exchange with %s across hosts (a rank stopped "
                                "or hung mid-way; SHMCOMM_TIMEOUT sets the limit)" % (what, self.timeout_s, peers))
        try:
            spin(requests if isinstance(requests, list) else [requests], self.deadline(), late)
        except TimeoutError as error:
            self.broken = str(error)
            raise

    def _late_all(self, what):
        return TimeoutError("%s: timed out after %.0f s waiting for the other ranks across hosts (a rank is stuck, or "
                            "it called a different collective; SHMCOMM_TIMEOUT sets the limit)"
                            % (what, self.timeout_s))
