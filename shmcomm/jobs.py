# SPDX-License-Identifier: Apache-2.0
"""Builds the world communicator for the kind of job this process is in.

- one host, the usual case: the host's shared-memory communicator, nothing else (no MPI);
- one host with SHMCOMM_TORUS_GRID=XxY: rows and columns of the torus both on shared memory, which is how the torus
  is exercised without several hosts;
- several hosts (launched by mpiexec, shmcommrun -H, srun): each host's shared memory for the rows, MPI for the
  columns and for the collectives that are not allreduce."""
import os

from shmcomm import env, topology
from shmcomm.basics import Communicator


def _grid_text():
    return os.environ.get("SHMCOMM_TORUS_GRID") or os.environ.get("HOROVOD_TORUS_GRID")


TORUS_SMALL_BYTES = 256 << 10


def torus_small_bytes(environ=os.environ):
    """Up to this size the torus takes its small-message path (see torus2d.Torus)."""
    return int(environ.get("SHMCOMM_TORUS_SMALL_BYTES") or environ.get("HOROVOD_TORUS_SMALL_BYTES")
               or TORUS_SMALL_BYTES)


def build_world(generation):
    if topology.launched_by_mpi():
        return _across_hosts(generation)
    topo = env.topology()
    tuning = env.tuning(topo.local_size)
    host = Communicator(topo, tuning, generation)
    grid = _grid_text()
    if not grid:
        return host
    return _logical_grid(topo, tuning, generation, host, *topology.parse_grid(grid, topo.size))


def _logical_grid(topo, tuning, generation, host, x, y):
    from shmcomm.algorithms.torus2d import ShmColumn, Torus
    from shmcomm.grid import GridComm

    row_index, column_index = topo.rank // x, topo.rank % x
    row = Communicator(topo, tuning, generation, ranks=[row_index * x + i for i in range(x)],
                       suffix="_r%d" % row_index)
    column = Communicator(topo, tuning, generation, ranks=[j * x + column_index for j in range(y)],
                          suffix="_c%d" % column_index)
    torus = Torus(row, ShmColumn(column), torus_small_bytes(), world_rank=topo.rank)
    world = GridComm(topo, tuning, host, torus, host_groups=[list(range(topo.size))])
    world.closables = [row, column]
    return world


def _across_hosts(generation):
    from shmcomm.algorithms.torus2d import MpiColumn, Torus
    from shmcomm.grid import GridComm, require_same_settings

    topo, ctx = topology.from_mpi()
    if ctx.hosts > 1 or _grid_text():
        require_same_settings(ctx.world)
    tuning = env.tuning(topo.local_size)
    host = Communicator(topo, tuning, generation, ranks=ctx.host_ranks, suffix="_h%d" % ctx.host_index, arena=True)
    if ctx.hosts == 1 and not _grid_text():
        host.ranks = list(range(topo.size))  # one host: the host communicator is the world
        return host
    try:
        grid = _grid_text()
        if grid:
            x, y = topology.parse_grid(grid, topo.size)
            if x != topo.local_size or not ctx.homogeneous:
                raise ValueError("SHMCOMM_TORUS_GRID=%s: across hosts a row must be one host's %d ranks"
                                 % (grid, topo.local_size))
        small_bytes = torus_small_bytes()
        # The column gives up a little before the host's own waits do, so that the rest of the host hears why.
        column_timeout_s = 0.8 * tuning.timeout_s
        torus = Torus(host, MpiColumn(ctx.cross, column_timeout_s, small_bytes, "torus column"), small_bytes,
                      world_rank=topo.rank) if ctx.homogeneous else None
        return GridComm(topo, tuning, host, torus, mpi=ctx.world, host_groups=ctx.world.allgather(ctx.host_ranks))
    except BaseException:
        host.close()
        raise
