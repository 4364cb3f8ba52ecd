# SPDX-License-Identifier: Apache-2.0
"""Allreduce on NCCL communicators: one call on the world communicator, or the 2D torus of torus2d.py on device
memory, with rows and columns split from the world communicator.

Rows are X consecutive ranks (one host's, across hosts), columns the ranks with the same place in their row; the
steps are torus_allreduce()'s. `layout` decides, from the path settings (SHMCOMM_ALLREDUCE_ALGO, SHMCOMM_TORUS_GRID)
and where the ranks live, whether the torus applies; it is plain data, tested without a GPU."""
from shmcomm.vocabulary.exceptions import InvalidArgumentError


def layout(size, host_groups, algorithm, grid):
    """(x, y) of the torus, or None for one allreduce on the world communicator.

    `algorithm`: SHMCOMM_ALLREDUCE_ALGO (auto, torus, ring, mpi); `grid`: SHMCOMM_TORUS_GRID as (x, y), or None;
    `host_groups`: the job ranks of each host. auto takes the torus across hosts when every host has the same
    ranks in consecutive order, as the host-memory torus does; ring and mpi mean NCCL's own algorithm (it picks ring
    or tree itself)."""
    if algorithm in ("ring", "mpi"):
        return None
    if grid is not None:
        x, y = grid
        if x * y != size:
            raise InvalidArgumentError("SHMCOMM_TORUS_GRID=%dx%d does not fit %d ranks" % (x, y, size))
    else:
        x, y = len(host_groups[0]), len(host_groups)
        consecutive = host_groups == [[j * x + i for i in range(x)] for j in range(y)]
        if not consecutive:
            if algorithm == "torus":
                raise InvalidArgumentError("SHMCOMM_ALLREDUCE_ALGO=torus needs hosts with equal numbers of ranks in "
                                           "consecutive order; hosts hold %s" % host_groups)
            return None
        if algorithm == "auto" and y == 1:
            return None  # one host: one NCCL allreduce over NVLink or PCIe
    return (x, y) if x > 1 and y > 1 else None


def row_and_column(rank, x, y):
    """((row color, key, job ranks), (column color, key, job ranks)) of `rank` on an x-by-y grid, for
    ncclCommSplit: the row is x consecutive ranks, the column every x-th."""
    row, column = rank // x, rank % x
    return ((row, column, [row * x + i for i in range(x)]),
            (column, row, [j * x + column for j in range(y)]))


def padded_count(count, x):
    """The element count the torus works on: `count` rounded up to a multiple of x."""
    return -(-count // x) * x


def torus_allreduce(row, column, padded, piece, count, dtype, op, stream):
    """The torus on `stream`, in this order on every rank: 1. ncclReduceScatter over the row (rank (x, y) gets the
    row's reduction of slice x); 2. ncclAllReduce over the column, on that slice only; 3. ncclAllGather over the row.

    `padded`: device pointer to `count` elements, reduced in place; NCCL's reduce-scatter wants equal slices, so the
    caller pads with zeros to a multiple of row.size (padded_count). `piece`: device pointer to count / row.size
    elements of scratch. `op`: sum, product, min or max; for an average pass sum and divide once at the end, since
    ncclAvg in each step would divide by the row's and the column's sizes, not the world's."""
    share = count // row.size
    row.reducescatter(padded, piece, share, dtype, op, stream)
    column.allreduce(piece, piece, share, dtype, op, stream)
    row.allgather(piece, padded, share, dtype, stream)
