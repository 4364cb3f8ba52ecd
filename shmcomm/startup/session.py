# SPDX-License-Identifier: Apache-2.0
"""The communicator this process holds between init() and shutdown(), for the modules that serve the API.

The process holds at most one at a time. `generation` counts inits so that init/shutdown/init in one process (all
ranks doing the same) meets a fresh segment."""
import threading

from shmcomm.vocabulary.exceptions import NotInitializedError

_NOT_INITIALIZED = "shmcomm has not been initialized; use shmcomm.init()."


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.comm = None
        self.generation = 0
        self.in_flight = None  # while shmcomm.jax's programs may still run collectives: the function that waits


state = _State()
_listeners = []


def on_change(listener):
    """Calls listener() after every init and start or stop of the engine, and at shutdown before the communicator
    closes (shmcomm.jax points its compiled handler at the communicator, or away from it)."""
    _listeners.append(listener)


def changed():
    for listener in list(_listeners):
        listener()


_closers = []


def on_close(listener):
    """Calls listener() at shutdown while the communicator is still open (shmcomm.jax waits there for the jitted
    collectives still in flight)."""
    _closers.append(listener)


def closing():
    """Waits for the collectives running on another thread (hold()) and calls the on_close listeners: shutdown()
    does, before it closes anything."""
    if state.in_flight is not None:
        state.in_flight()
    for listener in list(_closers):
        listener()


_holders = []


def on_hold(listener):
    """Calls listener() after every hold() and release() (quick_path closes and opens its quick calls)."""
    _holders.append(listener)


def hold(wait):
    """Marks collectives as running on another thread (a jitted program's, dispatched and not finished):
    communicator() then calls wait() first, and the quick calls close (quick_path), so that the next collective of
    this thread comes after them on every rank."""
    state.in_flight = wait
    for listener in list(_holders):
        listener()


def release():
    """Ends hold(): nothing runs collectives on another thread any more."""
    hold(None)


def communicator():
    """The world communicator (algorithms.host.HostComm or algorithms.world.WorldComm), to run a collective on:
    after the collectives still running on another thread (hold()) have finished."""
    comm = state.comm
    if comm is None:
        raise NotInitializedError(_NOT_INITIALIZED)
    if state.in_flight is not None:
        state.in_flight()
    return comm


def current():
    """The world communicator, to read who is where (its topology) without waiting for anything."""
    comm = state.comm
    if comm is None:
        raise NotInitializedError(_NOT_INITIALIZED)
    return comm


def is_initialized():
    """Whether this rank has joined the job.

    Returns:
        True between init() and shutdown() on this rank.
    """
    return state.comm is not None


def generation():
    """How many times this process has initialised; part of every segment name."""
    return state.generation
