# SPDX-License-Identifier: Apache-2.0
"""shmcomm's collectives against Intel oneCCL's on this host, call by call in one job:

    python -m benchmarks.oneccl -np 2 [--prefix benchmarks/.oneccl] [--ops allreduce,allgather,...]
        [--dtypes float32,float16] [--bytes 8,1K,64K,1M,4M,16M,64M] [--rounds 5] [--iters 20] [--cpu-load N]

oneCCL is a peer, never a dependency: it lives in a prefix of its own (benchmarks/README.md says how to install it
there), and this driver starts the job with that prefix's Intel MPI, over which oneCCL runs fastest on one host
(CCL_ATL_TRANSPORT=mpi, I_MPI_FABRICS=shm; CCL_WORKER_OFFLOAD=0, since a worker thread per rank spinning beside the
ranks takes the cores they need). shmcomm learns the job from the same MPI. oneCCL's side is its C API (onecclAllReduce
and the others, on host buffers: no stream) through ctypes, on numpy arrays as shmcomm's. Sizes follow nccl-tests:
the buffer of allreduce, alltoall and broadcast (in place, from rank 0), allgather's output and reducescatter's input.
The two take turns call by call, each call after a barrier; the table gives, per op, dtype and size, the median over
rounds of the slowest rank's median and 90th percentile of --iters calls, and oneCCL's time over shmcomm's as the
median of the rounds' ratios (above 1: shmcomm is faster). Both libraries' calls are those of
benchmarks.collectives' backends (backend_shmcomm.py, backend_oneccl.py) on its buffers, and their results are
checked element by element once per case."""
import argparse
import ctypes
import os
import subprocess
import sys

import numpy as np

import shmcomm
from benchmarks.taking_turns import alternating, chosen, parser_for, size_text, sizes_of, slowest_rank

PREFIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".oneccl")
OPS = ("allreduce", "allgather", "alltoall", "reducescatter", "broadcast")
DTYPES = {"float32": 7, "float16": 6}  # numpy's name -> onecclDataType_t
SUM = 0  # onecclSum
INSTALL = ("python -m venv {0} && {0}/bin/pip install --no-deps oneccl==2022.2.0 && "
           "{0}/bin/pip install oneccl-cpu==2022.1.2 intel-sycl-rt intel-cmplr-lib-rt (benchmarks/README.md)")


class UniqueId(ctypes.Structure):
    """onecclUniqueId: what rank 0 makes and every rank needs to join the communicator."""
    _fields_ = [("data", ctypes.c_char * 4096)]


def main(argv=None):
    parser = parser_for(__doc__, "8,1K,64K,1M,4M,16M,64M")
    parser.add_argument("-np", type=int, default=2, help="ranks, all on this host")
    parser.add_argument("--prefix", default=PREFIX, help="where oneCCL and its Intel MPI are installed")
    parser.add_argument("--ops", default="allreduce")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    options = parser.parse_args(argv)
    ops = chosen(parser, options.ops, OPS, "ops")
    dtypes = chosen(parser, options.dtypes, DTYPES, "dtypes")
    prefix = os.path.abspath(options.prefix)
    if options.worker:
        return _worker(options, prefix, ops, dtypes, argv)
    why = missing(prefix)
    if why:
        raise SystemExit("benchmarks.oneccl: %s" % why)
    command = launch_command(options.np, [sys.executable, "-m", "benchmarks.oneccl", "--worker"] + argv, prefix)
    return subprocess.run(command, env=dict(os.environ, **environment(prefix))).returncode


def missing(prefix=PREFIX):
    """Why oneCCL cannot run from `prefix`, with the commands that install it there; None when it can."""
    if os.path.exists(os.path.join(prefix, "lib", "libccl.so.2")) and os.path.exists(os.path.join(prefix, "bin",
                                                                                                    "mpiexec")):
        return None
    return "no oneCCL with its Intel MPI in %s; install them there: %s" % (prefix, INSTALL.format(prefix))


def environment(prefix=PREFIX):
    """The variables a job of oneCCL's ranks needs: its libraries, mpi4py on its Intel MPI, and the transport over
    which it runs fastest on one host."""
    libs = os.path.join(prefix, "lib")
    return dict(LD_LIBRARY_PATH=os.pathsep.join(filter(None, [libs, os.environ.get("LD_LIBRARY_PATH")])),
                MPI4PY_LIBMPI=os.path.join(libs, "libmpi.so.12"), MPI4PY_MPIABI="mpich", I_MPI_FABRICS="shm",
                CCL_ATL_TRANSPORT="mpi", CCL_PLUGIN="ONECCL_LEGACY_CPU", CCL_WORKER_OFFLOAD="0",
                CCL_LOG_LEVEL="error")


