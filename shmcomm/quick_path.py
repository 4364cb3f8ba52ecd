# SPDX-License-Identifier: Apache-2.0
"""Where the public blocking collectives may go at once: the world's shared memory, while the world is the ranks of
one host (no other hosts, no logical grid) and no engine runs; across hosts, a small allreduce's single C call.

Every Python frame between the public call and the core is a share of a small collective's time. So `world` keeps
what those calls need, kept in step with the session by its change listener (init, shutdown, the engine's start and
stop), and collectives.py's functions test one attribute instead of asking the session and the engine on every call."""
import logging

from shmcomm import engine
from shmcomm.startup import session
from shmcomm._native import ffi, quick_function
from shmcomm.algorithms.host import HostComm

# csrc/py/quick_calls.c: the numpy array's common case in one C call (None where this build has no such function)
allreduce_call, broadcast_call, allgather_call, alltoall_call, reducescatter_call, crossing_allreduce_call = (
    quick_function(k) for k in range(6))


class World:
    """What the quick calls need. On one host: the host communicator, its core handle's address, its size and this
    rank's index, the addresses of its count arrays; `address` is 0 whenever that short way is closed. Across hosts,
    `crossing` is the address of the world's smc_crossing_call_t instead (WorldComm.quick_call): a small allreduce
    takes the torus's small path (the row's step, the agreement's compiled rounds, the row's broadcast) in one C call
    (csrc/py/quick_crossing.c), and `comm` goes on as the full path would where that call stopped. `crossing` is 0
    when closed: no compiled rounds, an engine running, or debug logging on (the full path logs each call's choice)."""
    __slots__ = ("comm", "address", "crossing", "size", "rank", "every", "sends", "matrix", "counts")

    def __init__(self):
        self.comm = None  # the world's HostComm, or the WorldComm of a quick call across hosts, or None
        self.address = 0  # its core handle's address for the C calls, or 0
        self.crossing = 0  # the address of a WorldComm's quick call across hosts, or 0
        self.size = self.rank = 0
        self.every = self.sends = self.matrix = self.counts = 0  # addresses of its count arrays (HostComm)


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
    if not isinstance(comm, WorldComm) or comm.quick_call is None or engine.current() is not None \
            or crossing_allreduce_call is None or logging.getLogger("shmcomm.algorithms").isEnabledFor(logging.DEBUG):
        return None
    return comm


def _sync():
    comm = host_alone()
    world.comm = comm
    across = _across_hosts() if comm is None else None
    world.crossing = int(ffi.cast("uintptr_t", across.quick_call)) if across is not None else 0
    if across is not None:
        world.comm = across
    if comm is None or allreduce_call is None:
        world.address = world.size = world.rank = 0
        return
    world.size, world.rank = comm.size, comm.rank
    world.every, world.sends, world.matrix, world.counts = comm.every_at, comm.sends_at, comm.matrix_at, comm.counts_at
    world.address = comm.shm.address


session.on_change(_sync)
_sync()
