# SPDX-License-Identifier: Apache-2.0
"""Blocking collectives on numpy arrays and torch CPU and CUDA tensors, with Horovod's names and semantics.

Every rank must call the same collectives in the same order with agreeing arguments. When they do not, every rank
raises MismatchError for that call and the job can go on. While the background engine runs (asynchronous operations
started it), these calls go through it, so that they and the asynchronous ones keep one order on every rank."""
import numpy as np

from shmcomm.vocabulary import ops
from shmcomm.startup import session
from shmcomm.engine import current as current_engine
from shmcomm.engine.calls import (allgather_request, allreduce_request, alltoall_request, barrier_request,
                                  broadcast_request, is_cuda, received_splits, reducescatter_op, reducescatter_request,
                                  resolve_set, root_index, rows_per_rank, run)
from shmcomm.quick_path import world
from shmcomm.vocabulary.buffers import held_view
from shmcomm.vocabulary.exceptions import InvalidArgumentError


def _engine_free(tensor, process_set):
    """Whether a blocking call may go straight to the world communicator: no engine to keep in order with, the global
    set, a host tensor. The small-message latency of every collective is decided here: no Request, no dispatch."""
    return process_set is None and current_engine() is None and (type(tensor) is np.ndarray or not is_cuda(tensor))


# The blocking collectives on the global set without the engine go straight to the world communicator, no Request.
# Each is written out (no shared helper taking a closure): the smallest call is a few microseconds, and a closure and
# a call more are a measurable share of it. A failure of this rank's own checks fails the collective on every rank at
# once, as execute() does for requests (Communicator.refused).

def _what(kind, name):
    return kind if name is None else "%s.%s" % (kind, name)


def _latency_path(tensor, output, op, prescale_factor, postscale_factor, name):
    comm = session.communicator()
    what = _what("allreduce", name)
    try:
        return comm.allreduce(tensor, output, ops.resolve(op), prescale_factor, postscale_factor, what)
    except InvalidArgumentError as error:
        raise comm.refused("allreduce", error, what) from None


def _broadcast_now(tensor, output, root_rank, name):
    comm = session.communicator()
    what = _what("broadcast", name)
    try:
        return comm.broadcast(tensor, output, root_index(comm, root_rank, what), what)
    except InvalidArgumentError as error:
        raise comm.refused("broadcast", error, what) from None


def _quick_failed(got, tensor, kind, name, output=None):
    """Raises the error of a quick call that returned `got`: a failed step's code, explained as the full path explains
    it, or None: an allgather's or alltoall's output turned out not to fit."""
    what = _what(kind, name)
    if got is None:
        world.comm.output_misfit(kind, tensor, output, what)
    raise world.comm.step_failure(got, tensor, what)


# Each public function tries the quickest way first: a numpy array on the global set of a one-host world without the
# engine (quick_path.world) goes to the core in one C call (csrc/py/quick_calls.c), which returns NotImplemented for
# anything out of the ordinary, before any step; the full path then decides, and its checks say what is wrong. A small
# allreduce across hosts does the same through the torus's small path in one C call (world.crossing_allreduce).

