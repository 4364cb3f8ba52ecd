# SPDX-License-Identifier: Apache-2.0
"""Arrays in memory that every rank of the host maps, as MPI_Win_allocate_shared and ncclMemAlloc give theirs:
`grads = shmcomm.shared_empty(n, np.float32)` on every rank, then `shmcomm.allreduce_(grads, op=shmcomm.Average)`.

Collectives on such arrays read and write the peers' memory directly, with plain copies instead of the staging slots
and the kernel's copy (csrc/coll/window.c): an in-place allreduce of the array or of a slice of it (at any offset on
each rank), a reduce-scatter or a broadcast of them, an allgather into them and an alltoall out of them. The engine's
fusion buffer is one such buffer, so DistributedOptimizer's fused allreduces take that path by themselves."""
import math
import operator

import numpy as np

from shmcomm.vocabulary import description
from shmcomm import engine
from shmcomm.startup import session
from shmcomm.vocabulary.exceptions import InvalidArgumentError, NotSupportedError
from shmcomm.transport.shm import WindowMemory


def shared_empty(shape, dtype=np.float32):
    """A new uninitialised numpy array that every rank of this host maps, so that collectives on it
    read and write the ranks' memory directly instead of staging copies.

    Collective: every rank calls it, with the same shape and dtype. Its memory lives as long as the array and its views,
    past shutdown() too. Where the ranks cannot map each other's memory (no ptrace rights between them, a kernel before
    Linux 5.6, SHMCOMM_SHARED_BUFFERS=0) or in a world of one rank, it is an ordinary array, and every collective works
    on it as on any other. Across hosts, the ranks of each host map each other's.

    Args:
        shape: an int or a tuple of ints.
        dtype: any numpy dtype (default float32).

    Returns:
        A numpy array; is_shared() says whether the ranks map it.

    Raises:
        InvalidArgumentError: a shape that is not integers, a negative dimension, or not a dtype.
        MismatchError: the ranks passed different shapes or dtypes; every rank raises.
        NotSupportedError: the background engine runs (after the first asynchronous call, or init(engine=True)): its
            own fusion buffer is shared already.

    Example:
        `grads = shmcomm.shared_empty(1 << 20)`; fill it, then `shmcomm.allreduce_(grads)`.
    """
    try:
        shape = tuple(operator.index(d) for d in shape) if np.iterable(shape) else (operator.index(shape),)
    except TypeError:
        raise InvalidArgumentError("shared_empty: shape %r is not a tuple of integers" % (shape,)) from None
    if any(d < 0 for d in shape):
        raise InvalidArgumentError("shared_empty: shape %r has a negative dimension" % (shape,))
    try:
        dtype = np.dtype(dtype)
    except TypeError as error:
        raise InvalidArgumentError("shared_empty: %s" % error) from None
    comm = session.communicator()
    if engine.current() is not None:
        raise NotSupportedError("shared_empty: the engine runs collectives on the communicator meanwhile; make shared "
                                "arrays before the first asynchronous call (the engine's fusion buffer is shared "
                                "already)")
    share = getattr(comm, "shared_buffer", None)
    if share is None or comm.size == 1:
        return np.empty(shape, dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = share(max(nbytes, 1), "shared_empty", description.tag(dtype.num, shape))
    return raw[:nbytes].view(dtype).reshape(shape)


def is_shared(array):
    """Whether an array came from shared_empty() and every rank of its host maps it.

    Args:
        array: a numpy array, or a view of one.

    Returns:
        True when `array` (or the array it is a view of) is shared; False for any other array.
    """
    while array is not None:
        if isinstance(array, WindowMemory):
            return array.shared
        array = getattr(array, "base", None)
    return False
