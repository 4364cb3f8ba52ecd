# SPDX-License-Identifier: Apache-2.0
"""What a collective is: its kind, dtype, shape, op, scale factors and root, described once.

Every check that ranks agree reads this description: its kind codes are the C core's own (smc_coll_kind_t, read
through cffi), and the core's descriptor check takes its `tag` from here; the engine's negotiation compares
descriptions; the cross-host agreement compares their `signature`. After a disagreement, ranks swap `words()`, and
the messages that say what ranks passed are written here (`disagreement()` across hosts, `listing()` in the
engine)."""
import functools
import struct
from typing import NamedTuple

import numpy as np

from shmcomm.vocabulary import dtypes
from shmcomm._native import lib
from shmcomm.transport import kernels
from shmcomm.vocabulary.ops import ReduceOp

MASK = (1 << 64) - 1

# The collective-kind codes of the C core (smc_coll_kind_t), by the names the API uses.
KIND = {"barrier": lib.SMC_COLL_BARRIER, "allreduce": lib.SMC_COLL_ALLREDUCE,
        "reducescatter": lib.SMC_COLL_REDUCESCATTER, "broadcast": lib.SMC_COLL_BROADCAST,
        "allgather": lib.SMC_COLL_ALLGATHERV, "alltoall": lib.SMC_COLL_ALLTOALLV}
KIND_NAME = {code: name for name, code in KIND.items()}
_REDUCING = ("allreduce", "reducescatter")
_ROWS = ("allgather", "alltoall")  # the first dimension may differ between ranks

_WORDS = 32           # a description as int64 words: kind, dtype, op, prescale, postscale, root, ndim, then dims
_FIXED = 7
ALL_FIELDS = frozenset(("kind", "op", "scale", "root"))  # fields text() names when asked (dtype and shape always)


class Collective(NamedTuple):
    """The part of a call that every rank must pass alike. For allgather and alltoall, `shape` holds the trailing
    dimensions only (the first may differ)."""
    kind: str
    dtype: int = -1       # buffers.Buffer.dtype_key()
    shape: tuple = ()
    op: int = -1          # ReduceOp
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1

    def signature(self, *extra):
        """A 64-bit digest of the whole description (and `extra` numbers, such as the path taken), equal on every
        rank for equal descriptions: the core's smc_signature, which the quick allreduce across hosts computes alike."""
        return _signature(self, extra)

    def summary(self):
        """The whole call in words: 'allreduce float32[2, 3] op Sum', 'broadcast float32[4] root 1'."""
        if self.kind == "barrier":
            return "barrier"
        dims = (("*",) if self.kind in _ROWS else ()) + tuple(str(d) for d in self.shape)
        text = "%s %s[%s]" % (self.kind, dtype_name(self.dtype), ", ".join(dims))
        if self.kind == "broadcast":
            text += " root %d" % self.root
        elif self.kind in _REDUCING:
            text += " op %s" % ReduceOp(self.op).name
            if self.prescale != 1.0 or self.postscale != 1.0:
                text += " prescale %g postscale %g" % (self.prescale, self.postscale)
        return text

    def words(self):
        row = np.zeros(_WORDS, dtype=np.int64)
        dims = list(self.shape)[:_WORDS - _FIXED]
        row[:_FIXED] = (KIND[self.kind], self.dtype, self.op, _bits(self.prescale), _bits(self.postscale), self.root,
                        len(self.shape))
        row[_FIXED:_FIXED + len(dims)] = dims
        return row

    @classmethod
    def from_words(cls, row):
        kind, key, op, pre, post, root, ndim = (int(v) for v in row[:_FIXED])
        dims = tuple(int(d) for d in row[_FIXED:_FIXED + min(ndim, _WORDS - _FIXED)])
        return cls(KIND_NAME.get(kind, "collective#%d" % kind), key, dims, op, _float(pre), _float(post), root)

    def text(self, varying=ALL_FIELDS, names=None):
        """What a rank passed, in words; `varying`: the fields worth naming (those that differ between ranks)."""
        if self.kind == "barrier":
            return "barrier"
        dtype = dtype_name(self.dtype, names)
        dims = (("*",) if self.kind in _ROWS else ()) + tuple(str(d) for d in self.shape)
        text = "%s[%s]" % (dtype, ", ".join(dims))
        if "kind" in varying:
            text = "%s of %s" % (self.kind, text)
        if "op" in varying and self.op >= 0:
            text += " op %s" % ReduceOp(self.op).name.lower()
        if "scale" in varying and self.kind in _REDUCING:
            text += " scaled by (pre %g, post %g)" % (self.prescale, self.postscale)
        if "root" in varying and self.root >= 0:
            text += " root %d" % self.root
        return text