def allreduce(tensor, op=None, average=None, prescale_factor=1.0, postscale_factor=1.0, name=None, output=None,
              process_set=None):
    """The reduction of `tensor` over all ranks, in a new tensor or in `output`.

    Args:
        tensor: a numpy array or torch CPU tensor; every rank passes the same shape and dtype.
        op: Sum, Average (the default), Min, Max or Product.
        average: Horovod's older flag for op=Average (True) or op=Sum (False).
        prescale_factor: multiplies each rank's input before the reduction.
        postscale_factor: multiplies the result.
        name: names the call in errors and the timeline.
        output: an array of the tensor's shape and dtype to write the result into.
        process_set: the ranks that take part (default: every rank).

    Returns:
        The reduced tensor (`output` when given).

    Raises:
        InvalidArgumentError: this rank's arguments are wrong (dtype, shape of `output`, op).
        PeerArgumentError: another rank's were, so no rank ran the call.
        MismatchError: the ranks passed different shapes, dtypes or ops; every rank raises, and the job goes on.
        RankFailure: a rank died or left (the error names it).
        TimeoutError: a rank did not come within SHMCOMM_TIMEOUT.

    Example:
        `shmcomm.allreduce(np.ones(4, np.float32), op=shmcomm.Sum)` gives `size()` in every element on every rank.
    """
    if world.allreduce and type(tensor) is np.ndarray and average is None and process_set is None:
        got = world.allreduce(tensor, np.empty(tensor.shape, tensor.dtype) if output is None else output, op,
                              prescale_factor, postscale_factor)
        if got is not NotImplemented:
            return got if type(got) is not int else _quick_failed(got, tensor, "allreduce", name)
    elif world.allreduce and average is None and process_set is None:
        kept = held_view(tensor)  # a CPU torch tensor takes the same call through a numpy view of its memory
        result = None if kept is None else tensor.new_empty(tensor.shape) if output is None else output
        out = None if result is None else held_view(result)
        got = NotImplemented if out is None or out[1] != kept[1] else world.allreduce(
            kept[0], out[0], op, prescale_factor, postscale_factor, kept[1])
        if got is not NotImplemented:
            return result if type(got) is not int else _quick_failed(got, kept[0], "allreduce", name)
    elif world.crossing_allreduce and type(tensor) is np.ndarray and average is None and process_set is None:
        got = world.crossing_allreduce(tensor, np.empty(tensor.shape, tensor.dtype) if output is None else output, op,
                                       prescale_factor, postscale_factor)
        if got is not NotImplemented:
            return got if type(got) is np.ndarray else world.comm.quick_allreduce_failed(
                got, tensor, op, prescale_factor, postscale_factor, _what("allreduce", name))
    if average is None and _engine_free(tensor, process_set):
        return _latency_path(tensor, output, op, prescale_factor, postscale_factor, name)
    return run(allreduce_request(tensor, output, op, average, prescale_factor, postscale_factor, name, process_set))


def allreduce_(tensor, op=None, average=None, prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=None):
    """Reduces `tensor` over all ranks in place.

    Args:
        tensor: a numpy array or torch CPU tensor, overwritten with the result.
        op, average, prescale_factor, postscale_factor, name, process_set: as allreduce().

    Returns:
        `tensor`, holding the reduction.

    Raises:
        ShmCommError: as allreduce().
    """
    if world.allreduce and type(tensor) is np.ndarray and average is None and process_set is None:
        got = world.allreduce(tensor, tensor, op, prescale_factor, postscale_factor)
        if got is not NotImplemented:
            return got if type(got) is not int else _quick_failed(got, tensor, "allreduce", name)
    elif world.allreduce and average is None and process_set is None:
        kept = held_view(tensor)
        got = NotImplemented if kept is None else world.allreduce(kept[0], kept[0], op, prescale_factor,
                                                                  postscale_factor, kept[1])
        if got is not NotImplemented:
            return tensor if type(got) is not int else _quick_failed(got, kept[0], "allreduce", name)
    elif world.crossing_allreduce and type(tensor) is np.ndarray and average is None and process_set is None:
        got = world.crossing_allreduce(tensor, tensor, op, prescale_factor, postscale_factor)
        if got is not NotImplemented:
            return got if type(got) is np.ndarray else world.comm.quick_allreduce_failed(
                got, tensor, op, prescale_factor, postscale_factor, _what("allreduce", name))
    if average is None and _engine_free(tensor, process_set):
        return _latency_path(tensor, tensor, op, prescale_factor, postscale_factor, name)
    return run(allreduce_request(tensor, tensor, op, average, prescale_factor, postscale_factor, name, process_set))


