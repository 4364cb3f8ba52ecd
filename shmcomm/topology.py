# SPDX-License-Identifier: Apache-2.0
"""Who is where when a job spans hosts: ranks and hosts learned from MPI.

A job started by mpiexec/mpirun (directly, through shmcommrun -H, or by srun) has no SHMCOMM_RANK of its own; MPI
knows the ranks, and MPI_Comm_split_type(SHARED) groups them by host. Only such a job imports mpi4py: a single-host
job never pays for MPI's start-up."""
import os
import secrets
import sys
from dataclasses import dataclass

from shmcomm.env import Topology

_MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def launched_by_mpi():
    if os.environ.get("SHMCOMM_LAUNCHER") == "mpi":
        return True
    if os.environ.get("SHMCOMM_RANK") or os.environ.get("HOROVOD_RANK"):
        return False
    if any(os.environ.get(v) for v in _MPI_RANK_VARIABLES):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in os.environ


@dataclass
class MPIContext:
    world: object        # MPI.COMM_WORLD
    local: object        # the ranks of this host
    cross: object        # the ranks with this local rank, one per host
    host_index: int      # this host's place among the hosts (hosts ordered by their lowest rank)
    host_ranks: list     # global ranks on this host, in order
    hosts: int
    homogeneous: bool    # every host runs the same number of ranks


def from_mpi():
    """The topology and the MPI communicators of an MPI-launched job."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    per_host = int(os.environ.get("SHMCOMM_RANKS_PER_HOST", "0") or 0)
    if per_host > 0:
        # Testing aid: pretend consecutive groups of ranks are hosts (MPI still carries the cross-host steps).
        local = world.Split(color=world.rank // per_host, key=world.rank)
    else:
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    leader = local.bcast(world.rank, root=0)
    leaders = sorted(set(world.allgather(leader)))
    cross = world.Split(color=local.rank, key=world.rank)
    token = world.bcast(os.environ.get("SHMCOMM_JOB_TOKEN") or secrets.token_hex(16), root=0)
    local_sizes = world.allgather(local.size)
    _abort_job_on_uncaught_exception(world)
    topo = Topology(world.rank, world.size, local.rank, local.size, cross.rank, cross.size, token, True)
    ctx = MPIContext(world, local, cross, leaders.index(leader), local.allgather(world.rank), len(leaders),
                     len(set(local_sizes)) == 1)
    return topo, ctx


def _abort_job_on_uncaught_exception(world):
    """A rank that dies of an exception would otherwise wait in MPI_Finalize for ranks that wait for it: print the
    traceback, then abort the whole job (what `python -m mpi4py` does)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.flush()
        world.Abort(1)

    sys.excepthook = hook


def parse_grid(text, size):
    """SHMCOMM_TORUS_GRID=XxY: X ranks per row, Y rows, X*Y = size."""
    try:
        x, y = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError("SHMCOMM_TORUS_GRID=%r: expected XxY, e.g. 2x2" % text) from None
    if x < 1 or y < 1 or x * y != size:
        raise ValueError("SHMCOMM_TORUS_GRID=%s does not fit %d ranks (X*Y must equal the number of ranks)"
                         % (text, size))
    return x, y
