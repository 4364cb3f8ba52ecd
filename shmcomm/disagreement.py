# SPDX-License-Identifier: Apache-2.0
"""After ranks across hosts disagree on a collective, every rank says the same thing: who passed what.

Each rank packs what it passed into a fixed row of integers (collective, dtype, op, scale factors, root, shape),
the rows are allgathered (with the agreement's deadline), and the message groups ranks that passed the same."""
import struct
import time

import numpy as np

from shmcomm import dtypes, ops
from shmcomm._native import ffi, lib
from shmcomm.exceptions import MismatchError

_WORDS = 32
_FIXED = 7            # kind, dtype, op, prescale, postscale, root, ndim; then the dimensions
KINDS = {lib.SMC_COLL_ALLREDUCE: "allreduce", lib.SMC_COLL_BROADCAST: "broadcast",
         lib.SMC_COLL_ALLGATHERV: "allgather", lib.SMC_COLL_ALLTOALLV: "alltoall", lib.SMC_COLL_BARRIER: "barrier",
         lib.SMC_COLL_REDUCESCATTER: "reducescatter"}  # the C core's codes (smc_coll_kind_t)
KIND = {name: code for code, name in KINDS.items()}


def _bits(value):
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _float(bits):
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def words(kind, dtype_key=0, shape=(), op=-1, prescale=1.0, postscale=1.0, root=-1):
    row = np.zeros(_WORDS, dtype=np.int64)
    dims = list(shape)[:_WORDS - _FIXED]
    row[:_FIXED] = (KIND[kind], dtype_key, op, _bits(prescale), _bits(postscale), root, len(shape))
    row[_FIXED:_FIXED + len(dims)] = dims
    return row


def gather(mine, mpi=None, host=None, timeout_s=60.0):
    """Every rank's row: over MPI (within the deadline) or over a shared-memory communicator. None if that fails."""
    if mpi is not None:
        from mpi4py import MPI

        from shmcomm.algorithms.agreement import poll

        every = np.zeros((mpi.Get_size(), _WORDS), dtype=np.int64)
        try:
            request = mpi.Iallgather([mine, MPI.INT64_T], [every, MPI.INT64_T])
            poll([request], time.monotonic() + timeout_s, lambda: MismatchError("late"))
        except (MismatchError, MPI.Exception):
            return None
        return every
    every = np.zeros((host.size, _WORDS), dtype=np.int64)
    rc = lib.smc_allgatherv(host.handle, ffi.from_buffer(mine), mine.nbytes, ffi.from_buffer(every),
                            ffi.new("uint64_t[]", [mine.nbytes] * host.size), 0)
    return every if rc == 0 else None


def _text(row, varying, type_name):
    kind, key, op, pre, post, root, ndim = (int(v) for v in row[:_FIXED])
    if KINDS.get(kind) == "barrier":
        return "barrier"
    dtype = dtypes.NAMES.get(key) or type_name.get(key) or "dtype#%d" % key
    dims = ", ".join("*" if d < 0 else str(d) for d in row[_FIXED:_FIXED + min(ndim, _WORDS - _FIXED)].tolist())
    text = "%s[%s]" % (dtype, dims)
    if varying[0]:
        text = "%s of %s" % (KINDS.get(kind, "?"), text)
    if varying[2] and op >= 0:
        text += " op %s" % ops.ReduceOp(op).name.lower()
    if (varying[3] or varying[4]) and KINDS.get(kind) in ("allreduce", "reducescatter"):
        text += " scaled by (pre %g, post %g)" % (_float(pre), _float(post))
    if varying[5] and root >= 0:
        text += " root %d" % root
    return text


def _ranks(ranks):
    return ("rank %d" % ranks[0]) if len(ranks) == 1 else "ranks %s" % ",".join(map(str, ranks))


def error(what, mine, every, type_name=None):
    """The MismatchError every rank raises: ranks grouped by what they passed."""
    if every is None:
        return MismatchError("%s: ranks disagree on the tensor or the collective (their descriptions could not be "
                             "collected)" % what)
    varying = [len(set(every[:, c].tolist())) > 1 for c in range(_FIXED)]
    names = dict(type_name or {})
    groups = {}
    for r, row in enumerate(every):
        groups.setdefault(_text(row, varying, names), []).append(r)
    if len(groups) == 1:
        return MismatchError("%s: ranks disagree on the arguments, though all passed %s" % (what, next(iter(groups))))
    return MismatchError("%s: ranks disagree: %s" % (what, "; ".join(
        "%s passed %s" % (_ranks(ranks), text) for text, ranks in sorted(groups.items(), key=lambda g: g[1][0]))))
