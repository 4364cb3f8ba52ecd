# SPDX-License-Identifier: Apache-2.0
"""benchmarks/gpu_check.sh rehearsed without a GPU (second tier), in a stand-in for the GPU machine: a python3 that
sees this environment's torch, numpy, pytest and mpi4py but not cffi, pycparser, this checkout's shmcomm or an MPI
library; a copy of the tree (the suite's own core stays untouched); the wheels --prepare fetched; no network
(`unshare -n`). The script must run to its end within its 6 minutes, every step that needs no GPU passing and every
GPU step saying "no GPU"."""
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# site-packages entries the GPU machine lacks (the MPI library lives outside site-packages, in the prefix's lib/).
HIDDEN = ("cffi", "_cffi_backend", "pycparser", "shmcomm", "__editable__", "_shmcomm")

pytestmark = [
    pytest.mark.long,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0 or not shutil.which("unshare") or
                       not shutil.which("ip"), reason="needs Linux, root, unshare and ip (a network namespace stands "
                                                      "in for the offline machine)"),
]


def _stand_in_python(where):
    venv = where / "gpu-python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    seen = where / "seen"
    seen.mkdir()
    site = sysconfig.get_paths()["purelib"]
    for name in os.listdir(site):
        if not name.lower().startswith(HIDDEN) and not name.endswith(".pth"):
            os.symlink(os.path.join(site, name), seen / name)
    python = venv / "bin" / "python3"
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    Path(venv_site, "gpu_machine_packages.pth").write_text(str(seen) + "\n")
    return python


def _copy_of_the_tree(where):
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True, timeout=60).stdout.decode().split("\0")
    tree = where / "tree"
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tree / name)
    return tree


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHMCOMM_", "HOROVOD_", "PYTHON", "MPI4PY_", "OMPI_", "PMI", "VIRTUAL_ENV"))}
    env.update(extra)
    return env


def test_the_gpu_check_runs_to_its_end_offline_in_a_stand_in_for_the_gpu_machine(tmp_path):
    python = _stand_in_python(tmp_path)
    lacks = subprocess.run([str(python), "-c", "import torch, numpy, pytest, mpi4py; import cffi"], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)
    assert "No module named 'cffi'" in lacks.stderr, lacks.stderr  # the stand-in lacks what the machine lacks
    tree = _copy_of_the_tree(tmp_path)

    prepared = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--prepare"], cwd=tree, capture_output=True,
                              text=True, timeout=600, env=_clean_env(GPU_CHECK_PYTHON=sys.executable))
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    wheels = sorted(p.name for p in (tree / "benchmarks" / ".gpu_wheels").iterdir())
    assert any(w.startswith("cffi-") and "-cp312-cp312-" in w for w in wheels), wheels
    assert any(w.startswith("pycparser-") for w in wheels), wheels

    out = tmp_path / "out"
    env = _clean_env(PATH="%s:%s" % (python.parent, os.environ["PATH"]), HOME=str(tmp_path))
    started = time.monotonic()
    # A network namespace of its own: loopback only, as on the GPU machine (NCCL's bootstrap needs an interface).
    run = subprocess.run(["unshare", "-n", "sh", "-c", 'ip link set lo up && exec bash benchmarks/gpu_check.sh "$0"',
                          str(out)], cwd=tree, env=env, capture_output=True, text=True, timeout=480)
    took = time.monotonic() - started
    log = (out / "gpu_check.log").read_text()
    assert run.returncode == 3, run.stdout + run.stderr + log  # 3: everything passed that needs no GPU
    assert took < 360, took
    assert "failed:" not in log and ": exit " not in log, log
    assert "unpacked cffi-" in log and "unpacked pycparser-" in log, log
    assert "== " in log and "build the core in place" in log
    assert "shmcomm build:" in log or "Available Tensor Operations" in log or "check-build" in log
    assert "no GPU: torch" in log, log  # tests/gpu_smoke.py loaded NCCL, then found no GPU
    no_gpu = [line for line in log.splitlines() if line.endswith(": no GPU (torch.cuda.is_available() is False)")]
    assert len(no_gpu) == 5, no_gpu  # tests/test_gpu.py and the four sweeps
    assert " passed in " in log, log  # the tests that need no GPU
    assert "ok: rank 0 of 2" in log and "ok: rank 1 of 2" in log, log  # a job of 2 ranks without an MPI library
    assert len(list(out.iterdir())) <= 8
    assert (tree / ".gpu_check" / "site" / "cffi").is_dir()
