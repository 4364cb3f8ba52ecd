# SPDX-License-Identifier: Apache-2.0
"""The communicator of a job that spans hosts, or of a logical grid on one host (SHMCOMM_TORUS_GRID).

It offers what the host communicator offers (basics.Communicator), so the API and the engine use either unchanged.
Allreduce goes through the algorithm SHMCOMM_ALLREDUCE_ALGO picks (auto, torus, ring, mpi); the other collectives go
through MPI across hosts, or through the host's shared memory when the whole grid is on one host."""
import os

import numpy as np

from shmcomm import disagreement, host_ops, ops
from shmcomm._native import lib
from shmcomm.algorithms.agreement import MISMATCH, OK, failure_text, signature
from shmcomm.buffers import require_reducible, wrap
from shmcomm.exceptions import BrokenCommunicatorError, InvalidArgumentError, MismatchError, ShmCommError

ALGORITHMS = ("auto", "torus", "ring", "mpi")


def requested_algorithm():
    algo = (os.environ.get("SHMCOMM_ALLREDUCE_ALGO") or os.environ.get("HOROVOD_ALLREDUCE_ALGO") or "auto").lower()
    if algo not in ALGORITHMS:
        raise ValueError("SHMCOMM_ALLREDUCE_ALGO=%r: choose one of %s" % (algo, ", ".join(ALGORITHMS)))
    return algo


# Variables that choose paths: hosts on different paths would wait for each other instead of failing.
PATH_SETTINGS = ("SHMCOMM_ALLREDUCE_ALGO", "HOROVOD_ALLREDUCE_ALGO", "SHMCOMM_TORUS_SMALL_BYTES",
                 "HOROVOD_TORUS_SMALL_BYTES", "SHMCOMM_TORUS_MIN_BYTES", "SHMCOMM_TORUS_GRID", "HOROVOD_TORUS_GRID")


def require_same_settings(mpi):
    """Every rank must have the same PATH_SETTINGS; compared as they are set, before anything parses them, so that
    one rank's bad value fails every rank alike."""
    mine = tuple(os.environ.get(name) for name in PATH_SETTINGS)
    every = mpi.allgather(mine)
    if any(e != mine for e in every):
        differ = "; ".join("rank %d: %s" % (r, ", ".join("%s=%s" % (n, v) for n, v in zip(PATH_SETTINGS, e) if v))
                           for r, e in enumerate(every) if r == 0 or e != every[0])
        names = ", ".join(n for n in PATH_SETTINGS if n.startswith("SHMCOMM_"))
        raise ValueError("%s (or their HOROVOD_ names) must be the same on every rank (%s)" % (names, differ))


