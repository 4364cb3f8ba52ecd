# SPDX-License-Identifier: Apache-2.0
"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", arXiv:2006.02924), Horovod's
`op=Adasum`, on the CPU.

Two gradients a and b combine as (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b, tensor by tensor, in a binary
tree over N = 2^k ranks (allreduce() says how). Stages make it hierarchical: the levels inside a host run over its
shared memory, those between hosts over MPI, each rank carrying only its 1/local_size slice across the network."""
import numpy as np

from shmcomm.vocabulary import dtypes
from shmcomm._native import lib
from shmcomm.transport import memory
from shmcomm.vocabulary.buffers import _EMPTY
from shmcomm.vocabulary.exceptions import InvalidArgumentError, TimeoutError
from shmcomm.transport import kernels

_NORM_FLOOR = 1e-8   # Horovod's: below it a vector's coefficient stays 1 (no division by a vanishing norm)
_MPI_TAG = 0x5AD     # apart from the agreement's (0x5AC) and the ring's tags on the same MPI communicator

NOT_POWER_OF_TWO = "Running Adasum with non-power-of-two ranks is not supported yet."


def is_power_of_two(n):
    return n > 0 and n & (n - 1) == 0


def _ptr(array):
    return memory.address(array) if array.nbytes else _EMPTY


class ShmStage:
    """Levels over a shared-memory transport: the pair exchange is an alltoallv with one non-empty pair, the sums
    an allgatherv; `tag` (the call's description) lets the core see ranks that disagree."""

    def __init__(self, transport, tag, what):
        self.transport, self.tag, self.what = transport, tag, what
        self.rank, self.size = transport.rank, transport.size

    def exchange(self, peer, send, recv):
        send_sizes, recv_sizes = [0] * self.size, [0] * self.size
        send_sizes[peer], recv_sizes[peer] = send.nbytes, recv.nbytes
        self.transport.alltoallv(_ptr(send), send_sizes, _ptr(recv), recv_sizes, self.tag, self.what)

    def gather(self, values):
        every = np.empty((self.size, values.size), dtype=np.float64)
        self.transport.allgatherv(_ptr(values), values.nbytes, _ptr(every), [values.nbytes] * self.size, self.tag,
                                  self.what)
        return every


class MpiStage:
    """Levels over an MPI transport (after the agreement): point-to-point exchanges and gathers, each bounded by
    the transport's deadline."""

    def __init__(self, transport, what):
        self.transport, self.what = transport, what
        self.rank, self.size = transport.rank, transport.size

    def exchange(self, peer, send, recv):
        t = self.transport
        t.usable(self.what)

        def late():
            t.broken = "an Adasum exchange with rank %d was abandoned" % t.ranks[peer]
            return TimeoutError("%s: rank %d did not send its half within %.0f s (SHMCOMM_TIMEOUT sets the limit)"
                                % (self.what, t.ranks[peer], t.timeout_s))
        t.exchange(peer, send.view(np.uint8) if send.nbytes else None, send.nbytes,
                   recv.view(np.uint8) if recv.nbytes else None, t.deadline(), _MPI_TAG, late)

    def gather(self, values):
        every = self.transport.allgather_bytes(values.tobytes())
        return np.array([np.frombuffer(b, dtype=np.float64) for b in every])


def stage_for(transport, tag, what):
    """The stage over a transport: shared memory (the core checks `tag`), or MPI (the caller has agreed)."""
    return MpiStage(transport, what) if hasattr(transport, "exchange") else ShmStage(transport, tag, what)


def run(stages, src_ptr, dst_ptr, count, code, sizes, prescale, postscale, what):
    """Checks, then allreduce() on the memory at src_ptr and dst_ptr (`count` elements of `code`)."""
    check(code, _product(s.size for s in stages), what, [s.size for s in stages])
    nbytes = count * kernels.itemsize(code)
    src = memory.view(src_ptr, nbytes)
    dst = memory.view(dst_ptr, nbytes)
    allreduce(stages, src, dst, code, sizes, prescale, postscale)


def _product(values):
    out = 1
    for v in values:
        out *= v
    return out


def check(code, size, what, stage_sizes):
    """Raises before anything moves: only floats combine, and only in power-of-two groups (Horovod's rule)."""
    if code not in (lib.SMC_FLOAT32, lib.SMC_FLOAT64) and code not in kernels.HALF:
        raise InvalidArgumentError("%s: Adasum combines floating-point tensors only (float16, bfloat16, float32, "
                                   "float64), not %s" % (what, dtypes.NAMES.get(code, code)))
    if not all(is_power_of_two(n) for n in [size] + list(stage_sizes)):
        raise NotImplementedError("%s: %s (%d ranks%s)" % (what, NOT_POWER_OF_TWO, size, "" if len(stage_sizes) < 2
                                  else " as %s per stage" % " x ".join(map(str, stage_sizes))))


def allreduce(stages, src, dst, code, sizes, prescale, postscale):
    """Adasum of the uint8 buffers `src` (this rank's) into `dst` (may be the same memory) over `stages`; `sizes`:
    the element count of each tensor packed in the buffer, each combined with coefficients of its own (a coefficient
    stays 1 where a norm is below 1e-8).

    Horovod's recursive vector-halving, distance-doubling: at distance d, rank r and its partner r ^ d hold the same
    segment; the left one (bit d clear) keeps its first half, the right one the second. Each computes the partial dot
    products of each tensor on its piece, the 2d ranks that hold the whole vectors sum them, and all scale alike; the
    exchanges then run backwards to give every rank all of the result. Traffic per rank is a ring's, in 2 log2(N)
    steps. With ranks numbered host by host, the stages make the same tree as a flat run. Sums of dot products are
    exchanged as float64 and added in rank order, so every rank of a group scales alike; 16-bit floats are combined
    in float32 and rounded once at the end."""
    if code in kernels.HALF:
        work = kernels.widened(src, code)
    else:
        if dst.ctypes.data != src.ctypes.data:
            dst[:] = src
        work = dst.view(dtypes.numpy_dtype(code))
    if prescale != 1.0:
        work *= prescale
    bounds = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    lo, hi, trail = 0, work.size, []
    for s, stage in enumerate(stages):
        level = 1
        while level < stage.size:
            peer, left = stage.rank ^ level, not stage.rank & level
            mid = lo + (hi - lo) // 2
            keep, give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
            theirs = np.empty(keep[1] - keep[0], dtype=work.dtype)
            stage.exchange(peer, np.ascontiguousarray(work[give[0]:give[1]]), theirs)
            mine = work[keep[0]:keep[1]]
            a, b = (mine, theirs) if left else (theirs, mine)
            pieces = _pieces(bounds, keep)
            sums = _group_sums(stages, s, level, _dots(a, b, pieces, len(sizes)))
            _combine(mine, a, b, pieces, sums)
            trail.append((stage, peer, left, (lo, hi)))
            lo, hi = keep
            level <<= 1
    for stage, peer, left, (outer_lo, outer_hi) in reversed(trail):
        mid = outer_lo + (outer_hi - outer_lo) // 2
        other = (mid, outer_hi) if left else (outer_lo, mid)
        received = np.empty(other[1] - other[0], dtype=work.dtype)
        stage.exchange(peer, np.ascontiguousarray(work[lo:hi]), received)
        work[other[0]:other[1]] = received
        lo, hi = outer_lo, outer_hi
    if postscale != 1.0:
        work *= postscale
    if code in kernels.HALF:
        kernels.narrow_into(dst, work, code)


def _pieces(bounds, segment):
    """[(tensor index, start, end)] of the tensors that overlap `segment`, in the segment's own coordinates."""
    lo, hi = segment
    first = int(np.searchsorted(bounds, lo, side="right")) - 1
    out = []
    for t in range(max(first, 0), len(bounds) - 1):
        start, end = max(int(bounds[t]), lo), min(int(bounds[t + 1]), hi)
        if start >= hi:
            break
        if end > start:
            out.append((t, start - lo, end - lo))
    return out


def _dots(a, b, pieces, tensors):
    """Per tensor: (a.b, |a|^2, |b|^2) over this rank's piece, in float64; zeros for tensors it holds none of."""
    values = np.zeros(3 * tensors, dtype=np.float64)
    for t, start, end in pieces:
        x = a[start:end].astype(np.float64, copy=False)
        y = b[start:end].astype(np.float64, copy=False)
        values[3 * t:3 * t + 3] = (np.dot(x, y), np.dot(x, x), np.dot(y, y))
    return values


def _group_sums(stages, s, level, values):
    """The sums over the 2 * level ranks of stage `s` that hold the two vectors between them (with every rank of
    the earlier stages, which each hold a slice)."""
    for earlier in stages[:s]:
        values = earlier.gather(values).sum(axis=0)
    every = stages[s].gather(values)
    first = stages[s].rank // (2 * level) * (2 * level)
    return every[first:first + 2 * level].sum(axis=0)


def _combine(out, a, b, pieces, sums):
    for t, start, end in pieces:
        dot, a_norm, b_norm = sums[3 * t:3 * t + 3]
        a_coeff = 1.0 - dot / a_norm * 0.5 if a_norm >= _NORM_FLOOR else 1.0
        b_coeff = 1.0 - dot / b_norm * 0.5 if b_norm >= _NORM_FLOOR else 1.0
        out[start:end] = a_coeff * a[start:end] + b_coeff * b[start:end]
