# SPDX-License-Identifier: Apache-2.0
"""torch.distributed's gloo as a benchmark backend: ranks from shmcommrun's environment, rendezvous over
127.0.0.1, CPU tensors that share memory with the harness's numpy arrays."""
import os
from functools import partial

import torch
import torch.distributed as dist

from benchmarks.backends import Unsupported


def _newest(*names):
    """The first of these torch.distributed functions that this torch has (names change between releases)."""
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    return None


class GlooBackend:
    name = "gloo"
    process_group = "gloo"  # init_process_group's backend (benchmarks/backend_torch_shmcomm.py runs "shmcomm")
    # Older torch releases lack some collectives in gloo and say so only when called.
    call_errors = (RuntimeError, NotImplementedError, ValueError)

    def __init__(self, port, **_options):
        self.rank = int(os.environ["SHMCOMM_RANK"])
        self.size = int(os.environ["SHMCOMM_SIZE"])
        dist.init_process_group(self.process_group, init_method="tcp://127.0.0.1:%d" % port, rank=self.rank,
                                world_size=self.size)
        self.library = "torch %s gloo" % torch.__version__

    def barrier(self):
        dist.barrier()

    def combine(self, values, how):
        values = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX if how == "max" else dist.ReduceOp.SUM)
        return values.numpy()

    def prepare(self, op, buffers):
        send, recv = torch.from_numpy(buffers.send), torch.from_numpy(buffers.recv)
        result = buffers.recv
        if op == "allreduce":
            if not buffers.inplace:
                raise Unsupported("gloo's all_reduce works in place only")
            call = partial(dist.all_reduce, recv, op=dist.ReduceOp.SUM)
        elif op == "broadcast":
            if not buffers.inplace:
                raise Unsupported("gloo's broadcast works in place only")
            call = partial(dist.broadcast, recv, src=0)
        elif op == "allgather":
            gather = _newest("all_gather_single", "all_gather_into_tensor")
            if gather is None:
                call = partial(dist.all_gather, list(recv.chunk(self.size)), send)
            else:  # in place, `send` is this rank's block of `recv`, as in nccl-tests
                call = partial(gather, recv, send)
        elif op == "reducescatter":
            scatter = _newest("reduce_scatter_single", "reduce_scatter_tensor")
            if scatter is None:
                raise Unsupported("this torch has no reduce_scatter_tensor")
            out = recv
            if buffers.inplace:  # nccl-tests' in-place layout: the result is this rank's block of the input
                start = buffers.rank * buffers.block
                result, out = buffers.recv[start:start + buffers.block], recv[start:start + buffers.block]
            call = partial(scatter, out, send, op=dist.ReduceOp.SUM)
        elif op == "alltoall":
            if buffers.inplace:
                raise Unsupported("gloo's all_to_all_single needs distinct input and output")
            call = partial(dist.all_to_all_single, recv, send)
        else:
            raise Unsupported("gloo has no %s" % op)

        def run():
            call()
            return result
        return run

    def close(self):
        dist.destroy_process_group()
