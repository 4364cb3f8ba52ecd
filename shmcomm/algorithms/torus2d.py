# SPDX-License-Identifier: Apache-2.0
"""Hierarchical 2D-torus allreduce (Mikami et al., Sony, arXiv:1811.05233).

The ranks form an X-by-Y grid: a row is X ranks of one host, a column the ranks with the same place in their row.
Rows reduce-scatter and all-gather over shared memory and columns allreduce a slice across hosts, so all X ranks of a
host drive the network at once, each with 1/X of the bytes. It moves the bytes a ring moves, in 2(X-1) + 2(Y-1)
steps instead of 2(XY-1). Before anything crosses hosts the columns agree (agreement.py), so that a disagreement
anywhere fails the call on every rank instead of leaving some waiting in MPI."""
import logging

import numpy as np

from shmcomm.vocabulary import description
from shmcomm._native import lib
from shmcomm.transport import memory
from shmcomm.algorithms.agreement import (FAILED, HEADER_BYTES, MISMATCH, OK, REFUSED, Agreement, Refused,
                                          ShmAgreement, failure_text)
from shmcomm.algorithms.ring import ring_allreduce
from shmcomm.vocabulary.description import shares
from shmcomm.vocabulary.exceptions import InvalidArgumentError, MismatchError, PeerArgumentError, ShmCommError
from shmcomm.transport import kernels

log = logging.getLogger("shmcomm.algorithms")

