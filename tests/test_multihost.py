# SPDX-License-Identifier: Apache-2.0
"""shmcomm across simulated hosts (network namespaces with their own host names, MPI over a private bridge):
every allreduce algorithm and dtype, the other collectives, a DistributedOptimizer run, and a rank killed on one
host. Skipped with the reason where namespaces cannot be made."""
import functools
import os
import subprocess
import sys
import textwrap

import pytest

from report_gathered_weights import assert_same_on_every_rank
from test_simhosts import MPIEXEC, job_env, open_hosts, rank_lines
from test_torus import CHECKS, MISMATCHES, ROUNDS_AT_EVERY_STEP, run_checks_job

from shmcomm.testing import exact

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec beside Python or on PATH")


def _shmcommrun(sim, ranks_per_host, args, timeout=240, **env):
    return subprocess.run([sys.executable, "-m", "shmcomm.runner", *sim.shmcommrun_args(ranks_per_host)] + args,
                          cwd=ROOT, env=job_env(**env), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def two_hosts():
    sim = open_hosts(2)
    try:
        yield sim
    finally:
        sim.close()


@functools.lru_cache(maxsize=None)
def _two_host_reports(sim, algo):
    """Every rank's exact.run_checks report (bfloat16 included) and what each rank says of itself; run once for the
    tests that read them."""
    program = CHECKS + textwrap.dedent("""
        import socket, shmcomm
        from shmcomm import basics
        world = basics.communicator()
        print("ok", socket.gethostname(), type(world).__name__, shmcomm.local_size(), shmcomm.cross_size(), flush=True)
    """)
    return run_checks_job(lambda script, out: _shmcommrun(sim, 2, [sys.executable, script, out, "bf16"],
                                                           SHMCOMM_ALLREDUCE_ALGO=algo), 4, program)


@pytest.mark.parametrize("algo", ["torus", "ring", "mpi"])
def test_collectives_across_two_hosts(two_hosts, algo):
    reports, stdout = _two_host_reports(two_hosts, algo)
    exact.assert_identical(reports)
    lines = rank_lines(stdout)
    assert sorted(lines) == [0, 1, 2, 3]
    seen = {tuple(lines[r][-1].split()[1:]) for r in lines}
    assert seen == {("simhost0", "GridComm", "2", "2"), ("simhost1", "GridComm", "2", "2")}


@pytest.mark.parametrize("algo", [pytest.param(algo, marks=pytest.mark.xfail(strict=True, reason=ROUNDS_AT_EVERY_STEP))
                                  for algo in ("torus", "ring")] + ["mpi"])
def test_16_bit_sums_round_once_across_two_hosts(two_hosts, algo):
    exact.assert_rounds_once(_two_host_reports(two_hosts, algo)[0])


def test_mismatches_across_two_hosts(two_hosts, tmp_path):
    """Ranks that disagree, across hosts or inside one, all raise MismatchError naming what each passed; the job
    goes on."""
    script = tmp_path / "job.py"
    script.write_text(MISMATCHES + "\nassert check_mismatches()\nprint('ok', flush=True)\n")
    run = _shmcommrun(two_hosts, 2, [sys.executable, str(script)], SHMCOMM_TIMEOUT="60")
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(rank_lines(run.stdout)) == [0, 1, 2, 3]


def test_three_hosts(tmp_path):
    sim = open_hosts(3)
    try:
        script = tmp_path / "job.py"
        script.write_text(CHECKS)
        run = _shmcommrun(sim, 2, [sys.executable, str(script), str(tmp_path)])
        assert run.returncode == 0, run.stdout + run.stderr
        exact.assert_identical(exact.read_reports(tmp_path, 6))
    finally:
        sim.close()


def test_distributed_optimizer_across_hosts(two_hosts):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    report = os.path.join(ROOT, "tests", "report_gathered_weights.py")  # each rank's digest of the final weights
    run = _shmcommrun(two_hosts, 2, [sys.executable, report, os.path.join(ROOT, "examples", "torch_digits.py"),
                                     "--epochs", "2", "--no-progress"])
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ranks 4, weights identical on all ranks: True" in run.stdout
    assert_same_on_every_rank(run.stdout, 4)


KILLED = """
    import os, signal, threading, numpy as np, shmcomm
    shmcomm.init()
    print("token", os.environ["SHMCOMM_JOB_TOKEN"], flush=True)
    if shmcomm.rank() == 3:
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    x = np.ones(1 << 18, np.float32)
    while True:
        shmcomm.allreduce_(x)
"""


def test_rank_killed_on_one_host_stops_the_job(two_hosts):
    before = set(os.listdir("/dev/shm"))
    run = _shmcommrun(two_hosts, 2, [sys.executable, "-c", textwrap.dedent(KILLED)], timeout=120)
    assert run.returncode != 0
    token = run.stdout.split("token ")[1].split()[0]
    assert not [n for n in os.listdir("/dev/shm") if token in n]
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("mpich_shm_")]  # MPICH's too