def launch_command(nranks, target, prefix=PREFIX):
    """The command that starts `nranks` ranks of `target` under oneCCL's Intel MPI (with environment(prefix))."""
    return [os.path.join(prefix, "bin", "mpiexec"), "-n", str(nranks)] + list(target)


def _worker(options, prefix, ops, dtypes, argv):
    from benchmarks.backend_oneccl import OnecclBackend
    from benchmarks.backend_shmcomm import ShmcommBackend
    from benchmarks.collectives import buffers_for
    from benchmarks.operations import COLLECTIVES
    from shmcomm.testing import cpu_load

    ours = ShmcommBackend()
    me, n = ours.rank, ours.size
    if shmcomm.local_size() != n:
        raise SystemExit("benchmarks.oneccl compares the libraries on one host")
    theirs = OnecclBackend(prefix=prefix)
    rows = {}  # (op, dtype, size) -> {library: [(median, p90) per round]}
    with cpu_load.spinning(options.cpu_load if me == 0 else 0):
        for round_ in range(options.rounds):
            for op in ops:
                coll = COLLECTIVES[op]
                for dtype in map(np.dtype, dtypes):
                    for nbytes in sizes_of(options):
                        lay = coll.layout(nbytes // dtype.itemsize, n)
                        calls = {}
                        for name, backend in (("shmcomm", ours), ("oneCCL", theirs)):
                            # broadcast in place, as MPI_Bcast; the others out of place
                            buffers = buffers_for(coll, lay, dtype, op == "broadcast", me)
                            buffers.send[...] = coll.data(me, n, lay, dtype)
                            calls[name] = backend.prepare(op, buffers)
                            if round_ == 0:  # every element exact, or the benchmark stops
                                np.testing.assert_array_equal(calls[name](), coll.expected(me, n, lay, dtype),
                                                              err_msg="%s's %s of %s, %d bytes" % (
                                                                  name, op, dtype, nbytes))
                        times = alternating(calls, options.iters)
                        for library, spent in times.items():
                            rows.setdefault((op, dtype.name, nbytes), {}).setdefault(library, []).append(
                                slowest_rank(spent))
    if me == 0:
        _report(rows, options, n, argv)
    ours.barrier()
    theirs.close()
    ours.close()


def load(prefix=PREFIX):
    """oneCCL's C library from `prefix`, each call raising with oneCCL's reason where it does not succeed."""
    lib = ctypes.CDLL(os.path.join(prefix, "lib", "libccl.so.2"))
    lib.onecclGetErrorString.restype = ctypes.c_char_p

    def checked(result, function, arguments):
        if result != 0:
            raise RuntimeError("oneCCL: %s failed: %s" % (function.__name__, lib.onecclGetErrorString(result).decode()))
        return result
    for name in ("onecclGetUniqueId", "onecclCommInitRank", "onecclCommDestroy", "onecclAllReduce", "onecclAllGather",
                 "onecclAllToAll", "onecclReduceScatter", "onecclBroadcast"):
        getattr(lib, name).errcheck = checked
    return lib


def communicator(lib, rank, size, share):
    """A oneCCL communicator of the job's ranks, joined through the id rank 0 makes; `share(raw)` broadcasts a uint8
    array from rank 0 in place, with the other library of the job."""
    uid = UniqueId()
    if rank == 0:
        lib.onecclGetUniqueId(ctypes.byref(uid))
    raw = np.frombuffer(ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(uid)), np.uint8).copy()
    share(raw)
    ctypes.memmove(ctypes.addressof(uid), raw.ctypes.data, raw.nbytes)
    comm = ctypes.c_void_p()
    lib.onecclCommInitRank(ctypes.byref(comm), ctypes.c_size_t(size), uid, rank)
    return comm


def _report(rows, options, n, argv):
    print("# python -m benchmarks.oneccl %s | np=%d%s | medians over %d rounds of the slowest rank's median and p90 "
          "of %d calls" % (" ".join(a for a in argv if a != "--worker"), n,
                           " beside %d CPU-bound processes" % options.cpu_load if options.cpu_load else "",
                           options.rounds, options.iters))
    print("| op | dtype | size | shmcomm us (p90) | oneCCL us (p90) | oneCCL / shmcomm |")
    print("|---|---|---|---|---|---|")
    for (op, dtype, nbytes), by_library in rows.items():
        ours, theirs = (np.array(by_library[lib]) for lib in ("shmcomm", "oneCCL"))
        print("| %s | %s | %s | %.1f (%.1f) | %.1f (%.1f) | %.2f |" % (
            op, dtype, size_text(nbytes), *(1e6 * np.median(ours, axis=0)), *(1e6 * np.median(theirs, axis=0)),
            np.median(theirs[:, 0] / ours[:, 0])), flush=True)


if __name__ == "__main__":
    sys.exit(main())
