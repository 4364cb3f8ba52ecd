# SPDX-License-Identifier: Apache-2.0
"""Where the public blocking collectives may go at once: the world's shared memory, while the world is the ranks of
one host (no other hosts, no logical grid) and no engine runs; across hosts, a small allreduce's single C call.

Every Python frame between the public call and the core is a share of a small collective's time. So `world` keeps
the transports' bound quick calls, kept in step with the session by its change listener (init, shutdown, the
engine's start and stop), and collectives.py's functions test one attribute instead of asking the session and the
engine on every call."""
import logging

from shmcomm import engine
from shmcomm.startup import session
from shmcomm.algorithms.host import HostComm

_ONE_HOST = ("allreduce", "broadcast", "allgather", "alltoall", "reducescatter")


class World:
    """What the quick calls need. On one host: the host communicator, its size, and its transport's quick calls
    (transport/shm.py's QuickCalls), each None whenever that short way is closed. Across hosts, `crossing_allreduce`
    instead (WorldComm.quick_crossing): a small allreduce takes the torus's small path (the row's step, the
    agreement's compiled rounds, the row's broadcast) in one C call, and `comm` goes on as the full path would where
    that call stopped. It is None when closed: no compiled rounds, an engine running, or debug logging on (the full
    path logs each call's choice). Every quick call is closed too while shmcomm.jax's programs may be running
    collectives (session.hold): the full path waits for them. `jitted_crossing` is the call across hosts for the
    handler of those programs, which stays open then."""
    __slots__ = ("comm", "size") + _ONE_HOST + ("crossing_allreduce", "jitted_crossing")

    def __init__(self):
        self.comm = None  # the world's HostComm, or the WorldComm of a quick call across hosts, or None
        self.size = 0
        self.allreduce = self.broadcast = self.allgather = self.alltoall = self.reducescatter = None
        self.crossing_allreduce = self.jitted_crossing = None


world = World()


def host_alone():
    """The world communicator when it is one host's shared memory and no engine runs (the engine keeps every
    collective in one order on every rank, so calls must pass through it while it runs); None otherwise."""
    comm = session.state.comm
    return comm if isinstance(comm, HostComm) and engine.current() is None else None


def _across_hosts():
    """The world communicator when its allreduce may take the quick call across hosts; None otherwise."""
    from shmcomm.algorithms.world import WorldComm

    comm = session.state.comm
    if not isinstance(comm, WorldComm) or comm.quick_crossing is None or engine.current() is not None \
            or logging.getLogger("shmcomm.algorithms").isEnabledFor(logging.DEBUG):
        return None
    return comm


def _sync():
    comm = host_alone()
    across = _across_hosts() if comm is None else None
    world.comm = comm if comm is not None else across
    world.jitted_crossing = across.quick_crossing if across is not None else None
    held = session.state.in_flight is not None
    world.crossing_allreduce = None if held else world.jitted_crossing
    world.size = comm.size if comm is not None else 0
    quick = comm.shm.quick if comm is not None and not held else None
    for name in _ONE_HOST:
        setattr(world, name, getattr(quick, name) if quick is not None else None)


session.on_change(_sync)
session.on_hold(_sync)
_sync()
