# SPDX-License-Identifier: Apache-2.0
"""torch.distributed's own layer alone, as a yardstick for a backend written in Python: a process group whose
operations do nothing but return a finished Work. A call on it costs what torch's functions (argument checks, options,
the call into the group, wait()) cost before and after any Python backend's own work, which no such backend can
shorten; benchmarks/torch_distributed.py times it right after the numpy-level call, in the caches that call left."""
import torch.distributed as dist

from shmcomm.torch.work import finished

NAME = "layer_only"


class LayerOnly(dist.ProcessGroup):
    """The process group of the backend NAME: each operation the benchmark times returns one finished Work."""

    def __init__(self, rank, size):
        super().__init__(rank, size)
        self._done = finished([])

    def getBackendName(self):
        """The backend's name."""
        return NAME

    def _nothing(self, *args):
        return self._done

    allreduce = all_gather_single = reduce_scatter_single = all_to_all_single = broadcast = _nothing


def group():
    """A group of every rank on the do-nothing backend (registered on first use); every rank calls it alike."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, lambda options, *_: LayerOnly(options.group_rank, options.group_size),
                                      extended_api=True, devices=["cpu"])
    return dist.new_group(backend=NAME)
