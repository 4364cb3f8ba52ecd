# SPDX-License-Identifier: Apache-2.0
"""shmcomm as a benchmark backend: the public API, called the way an application calls it."""
import numpy as np

import shmcomm
from benchmarks.backends import Unsupported


class ShmcommBackend:
    name = "shmcomm"
    call_errors = ()  # every operation exists; any error is a real failure

    def __init__(self, **_options):
        shmcomm.init()
        self.rank, self.size = shmcomm.rank(), shmcomm.size()
        self.library = "shmcomm %s" % shmcomm.__version__

    def barrier(self):
        shmcomm.barrier()

    def combine(self, values, how):
        op = shmcomm.Max if how == "max" else shmcomm.Sum
        return shmcomm.allreduce(np.asarray(values, dtype=np.float64), op=op)

    def prepare(self, op, buffers):
        send, recv = buffers.send, buffers.recv
        if op == "allreduce":
            if buffers.inplace:
                return lambda: shmcomm.allreduce_(recv, op=shmcomm.Sum)
            return lambda: shmcomm.allreduce(send, op=shmcomm.Sum, output=recv)
        if op == "broadcast":
            if buffers.inplace:
                return lambda: shmcomm.broadcast_(recv, 0)
            return lambda: shmcomm.broadcast(send, 0, output=recv)
        if buffers.inplace:
            raise Unsupported("shmcomm.%s has no in-place form" % op)
        # Into preallocated results, as MPI's calls are measured.
        if op == "allgather":
            return lambda: shmcomm.allgather(send, output=recv)
        if op == "reducescatter":
            return lambda: shmcomm.reducescatter(send, op=shmcomm.Sum, output=recv)
        if op == "alltoall":
            return lambda: shmcomm.alltoall(send, output=recv)
        raise Unsupported("shmcomm has no %s" % op)

    def close(self):
        shmcomm.shutdown()
