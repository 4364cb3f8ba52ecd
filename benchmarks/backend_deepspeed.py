# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's shared-memory allreduce for CPUs as a benchmark backend (benchmarks/deepspeed.py loads it): in place,
on torch tensors that share memory with the harness's numpy arrays, float32 and float16. Its ranks run under
shmcommrun, whose shmcomm gives the barrier and the combining of timings: DeepSpeed's op has neither."""
import importlib.metadata

import numpy as np
import torch

import shmcomm
from benchmarks import deepspeed
from benchmarks.backend_shmcomm import ShmcommBackend
from benchmarks.backends import Unsupported


class DeepspeedBackend(ShmcommBackend):
    """shmcomm's backend (its barrier and combining), with DeepSpeed's allreduce in place of every operation it has."""
    name = "deepspeed"

    def __init__(self, **options):
        super().__init__(**options)
        if shmcomm.local_size() != self.size:
            raise SystemExit("DeepSpeed's shared-memory allreduce needs every rank on one host")
        self.op, self.level = deepspeed.load(self.size, self.rank)
        self.library = "DeepSpeed %s" % importlib.metadata.version("deepspeed")

    def prepare(self, op, buffers):
        if op != "allreduce":
            raise Unsupported("DeepSpeed's op is an allreduce")
        if not buffers.inplace:
            raise Unsupported("DeepSpeed's allreduce works in place only")
        if buffers.recv.dtype not in (np.float32, np.float16) or (buffers.recv.dtype != np.float32 and self.level < 2):
            raise Unsupported("DeepSpeed's op takes float32, and float16 where the CPU has AVX-512")
        tensor, recv, op_ = torch.from_numpy(buffers.recv), buffers.recv, self.op

        def run():
            op_(tensor)
            return recv
        return run

    def close(self):
        shmcomm.barrier()
        deepspeed.remove_segments(self.rank)
        super().close()
