# SPDX-License-Identifier: Apache-2.0
"""The C unit tests (tests/c), built here with the compiler the package was built with, also under sanitizers."""
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C_DIR = os.path.join(ROOT, "tests", "c")
CC = os.environ.get("CC", "gcc")


def _core_flags():
    """The package's own flags (csrc/cflags.txt: the first word of each line starting with '-')."""
    with open(os.path.join(ROOT, "csrc", "cflags.txt")) as f:
        return [line.split()[0] for line in f if line.startswith("-")]


# The tests add -Werror and their own optimisation level (a later -O wins) or sanitizers.
FLAGS = _core_flags() + ["-Werror", "-I" + os.path.join(ROOT, "csrc"), "-I" + os.path.join(ROOT, "csrc", "include")]
SANITIZE = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]

pytestmark = pytest.mark.skipif(shutil.which(CC) is None, reason="no C compiler")


def _core_sources():
    return sorted(glob.glob(os.path.join(ROOT, "csrc", "*", "*.c")))


def _build_and_run(tmp_path, test, extra):
    exe = str(tmp_path / os.path.basename(test).replace(".c", ""))
    subprocess.run([CC] + FLAGS + extra + [os.path.join(C_DIR, test)] + _core_sources() + ["-o", exe, "-lrt", "-lm"],
                   check=True, timeout=300)
    run = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 failed" in run.stdout
    return run.stdout


@pytest.mark.parametrize("test", ["test_core.c", "test_failure.c", "test_reduce.c"])
def test_c_units(tmp_path, test):
    _build_and_run(tmp_path, test, ["-O2"])


@pytest.mark.parametrize("test", ["test_core.c", "test_failure.c", "test_reduce.c"])
def test_c_units_under_sanitizers(tmp_path, test):
    probe = subprocess.run([CC, "-fsanitize=address,undefined", "-x", "c", "-", "-o", str(tmp_path / "probe")],
                           input="int main(void){return 0;}", text=True, capture_output=True)
    if probe.returncode != 0:
        pytest.skip("this compiler has no address/undefined sanitizer runtime")
    _build_and_run(tmp_path, test, SANITIZE)