class Torus:
    """The torus over a row (a shared-memory transport) and a column (agreement.Agreement over an MPI transport, or
    agreement.ShmAgreement over a shared-memory one) that also runs the slices' allreduce (`column.allreduce_slice`).
    Ops are the core's (ops.C_OP).

    1. reduce-scatter along the row: rank (x, y) ends with the row's sum of slice x (1/X of the buffer);
    2. allreduce along the column, on that slice only;
    3. all-gather along the row: every rank copies the finished slices out.
    Scale factors are applied once: the prescale in step 1, the postscale and the average's divisor on the slice in
    step 2. Counts that do not divide by X give the first (count % X) ranks of a row one element more. In the
    columns' agreement each rank brings its signature and its row's verdict, so that a disagreement confined to a host,
    or one that sends hosts down different paths, is seen too.

    Up to `small_bytes` the cost is latency, not bandwidth: the row then allreduces the whole buffer in one
    shared-memory step, the first column (one rank per host) allreduces all of it inside its agreement, and the row
    takes the result and the verdict from its first rank. A single exchange per host pair crosses the network, not X
    of them competing for the host's cores and NIC for no gain in a message this small."""

    def __init__(self, row, column, small_bytes=0, world_rank=0):
        self.row = row
        self.column = column
        self.small_bytes = small_bytes
        self.world_rank = world_rank
        self._scratch = np.empty(0, dtype=np.uint8)

    def allreduce(self, src_ptr, dst_ptr, count, code, esize, op, prescale, postscale, divisor, what, collective):
        """`collective` (description.Collective) is what the caller passed. Raises MismatchError on every rank when
        ranks anywhere disagree (on count, dtype, shape, op or scale factors); the output is untouched then, and after
        a failed cross-host step."""
        nbytes = count * esize
        small = nbytes <= self.small_bytes
        # Everything that must agree, the path included; it is also the row's tag, so that the row's first step
        # sees what the core's own check does not (Average against Sum, postscale, divisor).
        sig = collective.signature(count, divisor, small)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("torus: %d bytes take the %s path", nbytes, "small" if small else "three-phase")
        if small:
            verdict = self._small(src_ptr, dst_ptr, count, code, nbytes, op, prescale, postscale, divisor, sig, what)
        else:
            verdict = self._three_phases(src_ptr, dst_ptr, count, code, esize, op, prescale, postscale, divisor, sig,
                                         what)
        if verdict[0] != OK:
            raise verdict_error(what, verdict)

    def agree(self, sig, what, refusal=None):
        """The verdict (status, culprit) of every rank on `sig`, by the small path's route with no data: a collective
        other than allreduce checks its arguments this way, so that ranks calling different collectives find out
        as surely as ranks passing different tensors. `refusal`: this rank's own checks failed with this error,
        which the row hears from the core and the columns as REFUSED."""
        return self._small(memory.NULL, memory.NULL, 0, lib.SMC_UINT8, 0, lib.SMC_SUM, 1.0, 1.0, 1, sig, what, refusal)

    def _small(self, src_ptr, dst_ptr, count, code, nbytes, op, prescale, postscale, divisor, sig, what,
               refusal=None):
        # Latency-bound: straight to the core, every Python layer here costs microseconds. The row's sum goes to a
        # message buffer (a header, then the data); the output is written only once the verdict is OK everywhere.
        row, column = self.row, self.column
        message = column.message(nbytes) if row.rank == 0 else self._scratch_ptr(HEADER_BYTES + nbytes)
        try:  # the row step's outcome, inline: a helper call is a measurable share of this path
            if refusal is None:
                row.allreduce(src_ptr, message + HEADER_BYTES, count, code, op, prescale, 1.0, 1, sig, what)
                status, culprit, error = OK, 0, None
            else:
                row.refuse(lib.SMC_COLL_ALLREDUCE, str(refusal), what)
                status, culprit, error = REFUSED, self.world_rank + 1, None
        except ShmCommError as failure:
            status, culprit, error = _row_status(failure, self.world_rank)
        return self._after_row(message, dst_ptr, nbytes, code, op, postscale, divisor, sig, what, status, culprit,
                               error)

    def after_quick_row(self, failure, nbytes, code, op, postscale, divisor, sig, what):
        """The verdict of the small path whose row step failed with `failure` in the quick call across hosts
        (csrc/py/quick_crossing.c): it goes on as _small does (the output is not written)."""
        message = self.column.message(nbytes) if self.row.rank == 0 else self._scratch_ptr(HEADER_BYTES + nbytes)
        return self._after_row(message, memory.NULL, nbytes, code, op, postscale, divisor, sig, what,
                               *_row_status(failure, self.world_rank))

    def after_quick_verdict(self, verdict, sig):
        """The verdict of the small path after the quick call got `verdict`, not OK, from its row or its rounds:
        a rank that does not cross agrees on it with its column, as _small does."""
        return verdict if self.row.rank == 0 else self.column.agree(sig, *verdict)

    def _after_row(self, message, dst_ptr, nbytes, code, op, postscale, divisor, sig, what, status, culprit, error):
        row, column = self.row, self.column
        data = message + HEADER_BYTES
        if row.rank == 0:
            try:
                verdict = column.allreduce(sig, status, culprit, nbytes, code, op, postscale, divisor)
            except BaseException as failure:  # KeyboardInterrupt too: the rest of the row must not be left waiting
                verdict, error = (FAILED, self.world_rank + 1), error or failure
            if status == OK:  # the row is in step: one broadcast gives it the verdict, and the data
                column.header[1], column.header[2] = verdict
                if row.size > 1:
                    try:
                        row.broadcast(message, message, HEADER_BYTES + nbytes, 0, nbytes, what)
                    except ShmCommError as failure:
                        raise error or failure
                if verdict[0] == OK:
                    memory.copy(dst_ptr, data, nbytes)
        else:
            if status == OK:
                row.broadcast(memory.NULL, message, HEADER_BYTES + nbytes, 0, nbytes, what)
                head = memory.view(message, HEADER_BYTES).view(np.uint64)
                verdict = int(head[1]), int(head[2])
                if verdict[0] == OK:
                    memory.copy(dst_ptr, data, nbytes)
                    return verdict
                status, culprit = verdict
            # A host that had other counts may have taken the three-phase path, whose every column agrees: this
            # rank's column does too, with the verdict it has.
            verdict = column.agree(sig, status, culprit)
        if error is not None and verdict[0] not in (MISMATCH, REFUSED):
            raise error
        return verdict

    def _three_phases(self, src_ptr, dst_ptr, count, code, esize, op, prescale, postscale, divisor, sig, what):
        row = self.row
        counts = shares(count, row.size)
        mine = counts[row.rank]
        if row.size == 1:  # one rank per host: its share is the whole, so it goes straight into the output
            piece_ptr = dst_ptr
            piece = memory.view(dst_ptr, count * esize)
        else:
            piece_ptr = self._scratch_ptr(mine * esize)
            piece = self._scratch[:mine * esize]
        try:
            row.reducescatter(src_ptr, piece_ptr, counts, code, op, prescale, 1.0, 1, sig, what)
            status, culprit, error = OK, 0, None
        except ShmCommError as failure:
            status, culprit, error = _row_status(failure, self.world_rank)
        verdict = self.column.agree(sig, status, culprit)
        if verdict[0] != OK:
            if error is not None and verdict[0] not in (MISMATCH, REFUSED):
                raise error
            return verdict
        failure = _attempt(self.column.allreduce_slice, piece, code, op, postscale, divisor)
        if row.size == 1:  # nothing to gather (the ring's and MPI's paths leave a failed call's output so too)
            if failure is not None:
                raise failure
            return OK, 0
        sizes = [c * esize for c in counts]
        # After a failure the slices are not sums: gather them somewhere harmless (the row may all have failed, and
        # then no mismatch stops the copy).
        target = dst_ptr if failure is None else memory.scratch(count * esize)
        try:
            row.allgatherv(piece_ptr, mine * esize, target, sizes, _FAILED if failure else 0, what)
        except MismatchError:  # the row agreed on the sizes in its first step: only a failure flag differs
            if failure is not None:
                raise failure from None
            raise ShmCommError("%s: the cross-host step failed on another rank of this host (its own error says "
                               "why); this allreduce did not complete" % what) from None
        except ShmCommError:
            if failure is not None:
                raise failure from None
            raise
        if failure is not None:
            raise failure
        return OK, 0

    def _scratch_ptr(self, nbytes):
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return memory.address(self._scratch)


