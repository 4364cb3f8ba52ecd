# SPDX-License-Identifier: Apache-2.0
"""The agreement's rounds across hosts compiled in C (shmcomm/transport/crossing.py) against the same rounds in
Python, under MPI: same verdicts, same bits, and a late rank makes the others time out (tests/crossing_checks.py).
3 ranks take the fold of a non-power-of-two world, 4 plain recursive doubling, and from HALVING_BYTES 4 ranks halve and
6 fold, then halve."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("ranks", [pytest.param(3, marks=pytest.mark.long), 4, pytest.param(6, marks=pytest.mark.long)])
def test_exchanges_in_c_and_in_python_give_the_same_rounds(ranks):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("no mpiexec beside this interpreter")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMCOMM_")}
    run = subprocess.run([str(mpiexec), "-n", str(ranks), sys.executable, str(REPO / "tests" / "crossing_checks.py")],
                         cwd=str(REPO), env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("crossing ok") == ranks, run.stdout + run.stderr


def test_without_mpicc_the_exchanges_stay_in_python(monkeypatch):
    from shmcomm.transport import crossing

    monkeypatch.setattr(crossing, "_loaded", None)
    monkeypatch.setenv("SHMCOMM_MPI_CROSSING", "0")
    assert crossing.load() is None
    monkeypatch.setattr(crossing, "_loaded", None)
    monkeypatch.delenv("SHMCOMM_MPI_CROSSING")
    monkeypatch.setattr(crossing, "_mpicc", lambda: None)
    assert crossing.load() is None
    monkeypatch.setattr(crossing, "_loaded", None)  # the next user builds or loads it again


@pytest.mark.parametrize("ranks,per_host", [(2, 1), (3, 1), (4, 2)])
def test_quick_allreduce_across_hosts(ranks, per_host):
    """tests/quick_crossing_checks.py: the same bits as the full path, for every dtype, op and scale; mismatches,
    refusals and other paths (3 ranks: the fold of a non-power-of-two world; 2 per host: the row's steps, and
    verdicts that reach a rank through its row)."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("no mpiexec beside this interpreter")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMCOMM_")}
    env.update(SHMCOMM_RANKS_PER_HOST=str(per_host), SHMCOMM_TIMEOUT="60",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([str(mpiexec), "-n", str(ranks), sys.executable,
                          str(REPO / "tests" / "quick_crossing_checks.py")],
                         cwd=str(REPO), env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("quick ok") == ranks, run.stdout + run.stderr
