# SPDX-License-Identifier: Apache-2.0
"""The examples run under the launcher, the way the README says."""
import os
import subprocess
import sys

import pytest

from at_once import run_at_once
from report_gathered_weights import assert_same_on_every_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Runs an example and prints each rank's digest of the weights it gathers (the example's own check uses shmcomm).
REPORT = os.path.join(ROOT, "tests", "report_gathered_weights.py")


def _launch(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "shmcomm.runner"] + list(args), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.long  # DistributedOptimizer's path: the digits example (the README's main job) takes it by default
def test_train_synthetic_two_ranks():
    pytest.importorskip("torch")
    run = _launch("-np", "2", sys.executable, REPORT, "examples/train_synthetic.py", "--epochs", "15")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "weights identical on all ranks: True" in run.stdout
    assert_same_on_every_rank(run.stdout, 2)
    accuracy = float(run.stdout.split("test accuracy ")[1].split("%")[0])
    assert accuracy > 90


def _accuracy(run):
    assert run.returncode == 0, run.stdout + run.stderr
    assert "weights identical on all ranks: True" in run.stdout
    return float(run.stdout.split("test accuracy ")[1].split("%")[0])


DIGITS = [sys.executable, REPORT, "examples/torch_digits.py", "--epochs", "8"]


def test_torch_digits_two_ranks():
    """The README's main job, as it runs it: 2 ranks reach 95%, hold identical weights, and rank 0 shows its
    progress bar."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    run = _launch("-np", "2", *DIGITS, timeout=600)
    assert _accuracy(run) >= 95, run.stdout
    assert_same_on_every_rank(run.stdout, 2)
    assert "training" in run.stderr  # rank 0's progress bar


@pytest.mark.long
@pytest.mark.timeout(900)  # well under a minute on quiet cores; beside CPU-bound processes, minutes
def test_torch_digits_two_ranks_match_one():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    one_run, two_run = run_at_once([([sys.executable, "-m", "shmcomm.runner", "-np", n, *DIGITS], {"cwd": ROOT})
                                    for n in ("1", "2")], timeout=600)
    one, two = _accuracy(one_run), _accuracy(two_run)
    assert_same_on_every_rank(two_run.stdout, 2)
    # Not the same computation: two ranks take half as many steps of a twice larger global batch at twice the
    # learning rate (Horovod's rule), so the accuracies differ by a few of the 360 test images, by how much depending
    # on the CPU's torch kernels. A broken average costs far more than 2 points.
    assert one >= 95 and two >= 95 and abs(one - two) <= 2.0, (one, two)


@pytest.mark.long
@pytest.mark.parametrize("backend", ["shmcomm", "ddp-backend", "fsdp-backend"])
def test_torch_synthetic_benchmark_reports_throughput(backend):
    pytest.importorskip("torch")
    run = _launch("-np", "2", sys.executable, "examples/torch_synthetic_benchmark.py", "--model", "resnet_tiny",
                  "--batch-size", "8", "--image-size", "16", "--num-warmup-batches", "1", "--num-batches-per-iter",
                  "2", "--num-iters", "2", "--backend", backend)
    assert run.returncode == 0, run.stdout + run.stderr
    for line in ("Model: resnet_tiny", "Batch size: 8", "Number of CPUs: 2", "Img/sec per CPU:",
                 "Total img/sec on 2 CPU(s):"):
        assert line in run.stdout


@pytest.mark.long  # the hook's path: test_torch_sync_bn_ddp.py checks it against DDP over gloo in the default run
def test_ddp_with_the_shmcomm_hook():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    run = _launch("-np", "2", sys.executable, "examples/torch_ddp_hook.py", "--epochs", "10")
    assert run.returncode == 0, run.stdout + run.stderr
    accuracy = float(run.stdout.split("test accuracy ")[1].split("%")[0])
    assert accuracy > 90


@pytest.mark.long  # FSDP2 on the backend: test_torch_distributed.py checks it against one process in the default run
def test_fsdp_on_the_shmcomm_backend():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    run = _launch("-np", "2", sys.executable, "examples/torch_fsdp.py", "--epochs", "6")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "13061 parameters held here of 26122" in run.stdout  # a shard each
    accuracy = float(run.stdout.split("test accuracy ")[1].split("%")[0])
    assert accuracy > 90


def test_readme_commands_are_what_ci_runs():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read().replace(" \\\n  ", " ")  # a command continued on the next line is one line
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        lines = [line for line in f.read().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    settings = [line for line in lines if line.startswith("export ")]
    ci = [line for line in lines if not line.startswith("export ")]
    # The README's test command, then the second tier, each as the README gives it.
    assert len(ci) == 2 and ci[0].endswith(" -m pytest tests") and ci[1].endswith(" -m pytest tests -m long"), ci
    assert ci[0] in readme and "`%s`" % ci[1] in readme
    # CI can run the simulated hosts and the sanitizers: there they must not be skipped.
    assert settings == ["export SHMCOMM_REQUIRE_SIMHOSTS=1 SHMCOMM_REQUIRE_SANITIZERS=1"], settings
