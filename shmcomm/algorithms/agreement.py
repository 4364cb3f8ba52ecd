# SPDX-License-Identifier: Apache-2.0
"""Agreement across hosts: before MPI carries a collective, every rank learns whether all ranks called it with the
same arguments and whether one of them failed.

MPI neither checks arguments nor times out: ranks that pass different counts to one allreduce corrupt each other's
data or wait forever. So a cross-host collective starts with an exchange of 32-byte headers by recursive doubling
(log2(N) rounds; when N is not a power of two, the first 2(N - 2^k) ranks fold in pairs first and the result is
sent back to them last). A header holds a signature (a hash of what must agree: collective, dtype, shape, op,
scale factors), a status (OK, MISMATCH or FAILED) and the lowest failed rank. Combining two headers is commutative
and associative, so every rank ends with the same verdict, whatever the order of the rounds.

A small allreduce rides in the same messages (`allreduce`): its data follows the header and each round also reduces
the partner's data, so the check costs no extra message where latency matters. Every wait has a deadline
(SHMCOMM_TIMEOUT), kept by a watchdog thread."""
import os
import threading
import time
import weakref

import numpy as np

from shmcomm import host_ops, ops
from shmcomm._native import error_for, ffi, lib
from shmcomm.exceptions import BrokenCommunicatorError, TimeoutError

OK, MISMATCH, FAILED = 0, 1, 2
HEADER_BYTES = 32     # uint64 words: signature, status, lowest failed rank + 1 (0: none), data bytes that follow
_TAG = 0x5AC          # apart from the tags of the ring's messages on the same communicator
_WATCH_PERIOD_S = 0.1
_CLOSE_POLL_S = 0.01  # how long poll() polls before it sleeps


def signature(*values):
    """A 64-bit hash of numbers, equal on every rank for equal values (no strings: their hashes differ per process)."""
    return hash(values) & host_ops.MASK


def combine(sig, status, culprit, other_sig, other_status, other_culprit):
    """Two headers into one: the worse status; two OKs with different signatures make a MISMATCH."""
    worst = max(status, other_status)
    if worst == OK and sig != other_sig:
        worst = MISMATCH
    culprits = [c for c in (culprit, other_culprit) if c]
    return sig, worst, min(culprits) if culprits else 0


def failure_text(what, culprit):
    """What the other ranks say when a cross-host step failed on rank culprit - 1 (0: unknown)."""
    return "%s: the cross-host step failed on %s (its own error says why); this collective did not complete" % (
        what, "rank %d" % (culprit - 1) if culprit else "another rank")


class Watchdog:
    """Deadlines for MPI's blocking waits, which have none: a thread that wakes ten times a second cancels the
    receive a wait is blocked on once its deadline has passed (MPI_Cancel of a receive is what every MPI supports).
    The wait itself stays MPI's own, not a polling loop in Python, which costs the CPU time that oversubscribed ranks
    share; only where threads may not call MPI (below MPI_THREAD_MULTIPLE) the receive is polled."""

    def __init__(self):
        from mpi4py import MPI

        self._lock = threading.Lock()
        self._armed = None  # (deadline, request) of the wait in progress
        self._thread = None
        self._threads_may_call_mpi = MPI.Query_thread() == MPI.THREAD_MULTIPLE

    def wait(self, request, deadline, late):
        """Waits for a receive request; cancels it at `deadline` and raises what late() returns."""
        from mpi4py import MPI

        if not self._threads_may_call_mpi:  # poll instead
            wait_all([request], deadline, late)
            return
        if self._thread is None:  # it ends once its watchdog is gone (shutdown, init again)
            self._thread = threading.Thread(target=_watch, args=(weakref.ref(self),), name="shmcomm-watchdog",
                                            daemon=True)
            self._thread.start()
        armed = (deadline, request)
        self._armed = armed
        status = MPI.Status()
        try:
            request.Wait(status)
        finally:
            with self._lock:
                self._armed = None
        if status.Is_cancelled():
            raise late()

    def cancel_if_late(self):
        armed = self._armed
        if armed is not None and time.monotonic() > armed[0]:
            with self._lock:
                if self._armed is armed:  # still waiting (the wait disarms under this lock once it returns)
                    try:
                        armed[1].Cancel()
                    except Exception:  # it completed at this very moment: nothing to cancel
                        pass


def _watch(ref):
    while True:
        time.sleep(_WATCH_PERIOD_S)
        watchdog = ref()
        if watchdog is None:
            return
        watchdog.cancel_if_late()
        del watchdog


def poll(requests, deadline, late):
    """Waits for MPI requests that should complete soon: polls closely for _CLOSE_POLL_S, yielding the core in
    between (MPI's own waits poll too), then with sleeps until `deadline` (wait_all)."""
    from mpi4py import MPI

    if MPI.Request.Testall(requests):
        return
    until = time.monotonic() + _CLOSE_POLL_S
    while time.monotonic() < until:
        os.sched_yield()
        if MPI.Request.Testall(requests):
            return
    wait_all(requests, deadline, late)


