# SPDX-License-Identifier: Apache-2.0
"""Blocking collectives on numpy arrays and torch CPU and CUDA tensors, with Horovod's names and semantics.

Every rank must call the same collectives in the same order with agreeing arguments. When they do not, every rank
raises MismatchError for that call and the job can go on. While the background engine runs (asynchronous operations
started it), these calls go through it, so that they and the asynchronous ones keep one order on every rank.

A request on a CUDA tensor is served by the device communicator next to the world's (algorithms/device.py), on the
global process set only."""
import numpy as np

from shmcomm.vocabulary import ops
from shmcomm.startup import session
from shmcomm.engine import current as current_engine
from shmcomm.quick_path import (allgather_call, allreduce_call, alltoall_call, broadcast_call, crossing_allreduce_call,
                                reducescatter_call, world)
from shmcomm.engine.request import Request, execute
from shmcomm.vocabulary.buffers import is_torch, wrap, wrap_device
from shmcomm.vocabulary.exceptions import InvalidArgumentError, NotSupportedError

def resolve_set(process_set):
    """The communicator and id of a process set (None or the global set: everyone)."""
    comm = session.communicator()
    if process_set is None or process_set.process_set_id == 0:
        return comm, 0
    return process_set.communicator(), process_set.process_set_id


def is_cuda(tensor):
    return is_torch(tensor) and tensor.is_cuda


def on_device(req):
    """Hands a request on a CUDA tensor to the device communicator, whose checks travel with it (Request.checked)."""
    if is_cuda(req.tensor):
        if req.set_id:
            req.checked(_no_device_sets, req.what)
        else:
            from shmcomm.algorithms import device

            req.comm = device.communicator(req.comm)
            req.checked(req.comm.prepare, req)
    return req


def _no_device_sets(what):
    raise NotSupportedError("%s: CUDA tensors are supported on the global process set only" % what)


def _name(kind, name):
    # Unnamed requests are named by the engine, which only they pass through when it runs.
    return None if name is None else "%s.%s" % (kind, name)


def run(req):
    """Runs a request now, or through the engine if it is running."""
    engine = current_engine()
    if engine is not None and not engine.in_engine_thread():
        return engine.submit(req, settle=True).wait()
    return execute(req)


def root_index(comm, root_rank, what):
    """Horovod's root_rank is a global rank; the core wants its index in the communicator."""
    if not isinstance(root_rank, (int, np.integer)) or int(root_rank) not in comm.ranks:
        raise InvalidArgumentError("%s: root rank %r is not one of the ranks %s" % (what, root_rank,
                                                                                 _ranks_text(comm.ranks)))
    return comm.ranks.index(int(root_rank))


def _ranks_text(ranks):
    return "0..%d" % (len(ranks) - 1) if ranks == list(range(len(ranks))) else str(ranks)


