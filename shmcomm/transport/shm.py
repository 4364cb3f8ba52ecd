# SPDX-License-Identifier: Apache-2.0
"""The shared-memory transport: ranks of one host meeting in a segment owned by the C core (csrc/coll/).

Each call is one C call; this module only converts sizes to C arrays and failures to exceptions. It is on the
latency path of everything (a small allreduce costs a few microseconds): keep it free of avoidable work."""
import numpy as np

from shmcomm._native import error_for, ffi, lib, quick_function
from shmcomm.startup.log import logger as log
from shmcomm.vocabulary.exceptions import RankFailure
from shmcomm.transport import Transport, allgather_bytes_over

REASON_BYTES = lib.SMC_REASON_MAX - 1  # what peers read of a refusal's reason, less the NUL


def _check(rc, what):
    """Raises the failure of a step the core returned `rc` for."""
    if rc != 0:
        raise _error(rc, what)


def _error(rc, what):
    """The exception for a failed step: the core's (built from its failure data), its text prefixed with the
    caller's name for the call where the core's own does not mention it. A dead rank's text stands as it is. The
    core has told the peers of every failure of its own checks (smc_coll_refuse): `told_peers` says so."""
    error = error_for(rc)
    if what not in str(error) and not isinstance(error, RankFailure):
        error.args = ("%s: %s" % (what, error),) + error.args[1:]
    error.told_peers = True
    return error


class WindowMemory:
    """A shared buffer's memory as numpy sees it (the array interface): the array keeps this object, and so the
    buffer's reference, alive, whatever views of it are taken. `shared`: whether every rank maps it."""

    def __init__(self, window, nbytes):
        self.window = window
        self.shared = bool(lib.smc_window_shared(window))
        self.__array_interface__ = {"data": (int(ffi.cast("uintptr_t", lib.smc_window_base(window))), False),
                                    "shape": (nbytes,), "typestr": "|u1", "version": 3}


class AbandonWord:
    """A word another thread sets while init waits in the core, where Python cannot be asked: 1 when the world
    being formed will not be (a newer one replaced it)."""

    def __init__(self):
        self.cdata = ffi.new("uint32_t[1]")

    def set(self, abandoned):
        self.cdata[0] = 1 if abandoned else 0


class QuickCalls:
    """A numpy array's common case of each collective in one C call, arrays and all (csrc/py/quick_calls.c), bound to
    one communicator: allreduce(x, out, op, prescale, postscale), broadcast(x, out, root), allgather(x, out),
    alltoall(x, out, splits), reducescatter(x, out, op, prescale, postscale); `op` is Horovod's number. Each returns
    the result, NotImplemented where the full path must decide (nothing was done), or a failed step's code; allgather
    and alltoall return None where `out` turned out not to fit. Each is None where this build has none."""

    __slots__ = ("allreduce", "broadcast", "allgather", "alltoall", "reducescatter")

    def __init__(self, bound):
        for which, name in enumerate(self.__slots__):
            setattr(self, name, quick_function(which, bound))