def wait_all(requests, deadline, late):
    """Waits for MPI requests until `deadline`, polling; then raises what late() returns, leaving them pending (the
    caller's communicator is then unusable)."""
    from mpi4py import MPI

    pause = 1e-4
    while not MPI.Request.Testall(requests):
        if time.monotonic() > deadline:
            raise late()
        time.sleep(pause)
        pause = min(2 * pause, 1e-2)


class Agreement:
    """Recursive-doubling agreement (and small allreduce) over an MPI communicator. Owns its message buffers: a
    small allreduce's data is placed in message(nbytes) by the caller, and the result is left there."""

    def __init__(self, mpi_comm, timeout_s, capacity=0, what="across hosts"):
        from mpi4py import MPI

        self.comm = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.world_ranks = mpi_comm.allgather(MPI.COMM_WORLD.Get_rank())
        self._byte = MPI.BYTE
        self.timeout_s = timeout_s
        self.what = what
        self.broken = None
        self.fold_into, self.fold_from, self.partners = _schedule(self.rank, self.size)
        # Partners may send a header and up to `capacity` bytes of data whatever this rank's own message is.
        self._send = np.zeros(HEADER_BYTES + capacity, dtype=np.uint8)
        self._recv = np.zeros(HEADER_BYTES + capacity, dtype=np.uint8)
        self._send_words = self._send[:HEADER_BYTES].view(np.uint64)
        self._recv_words = self._recv[:HEADER_BYTES].view(np.uint64)
        self._send_ptr, self._recv_ptr = ffi.from_buffer(self._send), ffi.from_buffer(self._recv)
        self._pair = ffi.new("void *[2]")
        self._watchdog = Watchdog()

    def message(self, nbytes):
        """The message buffer: HEADER_BYTES of header, then room for `nbytes` (at most `capacity`) of data, where
        the caller puts a small allreduce's input and finds its result. After a call the header's words 1 and 2 hold
        the verdict."""
        if nbytes > self._send.nbytes - HEADER_BYTES:
            raise ValueError("%d bytes do not fit the agreement's %d" % (nbytes, self._send.nbytes - HEADER_BYTES))
        return self._send_ptr

    @property
    def header(self):
        return self._send_words

    def agree(self, sig, status=OK, culprit=0):
        """(status, culprit) combined over every rank of the communicator; culprit is a failed world rank + 1."""
        return self._run(sig, status, culprit, 0, None, None)

    def allreduce(self, sig, status, culprit, nbytes, code, op, postscale=1.0, divisor=1):
        """agree(), and while the verdict stays OK, reduces the `nbytes` of data in message() over every rank in
        place."""
        verdict = self._run(sig, status, culprit, nbytes, code, op)
        if verdict[0] == OK and nbytes:
            host_ops.scale_raw(self._send_ptr + HEADER_BYTES, nbytes // host_ops.itemsize(code), code, postscale,
                               divisor)
        return verdict

    def _run(self, sig, status, culprit, nbytes, code, op):
        if self.broken:
            raise BrokenCommunicatorError("%s: unusable after an earlier failure: %s" % (self.what, self.broken))
        words = self._send_words
        words[0], words[1], words[2], words[3] = sig, status, culprit, nbytes
        if self.size == 1:
            return status, culprit
        deadline = time.monotonic() + self.timeout_s
        try:
            if self.fold_into is not None:  # hand everything to the partner; its next message is the verdict
                self._exchange(self.fold_into, deadline, send=True, receive=True)
                self._adopt(nbytes)
            else:
                if self.fold_from is not None:
                    self._exchange(self.fold_from, deadline, send=False, receive=True)
                    self._merge(nbytes, code, op, self.fold_from)
                for peer in self.partners:
                    self._exchange(peer, deadline, send=True, receive=True)
                    self._merge(nbytes, code, op, peer)
                if self.fold_from is not None:
                    self._exchange(self.fold_from, deadline, send=True, receive=False)
        except BaseException as error:  # a timeout, or MPI's own error: the rounds are out of step from here on
            self.broken = str(error) or type(error).__name__
            raise
        return int(words[1]), int(words[2])

    def _exchange(self, peer, deadline, send, receive):
        words = self._send_words
        length = HEADER_BYTES + (int(words[3]) if words[1] == OK else 0)
        incoming = self.comm.Irecv([self._recv, self._recv.nbytes, self._byte], peer, _TAG) if receive else None
        outgoing = self.comm.Isend([self._send, length, self._byte], peer, _TAG) if send else None
        if incoming is not None:
            self._watchdog.wait(incoming, deadline, lambda: self._late(peer))
        if outgoing is not None:
            # The peer posted its receive before it sent (or before it handed back a fold), so this completes as
            # soon as the bytes are through. (Sends are not cancelled: not every MPI can.)
            poll([outgoing], deadline, lambda: self._late(peer))

    def _merge(self, nbytes, code, op, peer):
        mine, theirs = self._send_words, self._recv_words
        both_ok = mine[1] == OK and theirs[1] == OK and mine[0] == theirs[0]
        _, mine[1], mine[2] = combine(int(mine[0]), int(mine[1]), int(mine[2]), int(theirs[0]), int(theirs[1]),
                                      int(theirs[2]))
        if both_ok and mine[3] != theirs[3]:  # same arguments, different paths: settings that differ per host
            both_ok, mine[1] = False, MISMATCH
        if both_ok and nbytes:
            # The lower rank's data first, on both sides, so both compute the very same bits.
            first, second = (self._send_ptr, self._recv_ptr) if self.rank < peer else (self._recv_ptr, self._send_ptr)
            self._pair[0], self._pair[1] = first + HEADER_BYTES, second + HEADER_BYTES
            rc = lib.smc_reduce(self._send_ptr + HEADER_BYTES, self._pair, 2, nbytes // host_ops.itemsize(code), code,
                                ops.C_OP[op], 1.0, 1.0, 1)
            if rc != 0:
                raise error_for(rc, self.what)

    def _adopt(self, nbytes):
        """A folded rank takes its partner's final header, and the data with it."""
        self._send_words[:] = self._recv_words
        if self._recv_words[1] == OK and nbytes:
            ffi.memmove(self._send_ptr + HEADER_BYTES, self._recv_ptr + HEADER_BYTES, nbytes)

    def _late(self, peer):
        return TimeoutError("%s: timed out after %.0f s waiting for rank %d: it is stuck, or it called a different "
                            "collective (SHMCOMM_TIMEOUT sets the limit)" % (self.what, self.timeout_s,
                                                                             self.world_ranks[peer]))


