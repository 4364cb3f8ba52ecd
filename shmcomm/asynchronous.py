# SPDX-License-Identifier: Apache-2.0
"""Asynchronous collectives: each returns a handle at once; poll() tells if it is done, synchronize() waits for the
result or raises its error. They run on the background engine, which starts with the first of them."""
from shmcomm import basics, engine
from shmcomm.engine.calls import (allgather_request, allreduce_request, alltoall_request, broadcast_request,
                                  received_splits, reducescatter_request)
from shmcomm.vocabulary.ops import Average


def _submit(req):
    return basics.start_engine().submit(req)


def allreduce_async(tensor, op=None, average=None, prescale_factor=1.0, postscale_factor=1.0, name=None,
                    process_set=None):
    """Starts allreduce() of `tensor` on the background engine and returns at once.

    `name` must be unique among the requests in flight and the same on every rank; without one, the requests are
    matched by the order each rank submits them.

    Args:
        tensor, op, average, prescale_factor, postscale_factor, name, process_set: as allreduce().

    Returns:
        A handle: synchronize(handle) returns the reduced tensor (a new one) or raises the collective's error (those of
        allreduce()); poll(handle) says whether it is done.

    Example:
        `h = shmcomm.allreduce_async(grad, name="grad.0")`, other work, then `grad = shmcomm.synchronize(h)`.
    """
    return _submit(allreduce_request(tensor, None, op, average, prescale_factor, postscale_factor, name, process_set))


def allreduce_async_(tensor, op=None, average=None, prescale_factor=1.0, postscale_factor=1.0, name=None,
                     process_set=None):
    """Starts an in-place allreduce() of `tensor` on the background engine and returns at once.

    Args:
        tensor: overwritten with the result once the handle completes.
        op, average, prescale_factor, postscale_factor, name, process_set: as allreduce_async().

    Returns:
        A handle: synchronize(handle) returns `tensor`, holding the result.
    """
    return _submit(allreduce_request(tensor, tensor, op, average, prescale_factor, postscale_factor, name,
                                     process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=None):
    """Starts broadcast() of rank `root_rank`'s `tensor` on the background engine.

    Args:
        tensor, root_rank, name, process_set: as broadcast().

    Returns:
        A handle: synchronize(handle) returns a new tensor with the root's values, or raises broadcast()'s errors.
    """
    return _submit(broadcast_request(tensor, None, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    """Starts an in-place broadcast() of rank `root_rank`'s `tensor` on the background engine.

    Args:
        tensor, root_rank, name, process_set: as broadcast().

    Returns:
        A handle: synchronize(handle) returns `tensor`, overwritten with the root's values on every other rank.
    """
    return _submit(broadcast_request(tensor, tensor, root_rank, name, process_set))


def allgather_async(tensor, name=None, process_set=None, output=None):
    """Starts allgather() of `tensor` on the background engine.

    Args:
        tensor, name, process_set, output: as allgather().

    Returns:
        A handle: synchronize(handle) returns every rank's tensor concatenated along the first dimension, in rank
        order, or raises allgather()'s errors.
    """
    return _submit(allgather_request(tensor, name, process_set, output))


def reducescatter_async(tensor, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None,
                        output=None):
    """Starts reducescatter() of `tensor` on the background engine.

    Args:
        tensor, op, name, prescale_factor, postscale_factor, process_set, output: as reducescatter().

    Returns:
        A handle: synchronize(handle) returns this rank's share of the reduction, split along the first dimension.
    """
    return _submit(reducescatter_request(tensor, op, name, prescale_factor, postscale_factor, process_set, output))


def alltoall_async(tensor, splits=None, name=None, process_set=None, output=None):
    """Starts alltoall() of `tensor` on the background engine.

    Args:
        tensor, splits, name, process_set, output: as alltoall().

    Returns:
        A handle: synchronize(handle) returns what the ranks sent this one, concatenated in rank order; with `splits`,
        also the number of rows received from each rank, as alltoall() does.
    """
    req = alltoall_request(tensor, splits, name, process_set, output)
    req.want_splits = splits is not None
    return _submit(req)


def poll(handle):
    """Whether an asynchronous operation has finished, successfully or not; never waits.

    Args:
        handle: what an `*_async` call returned.

    Returns:
        True once synchronize(handle) would return or raise at once.
    """
    return handle.poll()


def synchronize(handle):
    """Waits for an asynchronous operation to finish.

    Args:
        handle: what an `*_async` call returned.

    Returns:
        The operation's result, as its blocking twin returns it.

    Raises:
        ShmCommError: the operation's error, as its blocking twin raises it.
    """
    result = handle.wait()
    req = handle.request
    if req is not None and req.kind == "alltoall":
        out, got = result
        return (out, received_splits(out, got)) if req.want_splits else out
    return result


def join():
    """Says this rank has no more data, and waits for every rank to say the same.

    Until every rank has joined, this rank's engine contributes zeros to the others' allreduces (allgather and broadcast
    fail meanwhile): ranks with uneven amounts of data finish an epoch together.

    Returns:
        The rank that joined last, on every rank.

    Raises:
        ShmCommError: the background engine is not running (call init(engine=True), as shmcomm.torch.init() does, or
            set SHMCOMM_ENGINE=1).
    """
    basics.communicator()
    eng = engine.current()
    if eng is None:
        from shmcomm.vocabulary.exceptions import ShmCommError

        raise ShmCommError("join() needs the background engine on every rank from the start: call "
                           "shmcomm.init(engine=True) (shmcomm.torch.init() does), or set SHMCOMM_ENGINE=1")
    return eng.join().wait()


def start_timeline(file_path, mark_cycles=False):
    """Starts writing a Chrome-trace timeline of this rank's engine (starting the engine).

    Args:
        file_path: the JSON file to write; open it in chrome://tracing or Perfetto.
        mark_cycles: also mark every cycle of the engine.
    """
    basics.start_engine().timeline.start(file_path, mark_cycles)


def stop_timeline():
    """Stops the timeline; on return the file is a closed JSON array, written to the disk. No timeline: nothing."""
    eng = engine.current()
    if eng is not None:
        eng.timeline.stop()
