# SPDX-License-Identifier: Apache-2.0
"""The collectives of one host's ranks on numpy arrays and torch tensors: each is one or two steps of the
shared-memory transport, whose C core checks that every rank passed the same description.

Callers (the public API in collectives.py and the engine) have resolved the op, the root and the splits; this module
turns arrays into pointers and sizes, and explains a disagreement on shapes by naming what every rank passed."""
import numpy as np

from shmcomm.vocabulary import description, ops
from shmcomm.transport import memory
from shmcomm.algorithms import adasum
from shmcomm.algorithms.communicator import Communicator
from shmcomm.vocabulary.buffers import output_for, output_or_scratch, require_reducible, row_bytes, wrap
from shmcomm.vocabulary.exceptions import InvalidArgumentError, MismatchError, ShmCommError


class HostComm(Communicator):
    """A shared-memory transport's ranks: a host's, or a process set's."""

    def __init__(self, shm):
        super().__init__(shm, shm.topology, shm.tuning, shm.ranks)
        self._splits = {}  # (rows, elements per row): reducescatter's split (_split)

    def allreduce(self, x, output, op, prescale, postscale, what):
        """Reduces `x` into `output` (which may be `x` itself, or None for a new array); returns the result.
        This is the latency path of the whole library: keep it free of avoidable work."""
        if type(x) is np.ndarray and op != ops.Adasum:
            out = self._short(self.shm.quick.allreduce, x, what, np.empty(x.shape, x.dtype) if output is None
                              else output, op, prescale, postscale)
            if out is not NotImplemented:
                return out
        inplace = output is x
        src = wrap(x, what, inplace)
        if src.code is None:
            require_reducible(src, what)
        out, dst = (x, src) if inplace else output_for(src, output, src.shape, what)
        if op == ops.Adasum:
            self.adasum(src.ptr, dst.ptr, src.count, src.code, [src.count], prescale, postscale, what, src.shape)
            return out
        try:
            self.shm.allreduce(src.ptr, dst.ptr, src.count, src.code, ops.C_OP[op], prescale, postscale,
                               self.size if op == ops.Average else 1, description.tag(src.code, src.shape), what)
        except MismatchError as error:
            raise self.explain_mismatch(error, what, src) from None
        return out

    def shared_buffer(self, nbytes, what, tag=0):
        """`nbytes` (a uint8 array) that every rank of this communicator maps; collective (transport/shm.py)."""
        return self.shm.shared_buffer(nbytes, tag, what)

    def allreduce_raw(self, ptr, count, code, op, prescale, postscale, what, divisor=None):
        """In-place allreduce of `count` elements of type `code` at `ptr` (the engine's fusion buffer). The divisor
        defaults to the communicator's size for Average."""
        if divisor is None:
            divisor = self.size if op == ops.Average else 1
        self.shm.allreduce(ptr, ptr, count, code, ops.C_OP[op], prescale, postscale, divisor,
                           description.tag(code, (count,)), what)

    def adasum(self, ptr, dst_ptr, count, code, sizes, prescale, postscale, what, shape=None):
        """Adasum (algorithms/adasum.py) of the tensors of `sizes` elements packed at `ptr`, into `dst_ptr`. Every
        step carries the call's description as its tag, so ranks that disagree all raise MismatchError."""
        tag = description.describe("allreduce", code, tuple(sizes) if shape is None else tuple(shape), ops.Adasum,
                                   float(prescale), float(postscale)).signature(*sizes)
        adasum.run([adasum.ShmStage(self.shm, tag, what)], ptr, dst_ptr, count, code, sizes, prescale, postscale,
                   what)

    def broadcast(self, x, output, root, what):
        """`root` (an index in the communicator) sends `x`; everyone's result lands in `output` (may be `x`)."""
        if type(x) is np.ndarray:
            out = self._short(self.shm.quick.broadcast, x, what, np.empty(x.shape, x.dtype) if output is None
                              else output, root)
            if out is not NotImplemented:
                return out
        src = wrap(x, what, writable=output is x)
        out, dst = (x, src) if output is x else output_for(src, output, src.shape, what)
        try:
            self.shm.broadcast(src.ptr, dst.ptr, src.nbytes, root, description.tag(src.dtype_key(), src.shape), what)
        except MismatchError as error:
            raise self.explain_mismatch(error, what, src) from None
        return out

    def allgather(self, x, what, output=None):
        """Concatenation along the first dimension, which may differ between ranks: every rank's row count travels
        with the first window of data, so a small allgather is one synchronisation. Into `output` when given."""
        if type(x) is np.ndarray:
            out = self._short(self.shm.quick.allgather, x, what, output)
            if out is not NotImplemented:
                return out if out is not None else self.output_misfit("allgather", x, output, what)
        src, shape, size, tag = _rows(x, what)
        rows = self.shm.every
        self._step(self.shm.allgather_begin, src, what, src.ptr, shape[0], size, rows, tag, what)
        return self._finish(self.shm.allgather_finish, src, output, (sum(rows[0:self.size]),) + shape[1:], what, size,
                            rows)

    def reducescatter(self, x, op, prescale, postscale, what, output=None):
        """This rank's share of the reduction, split along the first dimension by Horovod's rule; into `output`
        when given."""
        if type(x) is np.ndarray:
            out = self._short(self.shm.quick.reducescatter, x, what, output, int(op), prescale, postscale)
            if out is not NotImplemented:
                return out
        src = wrap(x, what)
        require_reducible(src, what)
        if len(src.shape) == 0:
            raise InvalidArgumentError("%s: a tensor with at least one dimension is required" % what)
        rows = src.shape[0]
        per_row = src.count // rows if rows else 0
        mine, counts = self._split(rows, per_row)
        shape = (mine,) + tuple(src.shape[1:])
        out, dst, error = output_or_scratch(src, output, shape, what)
        tag = description.tag(src.code, src.shape)
        try:
            self.shm.reducescatter(src.ptr, dst.ptr, counts, src.code, ops.C_OP[op],
                                   float(prescale), float(postscale), self.size if op == ops.Average else 1, tag, what)
        except MismatchError as mismatch:
            raise self.explain_mismatch(mismatch, what, src) from None
        if error is not None:
            raise error
        return out

    def _split(self, rows, per_row):
        """(this rank's rows, elements per rank as a uint64_t[]) of a reducescatter of `rows` rows, kept for the next
        call of the same shape: a training loop repeats its shapes, and building the array is a share of a small
        call."""
        split = self._splits.get((rows, per_row))
        if split is None:
            if len(self._splits) >= 64:
                self._splits.clear()
            shares = description.shares(rows, self.size)
            split = self._splits[(rows, per_row)] = (shares[self.rank], memory.counts([s * per_row for s in shares]))
        return split

    def alltoall(self, x, splits, what, output=None):
        """Sends splits[j] rows to rank j; returns (rows received in rank order, rows received from each rank). The
        counts travel with the first window of data, so a small alltoall is one synchronisation."""
        if type(x) is np.ndarray:
            done = self._short(self.shm.quick.alltoall, x, what, output, splits)
            if done is not NotImplemented:
                return done if done is not None else self.output_misfit("alltoall", x, output, what)
        src, shape, size, tag = _rows(x, what)
        matrix = self.shm.matrix
        sends = memory.counts(splits)
        self._step(self.shm.alltoall_begin, src, what, src.ptr, sends, size, matrix, tag, what)
        n, me = self.size, self.rank
        got = [matrix[j * n + me] for j in range(n)]
        return self._finish(self.shm.alltoall_finish, src, output, (sum(got),) + shape[1:], what, size,
                            matrix), np.array(got, dtype=np.int64)

    @staticmethod
    def _finish(finish, src, output, shape, what, *args):
        """Ends a begun allgather or alltoall: into the caller's output (checked now that its shape is known) or a
        new array; a rank whose output does not fit still takes part (output_or_scratch), then raises."""
        out, dst, error = output_or_scratch(src, output, shape, what)
        finish(src.ptr, dst.ptr, *args, what)
        if error is not None:
            raise error
        return out

    def barrier(self, what="barrier"):
        self.shm.barrier(what)

    def allgather_bytes(self, payload):
        return self.shm.allgather_bytes(payload)

    def _short(self, quick, x, what, *args):
        """quick(x, *args), one of the transport's quick calls (transport/shm.py's QuickCalls): the result, or
        NotImplemented where it does not apply (or this build has none); a failed step raises as on the full path."""
        got = NotImplemented if quick is None else quick(x, *args)
        if type(got) is int:
            raise self.step_failure(got, x, what)
        return got

    def output_misfit(self, kind, x, output, what):
        """Raises the error of an allgather's or alltoall's output that turned out, once the ranks' rows were known,
        not to fit them (the quick call took part without keeping anything); that of output_for."""
        n = self.size
        every, matrix = self.shm.every, self.shm.matrix
        rows = sum(every[0:n]) if kind == "allgather" else sum(matrix[j * n + self.rank] for j in range(n))
        shape = (rows,) + x.shape[1:]
        try:
            output_for(wrap(x, what), output, shape, what)  # raises: the output has other rows than `shape`
            error = InvalidArgumentError("%s: the output does not fit a result of shape %s" % (what, list(shape)))
        except InvalidArgumentError as misfit:
            error = misfit
        error.told_peers = True  # this rank took part: it owes the peers no refusal (Communicator.refused)
        raise error

    def step_failure(self, rc, x, what):
        """The error of a quick call's failed step (core code `rc`) on numpy array `x`, explained as _short does."""
        error = self.shm.failure(rc, what)
        return self.explain_mismatch(error, what, wrap(x, what)) if isinstance(error, MismatchError) else error

    def _step(self, step, src, what, *args):
        try:
            step(*args)
        except MismatchError as error:
            raise self.explain_mismatch(error, what, src) from None

    def explain_mismatch(self, error, what, buf):
        """A shape mismatch names every rank's tensor: every rank lands here together, so they swap descriptions;
        except where a step that returned early failed (a small broadcast's), which not every rank fails at once."""
        if error.field != "shape" or getattr(error, "earlier", False):
            return error
        mine = description.Collective("allreduce", buf.dtype_key(), tuple(buf.shape)).words()
        every = np.zeros((self.size, mine.size), dtype=np.int64)
        try:
            self.shm.allgatherv(memory.address(mine), mine.nbytes, memory.address(every),
                                [mine.nbytes] * self.size, 0, what)
        except ShmCommError as failure:
            return MismatchError("%s: ranks disagree on the tensor: (could not collect the shapes: %s)"
                                 % (what, failure), error.field)
        names = {buf.dtype_key(): buf.type_name()}
        parts = []
        for r in range(self.size):
            theirs = description.Collective.from_words(every[r])
            parts.append("rank %d has %s%s" % (self.ranks[r], description.dtype_name(theirs.dtype, names),
                                               list(theirs.shape)))
        return MismatchError("%s: ranks disagree on the tensor: %s" % (what, "; ".join(parts)), error.field)


def _rows(x, what):
    """The input wrapped, its shape (one dimension at least), its bytes per row, and the tag of a call whose first
    dimension may differ between ranks."""
    src = wrap(x, what)
    shape = tuple(src.shape) or (1,)
    return src, shape, row_bytes(src, shape), description.tag(src.dtype_key(), shape[1:])
