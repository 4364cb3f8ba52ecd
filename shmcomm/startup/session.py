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
    """Calls the on_close listeners: shutdown() does, before it closes anything."""
    for listener in list(_closers):
        listener()


def communicator():
    """The world communicator (algorithms.host.HostComm or algorithms.world.WorldComm)."""
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