class SharedMemory(Transport):
    """A communicator over some ranks of this host: all of them, or a subset (a process set, a row or column of a
    logical grid). `ranks` are the job ranks it holds, in order; `rank` is this process's index among them.
    `arena`: whether the segment holds the Soft Memory Box arena (only a host's main communicator does).
    `abandon`: None, or an AbandonWord that another thread sets when the world being formed will not be (init then
    raises AbandonedError instead of waiting for ranks that went on to a newer world); kept for as long as init runs."""

    carrier = "shared memory"

    doorbell_reaches_all = True  # every rank of this communicator shares the segment

    def __init__(self, topology, tuning, generation, ranks=None, suffix="", arena=False, abandon=None):
        self.topology = topology
        self.tuning = tuning
        self.ranks = list(range(topology.size)) if ranks is None else list(ranks)
        self.rank = self.ranks.index(topology.rank)
        self.size = len(self.ranks)
        self._token = ffi.new("char[]", (topology.token + suffix).encode())
        cfg = ffi.new("smc_config_t *")
        cfg.token = self._token
        cfg.generation = generation
        cfg.rank = self.rank
        cfg.size = self.size
        cfg.start_timeout_s = tuning.start_timeout_s
        cfg.timeout_s = tuning.timeout_s
        cfg.liveness_s = tuning.liveness_s
        cfg.slot_bytes = tuning.slot_bytes
        cfg.small_bytes = tuning.small_bytes
        cfg.arena_bytes = tuning.arena_bytes if arena else 0
        cfg.spin_us = tuning.spin_us
        cfg.yield_us = tuning.yield_us
        cfg.single_copy_bytes = tuning.single_copy_bytes
        cfg.broadcast_single_copy_bytes = tuning.broadcast_single_copy_bytes
        cfg.piece_bytes = tuning.piece_bytes
        cfg.piece_probed = tuning.piece_probed
        cfg.pull_bytes = tuning.pull_bytes
        cfg.shared_from_bytes = tuning.shared_from_bytes
        cfg.cache_bytes = tuning.cache_bytes
        cfg.shared_cache_bytes = tuning.shared_cache_bytes
        cfg.single_copy_probed = tuning.single_copy_probed
        cfg.huge_pages = tuning.huge_pages
        cfg.pull_probed = tuning.pull_probed
        cfg.race_pause_us = tuning.race_pause_us
        job_ranks = ffi.new("int[]", self.ranks)  # so that the core's messages and failure data name job ranks
        cfg.job_ranks = job_ranks
        cfg.abandon = ffi.NULL if abandon is None else abandon.cdata
        out = ffi.new("smc_comm_t **")
        _check(lib.smc_comm_create(cfg, out), "init")
        self.handle = out[0]
        self.address = int(ffi.cast("uintptr_t", self.handle))  # for compiled callers (the quick calls); 0 once closed
        # The counts allgather, alltoall and reducescatter work out, reused by every call: one communicator runs one
        # collective at a time, and a fresh array per call is a measurable share of a small one.
        self.every = ffi.new("uint64_t[]", self.size)  # allgather's rows per rank
        self.sends = ffi.new("uint64_t[]", self.size)  # alltoall's rows this rank sends each rank
        self.matrix = ffi.new("uint64_t[]", self.size * self.size)  # [j * size + i]: rows rank j sends rank i
        self.counts = ffi.new("uint64_t[]", self.size)  # reducescatter's elements of each rank's share
        self._bound = [self.address, self.size, self.rank] + [
            int(ffi.cast("uintptr_t", a)) for a in (self.every, self.sends, self.matrix, self.counts)] + [np.empty]
        self.quick = QuickCalls(self._bound)
        # Single copy is a speed path with a silent fallback: say which one this machine took.
        if lib.smc_comm_single_copy(self.handle):
            log.debug("shared memory of %d ranks: pieces from %d bytes%s (broadcasts from %d) move by single copy "
                      "(process_vm_readv and process_vm_writev)", self.size,
                      lib.smc_comm_single_copy_from(self.handle, 0),
                      " where that proves cheaper than staging" if lib.smc_comm_single_copy_learned(self.handle)
                      else "", lib.smc_comm_single_copy_from(self.handle, 1))
            pulling = lib.smc_comm_pull_from(self.handle)
            log.debug("allreduces %s" % ("from %d bytes read the peers' inputs and write the reduced pieces into "
                                         "their outputs (where init found the kernel's copy slow: when that proves "
                                         "cheaper than staging)" % pulling if pulling else
                                         "gather their reduced pieces through the staging halves"))
        else:
            log.debug("shared memory of %d ranks: every size moves through the staging halves (single copy is off "
                      "or not allowed here)", self.size)

    @staticmethod
    def failure(rc, what):
        """The exception for a step that failed with code `rc` (see _error)."""
        return _error(rc, what)

    def shared_buffer(self, nbytes, tag, what):
        """`nbytes` of memory, a uint8 array, that every rank of this communicator maps (csrc/coll/window.c), so
        that an in-place allreduce inside it reads and writes the peers' buffers directly. Collective: every rank asks
        for the same size. Where some rank cannot map the others' (or SHMCOMM_SHARED_BUFFERS=0) it is plain memory of
        this process. The memory lives as long as the array (and its views), also past shutdown. `tag`: any 64-bit
        value (a digest of shapes) that must be equal on every rank."""
        out = ffi.new("smc_window_t **")
        _check(lib.smc_window_create(self.handle, nbytes, tag, 1 if self.tuning.shared_buffers else 0, out), what)
        memory = WindowMemory(ffi.gc(out[0], lib.smc_window_drop), nbytes)
        if not memory.shared:
            log.debug("%s: %d bytes stay this rank's own memory (%s)", what, nbytes, "SHMCOMM_SHARED_BUFFERS=0"
                      if not self.tuning.shared_buffers else "some rank could not map its peers' buffers")
        return np.asarray(memory)

    def shared_calls(self):
        """How many collectives read and wrote shared buffers directly (for logs and tests)."""
        return lib.smc_comm_shared_calls(self.handle)

    def single_copy_calls(self):
        """How many allgathers, alltoalls and broadcasts moved by single copy (the core's count)."""
        return lib.smc_comm_single_copy_calls(self.handle)

    def pulled_calls(self):
        """How many allreduces and reduce-scatters read the peers' inputs by single copy (for tests)."""
        return lib.smc_comm_pulled_calls(self.handle)

    def pieces(self):
        """How many pieces, a step each, the staged and pulled allreduces and reduce-scatters took (for tests)."""
        return lib.smc_comm_pieces(self.handle)

    def waits(self):
        """(waits that yielded to a peer on this rank's CPU, waits that polled with every peer elsewhere, moves of
        this rank to another CPU away from a lower rank) of the steps, where waiters yield (for tests)."""
        counts = ffi.new("uint64_t[3]")
        lib.smc_comm_waits(self.handle, counts, counts + 1, counts + 2)
        return counts[0], counts[1], counts[2]

    def huge_collapses(self):
        """How many of this rank's buffers were collapsed into huge pages for the peers' kernel copies (for tests)."""
        return lib.smc_comm_huge_collapses(self.handle)

    # ---- steps ----
    def allreduce(self, src, dst, count, dtype, op, prescale, postscale, divisor, tag, what):
        _check(lib.smc_allreduce(self.handle, src, dst, count, dtype, op, prescale, postscale, divisor, tag), what)

    # Each checks its return code inline: a helper call costs a measurable share of a small step.
    def reducescatter(self, src, dst, counts, dtype, op, prescale, postscale, divisor, tag, what):
        """`counts`: elements per rank, a sequence or a uint64_t[] the caller keeps for calls of the same split."""
        if not isinstance(counts, ffi.CData):
            counts = ffi.new("uint64_t[]", counts)
        _check(lib.smc_reducescatter(self.handle, src, dst, counts, dtype, op, prescale, postscale, divisor, tag), what)

    def broadcast(self, src, dst, nbytes, root, tag, what):
        _check(lib.smc_broadcast(self.handle, src, dst, nbytes, root, tag), what)

    def allgatherv(self, src, nbytes, dst, sizes, tag, what):
        _check(lib.smc_allgatherv(self.handle, src, nbytes, dst, ffi.new("uint64_t[]", sizes), tag), what)

    def alltoallv(self, src, send_sizes, dst, recv_sizes, tag, what):
        _check(lib.smc_alltoallv(self.handle, src, ffi.new("uint64_t[]", send_sizes), dst,
                                 ffi.new("uint64_t[]", recv_sizes), tag), what)

    # Allgather and alltoall whose sizes travel with the first window (csrc/coll/allgather.c, alltoall.c): `*_begin`
    # fills `every` (a uint64 array: rows per rank, or the size x size matrix of rows sent) and must be followed on
    # every rank by `*_finish`; dst NULL takes part without keeping anything.
    def allgather_begin(self, src, rows, row_bytes, every, tag, what):
        _check(lib.smc_allgather_begin(self.handle, src, rows, row_bytes, tag, every), what)

    def allgather_finish(self, src, dst, row_bytes, every, what):
        _check(lib.smc_allgather_finish(self.handle, src, dst, row_bytes, every), what)

    def alltoall_begin(self, src, send_rows, row_bytes, matrix, tag, what):
        _check(lib.smc_alltoall_begin(self.handle, src, send_rows, row_bytes, tag, matrix), what)

    def alltoall_finish(self, src, dst, row_bytes, matrix, what):
        _check(lib.smc_alltoall_finish(self.handle, src, dst, row_bytes, matrix), what)

    def barrier(self, what="barrier"):
        _check(lib.smc_barrier(self.handle), what)

    def refuse(self, kind, reason, what):
        """Takes the first step of collective `kind` (lib.SMC_COLL_*) as a refusal: every peer's call fails at once
        with PeerArgumentError naming this rank and `reason`."""
        _check(lib.smc_coll_refuse(self.handle, kind, reason.encode("utf-8", "replace")[:REASON_BYTES]), what)

    def allgather_bytes(self, payload):
        def gatherv(mine, every, sizes):
            self.allgatherv(ffi.from_buffer(mine) if mine else ffi.NULL, len(mine),
                            ffi.from_buffer(every) if every else ffi.NULL, sizes, 0, "negotiation")
        return allgather_bytes_over(gatherv, self.size, payload)

    def native_entry_points(self):
        """(this segment's handle, {name: address of the core's function}) as integers, for compiled code in another
        module that runs the same collectives on the same segment (shmcomm.jax's XLA handler)."""
        names = ("allreduce", "reducescatter", "broadcast", "allgatherv", "alltoallv", "barrier", "last_error")
        return (int(ffi.cast("intptr_t", self.handle)),
                {name: int(ffi.cast("intptr_t", ffi.addressof(lib, "smc_" + name))) for name in names})

    # ---- liveness, doorbells, waiting ----
    def failed_ranks(self):
        mask = lib.smc_comm_failed_ranks(self.handle)  # 0 once closed (NULL)
        return [self.ranks[r] for r in range(self.size) if mask >> r & 1]

    def set_spin(self, spin_us, yield_us):
        lib.smc_comm_set_spin(self.handle, spin_us, yield_us)

    def ring_doorbell(self, everyone=False):
        lib.smc_comm_doorbell_ring(self.handle, -1 if everyone else self.rank)

    def doorbell(self):
        return lib.smc_comm_doorbell_value(self.handle)

    def wait_doorbell(self, seen, timeout_s):
        return lib.smc_comm_doorbell_wait(self.handle, seen, timeout_s)

    def mark_failed(self):
        """This rank leaves because of an error of its own: peers will say it failed (smc_comm_mark_failed)."""
        if self.handle != ffi.NULL:
            lib.smc_comm_mark_failed(self.handle)

    def close(self):
        if self.handle != ffi.NULL:
            self.address = self._bound[0] = 0  # the quick calls answer NotImplemented from now on
            lib.smc_comm_destroy(self.handle)
            self.handle = ffi.NULL  # calls after close are refused by the core (a NULL communicator)
