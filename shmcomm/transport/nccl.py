# SPDX-License-Identifier: Apache-2.0
"""NCCL as a transport: one NCCL communicator, its collectives on a caller's CUDA stream, and a bounded wait.

It speaks in device pointers (ints), element counts, NCCL's dtype and op names (nccl_library.DTYPES, OPS) and CUDA
stream handles (ints: torch's `stream.cuda_stream`), so that nothing here needs torch or the CUDA runtime; whoever
calls it makes the communicator's device current first (NCCL takes the calling thread's current device when a
communicator is created). It does not take the host transports' interface: NCCL's calls enqueue and return, so each
piece of work ends with a separate bounded wait (NcclComm.wait)."""
import contextlib
import time

from shmcomm.vocabulary.exceptions import BrokenCommunicatorError, RankFailure, ShmCommError, TimeoutError
from shmcomm.transport.nccl_library import DTYPES, IN_PROGRESS, OPS, NcclError, load

_SPIN_S = 50e-6       # poll this long without sleeping: small collectives finish within it
_SLEEP_S = 200e-6     # then sleep this long between polls (ranks may share cores)
_LIVENESS_S = 0.1     # how often a long wait asks the host transport which ranks have died


def wait_for(done, async_error, timeout_s, failed_ranks=None, clock=time.monotonic, sleep=time.sleep):
    """Polls until `done()` is true. Returns None when it is; otherwise the reason it stopped: ("error", code) when
    `async_error()` reports an NCCL error, ("dead", ranks) when `failed_ranks()` names dead ranks, ("timeout",
    seconds) when `timeout_s` passed. ncclInProgress is not an error (non-blocking communicators report it)."""
    started = clock()
    last_liveness = started
    while True:
        if done():
            return None
        code = async_error()
        if code not in (0, IN_PROGRESS):
            return "error", code
        now = clock()
        if failed_ranks is not None and now - last_liveness >= _LIVENESS_S:
            last_liveness = now
            dead = list(failed_ranks())
            if dead:
                return "dead", dead
        if now - started > timeout_s:
            return "timeout", now - started
        if now - started > _SPIN_S:
            sleep(_SLEEP_S)


def _ranks_text(ranks):
    return "ranks %s" % ", ".join(str(r) for r in ranks)


