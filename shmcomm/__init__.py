# SPDX-License-Identifier: Apache-2.0
"""shmcomm: collective communication for distributed deep learning over shared memory.

    import shmcomm
    shmcomm.init()
    total = shmcomm.allreduce(array, op=shmcomm.Sum)

Names load on first use, so that `import shmcomm` (and the launcher, which lives in this package) stays cheap and
works before the C core is built."""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "shmcomm.basics": ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
                       "cross_size"],
    "shmcomm.collectives": ["allreduce", "allreduce_", "broadcast", "broadcast_", "allgather", "reducescatter",
                            "alltoall", "barrier"],
    "shmcomm.asynchronous": ["allreduce_async", "allreduce_async_", "broadcast_async", "broadcast_async_",
                             "allgather_async", "reducescatter_async", "alltoall_async", "poll", "synchronize", "join",
                             "start_timeline", "stop_timeline"],
    "shmcomm.process_sets": ["ProcessSet", "add_process_set", "remove_process_set", "global_process_set"],
    "shmcomm.smb.box": ["SoftMemoryBox"],
    "shmcomm.shared_arrays": ["shared_empty", "is_shared"],
    "shmcomm.smb.averaging": ["ElasticCentre"],
    "shmcomm.vocabulary.ops": ["ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product"],
    "shmcomm.vocabulary.exceptions": ["ShmCommError", "NotInitializedError", "InvalidArgumentError", "MismatchError",
                           "TimeoutError", "RankFailure", "HostFailure", "BrokenCommunicatorError",
                           "OutOfMemoryError", "BoxExistsError", "BoxNotFoundError", "PeerArgumentError",
                           "NotSupportedError", "AbandonedError", "AuthenticationError"],
    "shmcomm.torch.optimizer": ["DistributedOptimizer"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError("module 'shmcomm' has no attribute %r" % name)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
