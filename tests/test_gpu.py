# SPDX-License-Identifier: Apache-2.0
"""CUDA tensors in shmcomm.torch, on a machine with a GPU: every check of tests/gpu_checks.py under the launcher at
1 rank (NCCL), at 2 and 4 ranks sharing one GPU (the host path), at as many ranks as GPUs (NCCL, and the 2D torus on
NCCL with 4), DistributedOptimizer equal to a single-process step, torch.distributed's collectives and DDP on the
"shmcomm" backend, and a killed rank during an allreduce, named by
the others while the job stops. Skipped, with the reason, where torch sees no GPU (benchmarks/gpu_check.sh runs
them on a GPU machine)."""
import os
import subprocess
import sys

import pytest

from test_simhosts import job_env, rank_lines

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no GPU: torch.cuda.is_available() is False (torch %s); benchmarks/gpu_check.sh runs these on a GPU "
                "machine" % torch.__version__, allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = os.path.join(ROOT, "tests", "gpu_checks.py")
GPUS = torch.cuda.device_count()
EVERY = ["collectives", "optimizer", "backend"]  # the checks each launch runs


def _launch(ranks, checks, timeout=300, **env):
    return subprocess.run([sys.executable, "-m", "shmcomm.runner", "-np", str(ranks), sys.executable, CHECKS,
                           *checks], cwd=ROOT, env=job_env(SHMCOMM_TIMEOUT="60", **env), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def _assert_all_ok(run, ranks, checks):
    assert run.returncode == 0, run.stdout + run.stderr
    lines = rank_lines(run.stdout)
    assert sorted(lines) == list(range(ranks)), run.stdout + run.stderr
    for r in range(ranks):
        assert [line.split()[1] for line in lines[r] if line.startswith("ok ")] == checks, lines[r]


@pytest.mark.slow
def test_one_rank_takes_nccl():
    _assert_all_ok(_launch(1, EVERY, EXPECT_PATH="nccl"), 1, EVERY)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_sharing_a_gpu_go_through_host_memory(ranks):
    if GPUS >= ranks:
        env = {"SHMCOMM_GPU_PATH": "host", "EXPECT_PATH": "host"}  # each rank has a GPU here: ask for the host path
    else:
        env = {"EXPECT_PATH": "host"}
    _assert_all_ok(_launch(ranks, EVERY, **env), ranks, EVERY)


@pytest.mark.slow
@pytest.mark.skipif(GPUS < 2, reason="NCCL across ranks needs a GPU per rank; this machine has %d" % GPUS)
def test_a_gpu_per_rank_takes_nccl():
    ranks = min(GPUS, 4)
    _assert_all_ok(_launch(ranks, EVERY, EXPECT_PATH="nccl"), ranks,
                   EVERY)


@pytest.mark.slow
@pytest.mark.skipif(GPUS < 4, reason="the 2D torus on NCCL needs 4 GPUs (a 2x2 grid); this machine has %d" % GPUS)
def test_the_torus_on_nccl_communicators():
    _assert_all_ok(_launch(4, EVERY, EXPECT_PATH="nccl", SHMCOMM_TORUS_GRID="2x2",
                           SHMCOMM_ALLREDUCE_ALGO="torus", EXPECT_TORUS="2x2"), 4, EVERY)


def _assert_rank_1_named(run):
    assert run.returncode != 0, run.stdout + run.stderr
    lines = rank_lines(run.stdout)
    said = [line for line in lines.get(0, []) if line.startswith("raised ")]
    assert said, run.stdout + run.stderr
    assert "RankFailure rank=1" in said[0] or ("rank 1" in said[0]), said[0]


@pytest.mark.slow
def test_a_killed_rank_is_named_on_the_host_path():
    _assert_rank_1_named(_launch(2, ["dead_rank"], SHMCOMM_GPU_PATH="host", SHMCOMM_TIMEOUT="20"))


@pytest.mark.slow
@pytest.mark.skipif(GPUS < 2, reason="NCCL across ranks needs a GPU per rank; this machine has %d" % GPUS)
def test_a_killed_rank_is_named_during_an_nccl_allreduce():
    _assert_rank_1_named(_launch(2, ["dead_rank"], SHMCOMM_TIMEOUT="20"))
