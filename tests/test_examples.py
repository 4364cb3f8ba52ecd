# SPDX-License-Identifier: Apache-2.0
"""The examples run under the launcher, the way the README says."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "shmcomm.runner"] + list(args), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_train_synthetic_two_ranks():
    pytest.importorskip("torch")
    run = _launch("-np", "2", sys.executable, "examples/train_synthetic.py", "--epochs", "15")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "weights identical on all ranks: True" in run.stdout
    accuracy = float(run.stdout.split("test accuracy ")[1].split("%")[0])
    assert accuracy > 90


def test_readme_commands_are_what_ci_runs():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [line for line in f.read().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert len(ci) == 1 and ci[0] in readme