# A row step's tag with this bit set says "my cross-host step failed": every rank of the row then sees a mismatch
# at once, instead of waiting for a result that will not come until the timeout.
_FAILED = 1 << 63


def _row_status(failure, world_rank):
    """(status, culprit, error) after the row's first step failed: a mismatch is everyone's to report; a refusal
    (a rank's own checks failed, the core told the row) is REFUSED, everyone's to report too; another failure is
    this rank's own error, which the columns hear about as FAILED."""
    if isinstance(failure, MismatchError):
        return MISMATCH, 0, None
    if isinstance(failure, PeerArgumentError):
        return REFUSED, (failure.rank if failure.rank is not None else world_rank) + 1, None
    if isinstance(failure, InvalidArgumentError):
        return REFUSED, world_rank + 1, None
    return FAILED, world_rank + 1, failure


def _attempt(fn, *args):
    """Runs a cross-host step; returns its exception instead of raising it, so the row can be told first."""
    try:
        fn(*args)
    except BaseException as error:  # KeyboardInterrupt too: the rest of the row must not be left waiting
        return error
    return None


def verdict_error(what, verdict):
    status, culprit = verdict
    if status == REFUSED:
        return Refused(culprit)
    if status == MISMATCH:
        return MismatchError("%s: ranks disagree on the tensor (count, dtype, shape, op or scale factors)" % what)
    return ShmCommError(failure_text(what, culprit))


class MpiColumn(Agreement):
    """A column across hosts: the agreement (and small allreduces) by recursive doubling or halving, the slices by a
    ring, which carries every dtype."""

    def allreduce_slice(self, piece, code, op, postscale, divisor):
        ring_allreduce(self.transport, piece, code, op, 1.0, postscale, divisor)


class ShmColumn(ShmAgreement):
    """A column on shared memory (a logical grid on one host)."""

    def allreduce_slice(self, piece, code, op, postscale, divisor):
        ptr = memory.address(piece)
        count = piece.nbytes // kernels.itemsize(code)
        self.transport.allreduce(ptr, ptr, count, code, op, 1.0, postscale, divisor, description.tag(code, (count,)),
                                 self.what)
