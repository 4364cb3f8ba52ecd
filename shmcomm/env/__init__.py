# SPDX-License-Identifier: Apache-2.0
"""The settings, and the one reader of the process environment: the launcher's rank contract, the paths taken,
where things are built. tuning.py holds the performance settings, values.py how one value is read and checked.

Every SHMCOMM_* name is also read under its HOROVOD_* spelling, so a job started the Horovod way finds its ranks.
Bad values raise ValueError naming the variable. docs/settings.md documents each setting."""
import os
import secrets
from dataclasses import dataclass

# The performance settings, read as env.tuning() and so on like the others.
from shmcomm.env.tuning import (AutotuneSettings, EngineSettings, Tuning, autotune, engine, start_timeout_s,
                                thread_affinity, timeout_s, tuning)
from shmcomm.env.values import (MAX_BYTES, flag as _flag, get as _get, number as _number, reading_from,
                                set_overrides as _set_overrides, switch)


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    token: str
    launched: bool  # False: a world of one started without a launcher


def validate(environ=None):
    """Reads every setting this rank could read later, so that a bad value is refused at init, naming it, not when
    the engine starts or a path is first taken; environ: a rank's environment to check instead of this process's
    (the launcher's check before ranks start). (Path settings are compared across ranks before they are parsed:
    bootstrap does that.)"""
    if environ is not None:
        with reading_from(environ):
            return validate()
    tuning(1)
    engine()
    timeline()
    log_level()
    elastic()
    engine_requested()
    pretend_ranks_per_host()
    gpu_path()
    jax_heap_bytes()
    mpi_crossing()


def gpu_path():
    path = (_get("GPU_PATH") or "auto").lower()
    if path not in ("auto", "nccl", "host"):
        raise ValueError("SHMCOMM_GPU_PATH=%r: choose one of auto, nccl, host" % path)
    return path


def topology():
    """Where this process sits in the job, from the launcher's variables; a world of one without them."""
    if _get("RANK") is None:
        return Topology(0, 1, 0, 1, 0, 1, secrets.token_hex(16), False)
    size = _number("SIZE", 1, int)
    rank = _number("RANK", 0, int)
    local_size = _number("LOCAL_SIZE", size, int)
    local_rank = _number("LOCAL_RANK", rank, int)
    token = _get("JOB_TOKEN")
    if token is None:
        raise ValueError("SHMCOMM_RANK is set but SHMCOMM_JOB_TOKEN is not: start the job with shmcommrun, or set a "
                         "job token (a random string of 8 to 64 letters and digits shared by all ranks)")
    if not (0 <= rank < size and 0 <= local_rank < local_size <= size):
        raise ValueError("inconsistent launch variables: rank %d of %d, local rank %d of %d"
                         % (rank, size, local_rank, local_size))
    return Topology(rank, size, local_rank, local_size, _number("CROSS_RANK", 0, int),
                    _number("CROSS_SIZE", 1, int), token, True)


_MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def launched_by_mpi():
    """Whether MPI placed this process (mpiexec, shmcommrun -H, srun): then MPI, not the launcher's variables, says
    where it sits."""
    if os.environ.get("SHMCOMM_LAUNCHER") == "mpi":
        return True
    if _get("RANK") is not None:
        return False
    if any(os.environ.get(v) for v in _MPI_RANK_VARIABLES):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in os.environ


def torch_rendezvous_given():
    """Whether torch's env:// rendezvous has its address (MASTER_ADDR), as shmcommrun and torchrun give it."""
    return bool(os.environ.get("MASTER_ADDR"))


def job_token():
    return _get("JOB_TOKEN")


SECRET = "SHMCOMM_SECRET"  # shmcommrun's per-job secret, as hex: how the launcher hands it to its ranks
_secret = []  # the secret once read: it leaves the environment then


def new_secret():
    """A fresh secret for a job: 256 random bits, as SHMCOMM_SECRET holds them."""
    return secrets.token_hex(32)


def job_secret():
    """The job's secret (bytes) from SHMCOMM_SECRET, or None without one. The first read takes it out of this
    process's environment, so that no child process, nor a dump of the environment, shows it. A value that is not
    32 to 128 hex digits raises ValueError, which does not repeat it."""
    if not _secret:
        text = os.environ.pop(SECRET, None)
        if text is None:
            return None
        try:
            value = bytes.fromhex(text)
        except ValueError:
            value = b""
        if not 16 <= len(value) <= 64:
            raise ValueError("%s must hold 32 to 128 hex digits (shmcommrun sets it); this one does not" % SECRET)
        _secret.append(value)
    return _secret[0]


