# SPDX-License-Identifier: Apache-2.0
"""shmcomm for JAX: collectives on jax arrays and pytrees, eagerly and inside jax.jit, and a distributed optax
optimizer; after `import shmcomm.jax as sj` and `sj.init()`, call `sj.allreduce(grads, op=sj.Average)` or use
`sj.DistributedOptimizer(optax.adam(1e-3))`.

Collectives inside jit are XLA custom calls to a C handler (csrc/jax/handler.c) that, on one host, runs the C core's
collective on XLA's own buffers; across hosts, or while the engine runs, it calls into Python (context.py). Every
collective is an ordered effect kept in program order (primitive.py), so JAX dispatches each jax.jit call through its
slower Python path; shmcomm.jax.jit seals the effect inside the program and takes the fast one (sealed.py)."""
try:
    import jax as _jax  # noqa: F401
    import optax as _optax  # noqa: F401
except ImportError as _error:
    raise ImportError("shmcomm.jax needs jax and optax: pip install 'shmcomm[jax]' (%s)" % _error) from _error

from shmcomm import basics as _basics
from shmcomm.jax import context as _context
from shmcomm.jax.collectives import allgather, allreduce, alltoall, barrier, broadcast, reducescatter
from shmcomm.jax.optimizer import Compression, DistributedOptimizer, broadcast_parameters
from shmcomm.jax.sealed import jit
from shmcomm.vocabulary.exceptions import (BrokenCommunicatorError, InvalidArgumentError, MismatchError,
                                           NotInitializedError, RankFailure, ShmCommError, TimeoutError)
from shmcomm.vocabulary.ops import Average, Max, Min, Product, ReduceOp, Sum

init = _basics.init
shutdown = _basics.shutdown
is_initialized = _basics.is_initialized
rank, size = _basics.rank, _basics.size
local_rank, local_size = _basics.local_rank, _basics.local_size
cross_rank, cross_size = _basics.cross_rank, _basics.cross_size
original = _context.original

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "jit", "allreduce", "allgather", "broadcast", "reducescatter", "alltoall", "barrier",
           "broadcast_parameters", "DistributedOptimizer", "Compression", "original", "ReduceOp", "Average", "Sum",
           "Min", "Max", "Product", "ShmCommError", "MismatchError", "RankFailure", "TimeoutError",
           "InvalidArgumentError", "NotInitializedError", "BrokenCommunicatorError"]
