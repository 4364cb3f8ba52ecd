# SPDX-License-Identifier: Apache-2.0
"""Intel oneCCL as a benchmark backend: its C API through ctypes (benchmarks/oneccl.py) on the harness's numpy
arrays, in a job that oneCCL's own Intel MPI starts; that MPI (through mpi4py) gives the ranks, the barrier and the
combining of timings, and hands out the communicator's id."""
import ctypes

import numpy as np

from benchmarks import oneccl
from benchmarks.backend_mpi import MpiBackend
from benchmarks.backends import Unsupported

DTYPES = {np.dtype(name): code for name, code in oneccl.DTYPES.items()}


class OnecclBackend(MpiBackend):
    """The job's MPI backend (its barrier and combining), with oneCCL's collectives in place of MPI's."""

    def __init__(self, prefix=oneccl.PREFIX, **options):
        super().__init__(**options)
        self.name = "oneccl"
        self.lib = oneccl.load(prefix)
        self.ccl = oneccl.communicator(self.lib, self.rank, self.size, lambda raw: self.comm.Bcast(raw, root=0))
        version = ctypes.c_int()
        self.lib.onecclGetVersion(ctypes.byref(version))
        self.library = "oneCCL %d (C API), over %s" % (version.value, self.library)

    def prepare(self, op, buffers):
        code = DTYPES.get(buffers.recv.dtype)
        if code is None:
            raise Unsupported("oneCCL's C API is measured on %s only" % ", ".join(oneccl.DTYPES))
        send, recv, block = buffers.send, buffers.recv, buffers.block
        at = ctypes.c_void_p
        result = recv
        if op == "allreduce":  # in place, send is recv
            args = (self.lib.onecclAllReduce, at(send.ctypes.data), at(recv.ctypes.data), ctypes.c_size_t(recv.size),
                    code, oneccl.SUM)
        elif op == "broadcast":
            if not buffers.inplace:
                raise Unsupported("the harness's broadcast is in place")
            args = (self.lib.onecclBroadcast, at(recv.ctypes.data), at(recv.ctypes.data), ctypes.c_size_t(recv.size),
                    code, 0)
        elif op == "allgather":  # in place, send is this rank's block of recv, as oneCCL takes it
            args = (self.lib.onecclAllGather, at(send.ctypes.data), at(recv.ctypes.data), ctypes.c_size_t(block),
                    code)
        elif op == "reducescatter":  # in place, the result is this rank's block of the input, as oneCCL leaves it
            out = recv[buffers.rank * block:(buffers.rank + 1) * block] if buffers.inplace else recv
            result = out
            args = (self.lib.onecclReduceScatter, at(send.ctypes.data), at(out.ctypes.data), ctypes.c_size_t(block),
                    code, oneccl.SUM)
        elif op == "alltoall":
            if buffers.inplace:
                raise Unsupported("oneCCL's alltoall needs distinct input and output")
            args = (self.lib.onecclAllToAll, at(send.ctypes.data), at(recv.ctypes.data), ctypes.c_size_t(block), code)
        else:
            raise Unsupported("oneCCL has no %s" % op)
        call, args = args[0], args[1:] + (self.ccl, None)  # host buffers: no stream

        def run():
            call(*args)
            return result
        return run

    def close(self):
        self.lib.onecclCommDestroy(self.ccl)
