# SPDX-License-Identifier: Apache-2.0
"""Runs one collective on a given communicator: arrays in, C core call, exceptions out.

Callers (the public API in collectives.py and the engine) have resolved the op, the root and the splits; this module
only turns arrays into pointers, calls the core and explains its failures."""
import numpy as np

from shmcomm import dtypes, ops
from shmcomm._native import error_for, ffi, lib
from shmcomm.buffers import empty_like, require_reducible, wrap
from shmcomm.exceptions import InvalidArgumentError, MismatchError

MASK = (1 << 64) - 1
_C_OP = {int(k): v for k, v in ops.C_OP.items()}
_DESCRIBE_WORDS = 32  # dtype, ndim, then up to 30 dims: what a rank says about its tensor after a shape mismatch


def _tag(buf, shape):
    return hash((buf.dtype_key(),) + tuple(shape)) & MASK


def _raise(rc, comm, what, buf):
    err = error_for(rc)
    if isinstance(err, MismatchError) and err.field == "shape":
        err = MismatchError("%s: ranks disagree on the tensor: %s" % (what, _describe_all(comm, buf)), err.field)
    elif what not in str(err) and not hasattr(err, "rank"):
        err.args = ("%s: %s" % (what, err),)  # in place: .field stays
    raise err


def _call(rc, comm, what, buf):
    if rc != 0:
        _raise(rc, comm, what, buf)


def _describe_all(comm, buf):
    """After a shape mismatch every rank lands here together: swap descriptions so the message can name them."""
    mine = np.zeros(_DESCRIBE_WORDS, dtype=np.int64)
    dims = list(buf.shape)[: _DESCRIBE_WORDS - 2]
    mine[0], mine[1] = buf.dtype_key(), len(buf.shape)
    mine[2: 2 + len(dims)] = dims
    every = np.zeros((comm.size, _DESCRIBE_WORDS), dtype=np.int64)
    recv_bytes = ffi.new("uint64_t[]", [mine.nbytes] * comm.size)
    rc = lib.smc_allgatherv(comm.handle, ffi.from_buffer(mine), mine.nbytes, ffi.from_buffer(every), recv_bytes, 0)
    if rc != 0:
        return "(could not collect the shapes: %s)" % error_for(rc)
    parts = []
    for r in range(comm.size):
        key, ndim = int(every[r, 0]), int(every[r, 1])
        dtype = dtypes.NAMES.get(key, buf.type_name() if key == buf.dtype_key() else "dtype#%d" % key)
        parts.append("rank %d has %s%s" % (comm.ranks[r], dtype, [int(d) for d in every[r, 2: 2 + min(ndim, 30)]]))
    return "; ".join(parts)


def output_for(src, output, shape, what):
    """The caller's output array after checking it fits, or a new one."""
    if output is None:
        out = empty_like(src, shape)
        return out, wrap(out, what, writable=True)
    dst = wrap(output, what, writable=True)
    if tuple(dst.shape) != tuple(shape) or dst.dtype_key() != src.dtype_key():
        raise InvalidArgumentError("%s: output is %s%s, expected %s%s" % (what, dst.type_name(), list(dst.shape),
                                                                         src.type_name(), list(shape)))
    return output, dst


def allreduce(comm, x, output, op, prescale, postscale, what):
    """Reduces `x` into `output` (which may be `x` itself, or None for a new array); returns the result.
    This is the latency path of the whole library: keep it free of avoidable work."""
    inplace = output is x
    src = wrap(x, what, inplace)
    if src.code is None:
        require_reducible(src, what)
    out, dst = (x, src) if inplace else output_for(src, output, src.shape, what)
    rc = lib.smc_allreduce(comm.handle, src.ptr, dst.ptr, src.count, src.code, _C_OP[op], prescale, postscale,
                           comm.size if op == ops.Average else 1, hash((src.code,) + tuple(src.shape)) & MASK)
    if rc != 0:
        _raise(rc, comm, what, src)
    return out


def allreduce_raw(comm, ptr, count, code, op, prescale, postscale, what, divisor=None):
    """In-place allreduce of `count` elements of type `code` at `ptr` (the engine's fusion buffer, a torus slice).
    The divisor defaults to the communicator's size for Average."""
    if divisor is None:
        divisor = comm.size if op == ops.Average else 1
    rc = lib.smc_allreduce(comm.handle, ptr, ptr, count, code, _C_OP[op], prescale, postscale, divisor,
                           hash((code, count)) & MASK)
    if rc != 0:
        raise error_for(rc, what)


def itemsize(code):
    return int(lib.smc_dtype_size(code))


def scale_raw(ptr, count, code, postscale, divisor):
    """x = postscale * x / divisor in place, with the same rules as the reductions (integers truncate)."""
    if postscale != 1.0 or divisor != 1:
        srcs = ffi.new("void *[1]", [ptr])
        rc = lib.smc_reduce(ptr, srcs, 1, count, code, lib.SMC_SUM, 1.0, postscale, divisor)
        if rc != 0:
            raise error_for(rc, "scale")


def broadcast(comm, x, output, root, what):
    """`root` (an index in the communicator) sends `x`; everyone's result lands in `output` (may be `x`)."""
    src = wrap(x, what, writable=output is x)
    out, dst = (x, src) if output is x else output_for(src, output, src.shape, what)
    _call(lib.smc_broadcast(comm.handle, src.ptr, dst.ptr, src.nbytes, root, _tag(src, src.shape)), comm, what, src)
    return out