def broadcast(tensor, root_rank, name=None, output=None, process_set=None):
    """Rank `root_rank`'s `tensor` on every rank, in a new tensor or in `output`.

    Args:
        tensor: a numpy array or torch tensor of the same shape and dtype on every rank; only the root's contents matter.
        root_rank: the rank whose tensor is sent, a rank of `process_set`.
        name: names the call in errors and the timeline.
        output: an array of the tensor's shape and dtype to write the result into.
        process_set: the ranks that take part (default: every rank).

    Returns:
        The root's tensor (`output` when given).

    Raises:
        InvalidArgumentError: `root_rank` is not in the set, or `output` does not fit; other errors as allreduce().

    Example:
        `shmcomm.broadcast(np.arange(3) * shmcomm.rank(), root_rank=1)` gives `[0, 1, 2]` on every rank.
    """
    if world.broadcast and type(tensor) is np.ndarray and process_set is None and type(root_rank) is int \
            and 0 <= root_rank < world.size:  # the world's ranks are its indices
        got = world.broadcast(tensor, np.empty(tensor.shape, tensor.dtype) if output is None else output, root_rank)
        if got is not NotImplemented:
            return got if type(got) is not int else _quick_failed(got, tensor, "broadcast", name)
    if _engine_free(tensor, process_set):
        return _broadcast_now(tensor, output, root_rank, name)
    return run(broadcast_request(tensor, output, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """Overwrites `tensor` with rank `root_rank`'s on every rank.

    Args:
        tensor, root_rank, name, process_set: as broadcast().

    Returns:
        `tensor`, holding the root's values.

    Raises:
        ShmCommError: as broadcast().
    """
    if world.broadcast and type(tensor) is np.ndarray and process_set is None and type(root_rank) is int \
            and 0 <= root_rank < world.size:
        got = world.broadcast(tensor, tensor, root_rank)
        if got is not NotImplemented:
            return got if type(got) is not int else _quick_failed(got, tensor, "broadcast", name)
    if _engine_free(tensor, process_set):
        return _broadcast_now(tensor, tensor, root_rank, name)
    return run(broadcast_request(tensor, tensor, root_rank, name, process_set))


def allgather(tensor, name=None, process_set=None, output=None):
    """Every rank's `tensor` concatenated along the first dimension, in rank order.

    Args:
        tensor: a numpy array or torch tensor; its first dimension may differ between ranks, the other dimensions and
            the dtype must agree.
        name: names the call in errors and the timeline.
        process_set: the ranks that take part (default: every rank).
        output: an array of the concatenation's shape and the tensor's dtype to write the result into.

    Returns:
        The concatenation (`output` when given).

    Raises:
        MismatchError: the ranks' other dimensions or dtypes differ; every rank raises. Other errors as allreduce().

    Example:
        `shmcomm.allgather(np.full(shmcomm.rank() + 1, shmcomm.rank()))` gives `[0, 1, 1]` on 2 ranks.
    """
    if world.allgather and type(tensor) is np.ndarray and process_set is None:
        got = world.allgather(tensor, output)
        if got is not NotImplemented:
            return got if got is not None and type(got) is not int else _quick_failed(got, tensor, "allgather", name,
                                                                                      output)
    if _engine_free(tensor, process_set):
        comm = session.communicator()
        what = _what("allgather", name)
        try:
            return comm.allgather(tensor, what, output)
        except InvalidArgumentError as error:
            raise comm.refused("allgather", error, what) from None
    return run(allgather_request(tensor, name, process_set, output))


def reducescatter(tensor, op=ops.Average, name=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None,
                  output=None):
    """This rank's share of the reduction of `tensor`, split along the first dimension.

    With rows that do not divide evenly, the first (rows % size) ranks get one extra row (Horovod's rule); a rank whose
    share is empty gets an array of no rows.

    Args:
        tensor: a numpy array or torch tensor of the same shape and dtype on every rank.
        op: Average (the default), Sum, Min, Max or Product (not Adasum).
        name: names the call in errors and the timeline.
        prescale_factor, postscale_factor: as allreduce().
        process_set: the ranks that take part (default: every rank).
        output: an array of this rank's share's shape and the tensor's dtype to write the result into.

    Returns:
        This rank's rows of the reduction (`output` when given).

    Raises:
        ShmCommError: as allreduce().
    """
    if world.reducescatter and type(tensor) is np.ndarray and process_set is None:
        got = world.reducescatter(tensor, output, op, prescale_factor, postscale_factor)
        if got is not NotImplemented:
            return got if type(got) is not int else _quick_failed(got, tensor, "reducescatter", name)
    if _engine_free(tensor, process_set):
        comm = session.communicator()
        what = _what("reducescatter", name)
        try:
            return comm.reducescatter(tensor, reducescatter_op(op), prescale_factor, postscale_factor, what, output)
        except InvalidArgumentError as error:
            raise comm.refused("reducescatter", error, what) from None
    return run(reducescatter_request(tensor, op, name, prescale_factor, postscale_factor, process_set, output))


def alltoall(tensor, splits=None, name=None, process_set=None, output=None):
    """Sends `splits[j]` rows of `tensor`, in order, to rank j; returns the rows received, in rank order.

    Args:
        tensor: a numpy array or torch tensor; the ranks agree on its dimensions after the first and its dtype.
        splits: one non-negative row count per rank, adding up to the first dimension; without it the first dimension
            must divide evenly by the number of ranks.
        name: names the call in errors and the timeline.
        process_set: the ranks that take part (default: every rank).
        output: an array with exactly the rows received, to write them into.

    Returns:
        The rows received (`output` when given); with `splits`, a pair of them and the number of rows that came from
        each rank (int32, a torch tensor for torch input), as Horovod returns.

    Raises:
        InvalidArgumentError: `splits` is not one count per rank adding up to the first dimension, or the first
            dimension does not divide evenly without it.
        MismatchError: the ranks' other dimensions or dtypes differ; every rank raises. Other errors as allreduce().
    """
    if world.alltoall and type(tensor) is np.ndarray and process_set is None:
        got = world.alltoall(tensor, output, splits)
        if got is not NotImplemented:
            if got is None or type(got) is int:
                _quick_failed(got, tensor, "alltoall", name, output)
            return got if splits is None else (got[0], received_splits(tensor, got[1]))  # without splits, rows only
    if _engine_free(tensor, process_set):
        comm = session.communicator()
        what = _what("alltoall", name)
        try:
            out, got = comm.alltoall(tensor, rows_per_rank(tensor, splits, comm.size, what), what, output)
        except InvalidArgumentError as error:
            raise comm.refused("alltoall", error, what) from None
    else:
        out, got = run(alltoall_request(tensor, splits, name, process_set, output))
    return out if splits is None else (out, received_splits(tensor, got))


def barrier(process_set=None):
    """Returns once every rank of `process_set` has called barrier().

    Args:
        process_set: the ranks that wait for one another (default: every rank).

    Raises:
        RankFailure: a rank died or left meanwhile (the error names it).
        TimeoutError: a rank did not come within SHMCOMM_TIMEOUT.
    """
    if process_set is None and current_engine() is None:
        session.communicator().barrier()
        return
    run(barrier_request(process_set))


def refused(kind, error, name=None, process_set=None):
    """Fails collective `kind` on every rank of `process_set` at once, for an API above this one that found `error`
    in this rank's own arguments before it could call the collective: the other ranks' calls of `kind` raise
    PeerArgumentError naming this rank, instead of waiting for it until SHMCOMM_TIMEOUT.

    Args:
        kind: "allreduce", "broadcast", "allgather", "reducescatter" or "alltoall": what the other ranks call.
        error: this rank's InvalidArgumentError.
        name, process_set: as the collective's.

    Returns:
        `error`, for the caller to raise.
    """
    return resolve_set(process_set)[0].refused(kind, error, _what(kind, name))
