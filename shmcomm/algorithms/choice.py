# SPDX-License-Identifier: Apache-2.0
"""Which allreduce algorithm a job takes across hosts (or on a logical grid): the one place that decides.

SHMCOMM_ALLREDUCE_ALGO picks it (env.ALGORITHMS). `auto` takes the 2D torus when every host runs the same number of
ranks, and MPI's own allreduce for hosts of unequal sizes and, across hosts, below SHMCOMM_TORUS_MIN_BYTES (0). The
torus's small-message path is a single exchange across hosts that carries the cross-host agreement too, where MPI's
allreduce needs that agreement as an exchange of its own first (benchmarks/RESULTS.md compares the two).
With SHMCOMM_LOG_LEVEL=debug every choice is logged ("allreduce of N bytes: <algorithm>"), which is how tests see
the path taken."""
import logging

log = logging.getLogger("shmcomm.algorithms")


def validate(algorithm, torus_possible, across_hosts):
    """The algorithm a job asked for, if it can run it; ValueError otherwise (raised on every rank alike)."""
    if algorithm == "torus" and not torus_possible:
        raise ValueError("SHMCOMM_ALLREDUCE_ALGO=torus needs the same number of ranks on every host")
    if algorithm in ("ring", "mpi") and not across_hosts:
        raise ValueError("SHMCOMM_ALLREDUCE_ALGO=%s needs a job launched across hosts" % algorithm)
    log.info("allreduce algorithm: %s (torus %s)", algorithm, "possible" if torus_possible else
             "impossible: hosts run different numbers of ranks")
    return algorithm


def allreduce(algorithm, nbytes, torus_possible, across_hosts, torus_min_bytes):
    """torus, ring or mpi for an allreduce of `nbytes`."""
    if algorithm == "auto":
        if not torus_possible or (across_hosts and nbytes < torus_min_bytes):
            algorithm = "mpi"
        else:
            algorithm = "torus"
    if log.isEnabledFor(logging.DEBUG):
        log.debug("allreduce of %d bytes: %s", nbytes, algorithm)
    return algorithm
