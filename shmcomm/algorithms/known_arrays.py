# SPDX-License-Identifier: Apache-2.0
"""The short path of a host's allgather, reducescatter and alltoall for numpy arrays of a dtype and shape that the same
collective took before (allreduce and broadcast have a shorter one still: transport.shm's quick calls, in C).

A training loop passes arrays of the same dtypes and shapes every step. The first call of a collective with an array
of a new dtype and shape takes HostComm's full path: buffers.wrap, the output's checks and the tag, several
microseconds where the core's step takes one. What that path worked out for the core (counts, sizes, the tag) is kept
here under (collective, dtype, shape), and later calls with such an array go to the core at once. The only checks left
are the ones two arrays of one dtype and shape can fail differently: contiguous, writable, the output's dtype and
shape. Each method returns None, before any step, where anything is out of the ordinary; HostComm then takes its full
path, whose errors say what is wrong.

Where this build has them, the step itself is one C call (transport.shm's quick_allgather, quick_alltoall and
quick_reducescatter, in csrc/py/quick_calls.c), given the kept facts and the output. An allgather or alltoall whose
result shape is not known before the step (no output given, or one that turns out not to fit) gets an array of the
shape this array's last result had; where the ranks sent other row counts this time, the C call returns after the
first step and the rest is finished here, as on the full path."""
import numpy as np

from shmcomm import ops
from shmcomm._native import ffi
from shmcomm.buffers import output_or_scratch, wrap

_REFUSED = (BufferError, TypeError, ValueError)  # what ffi.from_buffer raises for an array it cannot pass
_MOST_KEPT = 256  # (collective, dtype, shape) entries; a loop that keeps making new shapes starts over


def address(cdata):
    """The address of a cffi array, as the quick calls take it."""
    return int(ffi.cast("uintptr_t", cdata))


class KnownArrays:
    """The kept arguments of one communicator's collectives (`shm`: its transport.shm.SharedMemory)."""

    def __init__(self, shm, every, matrix):
        self.shm = shm
        self.size = shm.size
        self._kept = {}
        self._every = every  # allgather's rows per rank (uint64_t[size]), filled by its first step
        self._matrix = matrix  # alltoall's rows (uint64_t[size * size]), [j * size + i]: rank j sends rank i
        self._every_at, self._matrix_at = address(every), address(matrix)
        self._shapes = {}  # (collective, dtype, shape) -> the shape of the last allgather's or alltoall's result

    def keep(self, kind, array, *facts):
        """What the full path of collective `kind` worked out for `array`, if it is a numpy array."""
        if type(array) is np.ndarray:
            if len(self._kept) >= _MOST_KEPT:
                self._kept.clear()
                self._shapes.clear()
            self._kept[(kind, array.dtype, array.shape)] = facts

    def reducescatter(self, x, op, prescale, postscale, what, output):
        facts = self._kept.get(("reducescatter", x.dtype, x.shape))
        if facts is None or op not in ops.C_OP:
            return None
        code, shape, counts, tag, counts_at = facts
        divisor = self.size if op == ops.Average else 1
        out = self.shm.quick_reducescatter(x, np.empty(shape, x.dtype) if output is None else output, counts_at,
                                           ops.C_OP[op], prescale, postscale, divisor, tag, what)
        if out is not NotImplemented:
            return out
        places = _in_and_out(x, output, shape)
        if places is None:
            return None
        out, src, dst = places
        self.shm.reducescatter(src, dst, counts, code, ops.C_OP[op], prescale, postscale, divisor, tag, what)
        return out

    def allgather(self, x, what, output):
        key = ("allgather", x.dtype, x.shape)
        facts = self._kept.get(key)
        if facts is None:
            return None
        rows, row_bytes, tag = facts
        every = self._every
        done = self.shm.quick_allgather(x, self._output(key, x, output), self._every_at, tag, what)
        if done is not None and done is not NotImplemented:
            return done
        src = _source(x, done, self.shm.allgather_begin, rows, row_bytes, every, tag, what)
        if src is None:
            return None
        shape = self._shapes[key] = (sum(every[0:self.size]),) + x.shape[1:]
        return self._finish(self.shm.allgather_finish, x, src, output, shape, what, row_bytes, every)

    def alltoall(self, x, splits, what, output):
        """(rows received in rank order, rows received from each rank), as HostComm.alltoall."""
        key = ("alltoall", x.dtype, x.shape)
        facts = self._kept.get(key)
        if facts is None or facts[0] != splits:
            return None
        _, sends, row_bytes, tag, sends_at = facts
        matrix, n, me = self._matrix, self.size, self.shm.rank
        done = self.shm.quick_alltoall(x, self._output(key, x, output), sends_at, self._matrix_at, tag, what)
        if done is not None and done is not NotImplemented:
            return done  # (out, rows received from each rank)
        src = _source(x, done, self.shm.alltoall_begin, sends, row_bytes, matrix, tag, what)
        if src is None:
            return None
        got = ffi.unpack(matrix, n * n)[me::n]
        shape = self._shapes[key] = (sum(got),) + x.shape[1:]
        return (self._finish(self.shm.alltoall_finish, x, src, output, shape, what, row_bytes, matrix),
                np.array(got, dtype=np.int64))

    def _output(self, key, x, output):
        """The caller's output, or a new array of the shape of the last result (None before the first)."""
        if output is not None:
            return output
        shape = self._shapes.get(key)
        return None if shape is None else np.empty(shape, x.dtype)

    @staticmethod
    def _finish(finish, x, src, output, shape, what, *args):
        """The second step of an allgather or alltoall: it must be taken whatever the output, so an output that does
        not fit takes it into a new array (buffers.output_or_scratch) before its error is raised."""
        if output is None or type(output) is np.ndarray and output.dtype == x.dtype and output.shape == shape \
                and output.flags.writeable:
            out = np.empty(shape, x.dtype) if output is None else output
            try:
                finish(src, ffi.from_buffer(out), *args, what)
                return out
            except _REFUSED:
                pass
        out, dst, error = output_or_scratch(wrap(x, what), output, shape, what)
        finish(src, dst.ptr, *args, what)
        if error is not None:
            raise error
        return out


def _source(x, done, begin, *args):
    """x's pointer for the rest of an allgather or alltoall whose quick call returned `done`: None there means the
    call began (it took x's buffer, so cffi takes it too); NotImplemented that nothing began, and the first step,
    begin(src, *args), is taken here. None where cffi refuses x before anything began."""
    if done is None:
        return ffi.from_buffer(x)
    try:
        src = ffi.from_buffer(x)
    except _REFUSED:
        return None
    begin(src, *args)
    return src


def _in_and_out(x, output, shape):
    """(result, x's pointer, the result's pointer) for a step from `x` into `output` (x itself, None for a new array
    of `shape`, or an array of x's dtype and that shape); None where the full path must look closer."""
    try:
        src = ffi.from_buffer(x)
    except _REFUSED:
        return None
    if output is x:
        return (x, src, src) if x.flags.writeable and x.shape == shape else None
    if output is None:
        out = np.empty(shape, x.dtype)
        return out, src, ffi.from_buffer(out)
    if type(output) is not np.ndarray or output.dtype != x.dtype or output.shape != shape or not output.flags.writeable:
        return None
    try:
        return output, src, ffi.from_buffer(output)
    except _REFUSED:
        return None
