# SPDX-License-Identifier: Apache-2.0
"""A DistributedDataParallel communication hook that averages the gradient buckets with shmcomm:

    model = torch.nn.parallel.DistributedDataParallel(model)
    model.register_comm_hook(state=None, hook=shmcomm.torch.allreduce_hook)

DDP keeps its bucketing and its overlap of communication with backward; only the bytes travel through shmcomm
(shared memory inside a host, the 2D torus across hosts). DDP still needs a torch.distributed process group (gloo)
for its start-up broadcasts."""
import itertools
import threading

import torch

from shmcomm import asynchronous
from shmcomm.vocabulary.ops import Average
from shmcomm.process_sets import ProcessSet

_calls = itertools.count()
_lock = threading.Lock()


def allreduce_hook(state, bucket):
    """DDP's communication hook: starts the in-place Average allreduce of a bucket's flat gradient.

    Args:
        state: None (every rank), or a ProcessSet of the ranks that run this DDP model; any other state is ignored.
        bucket: the torch.distributed.GradBucket DDP passes.

    Returns:
        A torch.futures.Future of the averaged bucket; it fails with the collective's error.

    Example:
        `model.register_comm_hook(state=None, hook=shmcomm.torch.allreduce_hook)`.
    """
    buffer = bucket.buffer()
    with _lock:
        call = next(_calls)
    # DDP reduces the buckets in the same order on every rank, so (bucket index, call number) names the same
    # bucket everywhere, and the call number keeps names unique while earlier buckets are still in flight.
    name = "ddp.bucket%d.%d" % (bucket.index(), call)
    future = torch.futures.Future()
    process_set = state if isinstance(state, ProcessSet) else None
    handle = asynchronous.allreduce_async_(buffer, op=Average, name=name, process_set=process_set)

    def done(h):
        # Runs on the engine's thread: only hand over the outcome here.
        try:
            future.set_result(h.wait(0))
        except Exception as error:
            future.set_exception(error)

    handle.add_done_callback(done)
    return future
