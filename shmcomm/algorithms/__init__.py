# SPDX-License-Identifier: Apache-2.0
"""Allreduce algorithms for jobs that span hosts (or a logical grid on one host): 2D torus, ring, MPI's own."""


def shares(count, parts):
    """Horovod's split: the first (count % parts) parts get one element more."""
    return [count // parts + (1 if i < count % parts else 0) for i in range(parts)]
