# SPDX-License-Identifier: Apache-2.0
"""Blocking collectives on numpy arrays and torch CPU tensors, with Horovod's names and semantics.

Every rank must call the same collectives in the same order with agreeing arguments. When they do not, every rank
raises MismatchError for that call and the job can go on."""
import numpy as np

from shmcomm import basics, dtypes, ops
from shmcomm._native import error_for, ffi, lib
from shmcomm.buffers import empty_like, require_reducible, wrap
from shmcomm.exceptions import InvalidArgumentError, MismatchError

_MASK = (1 << 64) - 1
_DESCRIBE_WORDS = 32  # dtype, ndim, then up to 30 dims: what a rank says about its tensor after a shape mismatch


def _what(kind, name):
    return kind if name is None else "%s.%s" % (kind, name)


def _tag(buf, shape):
    return hash((buf.dtype_key(),) + tuple(shape)) & _MASK


def _raise(rc, comm, what, buf):
    err = error_for(rc, None)
    if isinstance(err, MismatchError) and "different shapes" in str(err):
        err = MismatchError("%s: ranks disagree on the tensor: %s" % (what, _describe_all(comm, buf)))
    elif what not in str(err):
        err = type(err)("%s: %s" % (what, err)) if not hasattr(err, "rank") else err
    raise err


def _describe_all(comm, buf):
    """After a shape mismatch every rank lands here together: swap descriptions so the message can name them."""
    mine = np.zeros(_DESCRIBE_WORDS, dtype=np.int64)
    dims = list(buf.shape)[: _DESCRIBE_WORDS - 2]
    mine[0], mine[1] = buf.dtype_key(), len(buf.shape)
    mine[2: 2 + len(dims)] = dims
    n = comm.topology.size
    every = np.zeros((n, _DESCRIBE_WORDS), dtype=np.int64)
    recv_bytes = ffi.new("uint64_t[]", [mine.nbytes] * n)
    rc = lib.smc_allgatherv(comm.handle, ffi.cast("void *", mine.ctypes.data), mine.nbytes,
                            ffi.cast("void *", every.ctypes.data), recv_bytes, 0)
    if rc != 0:
        return "(could not collect the shapes: %s)" % error_for(rc)
    parts = []
    for r in range(n):
        key, ndim = int(every[r, 0]), int(every[r, 1])
        dtype = dtypes.NAMES.get(key, buf.type_name() if key == buf.dtype_key() else "dtype#%d" % key)
        parts.append("rank %d has %s%s" % (r, dtype, list(int(d) for d in every[r, 2: 2 + min(ndim, 30)])))
    return "; ".join(parts)


def _call(rc, comm, what, buf):
    if rc != 0:
        _raise(rc, comm, what, buf)


def _output(src, output, shape, what):
    """The caller's output array after checking it fits, or a new one."""
    if output is None:
        out = empty_like(src, shape)
        return out, wrap(out, what, writable=True)
    dst = wrap(output, what, writable=True)
    if tuple(dst.shape) != tuple(shape) or dst.dtype_key() != src.dtype_key():
        raise InvalidArgumentError("%s: output is %s%s, expected %s%s" % (what, dst.type_name(), list(dst.shape),
                                                                         src.type_name(), list(shape)))
    return output, dst


def _allreduce(x, inplace, op, average, prescale_factor, postscale_factor, name, output=None):
    comm = basics.communicator()
    what = _what("allreduce", name)
    src = wrap(x, what, writable=inplace)
    require_reducible(src, what)
    op = ops.resolve(op, average)
    out, dst = (x, src) if inplace else _output(src, output, src.shape, what)
    divisor = comm.topology.size if op == ops.Average else 1
    rc = lib.smc_allreduce(comm.handle, src.ptr, dst.ptr, src.count, src.code, ops.C_OP[op], float(prescale_factor),
                           float(postscale_factor), divisor, _tag(src, src.shape))
    _call(rc, comm, what, src)
    return out


def allreduce(tensor, op=None, average=None, prescale_factor=1.0, postscale_factor=1.0, name=None, output=None):
    """The reduction of `tensor` over all ranks (default op: Average), in a new tensor or in `output`."""
    return _allreduce(tensor, False, op, average, prescale_factor, postscale_factor, name, output)


def allreduce_(tensor, op=None, average=None, prescale_factor=1.0, postscale_factor=1.0, name=None):
    """Reduces `tensor` over all ranks in place and returns it."""
    return _allreduce(tensor, True, op, average, prescale_factor, postscale_factor, name)


def _check_root(comm, root_rank, what):
    if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < comm.topology.size:
        raise InvalidArgumentError("%s: root rank %r is outside 0..%d" % (what, root_rank, comm.topology.size - 1))
    return int(root_rank)


def broadcast(tensor, root_rank, name=None, output=None):
    """root_rank's `tensor` on every rank, in a new tensor or in `output`."""
    comm = basics.communicator()
    what = _what("broadcast", name)
    root = _check_root(comm, root_rank, what)
    src = wrap(tensor, what)
    out, dst = _output(src, output, src.shape, what)
    _call(lib.smc_broadcast(comm.handle, src.ptr, dst.ptr, src.nbytes, root, _tag(src, src.shape)), comm, what, src)
    return out