@functools.lru_cache(maxsize=4096)  # a training loop passes the same shapes every step
def tag(dtype, shape):
    """The C core's tag: what its own descriptor (kind, dtype, count, op, root, scales) does not hold, the shape
    (a tuple), digested by the core's smc_shape_tag as the quick calls in C digest it. A function of its own because
    the smallest allreduce computes it without building a Collective."""
    return kernels.shape_tag(dtype, shape)


@functools.lru_cache(maxsize=4096)
def _signature(collective, extra):
    c = collective
    return kernels.signature(KIND[c.kind], c.dtype, c.shape, c.op, c.prescale, c.postscale, c.root, extra)


def dtype_name(key, names=None):
    """A dtype key in words; `names` adds the keys of types the core does not reduce (Buffer.type_name)."""
    if dtypes.device_code(key) is not None:
        return "cuda " + dtypes.NAMES[dtypes.device_code(key)]
    return dtypes.NAMES.get(key) or (names or {}).get(key) or "dtype#%d" % key


def listing(every):
    """'rank 0: allreduce float32[4] op Sum; rank 1: ...': every rank's call in full ({rank: Collective}), as the
    engine's negotiation reports a disagreement."""
    return "; ".join("rank %d: %s" % (r, c.summary()) for r, c in sorted(every.items()))


@functools.lru_cache(maxsize=1024)  # a training loop describes the same calls every step
def describe(kind, dtype=-1, shape=(), op=-1, prescale=1.0, postscale=1.0, root=-1):
    """The Collective for a call, keeping only what must agree for its kind."""
    if kind in _REDUCING:
        return Collective(kind, dtype, tuple(shape), int(op), float(prescale), float(postscale))
    if kind == "broadcast":
        return Collective(kind, dtype, tuple(shape), root=int(root))
    if kind in _ROWS:
        return Collective(kind, dtype, tuple(shape[1:]) if len(shape) else ())
    return Collective(kind)


def disagreement(every, names=None):
    """'rank 0 passed ...; ranks 1,2 passed ...': ranks grouped by what they passed ({rank: Collective}), naming the
    fields that differ."""
    known = list(every.values())
    varying = {field for field, values in (
        ("kind", {c.kind for c in known}), ("dtype", {c.dtype for c in known}), ("op", {c.op for c in known}),
        ("scale", {(c.prescale, c.postscale) for c in known}), ("root", {c.root for c in known})) if len(values) > 1}
    groups = {}
    for r, c in sorted(every.items()):
        groups.setdefault(c.text(varying, names), []).append(r)
    if len(groups) == 1:
        return "all passed %s" % next(iter(groups))
    return "; ".join("%s passed %s" % (_ranks(ranks), text) for text, ranks in sorted(groups.items(),
                                                                                   key=lambda g: g[1][0]))


@functools.lru_cache(maxsize=256)  # the same split every step of a training loop
def shares(count, parts):
    """Horovod's split of `count` rows (or elements) over `parts` ranks: the first (count % parts) get one more."""
    return tuple(count // parts + (1 if i < count % parts else 0) for i in range(parts))


def _ranks(ranks):
    return ("rank %d" % ranks[0]) if len(ranks) == 1 else "ranks %s" % ",".join(map(str, ranks))


def _bits(value):
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _float(bits):
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]
