# SPDX-License-Identifier: Apache-2.0
"""Reduction operations, numbered as Horovod numbers them so scripts that pass the ints keep working."""
import enum

from shmcomm._native import lib
from shmcomm.vocabulary.exceptions import InvalidArgumentError


class ReduceOp(enum.IntEnum):
    """How a reduction combines the ranks' tensors, element by element: the mean, the sum, Adasum (torch's
    allreduce and DistributedOptimizer; a power-of-two number of ranks), the smallest, the largest, the product.
    Also exported as shmcomm.Average, shmcomm.Sum, shmcomm.Adasum, shmcomm.Min, shmcomm.Max and shmcomm.Product."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum, ReduceOp.Min,
                                           ReduceOp.Max, ReduceOp.Product)

# What the C core computes for each op; Average is a sum divided by the number of ranks. Adasum is not an
# element-wise op: algorithms/adasum.py computes it.
C_OP = {
    ReduceOp.Average: lib.SMC_SUM,
    ReduceOp.Sum: lib.SMC_SUM,
    ReduceOp.Min: lib.SMC_MIN,
    ReduceOp.Max: lib.SMC_MAX,
    ReduceOp.Product: lib.SMC_PROD,
}


_SUPPORTED = {op: op for op in ReduceOp}


def resolve(op, average=None):
    """Horovod's rules: `average=` (deprecated) still works, None means Average, and ints are accepted."""
    if average is None and op in _SUPPORTED:
        return _SUPPORTED[op]  # the common case, without the enum's slower constructor
    if average is not None:
        if op is not None:
            raise InvalidArgumentError("op and average cannot both be given; average is deprecated, use op=")
        return ReduceOp.Average if average else ReduceOp.Sum
    if op is None:
        return ReduceOp.Average
    try:
        return ReduceOp(op)
    except ValueError:
        raise InvalidArgumentError("unknown reduction op %r" % (op,)) from None
    return op
