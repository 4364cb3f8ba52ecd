# SPDX-License-Identifier: Apache-2.0
"""Agreement across hosts: before MPI carries a collective, every rank learns whether all ranks called it with the
same arguments and whether one of them failed.

MPI neither checks arguments nor times out: ranks that pass different counts to one allreduce corrupt each other's
data or wait forever. So a cross-host collective starts with an exchange of small headers (Agreement), and a small
allreduce rides in the same messages, so that the check costs no extra message where latency matters. The rounds are
the core's (transport/crossing.py), every one within SHMCOMM_TIMEOUT; over MPI their exchanges run in C where that
module can be built, without a Python layer between MPI's calls."""
import numpy as np

from shmcomm.vocabulary import description
from shmcomm._native import error_for, lib
from shmcomm.transport import memory
from shmcomm.vocabulary.exceptions import PeerArgumentError, TimeoutError
from shmcomm.transport import crossing, kernels

# Statuses, the worse the higher: REFUSED is a call that failed a rank's own checks (a bad argument there): every
# rank is in step and hears why (refusal_error); FAILED is a failed step, after which nothing more is exchanged.
OK, MISMATCH, REFUSED, FAILED = lib.SMC_AGREEMENT_OK, lib.SMC_AGREEMENT_MISMATCH, lib.SMC_AGREEMENT_REFUSED, \
    lib.SMC_AGREEMENT_FAILED
HEADER_BYTES = lib.SMC_AGREEMENT_HEADER_BYTES  # uint64 words: signature, status, lowest failed rank + 1, data bytes
_REASON_WORDS = 64    # a refusal's reason as int64 words (512 bytes of UTF-8)
HALVING_BYTES = lib.SMC_AGREEMENT_HALVING_BYTES


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
        self._send_ptr, self._recv_ptr = memory.address(self._send), memory.address(self._recv)
        self._send_data = self._send_ptr + HEADER_BYTES
        self._rounds = crossing.Rounds(transport, crossing.plan(self.fold_into, self.fold_from, self.partners),
                                       self._send_ptr, self._recv_ptr, capacity, self._late)

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
        count = nbytes // kernels.itemsize(code) if nbytes else 0
        rc, peer = self._rounds.run(nbytes, count, code or 0, op or 0)
        if rc == 0:
            return int(words[1]), int(words[2])
        raise self.rounds_failed(rc, peer)

    def quick_call(self, world_size, usable, row, world_rank):
        """The rounds for csrc/py/quick_crossing.c and its bound function (crossing.Rounds.quick_call), or None where
        their exchanges are Python's."""
        return self._rounds.quick_call(world_size, usable, row, world_rank)

    def rounds_failed(self, rc, peer):
        """The error of compiled rounds that returned `rc` in the round with `peer`; the transport is refused from
        then on, since its rounds are out of step."""
        if rc == crossing.EXCHANGE_LATE:
            error = self._late(peer)
        elif rc == crossing.EXCHANGE_RAISED:
            error = self._rounds.raised
        elif rc <= crossing.REDUCE_FAILED:
            error = error_for(crossing.REDUCE_FAILED - rc, self.what)
        else:
            from mpi4py import MPI
            error = MPI.Exception(rc)
        self.transport.broken = str(error) or type(error).__name__
        return error

    def quick_failed(self, rc, call):
        """rounds_failed for a quick call that returned `rc` (its late_round says with whom)."""
        return self.rounds_failed(rc, self._rounds.late_peer(call))

    def _late(self, peer):
        return TimeoutError("%s: timed out after %.0f s waiting for rank %d: it is stuck, or it called a different "
                            "collective (SHMCOMM_TIMEOUT sets the limit)" % (self.what, self.transport.timeout_s,
                                                                             self.transport.ranks[peer]))


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
        self._headers_ptr = memory.address(self._headers)
        self._sizes = [HEADER_BYTES] * transport.size
        self._grow(capacity)

    def _grow(self, capacity):
        self._buffer = np.zeros(HEADER_BYTES + capacity, dtype=np.uint8)
        self.header = self._buffer[:HEADER_BYTES].view(np.uint64)
        self._ptr = memory.address(self._buffer)

    def message(self, nbytes):
        if nbytes > self._buffer.nbytes - HEADER_BYTES:
            self._grow(nbytes)
        return self._ptr

    def agree(self, sig, status=OK, culprit=0):
        self.header[:3] = (sig, status, culprit)
        self.transport.allgatherv(self._ptr, HEADER_BYTES, self._headers_ptr, self._sizes, 0, self.what)
        kernels.combine_headers(self._headers)
        status, culprit = int(self._headers[0, 1]), int(self._headers[0, 2])
        self.header[1], self.header[2] = status, culprit
        return status, culprit

    def allreduce(self, sig, status, culprit, nbytes, code, op, postscale=1.0, divisor=1):
        verdict = self.agree(sig, status, culprit)
        if verdict[0] == OK and nbytes:
            count = nbytes // kernels.itemsize(code)
            data = self._ptr + HEADER_BYTES
            self.transport.allreduce(data, data, count, code, op, 1.0, postscale, divisor,
                                     description.tag(code, (count,)), self.what)
        return verdict
