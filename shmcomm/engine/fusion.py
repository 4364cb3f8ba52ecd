# SPDX-License-Identifier: Apache-2.0
"""Tensor fusion: many small allreduces become one.

Agreed allreduce responses with the same process set, dtype, op and scale factors are packed, in response order, into
one buffer of at most the fusion threshold, reduced once, and unpacked. Grouping looks only at the responses, which
are identical on every rank, so every rank forms the same groups. A rank that has joined packs zeros in place of the
tensor it does not have. CUDA tensors (their dtype keys are dtypes.DEVICE_KEY apart, so they never share a group
with CPU tensors) are fused on their device by their communicator (algorithms/device.py, DeviceComm.run_fused)."""
import math
import weakref

import numpy as np

from shmcomm.vocabulary import dtypes
from shmcomm.transport import memory
from shmcomm.vocabulary.buffers import output_for
from shmcomm.vocabulary.exceptions import NotSupportedError
from shmcomm.vocabulary.ops import ReduceOp
from shmcomm.transport import kernels


def itemsize(key):
    """The element size of a dtype key, a CUDA tensor's included."""
    code = dtypes.device_code(key)
    return kernels.itemsize(key if code is None else code)


def on_device(group):
    return dtypes.device_code(group[0].sig.collective.dtype) is not None


def nbytes(sig, itemsize):
    return math.prod(sig.collective.shape) * itemsize  # math.prod: a tenth of np.prod's cost on a short tuple


def groups(responses, threshold, itemsize_of):
    """Splits a run of agreed allreduce responses into fusion groups (lists of responses)."""
    out, current, key, used = [], [], None, 0
    for resp in responses:
        c = resp.sig.collective
        size = nbytes(resp.sig, itemsize_of(c.dtype))
        this_key = (resp.sig.set_key, c.dtype, c.op, c.prescale, c.postscale)
        if current and (this_key != key or used + size > threshold):
            out.append(current)
            current, used = [], 0
        current.append(resp)
        key = this_key
        used += size
    if current:
        out.append(current)
    return out


class FusionBuffer:
    """A reusable byte buffer per communicator, grown on demand, so steady-state steps allocate nothing. Where the
    communicator offers shared buffers (a host's ranks: algorithms/host.py), it is one that every rank maps, and its
    in-place allreduce reads and writes the peers' buffers directly (csrc/coll/window.c). Making one is collective,
    which growing here is: every rank runs the same groups in the same order, so every rank grows a communicator's
    buffer in the same group, to the same size."""

    def __init__(self):
        self.bufs = weakref.WeakKeyDictionary()  # a removed process set's communicator takes its buffer along

    def get(self, nbytes, comm):
        buf = self.bufs.get(comm)
        if buf is None or buf.nbytes < nbytes:
            size = max(nbytes, 2 * (0 if buf is None else buf.nbytes))
            share = getattr(comm, "shared_buffer", None) if comm.size > 1 else None
            buf = share(size, "fusion buffer") if share is not None else np.empty(size, dtype=np.uint8)
            self.bufs[comm] = buf
        return buf


def run_group(comm, group, requests, fusion, itemsize, timeline):
    """Packs, reduces once and unpacks one group; returns {name: result} for this rank's requests."""
    sizes = [nbytes(r.sig, itemsize) for r in group]
    total = sum(sizes)
    buf = fusion.get(total, comm)
    base = memory.address(buf)
    names = [r.name for r in group]
    timeline.begin(names, "MEMCPY_IN_FUSION_BUFFER")
    at, views = 0, []
    for resp, size in zip(group, sizes):
        req = requests.get(resp.name)
        if req is None:
            buf[at:at + size] = 0  # joined: contribute zeros
            views.append(None)
        else:
            src = req.buffer
            memory.copy(base + at, src.ptr, size)
            views.append(src)
        at += size
    timeline.end(names, "MEMCPY_IN_FUSION_BUFFER")
    first = group[0].sig.collective
    timeline.begin(names, "ALLREDUCE")
    what = "fused allreduce of %s" % ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
    if first.op == ReduceOp.Adasum:  # each tensor (layer) keeps coefficients of its own
        comm.adasum(base, base, total // itemsize, first.dtype, [s // itemsize for s in sizes], first.prescale,
                    first.postscale, what)
    else:
        comm.allreduce_raw(base, total // itemsize, first.dtype, first.op, first.prescale, first.postscale, what)
    timeline.end(names, "ALLREDUCE")
    timeline.begin(names, "MEMCPY_OUT_FUSION_BUFFER")
    results, at = {}, 0
    for resp, size, src in zip(group, sizes, views):
        if src is not None:
            req = requests[resp.name]
            out, dst = (req.tensor, src) if req.output is req.tensor else output_for(src, req.output,
                                                                                               src.shape, req.what)
            memory.copy(dst.ptr, base + at, size)
            results[resp.name] = out
        at += size
    timeline.end(names, "MEMCPY_OUT_FUSION_BUFFER")
    return results


def run_device_group(group, requests, timeline):
    """A group of CUDA tensors, packed and reduced on their device by their communicator. A rank that has joined has
    no tensors (nor a device communicator) to contribute zeros from: every rank fails the group alike instead."""
    if group[0].joined:
        raise NotSupportedError("%s: ranks %s have called join(); join() covers allreduces of CPU tensors only"
                                % (group[0].name, ", ".join(map(str, group[0].joined))))
    names = [r.name for r in group]
    timeline.begin(names, "ALLREDUCE")
    try:
        return requests[names[0]].comm.run_fused([requests[name] for name in names])
    finally:
        timeline.end(names, "ALLREDUCE")
