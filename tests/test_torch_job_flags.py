# SPDX-License-Identifier: Apache-2.0
"""Horovod's questions about the job (is_homogeneous, mpi_built, mpi_enabled) answered truthfully in an MPI-launched
job whose ranks pretend to sit on several hosts (SHMCOMM_RANKS_PER_HOST), so the cross-host steps use MPI. The
one-host answers are checked in test_torch_ops.py."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BESIDE = os.path.join(os.path.dirname(sys.executable), "mpiexec")
MPIEXEC = BESIDE if os.path.exists(BESIDE) else shutil.which("mpiexec")

# Each rank writes its answers to its own file: hydra may interleave the ranks' output within a line.
FLAGS = textwrap.dedent("""
    import sys
    import torch
    import shmcomm.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    with open("%s/rank%d" % (sys.argv[1], hvd.rank()), "w") as f:
        f.write("%s %s %s" % (hvd.is_homogeneous(), hvd.mpi_built(), hvd.mpi_enabled()))
    hvd.shutdown()
""")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
@pytest.mark.parametrize("ranks,per_host,homogeneous",
                         [pytest.param(4, 2, True, marks=pytest.mark.long),
                          pytest.param(3, 2, False, marks=pytest.mark.long)])
def test_flags_across_pretend_hosts(tmp_path, ranks, per_host, homogeneous):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               SHMCOMM_RANKS_PER_HOST=str(per_host))
    run = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, "-c", FLAGS, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    answers = [(tmp_path / ("rank%d" % rank)).read_text() for rank in range(ranks)]
    assert answers == ["%s True True" % homogeneous] * ranks
