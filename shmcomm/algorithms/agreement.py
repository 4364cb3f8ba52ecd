# SPDX-License-Identifier: Apache-2.0
"""Agreement across hosts: before MPI carries a collective, every rank learns whether all ranks called it with the
same arguments and whether one of them failed.

MPI neither checks arguments nor times out: ranks that pass different counts to one allreduce corrupt each other's
data or wait forever. So a cross-host collective starts with an exchange of small headers (Agreement), and a small
allreduce rides in the same messages, so that the check costs no extra message where latency matters. Every wait has
a deadline (SHMCOMM_TIMEOUT, kept by transport/deadline.py); over MPI the rounds run in C where transport/crossing.py
can be built: the same rules, the same deadline, without a Python layer between MPI's calls."""
import numpy as np

from shmcomm.vocabulary import description
from shmcomm._native import error_for, ffi, lib
from shmcomm.vocabulary.exceptions import PeerArgumentError, TimeoutError
from shmcomm.transport import crossing, kernels

# Statuses, the worse the higher: REFUSED is a call that failed a rank's own checks (a bad argument there): every
# rank is in step and hears why (refusal_error); FAILED is a failed step, after which nothing more is exchanged.
OK, MISMATCH, REFUSED, FAILED = lib.SMC_AGREEMENT_OK, lib.SMC_AGREEMENT_MISMATCH, lib.SMC_AGREEMENT_REFUSED, \
    lib.SMC_AGREEMENT_FAILED
HEADER_BYTES = lib.SMC_AGREEMENT_HEADER_BYTES  # uint64 words: signature, status, lowest failed rank + 1, data bytes
_REASON_WORDS = 64    # a refusal's reason as int64 words (512 bytes of UTF-8)
_TAG = 0x5AC          # apart from the tags of the ring's messages on the same communicator
HALVING_BYTES = lib.SMC_AGREEMENT_HALVING_BYTES


def combine(sig, status, culprit, other_sig, other_status, other_culprit):
    """Two headers into one: the worse status; two OKs with different signatures make a MISMATCH."""
    worst = max(status, other_status)
    if worst == OK and sig != other_sig:
        worst = MISMATCH
    culprits = [c for c in (culprit, other_culprit) if c]
    return sig, worst, min(culprits) if culprits else 0


class Refused(Exception):
    """The verdict was REFUSED (`culprit`: the first refusing rank + 1): the communicator that started the
    agreement now has every rank swap reasons (refusal_error) and raises what that returns."""

    def __init__(self, culprit):
        super().__init__("rank %d's own checks failed" % (culprit - 1))
        self.culprit = culprit


def refusal_error(what, own, mpi, shm):
    """After a REFUSED verdict, every rank swaps the reason of its own refusal (`own`: this rank's error, or None)
    over the MPI transport, or the host's shared memory; returns `own` on a refusing rank, and on the others the
    PeerArgumentError naming the refusing ranks and their errors."""
    from shmcomm.algorithms.disagreement import gather_rows  # (disagreement imports this module)

    mine = np.zeros(_REASON_WORDS, dtype=np.int64)
    if own is not None:
        text = str(own).encode("utf-8", "replace")[:mine.nbytes - 1]
        mine.view(np.uint8)[:len(text)] = np.frombuffer(text, dtype=np.uint8)
    every = gather_rows(mine, mpi, shm)
    if own is not None:
        return own
    if every is None:
        return PeerArgumentError("%s: another rank's call failed its own checks, so no rank ran it (its reason could "
                                 "not be collected)" % what)
    ranks = mpi.ranks if mpi is not None else shm.ranks
    reasons = [(ranks[r], bytes(row.view(np.uint8)).rstrip(b"\0").decode("utf-8", "replace"))
               for r, row in enumerate(every) if row.any()]
    if not reasons:
        return PeerArgumentError("%s: another rank's call failed its own checks, so no rank ran it" % what)
    return PeerArgumentError("%s: rank %d's call failed its own checks%s, so no rank ran it; %s" % (
        what, reasons[0][0], " (and other ranks' too)" if len(reasons) > 1 else "",
        "; ".join("rank %d: %s" % reason for reason in reasons)), reasons[0][0])


