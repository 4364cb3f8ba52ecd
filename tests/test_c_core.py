# SPDX-License-Identifier: Apache-2.0
"""The C unit tests (tests/c), built here with the compiler the package was built with, also under sanitizers, and
the other builds of tests/c/Makefile (the kernels without -fwrapv under UBSan, and every clone of them)."""
import glob
import os
import platform
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


APART = ("jax", "mpi", "py")  # csrc/ffi_build.py's


def _core_sources():
    """The core's sources, as csrc/ffi_build.py builds them: csrc/jax/ is shmcomm.jax's handler and csrc/mpi/ the
    cross-host rounds, each built apart, and csrc/py/ the CPython functions compiled into the cffi module."""
    return sorted(p for p in glob.glob(os.path.join(ROOT, "csrc", "*", "*.c"))
                  if os.path.basename(os.path.dirname(p)) not in APART)


@pytest.fixture(scope="module")
def core_objects(tmp_path_factory):
    """core_objects(flags): the core's object files built with FLAGS + flags, once per set of flags for the module
    (each test used to compile the whole core again), two compilers at a time."""
    built = {}

    def objects(extra):
        key = tuple(extra)
        if key not in built:
            out = tmp_path_factory.mktemp("core")
            sources = _core_sources()
            names = [str(out / (os.path.relpath(p, os.path.join(ROOT, "csrc")).replace(os.sep, "_")[:-2] + ".o"))
                     for p in sources]
            pending = list(zip(sources, names))
            running = []
            while pending or running:
                while pending and len(running) < max(2, os.cpu_count() or 1):
                    source, name = pending.pop()
                    running.append(subprocess.Popen([CC] + FLAGS + extra + ["-c", source, "-o", name]))
                if running[0].wait(timeout=300) != 0:
                    pytest.fail("the core did not compile with %s" % " ".join(extra))
                running.pop(0)
            built[key] = names
        return built[key]
    return objects


def _build_and_run(tmp_path, test, extra, objects):
    exe = str(tmp_path / os.path.basename(test).replace(".c", ""))
    subprocess.run([CC] + FLAGS + extra + [os.path.join(C_DIR, test)] + objects + ["-o", exe, "-lrt", "-lm"],
                   check=True, timeout=300)
    run = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 failed" in run.stdout
    return run.stdout


# test_copy.c tests the copy loop for placements that AMD's `rep movsb` handles slowly (csrc/core/copy.h), which the
# core takes on AMD's CPUs only: it is built with csrc/core/copy.c alone, told that this CPU is such a one.
SLOW_SHORT_MOVES = "-DSMC_SLOW_SHORT_MOVES=1"


def _objects(test, extra, core_objects):
    if test == "test_copy.c":
        return extra + [SLOW_SHORT_MOVES], [os.path.join(ROOT, "csrc", "core", "copy.c")]
    if test == "test_path_choice.c":  # the choice alone, fed the costs its calls would report
        return extra, [os.path.join(ROOT, "csrc", "coll", "path_choice.c")]
    return extra, core_objects(extra)


# test_core.c and test_box_server.c run their rounds in the second tier: the Python tests drive the same code.
@pytest.mark.parametrize("test", [pytest.param("test_core.c", marks=pytest.mark.long), "test_failure.c",
                                  "test_reduce.c", pytest.param("test_box_server.c", marks=pytest.mark.long),
                                  "test_copy.c", "test_path_choice.c"])
def test_c_units(tmp_path, test, core_objects):
    _build_and_run(tmp_path, test, *_objects(test, ["-O2"], core_objects))


def _require_sanitizers(tmp_path):
    """Skips where this compiler has no sanitizer runtime, unless SHMCOMM_REQUIRE_SANITIZERS=1 (CI, whose machines
    have it): there a missing runtime fails."""
    probe = subprocess.run([CC, "-fsanitize=address,undefined", "-x", "c", "-", "-o", str(tmp_path / "probe")],
                           input="int main(void){return 0;}", text=True, capture_output=True)
    if probe.returncode != 0:
        why = "this compiler has no address/undefined sanitizer runtime: " + probe.stderr.strip()[-300:]
        if os.environ.get("SHMCOMM_REQUIRE_SANITIZERS") == "1":
            pytest.fail(why + " (SHMCOMM_REQUIRE_SANITIZERS=1)")
        pytest.skip(why)


@pytest.mark.parametrize("test", ["test_core.c", "test_failure.c", "test_box_server.c", "test_copy.c",
                                  "test_path_choice.c"])
@pytest.mark.long
def test_core_units_under_sanitizers(tmp_path, test, core_objects):
    """test_reduce.c runs under them through `make asan`, below, without -fwrapv."""
    _require_sanitizers(tmp_path)
    _build_and_run(tmp_path, test, *_objects(test, SANITIZE, core_objects))


def _make(tmp_path, target):
    """Runs a target of tests/c/Makefile, building in tmp_path; returns its output."""
    if shutil.which("make") is None:
        pytest.fail("tests/c/Makefile needs make")
    run = subprocess.run(["make", "-s", "-f", os.path.join(C_DIR, "Makefile"), "-C", str(tmp_path), target,
                          "CC=" + CC], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.mark.long
def test_reduce_kernels_under_ubsan_without_fwrapv(tmp_path):
    """`make asan`: the kernels built without -fwrapv, so that UBSan sees any signed overflow they rely on, and with
    float-cast-overflow, which guards their double -> integer conversions."""
    _require_sanitizers(tmp_path)
    assert _make(tmp_path, "asan").count(" 0 failed") == 1


@pytest.mark.long
def test_every_clone_of_the_reduce_kernels(tmp_path):
    """`make clones`: the kernels pinned to the portable code and, where the CPU has it, to the avx2 code, so that
    every target_clones variant is checked on one machine (the library runs only the best one)."""
    with open("/proc/cpuinfo") as f:
        avx2 = platform.machine() == "x86_64" and " avx2" in f.read()
    assert _make(tmp_path, "clones").count(" 0 failed") == (2 if avx2 else 1)