def adopt_secret(text):
    """Takes `text` (hex, as SHMCOMM_SECRET holds it) for the job's secret, where this process was started without
    one: a job whose ranks agree on it through a store (startup/rendezvous.py)."""
    if job_secret() is None:
        _secret.append(bytes.fromhex(text))


def adopt_identity(identity):
    """Takes a re-formed elastic world's place ({"RANK": 2, ...}) for this process's launch variables: read from here
    on instead of the environment's, which keeps what the worker was started with (startup/membership.py)."""
    _set_overrides({key: str(value) for key, value in identity.items()})


def bound_timeout(seconds):
    """Lowers SHMCOMM_TIMEOUT and SHMCOMM_START_TIMEOUT for this process to `seconds` where they are longer: a torch
    process group's timeout then bounds every wait of the worlds and process sets built from here on (the start of
    each included), as it bounds gloo's."""
    current = {"TIMEOUT": timeout_s(), "START_TIMEOUT": start_timeout_s()}
    _set_overrides({name: repr(float(seconds)) for name, now in current.items() if 0 < seconds < now})


def environment():
    """A copy of this process's environment: what the launcher hands its ranks, with their variables added."""
    return dict(os.environ)


def prefer_mpich_network(netmod):
    """Asks MPICH for a network module unless MPIR_CVAR_CH4_NETMOD is set (topology.py says why). The one change to
    this process's environment: MPICH reads its settings from there only, at MPI_Init."""
    os.environ.setdefault("MPIR_CVAR_CH4_NETMOD", netmod)