class NcclComm:
    """One NCCL communicator. `ranks`: the job ranks it holds, in its rank order (for messages); `failed_ranks`:
    the host transport's liveness (job ranks known dead), consulted while a wait lasts.

    Its life, as NCCL documents it: create() with the id that rank 0 drew and the host transport handed to the
    others; split() for the 2D torus's rows and columns; collectives that enqueue and return, in group() where they
    must launch together; wait() for each piece of work; close(): ncclCommAbort, which never waits for peers
    (ncclCommDestroy may). The communicator is a non-blocking one: creation and split (which need every rank) and a
    collective that first connects to its peers return ncclInProgress, and the call's end is polled (_settle) under
    the same deadline and liveness checks as wait(), so no NCCL call can hold the thread past SHMCOMM_TIMEOUT."""

    def __init__(self, library, handle, rank, ranks, timeout_s, failed_ranks=None, on_thread=None):
        self.library = library
        self.handle = handle
        self.rank = rank
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        self.timeout_s = timeout_s
        self.failed_ranks = failed_ranks
        self.on_thread = on_thread  # makes this communicator's device current in the calling thread (split takes it)
        self.broken = None  # the error that made it unusable
        self.grouped = None  # inside group(): None, or [] and then the first error of a call in the group
        self._splits = []
        self._status = library.ffi.new("ncclResult_t*")  # _state()'s answer, polled in every wait

    @classmethod
    def create(cls, unique_id, rank, ranks, timeout_s, failed_ranks=None, library=None, on_thread=None):
        """ncclCommInitRankConfig, non-blocking: every rank of `ranks` calls this with the same `unique_id` (bytes,
        128: rank 0's nccl_library.NcclLibrary.unique_id(), which the host transport's `allgather_bytes` distributes)
        and its own `rank` (an index in `ranks`). `on_thread()` makes the rank's device current in the calling thread
        first (NCCL takes the current device)."""
        library = library or load()
        ffi, lib = library.ffi, library.lib
        if len(unique_id) != ffi.sizeof("ncclUniqueId"):
            raise NcclError("an NCCL unique id has %d bytes, got %d" % (ffi.sizeof("ncclUniqueId"), len(unique_id)))
        uid = ffi.new("ncclUniqueId*")
        ffi.memmove(uid, unique_id, len(unique_id))
        out = ffi.new("ncclComm_t*")
        size, what = len(ranks), "ncclCommInitRank (rank %d of %d)" % (rank, len(ranks))
        if on_thread is not None:
            on_thread()
        result = lib.ncclCommInitRankConfig(out, size, uid[0], rank, library.non_blocking_config())
        if result not in (0, IN_PROGRESS):
            if out[0] != ffi.NULL:
                lib.ncclCommAbort(out[0])
            library.check(result, what)
        comm = cls(library, out[0], rank, ranks, timeout_s, failed_ranks, on_thread)
        comm._settle(what, result, joining=True)
        return comm

    def split(self, color, key, ranks):
        """ncclCommSplit: every rank of this communicator calls it; those with the same `color` form a communicator,
        ordered by `key`. `ranks`: the job ranks of this rank's new communicator, in key order."""
        self._usable("ncclCommSplit")
        ffi, lib = self.library.ffi, self.library.lib
        # A non-blocking split runs as work of this communicator and writes the new one into `out` when it ends, which
        # may be after a timeout here: `out` lives as long as this communicator.
        out = ffi.new("ncclComm_t*")
        self._splits.append(out)
        if self.on_thread is not None:
            self.on_thread()
        result = lib.ncclCommSplit(self.handle, color, key, out, self.library.non_blocking_config())
        self._check(result, "ncclCommSplit")
        try:  # NCCL answers success while the split still runs: the parent is in progress until it ends
            self._settle("ncclCommSplit", IN_PROGRESS, joining=True)
        except ShmCommError:
            if out[0] != ffi.NULL:  # the parent's abort ended the split; a child it made goes too
                lib.ncclCommAbort(out[0])
            raise
        if out[0] == ffi.NULL:
            raise NcclError("ncclCommSplit over %s ended without a communicator" % _ranks_text(self.ranks))
        comm = NcclComm(self.library, out[0], 0, ranks, self.timeout_s, self.failed_ranks, self.on_thread)
        self.library.check(comm._state(), "ncclCommSplit", comm.handle)
        rank = ffi.new("int*")
        self.library.check(lib.ncclCommUserRank(comm.handle, rank), "ncclCommUserRank", comm.handle)
        comm.rank = rank[0]
        return comm

    # ---- collectives: enqueue on `stream` and return ----
    def allreduce(self, src, dst, count, dtype, op, stream):
        self._call("ncclAllReduce", self._ptr(src), self._ptr(dst), count, DTYPES[dtype], OPS[op], self.handle,
                   self._stream(stream))

    def broadcast(self, src, dst, count, dtype, root, stream):
        self._call("ncclBroadcast", self._ptr(src), self._ptr(dst), count, DTYPES[dtype], root, self.handle,
                   self._stream(stream))

    def allgather(self, src, dst, count, dtype, stream):
        """dst holds size * count elements: rank r's `count` at r * count."""
        self._call("ncclAllGather", self._ptr(src), self._ptr(dst), count, DTYPES[dtype], self.handle,
                   self._stream(stream))

    def reducescatter(self, src, dst, count, dtype, op, stream):
        """src holds size * count elements; rank r gets the reduction of elements [r * count, (r + 1) * count)."""
        self._call("ncclReduceScatter", self._ptr(src), self._ptr(dst), count, DTYPES[dtype], OPS[op], self.handle,
                   self._stream(stream))

    def send(self, src, count, dtype, peer, stream):
        self._call("ncclSend", self._ptr(src), count, DTYPES[dtype], peer, self.handle, self._stream(stream))

    def recv(self, dst, count, dtype, peer, stream):
        self._call("ncclRecv", self._ptr(dst), count, DTYPES[dtype], peer, self.handle, self._stream(stream))

    @contextlib.contextmanager
    def group(self):
        """ncclGroupStart ... ncclGroupEnd: the calls inside are launched together (sends and receives that pair up
        must be, or they deadlock). A call that fails inside is raised after ncclGroupEnd has closed the group: the
        communicator is aborted only then (aborting it first would leave ncclGroupEnd a freed communicator)."""
        self._usable("ncclGroupStart")
        self.library.check(self.library.lib.ncclGroupStart(), "ncclGroupStart")
        self.grouped = []
        try:
            yield
        finally:  # also when the body raised something else: the group's launch is waited for all the same
            failed, self.grouped = self.grouped, None
            result = self.library.lib.ncclGroupEnd()
            if failed:
                self.abort()
                self.broken = failed[0]
                raise failed[0]
            self._check(result, "ncclGroupEnd")
            self._settle("ncclGroupEnd", result)

    # ---- completion and failure ----
    def wait(self, done, what, also=()):
        """Returns once `done()` is true (the caller's event query on the stream the calls went to); aborts the
        communicator (and `also`, communicators split from it that the same work used) and raises if an NCCL error
        appears on any of them, a rank dies or SHMCOMM_TIMEOUT passes first."""
        self._bounded_wait(done, what, (self,) + tuple(also))

    def _settle(self, what, result, joining=False, also=()):
        """After a call that returned ncclInProgress (or left the communicator in progress): waits, bounded, until its
        state is success (the call's work is then enqueued, or the communicator made). `joining`: the call needs
        every rank."""
        if result == IN_PROGRESS or (result == 0 and self._state() == IN_PROGRESS):
            comms = (self,) + tuple(also)
            self._bounded_wait(lambda: all(c._state() == 0 for c in comms), what, comms, joining)

    def _state(self):
        result = self.library.lib.ncclCommGetAsyncError(self.handle, self._status)
        return result if result != 0 else self._status[0]

    def _bounded_wait(self, done, what, comms, joining=False):
        for comm in comms:
            comm._usable(what)

        def async_error():
            for comm in comms:
                result = comm._state()
                if result not in (0, IN_PROGRESS):
                    return result
            return 0

        stopped = wait_for(done, async_error, self.timeout_s, self.failed_ranks)
        if stopped is None:
            return
        for comm in comms:
            comm.abort()
        reason, detail = stopped
        if reason == "dead":
            error = RankFailure("%s: rank %s died during the NCCL call over %s; the NCCL communicator was aborted"
                                % (what, detail[0], _ranks_text(self.ranks)), detail[0])
        elif reason == "timeout" and joining:
            error = TimeoutError("%s: not every rank of %s joined within %.0f s (SHMCOMM_TIMEOUT); a rank may have "
                                 "died or not reached this call" % (what, _ranks_text(self.ranks), self.timeout_s))
        elif reason == "timeout":
            error = TimeoutError("%s: the NCCL call over %s did not finish within %.0f s (SHMCOMM_TIMEOUT); the NCCL "
                                 "communicator was aborted" % (what, _ranks_text(self.ranks), self.timeout_s))
        else:
            error = NcclError("%s: NCCL reported an error over %s: %s (NCCL error %d); the NCCL communicator was "
                              "aborted" % (what, _ranks_text(self.ranks), self.library.error_string(detail), detail),
                              detail)
        for comm in comms:
            comm.broken = error
        raise error

    def abort(self):
        """ncclCommAbort: stops this rank's outstanding NCCL work (kernels blocked on a dead peer included) and frees
        the communicator; never waits for peers."""
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self.library.lib.ncclCommAbort(handle)
        if self.broken is None:
            self.broken = BrokenCommunicatorError("the NCCL communicator over %s was closed" % _ranks_text(self.ranks))

    close = abort

    # ---- helpers ----
    def _usable(self, what):
        if self.broken is not None:
            raise BrokenCommunicatorError("%s: the NCCL communicator over %s is unusable after an earlier failure (%s)"
                                          % (what, _ranks_text(self.ranks), self.broken))

    def _call(self, name, *args):
        self._usable(name)
        result = getattr(self.library.lib, name)(*args)
        self._check(result, name)
        if self.grouped is None:
            self._settle(name, result)  # the work is on the stream only once the call has settled

    def _check(self, result, what):
        if result not in (0, IN_PROGRESS):
            try:
                self.library.check(result, what, self.handle)
            except ShmCommError as error:
                if self.grouped is not None:  # group() aborts once ncclGroupEnd has run
                    self.grouped.append(error)
                else:
                    self.abort()
                    self.broken = error
                raise

    def _ptr(self, address):
        return self.library.ffi.cast("void*", address)

    def _stream(self, handle):
        return self.library.ffi.cast("cudaStream_t", handle)
