# SPDX-License-Identifier: Apache-2.0
"""Horovod's torch collectives on CPU and CUDA tensors: blocking, asynchronous (an int handle for
poll/synchronize), grouped, and differentiable. (CUDA tensors: see shmcomm/algorithms/device.py.)

Gradients follow Horovod's rules, so that scripts and tests written for it get the same numbers:
allreduce -> allreduce of the gradient with the same op and scale factors; allgather -> the Average allreduce of the
gradient, this rank's rows; broadcast -> the Average allreduce of the gradient on the root, zeros elsewhere;
reducescatter -> the allgather of the gradient, times the set size for Sum (and times the scale factors);
alltoall -> the alltoall of the gradient back along the received splits."""
import torch

from shmcomm import asynchronous as _async, basics
from shmcomm.vocabulary.exceptions import ShmCommError
from shmcomm.vocabulary.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
from shmcomm.process_sets import global_process_set
from shmcomm.torch.compression import Compression
from shmcomm.torch.handles import _apply, _group, _names, _resolved, _set, _single, _start, poll, synchronize

# Errors of the collectives themselves (mismatches, failed or shut-down peers) are ShmCommErrors, and RuntimeErrors
# as Horovod's are; bad arguments are also ValueErrors.
HorovodInternalError = ShmCommError


def is_homogeneous():
    """Whether every host runs the same number of ranks, as in Horovod.

    Returns:
        True when it does (always, on one host).
    """
    return len({len(host) for host in basics.current().host_groups}) == 1


# ---- allreduce ----