def _schedule(rank, size):
    """(fold_into, fold_from, partners): with p the largest power of two <= size and e = size - p, ranks 2i < 2e hand
    their header to 2i + 1 and take the verdict back; the other p ranks run log2(p) rounds of recursive doubling."""
    if size <= 1:
        return None, None, []
    p = 1 << (size.bit_length() - 1)
    extra = size - p
    if rank < 2 * extra and rank % 2 == 0:
        return rank + 1, None, []
    virtual = rank // 2 if rank < 2 * extra else rank - extra
    real = [2 * v + 1 if v < extra else v + extra for v in range(p)]
    partners = [real[virtual ^ bit] for bit in (1 << k for k in range(p.bit_length() - 1))]
    return None, (rank - 1 if rank < 2 * extra else None), partners


class ShmAgreement:
    """The same contract over a shared-memory communicator (a logical grid's column on one host): headers are
    allgathered, every rank combines them all; a small allreduce is the agreement, then the core's allreduce."""

    def __init__(self, comm, capacity=0, what="torus column"):
        self.comm = comm
        self.what = what
        self._headers = np.zeros((comm.size, 4), dtype=np.uint64)
        self._sizes = ffi.new("uint64_t[]", [HEADER_BYTES] * comm.size)
        self._grow(capacity)

    def _grow(self, capacity):
        self._buffer = np.zeros(HEADER_BYTES + capacity, dtype=np.uint8)
        self.header = self._buffer[:HEADER_BYTES].view(np.uint64)
        self._ptr = ffi.from_buffer(self._buffer)

    def message(self, nbytes):
        if nbytes > self._buffer.nbytes - HEADER_BYTES:
            self._grow(nbytes)
        return self._ptr

    def agree(self, sig, status=OK, culprit=0):
        self.header[:3] = (sig, status, culprit)
        rc = lib.smc_allgatherv(self.comm.handle, self._ptr, HEADER_BYTES, ffi.from_buffer(self._headers),
                                self._sizes, 0)
        if rc != 0:
            raise error_for(rc, self.what)
        verdict = (int(self._headers[0, 0]), int(self._headers[0, 1]), int(self._headers[0, 2]))
        for r in range(1, self.comm.size):
            verdict = combine(*verdict, *(int(v) for v in self._headers[r, :3]))
        self.header[1], self.header[2] = verdict[1], verdict[2]
        return verdict[1], verdict[2]

    def allreduce(self, sig, status, culprit, nbytes, code, op, postscale=1.0, divisor=1):
        verdict = self.agree(sig, status, culprit)
        if verdict[0] == OK and nbytes:
            host_ops.allreduce_raw(self.comm, self._ptr + HEADER_BYTES, nbytes // host_ops.itemsize(code), code, op,
                                   1.0, postscale, self.what, divisor=divisor)
        return verdict