def splits_list(splits, rows, n, what):
    if splits is None:
        if rows % n:
            raise InvalidArgumentError("%s: the first dimension (%d) does not divide by the number of ranks (%d); pass "
                                       "splits" % (what, rows, n))
        return [rows // n] * n
    if hasattr(splits, "tolist"):
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        raise InvalidArgumentError("%s: splits %s must have %d non-negative entries that add up to the first "
                                   "dimension (%d)" % (what, splits, n, rows))
    return splits


def allreduce_request(tensor, output, op, average, prescale_factor, postscale_factor, name, process_set):
    comm, set_id = resolve_set(process_set)
    req = Request("allreduce", _name("allreduce", name), tensor, comm, set_id, output=output,
                  prescale=prescale_factor, postscale=postscale_factor)
    req.op = req.checked(ops.resolve, op, average, default=ops.Sum)
    return on_device(req)


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
# allreduce across hosts does the same through the torus's small path in one C call (world.crossing).

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
    if world.address and type(tensor) is np.ndarray and average is None and process_set is None:
        got = allreduce_call(world.address, world.size, tensor,
                             np.empty(tensor.shape, tensor.dtype) if output is None else output, op, prescale_factor,
                             postscale_factor)
        if got is not NotImplemented:
            return got if type(got) is not int else _quick_failed(got, tensor, "allreduce", name)
    elif world.crossing and type(tensor) is np.ndarray and average is None and process_set is None:
        got = crossing_allreduce_call(world.crossing, tensor,
                                      np.empty(tensor.shape, tensor.dtype) if output is None else output, op,
                                      prescale_factor, postscale_factor)
        if got is not NotImplemented:
            return got if type(got) is np.ndarray else world.comm.quick_allreduce_failed(
                got, tensor, op, prescale_factor, postscale_factor, _what("allreduce", name))
    if average is None and _engine_free(tensor, process_set):
        return _latency_path(tensor, output, op, prescale_factor, postscale_factor, name)
    return run(allreduce_request(tensor, output, op, average, prescale_factor, postscale_factor, name, process_set))


def allreduce_(tensor, op=None, average=None, prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=None):
    """Reduces `tensor` over all ranks in place and returns it; arguments and errors as allreduce()."""
    if world.address and type(tensor) is np.ndarray and average is None and process_set is None:
        got = allreduce_call(world.address, world.size, tensor, tensor, op, prescale_factor, postscale_factor)
        if got is not NotImplemented:
            return got if type(got) is not int else _quick_failed(got, tensor, "allreduce", name)
    elif world.crossing and type(tensor) is np.ndarray and average is None and process_set is None:
        got = crossing_allreduce_call(world.crossing, tensor, tensor, op, prescale_factor, postscale_factor)
        if got is not NotImplemented:
            return got if type(got) is np.ndarray else world.comm.quick_allreduce_failed(
                got, tensor, op, prescale_factor, postscale_factor, _what("allreduce", name))
    if average is None and _engine_free(tensor, process_set):
        return _latency_path(tensor, tensor, op, prescale_factor, postscale_factor, name)
    return run(allreduce_request(tensor, tensor, op, average, prescale_factor, postscale_factor, name, process_set))


def broadcast_request(tensor, output, root_rank, name, process_set):
    comm, set_id = resolve_set(process_set)
    req = Request("broadcast", _name("broadcast", name), tensor, comm, set_id, output=output)
    req.root = req.checked(root_index, comm, root_rank, req.what, default=0)
    return on_device(req)


def broadcast(tensor, root_rank, name=None, output=None, process_set=None):
    """Rank `root_rank`'s `tensor` on every rank, in a new tensor or in `output`.

    Every rank passes a tensor of the same shape and dtype; only the root's contents matter. `root_rank` is a rank of
    `process_set` (default: every rank). Errors as allreduce(); a root outside the set is an InvalidArgumentError.
    """
    if world.address and type(tensor) is np.ndarray and process_set is None and type(root_rank) is int \
            and 0 <= root_rank < world.size:  # the world's ranks are its indices
        got = broadcast_call(world.address, tensor, np.empty(tensor.shape, tensor.dtype) if output is None else output,
                             root_rank)
        if got is not NotImplemented:
            return got if type(got) is not int else _quick_failed(got, tensor, "broadcast", name)
    if _engine_free(tensor, process_set):
        return _broadcast_now(tensor, output, root_rank, name)
    return run(broadcast_request(tensor, output, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """Overwrites `tensor` with root_rank's on every rank; returns it."""
    if world.address and type(tensor) is np.ndarray and process_set is None and type(root_rank) is int \
            and 0 <= root_rank < world.size:
        got = broadcast_call(world.address, tensor, tensor, root_rank)
        if got is not NotImplemented:
            return got if type(got) is not int else _quick_failed(got, tensor, "broadcast", name)
    if _engine_free(tensor, process_set):
        return _broadcast_now(tensor, tensor, root_rank, name)
    return run(broadcast_request(tensor, tensor, root_rank, name, process_set))


def allgather_request(tensor, name, process_set, output=None):
    comm, set_id = resolve_set(process_set)
    return on_device(Request("allgather", _name("allgather", name), tensor, comm, set_id, output=output))


def allgather(tensor, name=None, process_set=None, output=None):
    """Concatenation of every rank's `tensor` along the first dimension, which may differ between ranks; in a new
    array, or in `output` (which must have the concatenation's shape and the tensor's dtype).

    The other dimensions and the dtype must agree on every rank (else MismatchError on every rank); other errors as
    allreduce().
    """
    if world.address and type(tensor) is np.ndarray and process_set is None:
        got = allgather_call(world.address, world.size, tensor, output, world.every, np.empty)
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


def _reducescatter_op(op):
    resolved = ops.resolve(op)
    if resolved == ops.Adasum:
        raise InvalidArgumentError("reducescatter: Adasum is an allreduce op; use Sum or Average")
    return resolved


def reducescatter_request(tensor, op, name, prescale_factor, postscale_factor, process_set, output=None):
    comm, set_id = resolve_set(process_set)
    req = Request("reducescatter", _name("reducescatter", name), tensor, comm, set_id, output=output,
                  prescale=prescale_factor, postscale=postscale_factor)
    req.op = req.checked(_reducescatter_op, op, default=ops.Sum)
    return on_device(req)


def reducescatter(tensor, op=ops.Average, name=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None,
                  output=None):
    """Rank r receives its share of the reduction of `tensor` along the first dimension; with rows that do not
    divide evenly, the first (rows % size) ranks get one extra row (Horovod's rule). In a new array, or in
    `output`.

    `op`, `prescale_factor` and `postscale_factor` as allreduce() (the default op here is Average too); so are the
    errors. A rank whose share is empty gets an array of no rows.
    """
    if world.address and type(tensor) is np.ndarray and process_set is None:
        got = reducescatter_call(world.address, world.size, world.rank, tensor, output, op, prescale_factor,
                                 postscale_factor, world.counts, np.empty)
        if got is not NotImplemented:
            return got if type(got) is not int else _quick_failed(got, tensor, "reducescatter", name)
    if _engine_free(tensor, process_set):
        comm = session.communicator()
        what = _what("reducescatter", name)
        try:
            return comm.reducescatter(tensor, _reducescatter_op(op), prescale_factor, postscale_factor, what, output)
        except InvalidArgumentError as error:
            raise comm.refused("reducescatter", error, what) from None
    return run(reducescatter_request(tensor, op, name, prescale_factor, postscale_factor, process_set, output))


def alltoall_request(tensor, splits, name, process_set, output=None):
    comm, set_id = resolve_set(process_set)
    req = Request("alltoall", _name("alltoall", name), tensor, comm, set_id, output=output)
    req.splits = req.checked(_rows_per_rank, tensor, splits, comm.size, req.what)
    return on_device(req)


def _rows_per_rank(tensor, splits, n, what):
    if type(tensor) is np.ndarray:
        shape = tensor.shape
    else:
        shape = (wrap_device if is_cuda(tensor) else wrap)(tensor, what).shape  # checks the tensor before reading it
    return splits_list(splits, (tuple(shape) or (1,))[0], n, what)


def received_splits(tensor, got):
    """Rows received per rank, as Horovod returns them: int32, a torch tensor for torch input."""
    got = np.asarray(got, dtype=np.int32)
    if is_torch(tensor):
        import torch

        return torch.from_numpy(got)
    return got


def alltoall(tensor, splits=None, name=None, process_set=None, output=None):
    """Sends splits[j] rows of `tensor` (in order) to rank j and returns the rows received, in rank order, in a new
    array or in `output` (which must have exactly the rows received). With `splits`, also returns how many rows came
    from each rank (as Horovod does).

    Without `splits`, the first dimension must divide evenly by the number of ranks. `splits` must have one
    non-negative count per rank that add up to the first dimension (InvalidArgumentError otherwise); the ranks must
    agree on the other dimensions and the dtype (MismatchError on every rank otherwise); other errors as allreduce().
    """
    if world.address and type(tensor) is np.ndarray and process_set is None:
        got = alltoall_call(world.address, world.size, world.rank, tensor, output, splits, world.sends, world.matrix,
                            np.empty)
        if got is not NotImplemented:
            if got is None or type(got) is int:
                _quick_failed(got, tensor, "alltoall", name, output)
            return got if splits is None else (got[0], received_splits(tensor, got[1]))  # without splits, rows only
    if _engine_free(tensor, process_set):
        comm = session.communicator()
        what = _what("alltoall", name)
        try:
            out, got = comm.alltoall(tensor, _rows_per_rank(tensor, splits, comm.size, what), what, output)
        except InvalidArgumentError as error:
            raise comm.refused("alltoall", error, what) from None
    else:
        out, got = run(alltoall_request(tensor, splits, name, process_set, output))
    return out if splits is None else (out, received_splits(tensor, got))


def barrier(process_set=None):
    """Returns once every rank of `process_set` (default: every rank) has called barrier().

    Raises RankFailure if a rank dies meanwhile and TimeoutError if one does not come within SHMCOMM_TIMEOUT."""
    if process_set is None and current_engine() is None:
        session.communicator().barrier()
        return
    comm, set_id = resolve_set(process_set)
    run(Request("barrier", None, None, comm, set_id))
