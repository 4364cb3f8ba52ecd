# SPDX-License-Identifier: Apache-2.0
"""torch.distributed's reduction ops and tensors as shmcomm's collectives take them: which shmcomm op (and prescale)
a torch ReduceOp means for a dtype, and flat, contiguous views that any dtype's bytes travel in."""
import functools

import torch
import torch.distributed as dist

from shmcomm.transport import memory
from shmcomm.vocabulary import ops
from shmcomm.vocabulary.buffers import held_view, host_view
from shmcomm.vocabulary.dtypes import numpy_dtype, torch_codes
from shmcomm.vocabulary.exceptions import InvalidArgumentError, NotSupportedError

_RED = dist.ReduceOp.RedOpType
# torch's ops by their numbers: its enum's own hashing and comparisons cost a microsecond each, per call.
_SUM, _AVG, _PRODUCT, _MIN, _MAX, _BAND, _BOR, _BXOR, _PREMUL_SUM = (
    _RED.SUM.value, _RED.AVG.value, _RED.PRODUCT.value, _RED.MIN.value, _RED.MAX.value, _RED.BAND.value,
    _RED.BOR.value, _RED.BXOR.value, _RED.PREMUL_SUM.value)
_NAMES = {kind.value: name for name, kind in _RED.__members__.items()}
_ELEMENTWISE = {_SUM: ops.Sum, _AVG: ops.Average, _PRODUCT: ops.Product, _MIN: ops.Min, _MAX: ops.Max,
                _PREMUL_SUM: ops.Sum}
# A bool tensor reduces as bytes of 0 and 1: a sum or maximum is a logical or, a product or minimum a logical and.
_BOOL = {_SUM: ops.Max, _MAX: ops.Max, _BOR: ops.Max, _PRODUCT: ops.Min, _MIN: ops.Min, _BAND: ops.Min}
_BITWISE = {_BAND: torch.bitwise_and, _BOR: torch.bitwise_or, _BXOR: torch.bitwise_xor}
# What reduction() gives without a factor, by the number that torch hashes a ReduceOp or RedOpType as (its kind's).
_PLAIN = {kind: op for kind, op in _ELEMENTWISE.items() if kind != _PREMUL_SUM}
# The dtypes that host_view() gives numpy views of: the core's, but bfloat16, which numpy lacks.
_NUMPY = {kind: numpy_dtype(code) for kind, code in torch_codes().items() if kind is not torch.bfloat16}


class HostViews:
    """data() and reduction() for a process group, which moves the same tensors call after call: the numpy view of a
    tensor is kept by its memory (address, length and dtype) and found again for a fraction of what making one costs.

    A view never owns that memory: it is used only for a tensor that has this memory now, while the call holds the
    tensor; a new tensor at the same memory rightly gets the same view. Only views are kept, never tensors, so a
    tensor made for one call (a concatenation) takes data() instead: nothing else would hold it while the view is
    used."""

    KEPT = 64  # views kept before all are dropped: more than a step moves in distinct tensors, each a few hundred bytes

    def __init__(self):
        self._views = {}

    def _view(self, tensor):
        """The flat numpy view of a contiguous CPU tensor of a dtype numpy has, else None (as host_view)."""
        if type(tensor) is not torch.Tensor or not tensor.is_cpu or tensor.layout is not torch.strided \
                or not tensor.is_contiguous():
            return None
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
        array = self._views.get(key)
        if array is None and key[1] and key[2] in _NUMPY:
            if len(self._views) >= self.KEPT:
                self._views.clear()
            array = self._views[key] = memory.view(memory.at(key[0]), key[1] * tensor.element_size()).view(
                _NUMPY[key[2]])
        return array

    def data(self, tensor, what):
        """As data(tensor, what)."""
        array = self._view(tensor)
        return data(tensor, what) if array is None else array

    def reduction(self, tensor, op, what):
        """As reduction(tensor, op, what)."""
        plain = self.plain(tensor, op)
        return reduction(tensor, op, what) if plain is None else (plain[0], plain[1], 1.0)

    def plain(self, tensor, op):
        """(data, shmcomm's op) where reduction(tensor, op) gives them with no prescale factor and data is a numpy
        view, or a bfloat16 tensor flat (the collectives take it through a kept view of its bits); else None."""
        shmcomm_op = _PLAIN.get(hash(op))
        if shmcomm_op is None:
            return None
        array = self._view(tensor)
        if array is None and tensor.dtype is torch.bfloat16 and tensor.is_contiguous():
            flat = tensor.reshape(-1)  # a view: the kept view made here is the one the collectives then find
            array = flat if held_view(flat) is not None else None
        return None if array is None else (array, shmcomm_op)