def failure_text(what, culprit):
    """What the other ranks say when a cross-host step failed on rank culprit - 1 (0: unknown)."""
    return "%s: the cross-host step failed on %s (its own error says why); this collective did not complete" % (
        what, "rank %d" % (culprit - 1) if culprit else "another rank")


class Agreement:
    """Recursive-doubling agreement (and small allreduce) over an MPI transport (transport.mpi.Mpi). Owns its message
    buffers: a small allreduce's data is placed in message(nbytes) by the caller, and the result is left there.
    Ops are the core's (ops.C_OP).

    A header holds a signature (a hash of what must agree: collective, dtype, shape, op, scale factors), a status and
    the lowest failed rank. Combining two headers is commutative and associative, so every rank ends with the same
    verdict whatever the order of the rounds: log2(N) of them, after the first 2(N - 2^k) ranks fold in pairs when N
    is not a power of two (they get the result back last). An allreduce's data follows the header and each round
    also reduces the partner's. From HALVING_BYTES among 4 or more ranks (after the fold) the rounds halve instead:
    each carries the header and the half of the data the partner goes on reducing, and where the verdict is OK the
    shares are gathered back by doubling, without headers. That sends 2(p - 1)/p of the data instead of log2(p) times
    all of it, for twice the rounds: worth it once the extra bytes cost more than a round's latency."""

    def __init__(self, transport, capacity=0):
        self.transport = transport
        self.rank, self.size = transport.rank, transport.size
        self.what = transport.what
        self.fold_into, self.fold_from, self.partners = _schedule(self.rank, self.size)
        # Partners may send a header and up to `capacity` bytes of data whatever this rank's own message is.
        self._send = np.zeros(HEADER_BYTES + capacity, dtype=np.uint8)
        self._recv = np.zeros(HEADER_BYTES + capacity, dtype=np.uint8)
        self._send_words = self._send[:HEADER_BYTES].view(np.uint64)
        self._recv_words = self._recv[:HEADER_BYTES].view(np.uint64)
        self._send_ptr, self._recv_ptr = ffi.from_buffer(self._send), ffi.from_buffer(self._recv)
        self._send_data, self._recv_data = self._send_ptr + HEADER_BYTES, self._recv_ptr + HEADER_BYTES
        self._pair = ffi.new("void *[2]")
        # The same rounds in C over MPI where that module can be had (transport/crossing.py); None: these, in Python.
        self._compiled = crossing.rounds_for(transport, self.fold_into, self.fold_from, self.partners,
                                             self._send_ptr, self._recv_ptr, capacity)

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
        """(status, culprit) combined over every rank of the communicator; culprit is a failed job rank + 1."""
        return self._run(sig, status, culprit, 0, None, None)

    def allreduce(self, sig, status, culprit, nbytes, code, op, postscale=1.0, divisor=1):
        """agree(), and while the verdict stays OK, reduces the `nbytes` of data in message() over every rank in
        place."""
        verdict = self._run(sig, status, culprit, nbytes, code, op)
        if verdict[0] == OK and nbytes:
            kernels.scale(self._send_data, nbytes // kernels.itemsize(code), code, postscale, divisor)
        return verdict

    def _run(self, sig, status, culprit, nbytes, code, op):
        transport = self.transport
        if transport.broken:
            transport.usable(self.what)  # raises
        words = self._send_words
        words[0], words[1], words[2], words[3] = sig, status, culprit, nbytes
        if self.size == 1:
            return status, culprit
        if self._compiled is not None:
            return self._run_compiled(nbytes, code, op)
        deadline = transport.deadline()
        try:
            if self.fold_into is not None:  # hand everything to the partner; its next message is the verdict
                self._exchange(self.fold_into, deadline, send=True, receive=True)
                self._adopt(nbytes)
            else:
                if self.fold_from is not None:
                    self._exchange(self.fold_from, deadline, send=False, receive=True)
                    self._merge(nbytes, code, op, self.fold_from)
                if halving(self.partners, nbytes, nbytes // kernels.itemsize(code) if nbytes else 0):
                    self._halve_and_double(nbytes, code, op, deadline)
                else:
                    for peer in self.partners:
                        self._exchange(peer, deadline, send=True, receive=True)
                        self._merge(nbytes, code, op, peer)
                if self.fold_from is not None:
                    self._exchange(self.fold_from, deadline, send=True, receive=False)
        except BaseException as error:  # a timeout, or MPI's own error: the rounds are out of step from here on
            self.transport.broken = str(error) or type(error).__name__
            raise
        return int(words[1]), int(words[2])

    def _run_compiled(self, nbytes, code, op):
        count = nbytes // kernels.itemsize(code) if nbytes else 0
        rc, peer = self._compiled.run(nbytes, count, code or 0, op or 0)
        if rc == 0:
            return int(self._send_words[1]), int(self._send_words[2])
        raise self.rounds_failed(rc, peer)

    def quick_call(self, world_size, min_bytes, max_bytes, usable):
        """The compiled rounds for csrc/py/quick_crossing.c (crossing.Rounds.quick_call), or None where the rounds
        run in Python."""
        if self._compiled is None:
            return None
        return self._compiled.quick_call(world_size, min_bytes, max_bytes, usable)

    def rounds_failed(self, rc, peer):
        """The error of compiled rounds that returned `rc` in the round with `peer`; the transport is refused from
        then on, since its rounds are out of step."""
        if rc == -1:
            error = self._late(peer)
        elif rc <= crossing.REDUCE_FAILED:
            error = error_for(crossing.REDUCE_FAILED - rc, self.what)
        else:
            from mpi4py import MPI
            error = MPI.Exception(rc)
        self.transport.broken = str(error) or type(error).__name__
        return error

    def quick_failed(self, rc, call):
        """rounds_failed for a quick call that returned `rc` (its late_round says with whom)."""
        return self.rounds_failed(rc, self._compiled.late_peer(call))

    def _exchange(self, peer, deadline, send, receive):
        words = self._send_words
        length = HEADER_BYTES + (int(words[3]) if words[1] == OK else 0)
        self.transport.exchange(peer, self._send if send else None, length, self._recv if receive else None,
                                deadline, _TAG, lambda: self._late(peer))

    def _halve_and_double(self, nbytes, code, op, deadline):
        """The partners' rounds by halving, then (verdict OK) the gathering back by doubling; as crossing.c does."""
        esize, words = kernels.itemsize(code), self._send_words
        data = self._send[HEADER_BYTES:]
        lo, hi, ranges = 0, nbytes // esize, []
        for peer in self.partners:
            mid = lo + (hi - lo) // 2
            keep, give = (lo, mid) if self.rank < peer else (mid, lo)
            kept = mid - lo if self.rank < peer else hi - mid
            ranges.append((lo, hi))
            given = (hi - lo - kept) * esize if words[1] == OK else 0
            if give == 0 or given == 0:
                out = self._send[:HEADER_BYTES + given]
            else:  # the header and a part of the data from further on, as one message
                out = np.concatenate((self._send[:HEADER_BYTES], data[give * esize:give * esize + given]))
            self.transport.exchange(peer, out, out.nbytes, self._recv, deadline, _TAG, lambda p=peer: self._late(p))
            self._merge(nbytes, code, op, peer, keep, kept)
            lo, hi = keep, keep + kept
        if words[1] != OK:
            return
        for peer, (below, above) in zip(reversed(self.partners), reversed(ranges)):
            start, end = (hi, above) if lo == below else (below, lo)
            self.transport.exchange(peer, data[lo * esize:hi * esize], (hi - lo) * esize,
                                    data[start * esize:end * esize], deadline, _TAG, lambda p=peer: self._late(p))
            lo, hi = below, above

    def _merge(self, nbytes, code, op, peer, start=0, count=None):
        """Combines the partner's header into this rank's; while both are OK, reduces the partner's data into this
        rank's from element `start` (`count` elements, default all)."""
        # The headers as Python ints: comparing numpy scalars one by one costs more than the small data's reduction.
        sig, status, culprit, path = self._send_words.tolist()
        other_sig, other_status, other_culprit, other_path = self._recv_words.tolist()
        both_ok = status == OK and other_status == OK and sig == other_sig
        if not both_ok or path != other_path or culprit or other_culprit:  # else the header stays as it is
            _, status, culprit = combine(sig, status, culprit, other_sig, other_status, other_culprit)
            if both_ok and path != other_path:  # same arguments, different paths: settings that differ per host
                both_ok, status = False, MISMATCH
            self._send_words[1:3] = status, culprit
        if both_ok and nbytes:
            esize = kernels.itemsize(code)
            count = nbytes // esize if count is None else count
            mine = self._send_data + start * esize
            # The lower rank's data first, on both sides, so both compute the very same bits.
            first, second = (mine, self._recv_data) if self.rank < peer else (self._recv_data, mine)
            kernels.reduce_pair(mine, first, second, count, code, op, self.what, self._pair)

    def _adopt(self, nbytes):
        """A folded rank takes its partner's final header, and the data with it."""
        self._send_words[:] = self._recv_words
        if self._recv_words[1] == OK and nbytes:
            ffi.memmove(self._send_data, self._recv_data, nbytes)

    def _late(self, peer):
        return TimeoutError("%s: timed out after %.0f s waiting for rank %d: it is stuck, or it called a different "
                            "collective (SHMCOMM_TIMEOUT sets the limit)" % (self.what, self.transport.timeout_s,
                                                                             self.transport.ranks[peer]))


def halving(partners, nbytes, count):
    """Whether a small allreduce's rounds halve (crossing.c: halving): the same answer on every rank that calls with
    the same data."""
    # Every part that goes from further into the data than its start is at least a header long (crossing.c writes
    # the header just before it for the time of the send).
    return len(partners) >= 2 and nbytes >= HALVING_BYTES and count > 0 and (
        (count >> len(partners)) * (nbytes // count) >= HEADER_BYTES)


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
    """The same contract over a shared-memory transport (a logical grid's column on one host): headers are
    allgathered, every rank combines them all; a small allreduce is the agreement, then the transport's allreduce."""

    def __init__(self, transport, capacity=0, what="torus column"):
        self.transport = transport
        self.what = what
        self._headers = np.zeros((transport.size, 4), dtype=np.uint64)
        self._headers_ptr = ffi.from_buffer(self._headers)
        self._sizes = [HEADER_BYTES] * transport.size
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
        self.transport.allgatherv(self._ptr, HEADER_BYTES, self._headers_ptr, self._sizes, 0, self.what)
        verdict = (int(self._headers[0, 0]), int(self._headers[0, 1]), int(self._headers[0, 2]))
        for r in range(1, self.transport.size):
            verdict = combine(*verdict, *(int(v) for v in self._headers[r, :3]))
        self.header[1], self.header[2] = verdict[1], verdict[2]
        return verdict[1], verdict[2]

    def allreduce(self, sig, status, culprit, nbytes, code, op, postscale=1.0, divisor=1):
        verdict = self.agree(sig, status, culprit)
        if verdict[0] == OK and nbytes:
            count = nbytes // kernels.itemsize(code)
            data = self._ptr + HEADER_BYTES
            self.transport.allreduce(data, data, count, code, op, 1.0, postscale, divisor,
                                     description.tag(code, (count,)), self.what)
        return verdict
