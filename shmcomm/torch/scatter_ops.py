# SPDX-License-Identifier: Apache-2.0
"""Horovod's torch alltoall and reducescatter: blocking, asynchronous, grouped and differentiable, on the handles of
handles.py; mpi_ops.py holds the other collectives and the gradients' rules."""
import torch

from shmcomm import asynchronous as _async, basics
from shmcomm.engine.calls import alltoall_request
from shmcomm.vocabulary.ops import Average, Sum
from shmcomm.process_sets import global_process_set
from shmcomm.torch.compression import Compression
from shmcomm.torch.handles import (_apply, _first, _group, _names, _register, _resolved, _set, _single, _start,
                                   synchronize)
from shmcomm.torch.mpi_ops import grouped_allgather


# ---- alltoall ----

def _alltoall_async(tensor, splits, name, process_set):
    # Always return the received splits, so that the gradient can travel back along them. A bad `splits` travels
    # with the request, so that the other ranks hear of it (Request.checked).
    req = alltoall_request(tensor, splits, name, process_set)
    req.want_splits = True
    return basics.start_engine().submit(req)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts sending `splits[j]` rows of `tensor` to rank j (equal shares without splits).

    Args:
        tensor, splits, name, process_set: as alltoall().

    Returns:
        An int handle: synchronize(handle) returns the received rows, and with `splits` the pair (rows,
        received_splits); or raises alltoall()'s errors.
    """
    finish = _first if splits is not None else (lambda results: results[0][0])
    return _register([_alltoall_async(tensor, splits, name, process_set)], (tensor, splits), finish)


class HorovodAlltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = _async.synchronize(_alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad_output, *ignored):
        grad, _ = alltoall(grad_output.contiguous(), splits=ctx.received, process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends splits[j] rows of `tensor` to rank j and returns the rows every rank sent here, in rank order;
    differentiable.

    Args:
        tensor: the rows to send, split along the first dimension.
        splits: how many rows go to each rank of the set (a list or an int tensor of its size, summing to the first
            dimension); None: equal shares (the first dimension must divide by the set's size).
        name: names the call in errors, the timeline and the engine's matching of requests across ranks.
        process_set: the ranks that take part (default: every rank).

    Returns:
        The received rows; with `splits`, the pair (rows, received_splits), received_splits saying how many rows
        came from each rank.

    Raises:
        InvalidArgumentError: this rank's arguments are wrong; PeerArgumentError: another rank's were.
        MismatchError: the ranks disagree (dtype, trailing dimensions); every rank raises, and the job goes on.
        RankFailure: a rank died or left; TimeoutError: a rank did not come within SHMCOMM_TIMEOUT.
    """
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


# ---- reducescatter ----

def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Starts reducing `tensor`; this rank gets its share of the first dimension.

    Args:
        tensor, name, op, process_set, prescale_factor, postscale_factor: as reducescatter() (no compression here).

    Returns:
        An int handle: synchronize(handle) returns this rank's rows of the reduction, or raises reducescatter()'s
        errors.
    """
    return _single(_async.reducescatter_async, tensor, name, op=_resolved(op), prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor, process_set=process_set)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    """Starts reducescatter() of each tensor of a list, under one handle.

    Args:
        tensors: a list of tensors, the same on every rank.
        name, op, process_set, prescale_factor, postscale_factor: as reducescatter(); `name` names the group.

    Returns:
        An int handle: synchronize(handle) returns the tuple of this rank's shares.
    """
    return _group(_async.reducescatter_async, tensors, name, op=_resolved(op), prescale_factor=prescale_factor,
                  postscale_factor=postscale_factor, process_set=process_set)


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter of one tensor or a group, differentiable."""

    @staticmethod
    def forward(ctx, names, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.factor = prescale_factor * postscale_factor * (_set(process_set).size() if op == Sum else 1)
        ctx.process_set = process_set
        return synchronize(_start(_async.reducescatter_async, tensors, names, tuple, op=op,
                                  prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                  process_set=process_set))

    @staticmethod
    def backward(ctx, *grads):
        gathered = grouped_allgather([g.contiguous() for g in grads], process_set=ctx.process_set)
        return (None,) * 5 + tuple(g * ctx.factor if ctx.factor != 1 else g for g in gathered)


HorovodGroupedReducescatter = HorovodReducescatter


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """This rank's share, along the first dimension, of the reduction of `tensor` over the ranks; differentiable.

    Args:
        tensor: the same shape and dtype on every rank; its first dimension is shared out in rank order, the first
            (rows % size) ranks getting one row more.
        name: names the call in errors, the timeline and the engine's matching of requests across ranks.
        compression: Compression.fp16 sends floating-point tensors as float16.
        op: Average (the default), Sum, Min, Max or Product.
        process_set: the ranks that take part (default: every rank).
        prescale_factor: multiplies each rank's input before the reduction.
        postscale_factor: multiplies the result.

    Returns:
        A new tensor of this rank's rows of the reduced tensor.

    Raises:
        InvalidArgumentError: this rank's arguments are wrong; PeerArgumentError: another rank's were.
        MismatchError: the ranks disagree (shape, dtype, op); every rank raises, and the job goes on.
        RankFailure: a rank died or left; TimeoutError: a rank did not come within SHMCOMM_TIMEOUT.
    """
    return _apply(HorovodReducescatter, compression, [tensor], [name], _resolved(op), process_set, prescale_factor,
                  postscale_factor)[0]


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces each tensor of a list and returns this rank's share of each, as one group; differentiable.

    Args:
        tensors: a list of tensors, the same on every rank.
        name, compression, op, process_set, prescale_factor, postscale_factor: as reducescatter(); `name` names the
            group.

    Returns:
        A list of this rank's shares, in the list's order.

    Raises:
        ShmCommError: as reducescatter().
    """
    if not tensors:
        return []
    return _apply(HorovodReducescatter, compression, tensors, _names(name, len(tensors)), _resolved(op), process_set,
                  prescale_factor, postscale_factor)