class GridComm:
    def __init__(self, topology, tuning, host, torus, mpi=None, host_groups=()):
        self.topology = topology
        self.tuning = tuning
        self.host = host                # shared memory among this host's ranks
        self.torus = torus              # a Torus, or None (heterogeneous hosts)
        self.mpi = mpi                  # MPI.COMM_WORLD across hosts, None for a grid on one host
        self.host_groups = [list(g) for g in host_groups]  # the global ranks of each host
        self.rank = topology.rank
        self.size = topology.size
        self.ranks = list(range(topology.size))
        self.algorithm = requested_algorithm()
        if self.algorithm == "torus" and torus is None:
            raise ValueError("SHMCOMM_ALLREDUCE_ALGO=torus needs the same number of ranks on every host")
        if self.algorithm in ("ring", "mpi") and mpi is None:
            raise ValueError("SHMCOMM_ALLREDUCE_ALGO=%s needs a job launched across hosts" % self.algorithm)
        self.handle = host.handle       # for code that asks the host communicator directly (spin, boxes)
        self.torus_min_bytes = int(os.environ.get("SHMCOMM_TORUS_MIN_BYTES", 0))
        self.closables = []
        self.agreement = None           # without a torus, every cross-host collective starts with this
        self.broken = None              # why cross-host calls are refused (an abandoned MPI collective)
        if mpi is not None and torus is None:
            from shmcomm.algorithms.agreement import Agreement

            self.agreement = Agreement(mpi, tuning.timeout_s)

    def _choose(self, nbytes):
        """auto: the torus when every host has the same ranks; for uneven hosts, and below SHMCOMM_TORUS_MIN_BYTES
        (0), the MPI library's allreduce. The torus's small-message path is a single exchange across hosts, made by
        one rank per host while the others sleep, which carries the cross-host agreement too; MPI's allreduce needs
        that agreement as an exchange of its own first. On 2 simulated hosts the torus is on par with MPI's own
        allreduce at 4 KiB and ahead from 8 KiB; MPI is ahead at 2 KiB, and at 4 KiB with 3 hosts on 2 cores."""
        if self.algorithm != "auto":
            return self.algorithm
        if self.torus is None or (self.mpi is not None and nbytes < self.torus_min_bytes):
            return "mpi"
        return "torus"

    # ---- allreduce ----
    def allreduce(self, x, output, op, prescale, postscale, what):
        inplace = output is x
        src = wrap(x, what, inplace)
        require_reducible(src, what)
        out, dst = (x, src) if inplace else host_ops.output_for(src, output, src.shape, what)
        self._allreduce(src.ptr, dst.ptr, src.count, src.code, src.itemsize, op, prescale, postscale, what, None,
                        src.shape)
        return out

    def allreduce_raw(self, ptr, count, code, op, prescale, postscale, what, divisor=None, dst_ptr=None):
        self._allreduce(ptr, ptr if dst_ptr is None else dst_ptr, count, code, host_ops.itemsize(code), op, prescale,
                        postscale, what, divisor, (count,))

    def _allreduce(self, ptr, dst_ptr, count, code, esize, op, prescale, postscale, what, divisor, shape,
                   kind="allreduce"):
        if self.broken:
            raise BrokenCommunicatorError("%s: unusable after an earlier failure: %s" % (what, self.broken))
        divisor = (self.size if op == ops.Average else 1) if divisor is None else divisor
        # The kind tells reducescatter (an allreduce here) from allreduce.
        shape_tag = hash((disagreement.KIND[kind], code) + tuple(shape)) & host_ops.MASK
        algo = self._choose(count * esize)
        try:
            if algo == "torus":
                self.torus.allreduce(ptr, dst_ptr, count, code, esize, op, prescale, postscale, divisor, what,
                                     shape_tag)
                return
            self._agree(signature(count, code, int(op), prescale, postscale, divisor, shape_tag), what)
        except MismatchError:
            raise self._disagreement(what, disagreement.words(kind, code, shape, int(op), prescale,
                                                              postscale)) from None
        from shmcomm._native import ffi

        if dst_ptr != ptr:
            ffi.memmove(dst_ptr, ptr, count * esize)
        raw = np.frombuffer(ffi.buffer(dst_ptr, count * esize), dtype=np.uint8)
        if algo == "ring":
            from shmcomm.algorithms.ring import ring_allreduce

            ring_allreduce(self.mpi, raw, code, op, prescale, postscale, divisor)
        else:
            from shmcomm.algorithms.mpi_native import mpi_allreduce

            mpi_allreduce(self.mpi, raw, code, op, prescale, postscale, divisor)

    def _agree(self, sig, what):
        """Across hosts, before MPI carries a collective: raises MismatchError on every rank if they disagree, and
        TimeoutError if one does not come (MPI itself would check neither)."""
        if self.broken:
            raise BrokenCommunicatorError("%s: unusable after an earlier failure: %s" % (what, self.broken))
        status, culprit = self.torus.agree(sig, what) if self.torus is not None else self.agreement.agree(sig)
        if status != OK:
            raise MismatchError(what) if status == MISMATCH else ShmCommError(failure_text(what, culprit))

    def _disagreement(self, what, mine, buf=None):
        """The error every rank raises after a mismatch, naming what each rank passed."""
        every = disagreement.gather(mine, self.mpi, self.host, self.tuning.timeout_s)
        if every is None and self.mpi is not None:
            self.broken = "a rank did not take part in describing a disagreement"
        names = {buf.dtype_key(): buf.type_name()} if buf is not None else None
        return disagreement.error(what, mine, every, names)

    def _checked(self, what, sig, mine, buf):
        try:
            self._agree(sig, what)
        except MismatchError:
            raise self._disagreement(what, mine, buf) from None

    # ---- the rest: MPI across hosts, shared memory on one host. Each starts with the agreement, so that ranks
    # calling different collectives find out as surely as ranks passing different tensors. ----
    def broadcast(self, x, output, root, what):
        src = wrap(x, what, writable=output is x)
        if output is not None and output is not x:  # local checks first: after the agreement, one rank's error
            host_ops.output_for(src, output, src.shape, what)  # would leave the others waiting in MPI
        self._checked(what, signature(lib.SMC_COLL_BROADCAST, src.dtype_key(), root, *src.shape), disagreement.words(
            "broadcast", src.dtype_key(), src.shape, root=root), src)
        if self.mpi is None:
            return self.host.broadcast(x, output, root, what)
        from shmcomm.algorithms import mpi_native

        return mpi_native.broadcast(self.mpi, x, output, root, what)

    def allgather(self, x, what):
        self._check_rows(x, lib.SMC_COLL_ALLGATHERV, what)
        if self.mpi is None:
            return self.host.allgather(x, what)
        from shmcomm.algorithms import mpi_native

        return mpi_native.allgather(self.mpi, x, what)

    def _check_rows(self, x, kind, what):
        """allgather and alltoall: the ranks' first dimensions may differ, the rest and the dtype may not."""
        src = wrap(x, what)
        shape = tuple(src.shape) or (1,)
        mine = disagreement.words(disagreement.KINDS[kind], src.dtype_key(), (-1,) + shape[1:])
        self._checked(what, signature(kind, src.dtype_key(), *shape[1:]), mine, src)

    def reducescatter(self, x, op, prescale, postscale, what):
        """The allreduce, then this rank's rows: twice the traffic of a true reduce-scatter, but the torus's."""
        src = wrap(x, what)
        require_reducible(src, what)
        if len(src.shape) == 0:
            raise InvalidArgumentError("%s: a tensor with at least one dimension is required" % what)
        total, dst = host_ops.output_for(src, None, src.shape, what)
        self._allreduce(src.ptr, dst.ptr, src.count, src.code, src.itemsize, op, prescale, postscale, what, None,
                        src.shape, kind="reducescatter")
        rows = src.shape[0]
        share = [rows // self.size + (1 if r < rows % self.size else 0) for r in range(self.size)]
        start = sum(share[:self.rank])
        mine = total[start:start + share[self.rank]]
        return mine.clone() if src.is_torch else mine.copy()

    def alltoall(self, x, splits, what):
        self._check_rows(x, lib.SMC_COLL_ALLTOALLV, what)
        if self.mpi is None:
            return self.host.alltoall(x, splits, what)
        from shmcomm.algorithms import mpi_native

        return mpi_native.alltoall(self.mpi, x, splits, what)

    def barrier(self, what="barrier"):
        self._checked(what, signature(lib.SMC_COLL_BARRIER), disagreement.words("barrier"), None)
        if self.mpi is None:
            self.host.barrier(what)

    def allgather_bytes(self, payload):
        if self.mpi is None:
            return self.host.allgather_bytes(payload)
        if self.broken:
            raise BrokenCommunicatorError("negotiation: unusable after an earlier failure: %s" % self.broken)
        from shmcomm.algorithms.mpi_native import allgather_bytes
        from shmcomm.exceptions import TimeoutError

        try:
            return allgather_bytes(self.mpi, payload, self.tuning.timeout_s)
        except TimeoutError as error:
            self.broken = str(error)  # its allgather is still pending on the world
            raise

    def set_spin(self, spin_us):
        self.host.set_spin(spin_us)

    # The doorbell reaches this host's ranks; across hosts the engine's cycle time bounds the wait.
    @property
    def doorbell_reaches_all(self):
        return self.mpi is None

    def ring_doorbell(self, everyone=False):
        self.host.ring_doorbell(everyone)

    def doorbell(self):
        return self.host.doorbell()

    def wait_doorbell(self, seen, timeout_s):
        return self.host.wait_doorbell(seen, timeout_s)

    def close(self):
        for comm in self.closables:
            comm.close()
        self.host.close()
