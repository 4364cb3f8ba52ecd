# SPDX-License-Identifier: Apache-2.0
"""Where the public blocking collectives may go at once: the world's shared memory, while the world is the ranks of
one host (no other hosts, no logical grid) and no engine runs.

A small collective's step in the core takes under a microsecond; every Python frame between the public call and the
core is a share of the call. So `world` keeps what those calls need (the host communicator, its core handle's
address, its size and this rank's index, the addresses of its count arrays), kept in step with the session by its
change listener (init, shutdown, the engine's start and stop), and collectives.py's functions test one attribute
instead of asking the session and the engine on every call.
`world.address` is 0 whenever the short way is closed."""
from shmcomm import engine, session
from shmcomm._native import quick_function
from shmcomm.algorithms.host import HostComm

# csrc/py/quick_calls.c: the numpy array's common case in one C call (None where this build has no such function)
allreduce_call, broadcast_call, allgather_call, alltoall_call, reducescatter_call = (
    quick_function(k) for k in range(5))


class World:
    __slots__ = ("comm", "address", "size", "rank", "every", "sends", "matrix", "counts")

    def __init__(self):
        self.comm = None  # the world's HostComm, or None
        self.address = 0  # its core handle's address for the C calls, or 0
        self.size = self.rank = 0
        self.every = self.sends = self.matrix = self.counts = 0  # addresses of its count arrays (HostComm)


world = World()


def host_alone():
    """The world communicator when it is one host's shared memory and no engine runs (the engine keeps every
    collective in one order on every rank, so calls must pass through it while it runs); None otherwise."""
    comm = session.state.comm
    return comm if isinstance(comm, HostComm) and engine.current() is None else None


def _sync():
    comm = host_alone()
    world.comm = comm
    if comm is None or allreduce_call is None:
        world.address = world.size = world.rank = 0
        return
    world.size, world.rank = comm.size, comm.rank
    world.every, world.sends, world.matrix, world.counts = comm.every_at, comm.sends_at, comm.matrix_at, comm.counts_at
    world.address = comm.shm.address


session.on_change(_sync)
_sync()