def build_dir(name):
    """Where the things compiled on first use (transport/build_cache.py) named `name` are kept: in SHMCOMM_BUILD_DIR,
    else in ~/.cache/shmcomm (XDG_CACHE_HOME honoured)."""
    root = _get("BUILD_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                             os.path.join(os.path.expanduser("~"), ".cache"), "shmcomm")
    return os.path.join(root, name)


def cuda_home():
    """$CUDA_HOME, else $CUDA_PATH, else None."""
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or None


def cuda_archs():
    """SHMCOMM_CUDA_ARCHS ("80;90" or "80,90") as a list, empty when unset."""
    text = (_get("CUDA_ARCHS") or "").replace(",", ";")
    return [a.strip() for a in text.split(";") if a.strip()]


def nccl_library():
    """SHMCOMM_NCCL_LIBRARY: the NCCL library to load instead of the one found (transport/nccl_library.py)."""
    return (_get("NCCL_LIBRARY") or "").strip() or None


def mpi_crossing():
    """SHMCOMM_MPI_CROSSING=0 keeps the agreement's cross-host exchanges in Python (transport/crossing.py)."""
    return _flag("MPI_CROSSING", True)


def elastic():
    """HOROVOD_ELASTIC=1 (Horovod's elastic mode): a world of one still installs the optimizer's hooks, since ranks
    may join later."""
    return _flag("ELASTIC")


ERROR_REPORT_DIR = "SHMCOMM_ERROR_REPORT_DIR"  # set by shmcommrun -H (runner/mpi_launch.py), which reads it


def error_report_dir():
    """Where a rank saves the traceback and cause of an uncaught exception (failure_reports.py); None without."""
    return os.environ.get(ERROR_REPORT_DIR) or None


def guard_socket():
    """(descriptor, inode) of the socket on which a rank under shmcommrun -H tells its guard (runner/rank_guard.py) the
    cause of its failure and waits for its output to be passed on (startup/failure_reports.py), or None."""
    fd, _, inode = os.environ.get("SHMCOMM_GUARD_SOCKET", "").partition(":")
    return (int(fd), int(inode)) if fd.isdigit() and inode.isdigit() else None


def launcher_notices():
    """The multi-host launcher's notice server, "ip:port,ip:port" (startup/notices.py); None without one."""
    return _get("LAUNCHER_NOTICES")


def elastic_driver():
    """The elastic launcher's addresses, "ip:port,ip:port" (startup/membership.py); None outside an elastic job."""
    return _get("ELASTIC_DRIVER")


def elastic_worker():
    return _number("ELASTIC_WORKER", -1, int)


def elastic_timeout():
    """Seconds a worker waits for a membership that includes it (Horovod's --elastic-timeout, 600 by default)."""
    return _number("ELASTIC_TIMEOUT", 600.0)


def engine_requested():
    return _flag("ENGINE")


def mpi_threads_disabled():
    """HOROVOD_MPI_THREADS_DISABLE=1: initialise MPI without MPI_THREAD_MULTIPLE."""
    return bool(switch("MPI_THREADS_DISABLE"))


def timeline():
    """(file, mark_cycles) of the Chrome-trace timeline; file is None when none is asked for."""
    return _get("TIMELINE"), _flag("TIMELINE_MARK_CYCLES")


ALGORITHMS = ("auto", "torus", "ring", "mpi")
TORUS_SMALL_BYTES = 256 << 10

# Settings that choose paths: hosts on different paths would wait for each other instead of failing, so every rank
# must have the same (bootstrap compares them, as set, before anything parses them).
PATH_SETTINGS = ("ALLREDUCE_ALGO", "HIERARCHICAL_ALLREDUCE", "TORUS_ALLREDUCE", "TORUS_SMALL_BYTES", "TORUS_MIN_BYTES",
                 "TORUS_GRID")


def path_settings_as_set():
    return tuple(os.environ.get(prefix + name) for name in PATH_SETTINGS for prefix in ("SHMCOMM_", "HOROVOD_"))


@dataclass(frozen=True)
class PathSettings:
    algorithm: str          # across hosts: auto, torus, ring or mpi
    grid: object            # (x, y) of SHMCOMM_TORUS_GRID, or None
    grid_text: str          # as set, for messages
    torus_small_bytes: int  # up to this size the torus takes its small-message path
    torus_min_bytes: int    # auto takes MPI's own allreduce below this size


def grid(size):
    """(x, y) of SHMCOMM_TORUS_GRID, or None: the one path setting a job on one host reads."""
    text = _get("TORUS_GRID")
    return parse_grid(text, size) if text else None


def paths(size, environ=None):
    """The path settings of a job of `size` ranks."""
    algorithm = _algorithm(environ)
    if algorithm not in ALGORITHMS:
        raise ValueError("SHMCOMM_ALLREDUCE_ALGO=%r: choose one of %s" % (algorithm, ", ".join(ALGORITHMS)))
    grid_text = _get("TORUS_GRID", environ=environ)
    return PathSettings(algorithm, parse_grid(grid_text, size) if grid_text else None, grid_text,
                        torus_small_bytes(environ), _number("TORUS_MIN_BYTES", 0, int, environ, low=0, high=MAX_BYTES))


def _algorithm(environ):
    """SHMCOMM_ALLREDUCE_ALGO, else Horovod's switches: hierarchical allreduce (a reduction inside each host, one
    across hosts, a broadcast inside each host) is what the torus does on its default grid, so either switch on
    means torus; switched off, Horovod's flat allreduce is MPI's own."""
    chosen = _get("ALLREDUCE_ALGO", environ=environ)
    if chosen is not None:
        return chosen.lower()
    switches = (switch("HIERARCHICAL_ALLREDUCE", environ), switch("TORUS_ALLREDUCE", environ))
    if True in switches:
        return "torus"
    return "mpi" if False in switches else "auto"


def torus_small_bytes(environ=None):
    return _number("TORUS_SMALL_BYTES", TORUS_SMALL_BYTES, int, environ, low=0, high=MAX_BYTES)


def parse_grid(text, size):
    """SHMCOMM_TORUS_GRID=XxY: X ranks per row, Y rows, X*Y = size."""
    try:
        x, y = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError("SHMCOMM_TORUS_GRID=%r: expected XxY, e.g. 2x2" % text) from None
    if x < 1 or y < 1 or x * y != size:
        raise ValueError("SHMCOMM_TORUS_GRID=%s does not fit %d ranks (X*Y must equal the number of ranks)"
                         % (text, size))
    return x, y


def jax_heap_bytes():
    """shmcomm.jax raises glibc's mmap and trim thresholds to this (jax/results_heap.py); 0 leaves them."""
    return _number("JAX_HEAP_BYTES", 1 << 30, int, low=0, high=(1 << 31) - 1)


def pretend_ranks_per_host():
    """Testing aid: consecutive groups of this many ranks act as hosts (MPI still carries the cross-host steps)."""
    return _number("RANKS_PER_HOST", 0, int, low=0)


LOG_LEVELS = {"TRACE": 10, "DEBUG": 10, "INFO": 20, "WARNING": 30, "WARN": 30, "ERROR": 40, "FATAL": 50,
              "CRITICAL": 50}  # Horovod's names, as the logging module's numbers


def log_with_time():
    """Whether log records carry a timestamp: Horovod's HOROVOD_LOG_HIDE_TIME=0 asks for one."""
    return switch("LOG_HIDE_TIME") is False


def log_level():
    """SHMCOMM_LOG_LEVEL as a logging level (Horovod's names: trace, debug, info, warning, error, fatal), or None
    when unset."""
    text = _get("LOG_LEVEL")
    if text is None:
        return None
    level = LOG_LEVELS.get(text.strip().upper())
    if level is None:
        raise ValueError("SHMCOMM_LOG_LEVEL=%r: choose one of trace, debug, info, warning, error, fatal" % text)
    return level
