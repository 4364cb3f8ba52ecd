# SPDX-License-Identifier: Apache-2.0
"""Turns numpy arrays and torch CPU tensors into what the C core takes: a pointer, a count and a type code.

The checks here are the ones Horovod users know (contiguous, supported dtype, right device); they run before any
rank touches shared memory."""
import math
import sys

import numpy as np

from shmcomm.vocabulary import dtypes
from shmcomm.transport import memory
from shmcomm.vocabulary.exceptions import InvalidArgumentError


_EMPTY = memory.scratch(1)  # the address of empty tensors


class Buffer:
    """A borrowed view of an array. Holds a reference to the array so its memory outlives the call."""

    __slots__ = ("array", "ptr", "count", "code", "itemsize", "shape", "is_torch", "on_device")

    def __init__(self, array, ptr, count, code, itemsize, shape, is_torch, on_device=False):
        self.array = array
        self.ptr = ptr
        self.count = count
        self.code = code          # core dtype code, or None for types that can be moved but not reduced
        self.itemsize = itemsize
        self.shape = shape
        self.is_torch = is_torch
        self.on_device = on_device  # a CUDA tensor: `ptr` is a device address, never to be touched on the host

    @property
    def nbytes(self):
        return self.count * self.itemsize

    def dtype_key(self):
        """An integer that is equal across ranks exactly when the element types are equal."""
        if self.code is not None:
            return self.code + dtypes.DEVICE_KEY if self.on_device else self.code
        name = ("cuda " if self.on_device else "") + self.type_name()
        return dtypes.foreign_key(name)

    def type_name(self):
        return dtypes.NAMES.get(self.code) or str(self.array.dtype).replace("torch.", "")