def reduction(tensor, op, what):
    """How shmcomm reduces `tensor` under torch's `op` (a ReduceOp or a RedOpType): (what the collectives take for
    it, as data() gives, shmcomm's op, the prescale factor: PREMUL_SUM's, else 1), or (tensor, None, 1) for the
    bitwise ops, which the caller reduces itself from gathered copies.

    Raises:
        NotSupportedError: the op is not defined for the dtype, as in torch (bitwise ops on floating point, ordering
            ops on complex numbers) or shmcomm has no arithmetic for the dtype.
    """
    kind = (op.op if isinstance(op, dist.ReduceOp) else op).value
    factor = 1.0 if kind != _PREMUL_SUM else _factor(op)
    dtype = tensor.dtype
    if kind in _ELEMENTWISE:
        array = host_view(tensor)  # the common case: a plain tensor of a dtype numpy and the core share
        if array is not None:
            return (array if array.ndim == 1 else array.reshape(-1)), _ELEMENTWISE[kind], factor
    if dtype == torch.bool:
        if kind == _BXOR:
            return tensor, None, 1.0
        if kind not in _BOOL:
            raise NotSupportedError("%s: %s is not defined for bool tensors" % (what, _NAMES[kind]))
        return data(tensor, what), _BOOL[kind], factor
    if kind in _BITWISE:
        if dtype.is_floating_point or dtype.is_complex:
            raise NotSupportedError("%s: %s needs an integer or bool tensor, not %s" % (what, _NAMES[kind], dtype))
        return tensor, None, 1.0
    if dtype.is_complex:
        if kind not in (_SUM, _AVG, _PREMUL_SUM):
            raise NotSupportedError("%s: %s is not defined for complex tensors (SUM, AVG and PREMUL_SUM are)"
                                    % (what, _NAMES[kind]))
        return data(torch.view_as_real(flat(tensor, what)), what), _ELEMENTWISE[kind], factor
    if dtype not in torch_codes():
        raise NotSupportedError("%s: shmcomm cannot reduce %s tensors" % (what, dtype))
    return data(tensor, what), _ELEMENTWISE[kind], factor


def _factor(op):
    factor = op.factor  # a number or a one-element tensor
    factor = factor.item() if isinstance(factor, torch.Tensor) else factor
    if isinstance(factor, complex):
        raise NotSupportedError("PREMUL_SUM: a complex factor (%r) is not supported; shmcomm scales by a real one"
                                % (factor,))
    return float(factor)


def bitwise(stacked, op):
    """The bitwise reduction of a stack of every rank's copy (first dimension: ranks; bool tensors as bytes of 0
    and 1)."""
    return functools.reduce(_BITWISE[(op.op if isinstance(op, dist.ReduceOp) else op).value], stacked.unbind(0))


def flat(tensor, what="the shmcomm backend"):
    """`tensor` as one dimension, sharing its memory (`what` names the operation in the error)."""
    if not tensor.is_contiguous():
        raise InvalidArgumentError("%s: tensors must be contiguous, as for gloo and NCCL" % what)
    return tensor.reshape(-1)


def movable(tensor, what="the shmcomm backend"):
    """`tensor` flat, as shmcomm moves it: in its own dtype where shmcomm knows it, otherwise as its bytes (bool,
    complex, unsigned and float8 kinds), sharing its memory either way."""
    t = flat(tensor.detach(), what)  # written into in place, as gloo does, whether or not autograd tracks the tensor
    return t if t.dtype in torch_codes() else t.view(torch.uint8)


def data(tensor, what):
    """What the collectives take for `tensor`: movable(tensor), as a numpy array sharing its memory where numpy has
    its dtype (the core's quickest calls take numpy arrays), else (bfloat16, CUDA tensors) the tensor.

    Raises:
        NotSupportedError: a tensor on a device other than the CPU and CUDA.
        InvalidArgumentError: a tensor that is not contiguous.
    """
    array = host_view(tensor)
    if array is not None:
        return array if array.ndim == 1 else array.reshape(-1)
    if tensor.is_cuda:  # the collectives hand it to the device communicator (algorithms/device.py)
        return movable(tensor)
    if not tensor.is_cpu or tensor.layout is not torch.strided:
        raise NotSupportedError("%s: the shmcomm backend serves dense CPU and CUDA tensors; %s is a %s tensor on %s"
                                % (what, tuple(tensor.shape), tensor.layout, tensor.device))
    moved = movable(tensor, what)
    return moved if moved.dtype == torch.bfloat16 else moved.numpy()


def rows(flat_data, count):
    """A flat array or tensor as `count` equal rows."""
    return flat_data.reshape(count, len(flat_data) // count)
