# SPDX-License-Identifier: Apache-2.0
"""Horovod's torch collectives on CPU and CUDA tensors: blocking, asynchronous (an int handle for
poll/synchronize), grouped, and differentiable. (CUDA tensors: see shmcomm/algorithms/device.py.)

Gradients follow Horovod's rules, so that scripts and tests written for it get the same numbers:
allreduce -> allreduce of the gradient with the same op and scale factors; allgather -> the Average allreduce of the
gradient, this rank's rows; broadcast -> the Average allreduce of the gradient on the root, zeros elsewhere;
reducescatter -> the allgather of the gradient, times the set size for Sum (and times the scale factors);
alltoall -> the alltoall of the gradient back along the received splits."""
import itertools

import torch

from shmcomm import asynchronous as _async, basics
from shmcomm.vocabulary.exceptions import InvalidArgumentError, ShmCommError
from shmcomm.vocabulary.ops import Adasum, Average, Max, Min, Product, Sum, resolve  # noqa: F401
from shmcomm.process_sets import global_process_set
from shmcomm.torch.compression import Compression

# Errors of the collectives themselves (mismatches, failed or shut-down peers) are ShmCommErrors, and RuntimeErrors
# as Horovod's are; bad arguments are also ValueErrors.
HorovodInternalError = ShmCommError

# handle -> (engine handles, tensors kept alive until synchronize, how to turn the results into the output)
_handle_map = {}
_next_handle = itertools.count(1)


def _register(handles, keep, finish):
    handle = next(_next_handle)
    _handle_map[handle] = (handles, keep, finish)
    return handle


def _first(results):
    return results[0]


def _set(process_set):
    return global_process_set if process_set is None else process_set


def _names(name, count):
    # A group's tensors are negotiated one by one, so each needs its own name, identical on every rank.
    return [None] * count if name is None else ["%s.%d" % (name, i) for i in range(count)]


def _resolved(op, average=None):
    """The op Horovod's arguments mean; an unknown op is passed on as given, so that the request carries its error
    to the other ranks instead of raising here, before they could hear of it (Request.checked)."""
    try:
        return resolve(op, average)
    except InvalidArgumentError:
        if average is not None:
            raise
        return op


def is_homogeneous():
    """True when every host runs the same number of ranks, as in Horovod (always, on one host)."""
    return len({len(host) for host in basics.communicator().host_groups}) == 1


def _start(start, tensors, names, finish, **kwargs):
    """Submits one request per tensor (the inputs stay referenced until synchronize) under one handle."""
    tensors = list(tensors)
    return _register([start(t, name=n, **kwargs) for t, n in zip(tensors, names)], tensors, finish)


def _group(start, tensors, name, **kwargs):
    return _start(start, tensors, _names(name, len(tensors)), tuple, **kwargs)


def _single(start, tensor, name, **kwargs):
    return _start(start, [tensor], [name], _first, **kwargs)


def _apply(function, compression, tensors, *args):
    """Runs a differentiable collective over a list of tensors, compressed on the way."""
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    return [compression.decompress(t, c) for t, c in zip(function.apply(*args, *compressed), ctxs)]


# ---- allreduce ----

def _reduction(submit, combine, tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Horovod's allreduce arguments, resolved, for one tensor (combine=_single) or a list (_group)."""
    return combine(submit, tensors, name, op=_resolved(op, average), prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor, process_set=process_set)


def allreduce_async(tensor, *args, **kwargs):
    """allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
    process_set=global_process_set): starts reducing `tensor` over the ranks into a new tensor (allreduce's
    arguments, without compression) and returns at once.

    Returns:
        A handle: poll(handle) says whether the result is ready, synchronize(handle) waits for it and returns it (or
        raises the call's error: allreduce's). Give every handle to synchronize().
    """
    return _reduction(_async.allreduce_async, _single, tensor, *args, **kwargs)


def allreduce_async_(tensor, *args, **kwargs):
    """Starts reducing `tensor` in place (allreduce_async's arguments); synchronize() returns `tensor`."""
    return _reduction(_async.allreduce_async_, _single, tensor, *args, **kwargs)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduces `tensor` over the ranks of `process_set` in place and returns it (default op: Average)."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(tensors, *args, **kwargs):
    """One handle for the allreduce of every tensor of the list (allreduce_async's arguments); synchronize() returns
    a tuple of new tensors."""
    return _reduction(_async.allreduce_async, _group, tensors, *args, **kwargs)


def grouped_allreduce_async_(tensors, *args, **kwargs):
    """The same, in place."""
    return _reduction(_async.allreduce_async_, _group, tensors, *args, **kwargs)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """Reduces each of `tensors` in place, as one fused operation; returns the list."""
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
    """allreduce of every tensor of the list, started together; returns a list; differentiable."""
    if not tensors:
        return []
    return _apply(HorovodAllreduce, compression, tensors, _names(name, len(tensors)), _resolved(op, average),
                  prescale_factor, postscale_factor, process_set)


# ---- allgather ----

def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts concatenating every rank's `tensor` along the first dimension (which may differ between ranks)."""
    return _single(_async.allgather_async, tensor, name, process_set=process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Starts allgather() of each of `tensors`, as one group; returns one handle for all.

    synchronize(handle) returns the list of gathered tensors."""
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
    """Gathers each of `tensors` from every rank, as one group; returns the list of results.

    Differentiable: the gradient of each result is reduced back to the ranks' slices."""
    return list(HorovodAllgather.apply(_names(name, len(tensors)), process_set, *tensors)) if tensors else []


# ---- broadcast ----

def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts copying root_rank's `tensor` (root_rank is a global rank) into a new tensor on every rank."""
    return _single(_async.broadcast_async, tensor, name, root_rank=root_rank, process_set=process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts an in-place broadcast of rank `root_rank`'s `tensor`; returns a handle."""
    return _single(_async.broadcast_async_, tensor, name, root_rank=root_rank, process_set=process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrites `tensor` with rank `root_rank`'s on every rank; returns it."""
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

def poll(handle):
    """True once the operation behind `handle` has finished (synchronize() will then not block)."""
    entry = _handle_map.get(handle)
    if entry is None:
        raise ValueError("handle %r was not created by this process or has been synchronized already" % (handle,))
    return all(h.poll() for h in entry[0])


def synchronize(handle):
    """Waits for the operation and returns its output (a tuple for grouped operations, and for alltoall with
    splits); raises its error. Every part of a grouped operation is waited for before an error is raised."""
    entry = _handle_map.get(handle)
    if entry is None:
        return None  # as Horovod: unknown, or synchronized already
    handles, _, finish = entry
    results, error = [], None
    try:
        for h in handles:
            try:
                results.append(_async.synchronize(h))
            except Exception as e:  # keep waiting: the other parts still use their tensors
                error = error or e
    finally:
        _handle_map.pop(handle, None)
    if error is not None:
        raise error
    return finish(results)


def join(device=-1):
    """Says this rank has no more data and waits until every rank has; meanwhile this rank contributes zeros to the
    others' allreduces. Returns the rank that joined last (the same on every rank). `device` is accepted for
    Horovod compatibility; join() covers allreduces of CPU tensors (a CUDA allreduce fails on every rank while a
    rank has joined)."""
    return int(_async.join())


def barrier(process_set=global_process_set):
    """Returns once every rank of the set has called it."""
    from shmcomm.collectives import barrier as _barrier

    _barrier(process_set)
