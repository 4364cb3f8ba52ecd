# SPDX-License-Identifier: Apache-2.0
"""MPI (mpi4py) as a benchmark backend: buffer-interface calls on preallocated numpy arrays, no pickling."""
import numpy as np
from mpi4py import MPI

from benchmarks.backends import Unsupported


class MpiBackend:
    """Whichever MPI mpi4py loaded: "mpi" (the MPICH wheel, mpi4py's default) or "openmpi" (benchmarks/openmpi.py)."""
    call_errors = ()

    def __init__(self, **_options):
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.library = " ".join(MPI.Get_library_version().splitlines()[0].split())
        self.name = "openmpi" if self.library.startswith("Open MPI") else "mpi"

    def barrier(self):
        self.comm.Barrier()

    def combine(self, values, how):
        out = np.array(values, dtype=np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, out, MPI.MAX if how == "max" else MPI.SUM)
        return out

    def prepare(self, op, buffers):
        comm, send, recv, inplace = self.comm, buffers.send, buffers.recv, buffers.inplace
        source = MPI.IN_PLACE if inplace else send

        if op == "allreduce":
            def run():
                comm.Allreduce(source, recv, MPI.SUM)
                return recv
        elif op == "broadcast":
            if not inplace:
                raise Unsupported("MPI_Bcast works in place only")

            def run():
                comm.Bcast(recv, root=0)
                return recv
        elif op == "allgather":
            def run():  # in place, MPI takes this rank's block from its place in recv
                comm.Allgather(source, recv)
                return recv
        elif op == "reducescatter":
            # In place, MPI leaves this rank's block at the start of the buffer.
            result = recv[:buffers.block] if inplace else recv

            def run():
                comm.Reduce_scatter_block(source, recv, MPI.SUM)
                return result
        elif op == "alltoall":
            def run():
                comm.Alltoall(source, recv)
                return recv
        else:
            raise Unsupported("MPI has no %s" % op)
        return run

    def close(self):
        pass  # mpi4py finalizes MPI at exit
