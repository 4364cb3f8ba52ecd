# SPDX-License-Identifier: Apache-2.0
import compileall
import os
import re
import sys

import pytest

from shmcomm.testing.cpu_load import spinning

sys.path.insert(0, os.path.dirname(__file__))  # the multiproc harness

try:
    # Once here, not in every rank: ranks forked by tests/multiproc.py inherit it, and the exact checks move bfloat16
    # as torch tensors (shmcomm/testing/exact.py).
    import torch  # noqa: F401
except ImportError:
    pass


def _compile_sources():
    """Compiles the package's (and the tests', examples' and benchmarks') Python once, here. Where the environment
    sets PYTHONDONTWRITEBYTECODE (these machines' does), no process writes what it compiled, and an editable install
    has no compiled copy: each of the thousands of processes the tests start compiled every shmcomm module it imported
    again, 0.05 s of CPU for a numpy rank and 0.3-0.4 s for a torch rank. What this writes goes in __pycache__
    folders, which git ignores; a changed source is compiled again (the file's time is checked on import)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder in ("shmcomm", "tests", "examples", "benchmarks"):
        compileall.compile_dir(os.path.join(root, folder), quiet=2, rx=re.compile(r"[/\\]\."))  # not .openmpi


_compile_sources()

# MPI jobs of one host (pretend hosts, benchmarks) keep their network transport on the loopback: UCX and libfabric
# otherwise open every interface, bridges of simulated hosts of other jobs among them, and fail when one disappears.
# Jobs on simulated hosts set their own interface (shmcomm/testing/simhosts.py, MPI_ENVIRONMENT), which overrides this.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# No test uses numpy's BLAS, whose threads start with every process that imports numpy: one thread halves the CPU time
# of that import, and the tests start hundreds of such processes. (shmcommrun's ranks get OMP_NUM_THREADS, which
# OpenBLAS reads too.)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("FI_PROVIDER", "tcp")
os.environ.setdefault("FI_TCP_IFACE", "lo")


def pytest_addoption(parser):
    parser.addoption("--cpu-load", type=int, default=0, metavar="N",
                     help="run the tests beside N CPU-bound processes, as on a training machine that is never idle")


@pytest.fixture(scope="session", autouse=True)
def cpu_load(request):
    """--cpu-load N: N processes that spin for the whole session."""
    with spinning(request.config.getoption("--cpu-load")):
        yield


def pytest_report_header(config):
    load = config.getoption("--cpu-load")
    return "shmcomm tests: ranks are forked processes on one host (%d cores)%s" % (
        os.cpu_count() or 1, ", beside %d CPU-bound processes" % load if load else "")


def pytest_configure(config):
    # Every run lists its skips with their reasons (-rs): a skipped test must never pass for a passing one.
    if "s" not in config.option.reportchars and "a" not in config.option.reportchars:
        config.option.reportchars += "s"


# Every compiled program is kept, however quick its compilation or small its executable.
_KEEP_EVERY_PROGRAM = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


@pytest.fixture(scope="session", autouse=True)
def jax_compilation_cache(tmp_path_factory):
    """One persistent XLA compilation cache for every JAX job of the session. The jobs of tests/test_jax.py, the
    JAX example and the JAX benchmark compile the same hundred-odd small programs on every rank, and compiling them
    is most of those tests' time on 2 cores; what they test (the collectives, their order, their results) runs the
    same from a cached executable. Set in the environment, which every job's ranks inherit."""
    settings = dict(_KEEP_EVERY_PROGRAM, JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("xla-cache")))
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
