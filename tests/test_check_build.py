# SPDX-License-Identifier: Apache-2.0
"""`shmcommrun --check-build` marks what shmcomm can use, not what is installed. Each case runs the report in a
subprocess whose prelude hides or fakes a module, so the test process's own imports stay untouched."""

import importlib.util
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from at_once import run_at_once

REPO = Path(__file__).resolve().parents[1]
REPORT = "from shmcomm.runner.check_build import print_build_report\nprint_build_report()\n"
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = all(importlib.util.find_spec(name) is not None for name in ("jax", "optax"))
# What this test environment (the README's test command) can use.
# This machine has no GPU: CUDA and NCCL are unmarked (their details say why).
EVERYTHING = {"PyTorch": HAS_TORCH, "JAX": HAS_JAX, "Shared memory": True, "MPI": True, "NCCL": False, "CUDA": False,
              "C core (CPU)": True}


def _env(extra_path=()):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHMCOMM_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), str(REPO), env.get("PYTHONPATH", "")])
    return env


def _marks(stdout):
    """{name: True for [X], False for [ ]}, and the details as {name: text}."""
    marks = {m[2]: m[1] == "X" for m in re.finditer(r"^    \[(X| )\] (.+)$", stdout, re.M)}
    details = dict(re.findall(r"^    (\w[\w ]*): (.*)$", stdout, re.M))
    return marks, details


# Each case's prelude hides or fakes a module; "fake jax" runs `shmcommrun --check-build` with a JAX without the FFI
# ahead on the path (the fixture writes it).
PRELUDES = {
    "as installed": "",
    "no core": """
        import sys
        sys.modules["shmcomm._C"] = None  # what an unbuilt core looks like: its import fails
    """,
    "no mpi4py": """
        import sys
        sys.modules["mpi4py"] = None
    """,
    "no mpiexec": """
        import shmcomm.runner.mpi_launch
        shmcomm.runner.mpi_launch.find_mpiexec = lambda: None
    """,
    "no torch": """
        import sys
        sys.modules["torch"] = None
    """,
    "old torch": """
        import sys, types
        torch = types.ModuleType("torch")  # torch 2.0 had no Tensor.register_post_accumulate_grad_hook
        torch.__version__, torch.Tensor = "2.0.1", type("Tensor", (), {})
        sys.modules["torch"] = torch
    """,
}


def _run_cases(cases, fake=None):
    """{case: CompletedProcess}: the cases' reports, their subprocesses run at once (each imports torch and jax,
    seconds of CPU apiece, with waits for the disk between: at once they take less time than one after another)."""
    commands = {case: ([sys.executable, "-c", textwrap.dedent(PRELUDES[case]) + REPORT], _env()) for case in cases}
    if fake is not None:
        (fake / "jax").mkdir()
        (fake / "jax" / "__init__.py").write_text("__version__ = '0.4.30'\n")
        commands["fake jax"] = ([sys.executable, "-m", "shmcomm.runner", "--check-build"], _env([fake]))
    done = run_at_once([(argv, {"cwd": REPO, "env": env}) for argv, env in commands.values()], timeout=240)
    return dict(zip(commands, done))


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The reports as installed, without the core and with a JAX that lacks the FFI."""
    return _run_cases(["as installed", "no core"], tmp_path_factory.mktemp("fake"))


@pytest.fixture(scope="module")
def more_reports():
    """The reports without mpi4py, mpiexec or torch, and with a torch too old (the second tier)."""
    return _run_cases(["no mpi4py", "no mpiexec", "no torch", "old torch"])


def _report(reports, case):
    result = reports[case]
    assert result.returncode == 0, result.stderr
    return _marks(result.stdout)


def test_check_build_marks_what_shmcomm_can_use_not_what_is_installed(reports):
    # A JAX without the FFI that shmcomm.jax builds on must not make shmcomm claim it.
    result = reports["fake jax"]
    assert result.returncode == 0, result.stderr
    marks, details = _marks(result.stdout)
    assert marks == dict(EVERYTHING, JAX=False), result.stdout
    assert "jax.ffi" in details["JAX"] and "torch.cuda.is_available() is False" in details["CUDA"]
    assert "no GPU to use it on; library: NCCL 2." in details["NCCL"]
    assert details["C core"].startswith("built (") and "mpiexec" in details["MPI"]
    for heading in ("Available Frameworks:", "Available Controllers/Transports:", "Available Tensor Operations:"):
        assert heading in result.stdout


def test_jax_with_its_ffi_and_optax_is_marked(reports):
    marks, details = _report(reports, "as installed")
    assert marks == EVERYTHING
    assert details["JAX"].startswith("jax ") if HAS_JAX else "not available" in details["JAX"]


def test_without_the_c_core_shared_memory_is_unmarked(reports):
    marks, details = _report(reports, "no core")
    assert marks == dict(EVERYTHING, **{"Shared memory": False, "C core (CPU)": False})
    assert details["C core"].startswith("NOT built (")


@pytest.mark.long
def test_without_mpi4py_mpi_is_unmarked(more_reports):
    marks, details = _report(more_reports, "no mpi4py")
    assert marks == dict(EVERYTHING, MPI=False)
    assert details["MPI"].startswith("not available (")


@pytest.mark.long
def test_without_mpiexec_mpi_is_unmarked(more_reports):
    marks, details = _report(more_reports, "no mpiexec")
    assert marks == dict(EVERYTHING, MPI=False)
    assert "no mpiexec" in details["MPI"]


@pytest.mark.long
def test_without_torch_or_with_a_torch_too_old_pytorch_is_unmarked(more_reports):
    marks, details = _report(more_reports, "no torch")
    assert marks == dict(EVERYTHING, PyTorch=False)
    assert details["PyTorch"].startswith("not available (")
    marks, details = _report(more_reports, "old torch")
    assert marks == dict(EVERYTHING, PyTorch=False)
    assert "2.0.1 is too old" in details["PyTorch"]
