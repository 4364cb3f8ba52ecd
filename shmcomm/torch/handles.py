# SPDX-License-Identifier: Apache-2.0
"""Horovod's handles for torch: one integer for one or more requests in flight, which poll() and synchronize() take,
and the helpers that start a tensor or a group of them under one."""
import itertools

from shmcomm.process_sets import global_process_set
from shmcomm.vocabulary.exceptions import InvalidArgumentError
from shmcomm.vocabulary.ops import resolve
from shmcomm import asynchronous as _async

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


def poll(handle):
    """Whether the operation behind a handle has finished; never waits.

    Args:
        handle: an int handle from an `*_async` call, not yet synchronized.

    Returns:
        True once synchronize(handle) will not block.

    Raises:
        ValueError: the handle is unknown to this process, or synchronized already.
    """
    entry = _handle_map.get(handle)
    if entry is None:
        raise ValueError("handle %r was not created by this process or has been synchronized already" % (handle,))
    return all(h.poll() for h in entry[0])


def synchronize(handle):
    """Waits for the operation behind a handle and returns its output.

    Args:
        handle: an int handle from an `*_async` call.

    Returns:
        The output: a tensor, a tuple for grouped operations and for alltoall with splits; None for a handle unknown
        or synchronized already (as Horovod).

    Raises:
        ShmCommError: the operation's error, as its blocking twin raises it; every part of a grouped operation is waited
            for before it is raised.
    """
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
