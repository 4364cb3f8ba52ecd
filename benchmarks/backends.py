# SPDX-License-Identifier: Apache-2.0
"""The backends under comparison: how each one's ranks are started, and the object a worker rank measures with.

Each backend is one class in its own file (backend_<name>.py), and all offer the same methods:

    rank, size              where this process sits in the job
    barrier()               the backend's own barrier
    combine(values, how)    elementwise "max" or "sum" over the ranks of a float64 array, with the backend's own
                            collective; every rank gets the result
    prepare(op, buffers)    a function that runs `op` once on `buffers` (a Buffers) and returns the array that
                            holds the result; raises Unsupported when the backend has no such operation
    call_errors             exceptions that, raised by the first call of an op, mean "not supported here"
    close()

Only the worker ranks import a backend's file, so the driver never loads torch or MPI itself.
"""
import importlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

import numpy as np

NAMES = ("shmcomm", "mpi", "openmpi", "gloo", "torch_shmcomm", "memcpy", "oneccl", "deepspeed")
MPI_NAMES = ("mpi", "openmpi")  # "mpi" is the MPICH wheel that mpi4py loads by default; benchmarks/openmpi.py
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOP_GRACE_S = 10  # after SIGTERM, how long a timed-out job gets to stop its ranks before SIGKILL

# A driver started under shmcommrun must not hand its own place in that job to the jobs it starts.
_IDENTITY = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME", "JOB_TOKEN")


class Unsupported(Exception):
    """The backend has no such operation, or not in this form: reported as N/A, never as a failure."""


@dataclass
class Buffers:
    """The arrays of one measurement. Out of place, `send` and `recv` are distinct; in place, `recv` is the whole
    buffer and `send` the part of it that holds this rank's input (its block for allgather, all of it otherwise)."""
    send: np.ndarray
    recv: np.ndarray
    inplace: bool
    rank: int
    block: int  # elements per rank block (allgather, reducescatter, alltoall)


def find_mpiexec():
    """The mpiexec of the MPI that mpi4py was installed with (beside this Python), else the first on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


def unavailable(name):
    """Why backend `name` cannot run on this machine, or None when it can."""
    if name in MPI_NAMES and importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed"
    if name == "mpi" and find_mpiexec() is None:
        return "no mpiexec beside %s or on PATH" % sys.executable
    if name == "openmpi":
        from benchmarks import openmpi
        return openmpi.missing()
    if name in ("gloo", "torch_shmcomm", "deepspeed") and importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed (pip install deepspeed torch==2.13.0)"
    if name == "oneccl":
        from benchmarks import oneccl
        return oneccl.missing()
    return None


def free_loopback_port():
    """A TCP port that is free on 127.0.0.1 now (gloo's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(launcher, nranks, module, args):
    """The command that starts `nranks` ranks of `python -m module args`: under shmcommrun ("shmcomm", also used
    for gloo, which needs only a rank and a size), mpiexec ("mpi", kept on this host's loopback), Open MPI's
    mpiexec ("openmpi", with job_environment(openmpi.environment())), oneCCL's Intel MPI ("oneccl", with
    job_environment(oneccl.environment())), or as one plain process ("single")."""
    target = [sys.executable, "-m", module] + [str(a) for a in args]
    if launcher == "shmcomm":
        return [sys.executable, "-m", "shmcomm.runner", "-np", str(nranks)] + target
    if launcher == "mpi":
        return [find_mpiexec(), "-n", str(nranks), "-hosts", "localhost", "-iface", "lo"] + target
    if launcher == "openmpi":
        from benchmarks import openmpi
        return openmpi.launch_command(nranks, target)
    if launcher == "oneccl":
        from benchmarks import oneccl
        return oneccl.launch_command(nranks, target)
    return target


def job_environment(extra=None):
    """The driver's environment, with this repository importable and without any rank identity of its own."""
    env = {k: v for k, v in os.environ.items()
           if not any(k in ("SHMCOMM_" + n, "HOROVOD_" + n) for n in _IDENTITY)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    # gloo would otherwise pick the interface its host name resolves to; keep all of it on loopback.
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env.update(extra or {})
    return env


def _signal_group(proc, signum):
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def run_job(command, env, timeout_s):
    """Runs a job to its end; returns (exit code, stdout, stderr). Past `timeout_s` the job gets SIGTERM (both
    launchers pass it on to their ranks), then SIGKILL, and the exit code is 124."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group, so a timeout can stop it and its children
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        pass
    note = "\n(the job ran past its %.0f s timeout and was stopped)\n" % timeout_s
    _signal_group(proc, signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=STOP_GRACE_S)
        return 124, out, (err or "") + note
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
    try:
        out, err = proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:  # a grandchild still holds the pipes: give up on the rest of the output
        proc.kill()
        out, err = "", ""
    return 124, out, (err or "") + note


_CLASSES = {
    "shmcomm": ("benchmarks.backend_shmcomm", "ShmcommBackend"),
    "mpi": ("benchmarks.backend_mpi", "MpiBackend"),
    "openmpi": ("benchmarks.backend_mpi", "MpiBackend"),
    "gloo": ("benchmarks.backend_gloo", "GlooBackend"),
    "torch_shmcomm": ("benchmarks.backend_torch_shmcomm", "TorchShmcommBackend"),
    "memcpy": ("benchmarks.backend_memcpy", "MemcpyBackend"),
    "oneccl": ("benchmarks.backend_oneccl", "OnecclBackend"),
    "deepspeed": ("benchmarks.backend_deepspeed", "DeepspeedBackend"),
}


def open_backend(name, **options):
    """The backend object of a worker rank (joins the job)."""
    module, cls = _CLASSES[name]
    return getattr(importlib.import_module(module), cls)(**options)