def _exchange_first_dims(comm, buf, shape, what):
    """Every rank's first dimension, exchanged under a tag of the trailing shape so that those must agree."""
    mine = np.array([shape[0]], dtype=np.int64)
    every = np.empty(comm.size, dtype=np.int64)
    recv_bytes = ffi.new("uint64_t[]", [8] * comm.size)
    rc = lib.smc_allgatherv(comm.handle, ffi.from_buffer(mine), 8, ffi.from_buffer(every), recv_bytes,
                            _tag(buf, shape[1:]))
    _call(rc, comm, what, buf)
    return every


def allgather(comm, x, what):
    """Concatenation along the first dimension, which may differ between ranks."""
    src = wrap(x, what)
    shape = tuple(src.shape) if len(src.shape) > 0 else (1,)
    dims = _exchange_first_dims(comm, src, shape, what)
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * src.itemsize
    out = empty_like(src, (int(dims.sum()),) + shape[1:])
    dst = wrap(out, what, writable=True)
    recv_bytes = ffi.new("uint64_t[]", [int(d) * row_bytes for d in dims])
    _call(lib.smc_allgatherv(comm.handle, src.ptr, src.nbytes, dst.ptr, recv_bytes, _tag(src, shape[1:])), comm, what,
          src)
    return out


def reducescatter(comm, x, op, prescale, postscale, what):
    """This rank's share of the reduction, split along the first dimension by Horovod's rule: the first
    (rows % size) ranks get one extra row."""
    src = wrap(x, what)
    require_reducible(src, what)
    if len(src.shape) == 0:
        raise InvalidArgumentError("%s: a tensor with at least one dimension is required" % what)
    n, rows = comm.size, src.shape[0]
    per_row = src.count // rows if rows else 0
    shares = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    out = empty_like(src, (shares[comm.rank],) + tuple(src.shape[1:]))
    dst = wrap(out, what, writable=True)
    counts = ffi.new("uint64_t[]", [s * per_row for s in shares])
    divisor = n if op == ops.Average else 1
    rc = lib.smc_reducescatter(comm.handle, src.ptr, dst.ptr, counts, src.code, ops.C_OP[op], float(prescale),
                               float(postscale), divisor, _tag(src, src.shape))
    _call(rc, comm, what, src)
    return out


def alltoall(comm, x, splits, what):
    """Sends splits[j] rows to rank j; returns (rows received in rank order, rows received from each rank)."""
    src = wrap(x, what)
    n = comm.size
    shape = tuple(src.shape) if len(src.shape) > 0 else (1,)
    got = np.empty(n, dtype=np.int64)
    sent = np.array(splits, dtype=np.int64)
    eight = ffi.new("uint64_t[]", [8] * n)
    rc = lib.smc_alltoallv(comm.handle, ffi.from_buffer(sent), eight, ffi.from_buffer(got), eight, _tag(src, shape[1:]))
    _call(rc, comm, what, src)
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * src.itemsize
    out = empty_like(src, (int(got.sum()),) + shape[1:])
    dst = wrap(out, what, writable=True)
    rc = lib.smc_alltoallv(comm.handle, src.ptr, ffi.new("uint64_t[]", [s * row_bytes for s in splits]), dst.ptr,
                           ffi.new("uint64_t[]", [int(g) * row_bytes for g in got]), _tag(src, shape[1:]))
    _call(rc, comm, what, src)
    return out, got


# The engine's negotiation messages are usually a few hundred bytes: each rank sends a fixed block (its length, then
# the start of its message) so one exchange settles the common case; longer messages send their rest in a second.
_BYTES_BLOCK = 2048  # a few hundred tensors' cache ids


def allgather_bytes(comm, payload):
    """Every rank's bytes object, in rank order (the engine's negotiation messages)."""
    def gatherv(mine, every, sizes):
        rc = lib.smc_allgatherv(comm.handle, ffi.from_buffer(mine) if mine else ffi.NULL, len(mine),
                                ffi.from_buffer(every) if every else ffi.NULL, ffi.new("uint64_t[]", sizes), 0)
        if rc != 0:
            raise error_for(rc, "negotiation")
    return allgather_bytes_over(gatherv, comm.size, payload)


def allgather_bytes_over(gatherv, n, payload):
    """allgather_bytes with any transport: gatherv(mine, every, sizes) puts every rank's `mine` (sizes[r] bytes from
    rank r) into the bytearray `every`, in rank order."""
    head = _BYTES_BLOCK - 8
    block = bytearray(_BYTES_BLOCK)
    block[:8] = len(payload).to_bytes(8, "little")
    first = payload[:head]
    block[8:8 + len(first)] = first
    out = bytearray(_BYTES_BLOCK * n)
    gatherv(block, out, [_BYTES_BLOCK] * n)
    sizes = [int.from_bytes(out[r * _BYTES_BLOCK:r * _BYTES_BLOCK + 8], "little") for r in range(n)]
    views = [bytes(out[r * _BYTES_BLOCK + 8:r * _BYTES_BLOCK + 8 + min(s, head)]) for r, s in enumerate(sizes)]
    rest = [max(s - head, 0) for s in sizes]
    if any(rest):  # the same decision on every rank: all saw the same lengths
        tail = bytearray(sum(rest))
        gatherv(bytes(payload[head:]), tail, rest)
        at = 0
        for r in range(n):
            views[r] += bytes(tail[at:at + rest[r]])
            at += rest[r]
    return views


def barrier(comm, what="barrier"):
    _call(lib.smc_barrier(comm.handle), comm, what, None)