def broadcast_(tensor, root_rank, name=None):
    """Overwrites `tensor` with root_rank's on every rank; returns it."""
    comm = basics.communicator()
    what = _what("broadcast", name)
    root = _check_root(comm, root_rank, what)
    buf = wrap(tensor, what, writable=True)
    _call(lib.smc_broadcast(comm.handle, buf.ptr, buf.ptr, buf.nbytes, root, _tag(buf, buf.shape)), comm, what, buf)
    return tensor


def _first_dims(comm, buf, what, kind):
    """Every rank's first dimension, exchanged under a tag of the trailing shape so that those must agree."""
    n = comm.topology.size
    shape = buf.shape if len(buf.shape) > 0 else (1,)
    mine = np.array([shape[0]], dtype=np.int64)
    every = np.empty(n, dtype=np.int64)
    recv_bytes = ffi.new("uint64_t[]", [8] * n)
    rc = kind(comm.handle, mine, every, recv_bytes, _tag(buf, shape[1:]))
    _call(rc, comm, what, buf)
    return every, shape


def _allgather_dims(handle, mine, every, recv_bytes, tag):
    return lib.smc_allgatherv(handle, ffi.cast("void *", mine.ctypes.data), 8, ffi.cast("void *", every.ctypes.data),
                              recv_bytes, tag)


def allgather(tensor, name=None):
    """Concatenation of every rank's `tensor` along the first dimension, which may differ between ranks."""
    comm = basics.communicator()
    what = _what("allgather", name)
    src = wrap(tensor, what)
    dims, shape = _first_dims(comm, src, what, _allgather_dims)
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * src.itemsize
    out = empty_like(src, (int(dims.sum()),) + tuple(shape[1:]))
    dst = wrap(out, what, writable=True)
    recv_bytes = ffi.new("uint64_t[]", [int(d) * row_bytes for d in dims])
    rc = lib.smc_allgatherv(comm.handle, src.ptr, src.nbytes, dst.ptr, recv_bytes, _tag(src, shape[1:]))
    _call(rc, comm, what, src)
    return out


def reducescatter(tensor, op=ops.Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    """Rank r receives its share of the reduction of `tensor` along the first dimension; with rows that do not
    divide evenly, the first (rows % size) ranks get one extra row (Horovod's rule)."""
    comm = basics.communicator()
    what = _what("reducescatter", name)
    src = wrap(tensor, what)
    require_reducible(src, what)
    op = ops.resolve(op)
    if len(src.shape) == 0:
        raise InvalidArgumentError("%s: a tensor with at least one dimension is required" % what)
    n, me = comm.topology.size, comm.topology.rank
    rows = src.shape[0]
    per_row = src.count // rows if rows else 0
    shares = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    out = empty_like(src, (shares[me],) + tuple(src.shape[1:]))
    dst = wrap(out, what, writable=True)
    counts = ffi.new("uint64_t[]", [s * per_row for s in shares])
    divisor = n if op == ops.Average else 1
    rc = lib.smc_reducescatter(comm.handle, src.ptr, dst.ptr, counts, src.code, ops.C_OP[op], float(prescale_factor),
                               float(postscale_factor), divisor, _tag(src, src.shape))
    _call(rc, comm, what, src)
    return out


def _splits_list(splits, rows, n, what):
    if splits is None:
        if rows % n:
            raise InvalidArgumentError("%s: the first dimension (%d) does not divide by the number of ranks (%d); pass "
                                       "splits" % (what, rows, n))
        return [rows // n] * n
    if hasattr(splits, "tolist"):
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        raise InvalidArgumentError("%s: splits %s must have %d non-negative entries that add up to the first "
                                   "dimension (%d)" % (what, splits, n, rows))
    return splits


def alltoall(tensor, splits=None, name=None):
    """Sends splits[j] rows of `tensor` (in order) to rank j and returns the rows received, in rank order. With
    `splits`, also returns how many rows came from each rank (as Horovod does)."""
    comm = basics.communicator()
    what = _what("alltoall", name)
    src = wrap(tensor, what)
    n = comm.topology.size
    shape = src.shape if len(src.shape) > 0 else (1,)
    send = _splits_list(splits, shape[0], n, what)
    got = np.empty(n, dtype=np.int64)
    sent = np.array(send, dtype=np.int64)
    eight = ffi.new("uint64_t[]", [8] * n)
    rc = lib.smc_alltoallv(comm.handle, ffi.cast("void *", sent.ctypes.data), eight,
                           ffi.cast("void *", got.ctypes.data), eight, _tag(src, shape[1:]))
    _call(rc, comm, what, src)
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * src.itemsize
    out = empty_like(src, (int(got.sum()),) + tuple(shape[1:]))
    dst = wrap(out, what, writable=True)
    rc = lib.smc_alltoallv(comm.handle, src.ptr, ffi.new("uint64_t[]", [s * row_bytes for s in send]), dst.ptr,
                           ffi.new("uint64_t[]", [int(g) * row_bytes for g in got]), _tag(src, shape[1:]))
    _call(rc, comm, what, src)
    if splits is None:
        return out
    if src.is_torch:
        import torch

        return out, torch.from_numpy(got.astype(np.int32))
    return out, got.astype(np.int32)


def barrier():
    comm = basics.communicator()
    _call(lib.smc_barrier(comm.handle), comm, "barrier", None)