def is_torch(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


class _KeptViews:
    """Numpy views of torch tensors' memory, kept by (address, shape, torch dtype) and found again for less than half
    of what making one costs (a small collective's time is made of such costs). A view never owns that memory and is
    handed out only for a tensor that has this memory now, while the caller holds it; a new tensor at the same memory
    rightly gets the same view. Only views are kept, never tensors."""

    KEPT = 1024  # views kept before all are dropped: a model's tensors one by one; each a few hundred bytes

    def __init__(self):
        self.views = {}
        self.torch = None  # (torch.Tensor, torch.strided, torch.bfloat16, {torch dtype: its view's numpy dtype})

    def _seen(self):
        torch = sys.modules.get("torch")
        if torch is not None:
            kinds = {kind: np.dtype(np.int16) if kind is torch.bfloat16 else dtypes.numpy_dtype(code)
                     for kind, code in dtypes.torch_codes().items()}  # bfloat16's view holds its bits
            self.torch = (torch.Tensor, torch.strided, torch.bfloat16, kinds)
        return self.torch

    def view(self, x):
        """(the view, None) of `x`, a contiguous dense CPU tensor of a dtype the core reduces; (its int16 view,
        dtypes.BFLOAT16) for a bfloat16 one; else None."""
        t = self.torch or self._seen()
        if t is None or type(x) is not t[0] or not x.is_cpu or x.layout is not t[1] or not x.is_contiguous() \
                or x.is_neg():
            return None
        key = (x.data_ptr(), x.shape, x.dtype)
        kept = self.views.get(key)
        if kept is None:
            kind = t[3].get(key[2])
            if kind is None or not key[0]:  # another dtype, or no memory (empty)
                return None
            if len(self.views) >= self.KEPT:
                self.views.clear()
            array = memory.view(memory.at(key[0]), x.numel() * kind.itemsize).view(kind).reshape(key[1])
            kept = self.views[key] = (array, dtypes.BFLOAT16 if key[2] is t[2] else None)
        return kept


_kept = _KeptViews()
_numpy_kinds = []  # the torch dtypes numpy shares, once torch is seen


def host_view(x):
    """A numpy array sharing the memory of `x` when `x` is a contiguous CPU torch tensor of a dtype numpy has, so
    that it can take the core's quickest calls; otherwise None (the full path then moves it, or says what is wrong).
    The array holds `x`: it may outlive the caller's reference."""
    torch = sys.modules.get("torch")
    if torch is None or type(x) is not torch.Tensor or not x.is_cpu or x.layout is not torch.strided:
        return None
    if not _numpy_kinds:
        _numpy_kinds.append({torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
                             torch.int32, torch.int64})
    if x.dtype not in _numpy_kinds[0] or not x.is_contiguous():
        return None
    return (x.detach() if x.requires_grad else x).numpy()


# held_view(x): (a numpy view of the memory of `x`, None) as host_view(x) gives, for a tensor the caller holds while
# it uses the view (the view does not hold it), kept from call to call; for a bfloat16 tensor (its int16 view,
# dtypes.BFLOAT16), since numpy has no bfloat16 and the quick calls are told what its elements are; else None.
# A bound method: no frame of its own.
held_view = _kept.view


def _numpy_failure(x, what, writable):
    """Why numpy refused to export `x` as a plain buffer, in the user's terms."""
    if not x.flags.c_contiguous:
        return InvalidArgumentError("%s: tensor is required to be contiguous" % what)
    if writable and not x.flags.writeable:
        return InvalidArgumentError("%s: the output array is read-only" % what)
    return None


def wrap(x, what, writable=False):
    if isinstance(x, np.ndarray):
        try:
            # from_buffer is the cheapest way to a pointer (a fifth of x.ctypes.data), and it refuses what the core
            # must not get: non-contiguous arrays. (Its require_writable flag costs more than reading the flag.)
            ptr = memory.address(x)
            if writable and not x.flags.writeable:
                raise BufferError
        except (BufferError, TypeError, ValueError):
            error = _numpy_failure(x, what, writable)
            if error is not None:
                raise error from None
            if x.dtype.fields is not None:
                raise InvalidArgumentError("%s: structured dtype %s is not supported" % (what, x.dtype)) from None
            ptr = memory.at(x.ctypes.data)  # a dtype numpy cannot describe as a buffer (ml_dtypes)
        dtype = x.dtype
        return Buffer(x, ptr, x.size, dtypes.numpy_code(dtype), dtype.itemsize, x.shape, False)
    if is_torch(x):
        if x.device.type != "cpu":
            raise InvalidArgumentError(
                "%s: tensor is on %s; shmcomm moves CPU and CUDA tensors only (move it with .cpu())" % (what, x.device))
        if not x.is_contiguous():
            raise InvalidArgumentError("%s: tensor is required to be contiguous" % what)
        if x.is_sparse or x.is_quantized:
            raise InvalidArgumentError("%s: sparse and quantized tensors are not supported" % what)
        # An empty tensor's data pointer is NULL, which the core refuses for any buffer it may touch; numpy gives
        # empty arrays a real address, and so does this (nothing is read or written through it).
        ptr = memory.at(x.data_ptr()) if x.numel() else _EMPTY
        return Buffer(x, ptr, x.numel(), dtypes.torch_codes().get(x.dtype), x.element_size(), tuple(x.shape), True)
    raise InvalidArgumentError("%s: expected a numpy array or a torch tensor, got %s" % (what, type(x).__name__))


def wrap_device(x, what):
    """A CUDA tensor's Buffer, for the checks and the negotiation only: its pointer is a device address."""
    if not x.is_contiguous():
        raise InvalidArgumentError("%s: tensor is required to be contiguous" % what)
    if x.is_sparse or x.is_quantized:
        raise InvalidArgumentError("%s: sparse and quantized tensors are not supported" % what)
    return Buffer(x, None, x.numel(), dtypes.torch_codes().get(x.dtype), x.element_size(), tuple(x.shape), True,
                  on_device=True)


def require_reducible(buf, what):
    if buf.code is None:
        raise InvalidArgumentError(
            "%s: tensor type %s is not supported for reductions (supported: %s)"
            % (what, buf.type_name(), ", ".join(sorted(dtypes.NAMES.values()))))


def empty_like(buf, shape):
    """A new array of the same kind and dtype as `buf`, with the given shape."""
    if buf.is_torch:
        import torch

        return torch.empty(shape, dtype=buf.array.dtype)
    return np.empty(shape, dtype=buf.array.dtype)


def output_for(src, output, shape, what):
    """The caller's output array after checking it fits, or a new one; with its Buffer."""
    if output is None:
        out = empty_like(src, shape)
        return out, wrap(out, what, writable=True)
    dst = wrap(output, what, writable=True)
    if tuple(dst.shape) != tuple(shape) or dst.dtype_key() != src.dtype_key():
        raise InvalidArgumentError("%s: output is %s%s, expected %s%s" % (what, dst.type_name(), list(dst.shape),
                                                                         src.type_name(), list(shape)))
    return output, dst


def output_or_scratch(src, output, shape, what):
    """(out, dst, error): output_for's array and Buffer, or, when the caller's output does not fit, a new array and
    the error. A collective whose peers are already on their way takes part with the new array and raises the
    error afterwards, so that no peer is left waiting for this rank."""
    try:
        return output_for(src, output, shape, what) + (None,)
    except InvalidArgumentError as error:
        error.told_peers = True  # this rank takes part after all: it owes the peers no refusal (Communicator.refused)
        return output_for(src, None, shape, what) + (error,)


def row_bytes(buf, shape):
    """Bytes per row along the first dimension of `shape` (shape[1:]'s elements times the item size)."""
    return math.prod(shape[1:]) * buf.itemsize
