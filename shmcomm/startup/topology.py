# SPDX-License-Identifier: Apache-2.0
"""Who is where when a job spans hosts: ranks and hosts learned from MPI.

A job started by mpiexec/mpirun (directly, through shmcommrun -H, or by srun) has no SHMCOMM_RANK of its own; MPI
knows the ranks, and MPI_Comm_split_type(SHARED) groups them by host. Only such a job imports mpi4py: a single-host
job never pays for MPI's start-up."""
import fcntl
import os
import secrets
import stat
import struct
import sys
import termios
import time
from dataclasses import dataclass

from shmcomm import env
from shmcomm.startup import failure_reports
from shmcomm.env import Topology
from shmcomm.vocabulary.exceptions import SystemError


@dataclass
class MPIContext:
    world: object        # MPI.COMM_WORLD
    local: object        # the ranks of this host
    cross: object        # the ranks with this local rank, one per host
    host_index: int      # this host's place among the hosts (hosts ordered by their lowest rank)
    host_ranks: list     # global ranks on this host, in order
    hosts: int
    homogeneous: bool    # every host runs the same number of ranks


def start_mpi():
    """MPI_Init_thread, unless MPI has started already (the user imported mpi4py.MPI first).

    mpi4py starts MPI as it is imported, holding the GIL, and MPICH's start waits for every rank of the job: a rank
    that stopped before it would hold every other rank there, with no thread able to run. So MPI is started here,
    through ctypes, which lets go of the GIL, so that the caller can run this in a thread and give up on it
    (bootstrap._within). mpi4py still finalizes MPI at exit, as if it had started it."""
    import ctypes

    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True
    from mpi4py import MPI

    if MPI.Is_initialized():
        return
    _prefer_ofi(MPI.Get_library_version())
    library = next((line.split()[-1] for line in open("/proc/self/maps") if "/libmpi" in line), None)
    if library is None:
        MPI.Init_thread(_thread_level(MPI, mpi4py.rc.thread_level))  # (not on Linux: holding the GIL)
        return
    provided = ctypes.c_int()
    code = ctypes.CDLL(library).MPI_Init_thread(None, None, ctypes.c_int(_thread_level(MPI, mpi4py.rc.thread_level)),
                                                ctypes.byref(provided))
    if code != 0:
        raise SystemError("MPI_Init_thread failed with MPI error %d" % code)


def _prefer_ofi(library_version):
    """MPICH built with both network modules (the mpich wheel: "MPICH Device: ch4:ucx ofi") uses UCX unless told
    otherwise; shmcomm asks for libfabric's (ofi) instead, unless MPIR_CVAR_CH4_NETMOD is set. Why: a rank killed
    while UCX connects to it (MPI's start, or the first message to it) crashes its peers with SIGSEGV in UCX, or
    makes MPI_Init abort them, so they die without saying which rank failed; with ofi they stay alive and raise
    an error naming it (tests/chaos.py, across simulated hosts). The price, measured side by side on 2 simulated hosts
    x 2 ranks over TCP (benchmarks/RESULTS.md): the torus allreduce is about 10% slower from 4 to 64 KiB and 10%
    faster at 4 MiB; MPI's own collectives (broadcast, allgather, alltoall across hosts) are 33-41% slower at 4-64
    KiB. A job that prefers UCX's latency to naming a killed rank sets MPIR_CVAR_CH4_NETMOD=ucx."""
    device = next((line for line in library_version.splitlines() if line.startswith("MPICH Device:")), "")
    if "ofi" in device.split(":", 1)[-1]:
        env.prefer_mpich_network("ofi")


def _thread_level(MPI, name):
    return {"single": MPI.THREAD_SINGLE, "funneled": MPI.THREAD_FUNNELED, "serialized": MPI.THREAD_SERIALIZED}.get(
        name, MPI.THREAD_MULTIPLE)


def from_mpi():
    """The topology and the MPI communicators of an MPI-launched job."""
    start_mpi()
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    per_host = env.pretend_ranks_per_host()
    if per_host > 0:
        local = world.Split(color=world.rank // per_host, key=world.rank)
    else:
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    leader = local.bcast(world.rank, root=0)
    leaders = sorted(set(world.allgather(leader)))
    cross = world.Split(color=local.rank, key=world.rank)
    token = world.bcast(env.job_token() or secrets.token_hex(16), root=0)
    local_sizes = world.allgather(local.size)
    _abort_job_on_uncaught_exception(world)
    topo = Topology(world.rank, world.size, local.rank, local.size, cross.rank, cross.size, token, True)
    ctx = MPIContext(world, local, cross, leaders.index(leader), local.allgather(world.rank), len(leaders),
                     len(set(local_sizes)) == 1)
    return topo, ctx


def _abort_job_on_uncaught_exception(world):
    """A rank that dies of an exception would otherwise wait in MPI_Finalize for ranks that wait for it: print the
    traceback, then abort the whole job (what `python -m mpi4py` does).

    MPI_Abort has hydra kill every process of the job at once, the rank's output still on its way to mpiexec among
    them, so the traceback is also saved where shmcommrun reads it once the job has ended (failure_reports), and
    the hook lets the reader of its stderr take what it wrote before aborting (_wait_until_read)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        try:
            # First: a stderr nobody reads (a stopped reader, a full pipe) must not keep the report from the launcher.
            text = failure_reports.save_uncaught(world.rank, kind, value, tb)
            if previous is sys.__excepthook__ and sys.stderr is not None:
                sys.stderr.write(text)  # the default hook's text, to the letter the report's: the launcher compares
            else:
                previous(kind, value, tb)
            sys.stderr.flush()
            _wait_until_read(sys.stderr.fileno())
            failure_reports.wait_for_guard()  # and until shmcommrun's guard passed it on
        except BaseException:
            pass  # nothing may keep the rank from aborting the job
        world.Abort(1)

    sys.excepthook = hook


_READ_WAIT_S = 2.0


def _wait_until_read(fd):
    """Waits, _READ_WAIT_S at most, until whoever reads the pipe on fd (shmcommrun's guard of the rank, or hydra's
    proxy) has taken everything written to it: what is still in the pipe when MPI_Abort has hydra kill the reader is
    lost. Only the first step of the way to the launcher can be seen from here; the saved report covers the rest."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return  # a terminal or a file holds what was written; a socket cannot say what is unread
        deadline = time.monotonic() + _READ_WAIT_S
        while struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0] > 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.002)
    except OSError:
        pass