def _reduction(submit, combine, tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Horovod's allreduce arguments, resolved, for one tensor (combine=_single) or a list (_group)."""
    return combine(submit, tensors, name, op=_resolved(op, average), prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor, process_set=process_set)


def allreduce_async(tensor, *args, **kwargs):
    """Starts reducing `tensor` over the ranks into a new tensor and returns at once.

    Args:
        tensor: as allreduce().
        average, name, op, prescale_factor, postscale_factor, process_set: as allreduce(), in that order (there is no
            compression here).

    Returns:
        An int handle: poll(handle) says whether the result is ready; synchronize(handle) waits for it and returns it,
        or raises allreduce()'s errors. Give every handle to synchronize().

    Example:
        `h = hvd.allreduce_async(grad, name="grad.0")`, other work, then `grad = hvd.synchronize(h)`.
    """
    return _reduction(_async.allreduce_async, _single, tensor, *args, **kwargs)


def allreduce_async_(tensor, *args, **kwargs):
    """Starts reducing `tensor` in place and returns at once.

    Args:
        tensor: as allreduce(); it holds the result once the handle completes.
        average, name, op, prescale_factor, postscale_factor, process_set: as allreduce_async().

    Returns:
        An int handle: synchronize(handle) returns `tensor`.
    """
    return _reduction(_async.allreduce_async_, _single, tensor, *args, **kwargs)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduces `tensor` over the ranks of `process_set` in place (default op: Average).

    Args:
        tensor: as allreduce(); it holds the result on return.
        average, name, op, prescale_factor, postscale_factor, process_set: as allreduce().

    Returns:
        `tensor`.

    Raises:
        ShmCommError: as allreduce().
    """
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(tensors, *args, **kwargs):
    """Starts the allreduce of every tensor of a list, fused where the engine can, under one handle.

    Args:
        tensors: a list of tensors (each may differ in shape and dtype; every rank passes the same list).
        average, name, op, prescale_factor, postscale_factor, process_set: as allreduce_async(); `name` names the group
            (its tensors are `name.0`, `name.1`...).

    Returns:
        An int handle: synchronize(handle) returns a tuple of new tensors, in the list's order.
    """
    return _reduction(_async.allreduce_async, _group, tensors, *args, **kwargs)


def grouped_allreduce_async_(tensors, *args, **kwargs):
    """Starts the in-place allreduce of every tensor of a list, under one handle.

    Args:
        tensors: as grouped_allreduce_async(); each holds its result once the handle completes.
        average, name, op, prescale_factor, postscale_factor, process_set: as grouped_allreduce_async().

    Returns:
        An int handle: synchronize(handle) returns the tuple of `tensors`.
    """
    return _reduction(_async.allreduce_async_, _group, tensors, *args, **kwargs)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """Reduces each tensor of a list in place, as one group.

    Args:
        tensors, average, name, op, prescale_factor, postscale_factor, process_set: as grouped_allreduce_async_().

    Returns:
        The tuple of `tensors`, holding the results.

    Raises:
        ShmCommError: as allreduce(); every tensor of the group is waited for before an error is raised.
    """
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce of one tensor or a group, differentiable."""

    @staticmethod
    def forward(ctx, names, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(_start(_async.allreduce_async, tensors, names, tuple, op=op,
                                  prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                  process_set=process_set))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        return (None,) * 5 + tuple(grouped_allreduce([g.contiguous() for g in grads], op=op, prescale_factor=pre,
                                                     postscale_factor=post, process_set=ps))


HorovodGroupedAllreduce = HorovodAllreduce


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """The reduction of `tensor` over the ranks of `process_set`, in a new tensor; differentiable (the gradient is the
    same reduction of the output's gradient).

    Args:
        tensor: a CPU tensor (a CUDA tensor where the GPU path is built); every rank passes the same shape and dtype.
        average: Horovod's older flag: True for op=Average, False for op=Sum; give `op` or this, not both.
        name: names the call in errors, the timeline and the engine's matching of requests across ranks.
        compression: Compression.fp16 sends floating-point tensors as float16 and returns the tensor's own dtype.
        op: Average (the default), Sum, Min, Max, Product or Adasum.
        prescale_factor: multiplies each rank's input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks that take part (a ProcessSet from add_process_set; default: every rank).

    Returns:
        A new tensor of the input's shape and dtype, equal on every rank of the set.

    Raises:
        InvalidArgumentError: this rank's arguments are wrong (an unsupported dtype, `average` with `op`).
        PeerArgumentError: another rank's were, so no rank ran the call.
        MismatchError: the ranks passed different shapes, dtypes or ops; every rank raises, and the job goes on.
        RankFailure: a rank died or left; the error names it.
        TimeoutError: a rank did not come within SHMCOMM_TIMEOUT.

    Example:
        `hvd.allreduce(torch.ones(3), op=hvd.Sum)` is `torch.full((3,), float(hvd.size()))` on every rank.
    """
    return _apply(HorovodAllreduce, compression, [tensor], [name], _resolved(op, average), prescale_factor,
                  postscale_factor, process_set)[0]


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """The allreduce of every tensor of a list, started together; differentiable.

    Args:
        tensors: a list of tensors.
        average, name, compression, op, prescale_factor, postscale_factor, process_set: as allreduce(); `name` names the
            group.

    Returns:
        A list of new tensors, in the list's order.

    Raises:
        ShmCommError: as allreduce().
    """
    if not tensors:
        return []
    return _apply(HorovodAllreduce, compression, tensors, _names(name, len(tensors)), _resolved(op, average),
                  prescale_factor, postscale_factor, process_set)


# ---- allgather ----

def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts concatenating every rank's `tensor` along the first dimension.

    Args:
        tensor, name, process_set: as allgather().

    Returns:
        An int handle: synchronize(handle) returns the concatenation, or raises allgather()'s errors.
    """
    return _single(_async.allgather_async, tensor, name, process_set=process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Starts allgather() of each tensor of a list, under one handle.

    Args:
        tensors: a list of tensors; each one's first dimension may differ between ranks.
        name, process_set: as allgather(); `name` names the group.

    Returns:
        An int handle: synchronize(handle) returns the tuple of gathered tensors.
    """
    return _group(_async.allgather_async, tensors, name, process_set=process_set)


class HorovodAllgather(torch.autograd.Function):
    """Allgather of one tensor or a group, differentiable."""

    @staticmethod
    def forward(ctx, names, process_set, *tensors):
        ctx.shapes, ctx.process_set = [t.shape for t in tensors], process_set
        return synchronize(_start(_async.allgather_async, tensors, names, tuple, process_set=process_set))

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.process_set
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average, process_set=ps)
        rows = [s[0] if len(s) else 1 for s in ctx.shapes]
        every = allgather(torch.tensor([rows], dtype=torch.int64), process_set=ps)  # every rank's row counts
        offsets = every[:_set(ps).rank()].sum(0).tolist()
        return (None, None) + tuple(r.narrow(0, at, n).reshape(s)
                                    for r, at, n, s in zip(reduced, offsets, rows, ctx.shapes))


HorovodGroupedAllgather = HorovodAllgather


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's `tensor`, concatenated in rank order along the first dimension; differentiable.

    Args:
        tensor: a tensor whose first dimension may differ between ranks; the other dimensions and the dtype may not.
        name: names the call in errors, the timeline and the engine's matching of requests across ranks.
        process_set: the ranks that take part (default: every rank).

    Returns:
        A new tensor of the sum of the ranks' first dimensions, equal on every rank of the set.

    Raises:
        InvalidArgumentError: this rank's arguments are wrong; PeerArgumentError: another rank's were.
        MismatchError: the ranks disagree (dtype, trailing dimensions); every rank raises, and the job goes on.
        RankFailure: a rank died or left; TimeoutError: a rank did not come within SHMCOMM_TIMEOUT.

    Example:
        `hvd.allgather(torch.full((hvd.rank() + 1, 2), hvd.rank()))` has 1 + 2 + ... + size rows.
    """
    return HorovodAllgather.apply([name], process_set, tensor)[0]


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Gathers each tensor of a list from every rank, as one group; differentiable (the gradient of each result is
    reduced back to the ranks' slices).

    Args:
        tensors, name, process_set: as grouped_allgather_async().

    Returns:
        A list of the gathered tensors, in the list's order.

    Raises:
        ShmCommError: as allgather().
    """
    return list(HorovodAllgather.apply(_names(name, len(tensors)), process_set, *tensors)) if tensors else []


# ---- broadcast ----

def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts copying rank `root_rank`'s `tensor` into a new tensor on every rank.

    Args:
        tensor, root_rank, name, process_set: as broadcast().

    Returns:
        An int handle: synchronize(handle) returns the root's tensor, or raises broadcast()'s errors.
    """
    return _single(_async.broadcast_async, tensor, name, root_rank=root_rank, process_set=process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts overwriting `tensor` with rank `root_rank`'s on every rank.

    Args:
        tensor, root_rank, name, process_set: as broadcast().

    Returns:
        An int handle: synchronize(handle) returns `tensor`.
    """
    return _single(_async.broadcast_async_, tensor, name, root_rank=root_rank, process_set=process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrites `tensor` with rank `root_rank`'s on every rank.

    Args:
        tensor, root_rank, name, process_set: as broadcast().

    Returns:
        `tensor`.

    Raises:
        ShmCommError: as broadcast().
    """
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class HorovodBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        reduced = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        if basics.rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """root_rank's `tensor` on every rank, in a new tensor; differentiable (as Horovod's: the gradient is the average
    of the ranks' gradients on root_rank, zeros elsewhere).

    Args:
        tensor: the tensor to send on root_rank, and on every other rank one of the same shape and dtype.
        root_rank: the rank whose tensor everyone receives, a rank of `process_set` (a global rank number).
        name: names the call in errors, the timeline and the engine's matching of requests across ranks.
        process_set: the ranks that take part (default: every rank).

    Returns:
        A new tensor equal to root_rank's.

    Raises:
        InvalidArgumentError: this rank's arguments are wrong; PeerArgumentError: another rank's were.
        MismatchError: the ranks disagree (root, shape, dtype); every rank raises, and the job goes on.
        RankFailure: a rank died or left; TimeoutError: a rank did not come within SHMCOMM_TIMEOUT.
    """
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


# ---- completion, join, barrier ----

def join(device=-1):
    """Says this rank has no more data, and waits until every rank has said the same.

    Meanwhile this rank contributes zeros to the others' allreduces, so that ranks with uneven data finish an epoch
    together. join() covers allreduces of CPU tensors (a CUDA allreduce fails on every rank while a rank has joined).

    Args:
        device: accepted for Horovod's scripts; not used.

    Returns:
        The rank that joined last, the same on every rank.
    """
    return int(_async.join())


def barrier(process_set=global_process_set):
    """Returns once every rank of the set has called it.

    Args:
        process_set: the ranks that take part (a ProcessSet from add_process_set; default: every rank).

    Raises:
        RankFailure: a rank died or left meanwhile; TimeoutError: a rank did not come within SHMCOMM_TIMEOUT.
    """
    from shmcomm.collectives import barrier as _barrier

    _barrier(process_set)
