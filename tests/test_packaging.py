# SPDX-License-Identifier: Apache-2.0
"""The wheel: `pip wheel .` carries the compiled core, and installed into a fresh venv with no compiler it runs a
job from the installed copy, not from the source tree. No network: the build uses this environment's setuptools
and cffi, and the fresh venv takes numpy, cffi and mpi4py from this environment."""

import os
import shutil
import site
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

# Builds a wheel from a copy of the sources and installs it: the second tier (`pytest -m long`).
pytestmark = pytest.mark.long

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 180

# An in-tree build would write build/ and *.egg-info into the checkout, and a stale build/ or an editable install's
# shmcomm/_C*.so could end up in the wheel instead of a core compiled from these sources.
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "__pycache__", "*.egg-info", "*.so", "*.o",
                                     "_C.c")

ALLREDUCE = textwrap.dedent("""
    import numpy as np
    import shmcomm
    import shmcomm._C
    shmcomm.init()
    print("package", shmcomm.__file__)
    print("core", shmcomm._C.__file__)
    print("sum", shmcomm.allreduce(np.ones(4), op=shmcomm.Sum).tolist())
    shmcomm.shutdown()
""")


def _run(command, **kwargs):
    result = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=TIMEOUT, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result


def _no_compiler_env(venv):
    """The environment of a machine without a C compiler, with the venv first on PATH and nothing of the source
    tree or of an enclosing shmcomm job."""
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith(("SHMCOMM_", "HOROVOD_"))}
    env["CC"] = env["CXX"] = "/bin/false"  # any attempt to compile fails loudly
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(venv)
    return env


def _venv_site_packages(venv):
    return next((venv / "lib").glob("python*/site-packages"))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    copy = tmp_path_factory.mktemp("source") / "shmcomm"
    shutil.copytree(REPO, copy, ignore=NOT_SOURCES)
    return copy


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory):
    wheels = tmp_path_factory.mktemp("wheels")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, source])
    (built,) = wheels.glob("shmcomm-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """A fresh venv holding the wheel; its dependencies come from this environment."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    # `venv --system-site-packages` would only reach the base interpreter's packages, not those of the venv that
    # runs the tests, so a .pth file lists this environment's site-packages after the new venv's own.
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    (_venv_site_packages(venv) / "test-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-deps",
          "--no-index", wheel], env=_no_compiler_env(venv))
    return venv


JAX_HANDLER = ["shmcomm/jax/csrc/handler.c", "shmcomm/jax/csrc/handler.h", "shmcomm/jax/csrc/shmcomm.h"]
CROSSING = ["shmcomm/transport/csrc/crossing.c", "shmcomm/transport/csrc/crossing.h",
            "shmcomm/transport/csrc/shmcomm.h"]


def test_wheel_carries_the_compiled_core_and_no_sources(wheel):
    """No sources but those compiled on first use: the XLA handler's (against the jaxlib found then) and the cross-host
    rounds' (with the mpicc found then)."""
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.startswith("shmcomm/_C") and n.endswith(".so")], names
    sources = [n for n in names if n.startswith("csrc/") or n.endswith((".c", ".h"))]
    assert sorted(sources) == sorted(JAX_HANDLER + CROSSING), names
    packages = sorted(str(p.relative_to(REPO)) for p in (REPO / "shmcomm").rglob("__init__.py"))
    assert [p for p in packages if p not in names] == []
    assert any(n.endswith("entry_points.txt") for n in names)


def test_sdist_carries_everything_the_core_build_reads(source, tmp_path):
    # A wheel built from the sdist (as `python -m build` does) compiles the core from what the sdist holds.
    _run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(tmp_path)!r})"],
         cwd=source)
    (sdist,) = tmp_path.glob("shmcomm-*.tar.gz")
    with tarfile.open(sdist) as archive:
        carried = {Path(*Path(name).parts[1:]) for name in archive.getnames()}
    needed = {p.relative_to(source) for p in (source / "csrc").rglob("*") if p.is_file()}
    assert needed and needed <= carried, sorted(needed - carried)


def test_installed_wheel_runs_a_two_rank_allreduce_without_a_compiler(installed, tmp_path):
    launcher = installed / "bin" / "shmcommrun"
    assert launcher.is_file()
    python = installed / "bin" / "python"
    result = _run([launcher, "-np", 2, python, "-c", ALLREDUCE], cwd=tmp_path, env=_no_compiler_env(installed))
    site_packages = _venv_site_packages(installed).resolve()
    for rank in (0, 1):
        lines = dict(line.split(": ", 1)[1].split(" ", 1) for line in result.stdout.splitlines()
                     if line.startswith(f"[{rank}]<stdout>: "))
        assert Path(lines["package"]).resolve().is_relative_to(site_packages), lines
        assert Path(lines["core"]).resolve().is_relative_to(site_packages), lines
        assert lines["sum"] == "[2.0, 2.0, 2.0, 2.0]"


JAX_ALLREDUCE = textwrap.dedent("""
    import jax, shmcomm.jax as sj, shmcomm.jax.native as native
    sj.init()
    print("handler", native._sources()[0])
    print("sum", jax.jit(lambda x: sj.allreduce(x, op=sj.Sum))(jax.numpy.ones(3)).tolist())
    sj.shutdown()
""")


def test_installed_wheel_builds_the_jax_handler_from_its_own_copy(installed, tmp_path):
    pytest.importorskip("jax", reason="shmcomm.jax needs jax: pip install -e '.[jax]'")
    env = {k: v for k, v in _no_compiler_env(installed).items() if k not in ("CC", "CXX")}  # a compiler, once
    env["SHMCOMM_BUILD_DIR"] = str(tmp_path / "builds")
    result = _run([installed / "bin" / "shmcommrun", "-np", 2, installed / "bin" / "python", "-c", JAX_ALLREDUCE],
                  cwd=tmp_path, env=env)
    site_packages = _venv_site_packages(installed).resolve()
    for rank in (0, 1):
        lines = dict(line.split(": ", 1)[1].split(" ", 1) for line in result.stdout.splitlines()
                     if line.startswith(f"[{rank}]<stdout>: "))
        assert Path(lines["handler"]).resolve().is_relative_to(site_packages), lines
        assert lines["sum"] == "[2.0, 2.0, 2.0]", lines
