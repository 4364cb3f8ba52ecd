# SPDX-License-Identifier: Apache-2.0
"""NCCL is found and bound at run time, without a GPU: the test extra installs the nvidia-nccl-cu13 wheel (on Linux),
whose library answers its version, error strings and unique ids on any machine. Each case that changes where the
library is looked for runs in a subprocess, since a process loads a library once."""

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shmcomm.transport import cuda_kernels, nccl_library

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="NCCL's wheels are for Linux only")


def _wheel_library():
    found = nccl_library._from_wheels()
    assert found is not None, "the test extra installs nvidia-nccl-cu13; no NCCL wheel is installed"
    return found[0]


def _run(code, **settings):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHMCOMM_", "HOROVOD_"))}
    env.update(settings)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    return result


def test_the_wheel_is_found_and_answers_without_a_gpu():
    library = nccl_library.load()
    # Another test of this process may have mapped the wheel's library already: then that copy is the one taken.
    assert library.found_by in ("the nvidia-nccl-cu13 wheel", "the nvidia-nccl-cu12 wheel",
                                "the copy already loaded in this process")
    assert os.path.realpath(library.path) == os.path.realpath(_wheel_library())
    wheel = nccl_library._from_wheels()[1].split()[1]
    assert library.version_text == ".".join(importlib.metadata.version(wheel).split(".")[:3])
    assert library.version >= nccl_library.OLDEST
    first, second = library.unique_id(), library.unique_id()
    assert len(first) == len(second) == 128 and first != second
    assert "invalid argument" in library.error_string(4)
    with pytest.raises(nccl_library.NcclError, match=r"ncclBroadcast failed: .*\(NCCL error 4\)") as caught:
        library.check(4, "ncclBroadcast")
    assert caught.value.result == 4
    library.check(0, "ncclBroadcast")  # success raises nothing


def test_the_setting_wins_and_a_bad_path_names_it(tmp_path):
    chosen = _run("""
        from shmcomm.transport import nccl_library
        library = nccl_library.load()
        print(library.found_by, library.path, sep="|")
    """, SHMCOMM_NCCL_LIBRARY=_wheel_library())
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.strip() == f"SHMCOMM_NCCL_LIBRARY|{_wheel_library()}"

    not_a_library = tmp_path / "libnccl.so.2"
    not_a_library.write_text("not an ELF file\n")
    bad = _run("""
        from shmcomm.transport import nccl_library
        nccl_library.load()
    """, SHMCOMM_NCCL_LIBRARY=str(not_a_library))
    assert bad.returncode != 0
    assert f"NcclError: cannot load NCCL from {not_a_library} (SHMCOMM_NCCL_LIBRARY)" in bad.stderr


def test_a_copy_already_loaded_is_used_when_no_wheel_is_installed():
    # What a process looks like after torch.distributed loaded its NCCL: the library is mapped, no wheel is listed.
    result = _run(f"""
        import ctypes
        from shmcomm.transport import nccl_library
        nccl_library._from_wheels = lambda cuda_major: None
        assert nccl_library.find() is None or nccl_library.find()[1] != "the copy already loaded in this process"
        ctypes.CDLL({_wheel_library()!r})
        library = nccl_library.load()
        print(library.found_by, library.version_text, sep="|")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("the copy already loaded in this process|2.")


def test_nothing_found_says_where_to_get_it():
    result = _run("""
        from shmcomm.transport import nccl_library
        nccl_library._from_wheels = lambda cuda_major: None
        nccl_library._on_loader_path = lambda: None
        nccl_library.load()
    """)
    assert result.returncode != 0
    assert ("NCCL not found: set SHMCOMM_NCCL_LIBRARY to libnccl.so.2, or install the NCCL wheel of torch's CUDA: "
            "pip install nvidia-nccl-cu12 (CUDA 12) or nvidia-nccl-cu13 (CUDA 13)") in result.stderr


def test_version_codes_decode_both_layouts():
    assert nccl_library.version_tuple(23203) == (2, 32, 3)  # 2.9 and later: major*10000 + minor*100 + patch
    assert nccl_library.version_tuple(2804) == (2, 8, 4)  # before 2.9: major*1000 + minor*100 + patch


def test_the_wheel_for_torchs_cuda_comes_first_and_never_a_newer_one():
    assert nccl_library.wheel_order(13) == ["nvidia-nccl-cu13", "nvidia-nccl-cu12"]
    assert nccl_library.wheel_order(12) == ["nvidia-nccl-cu12"]  # cu13's library may need a newer driver
    assert nccl_library.wheel_order(11) == []
    assert nccl_library.wheel_order(None) == ["nvidia-nccl-cu12", "nvidia-nccl-cu13"]  # a CPU torch: oldest first


def test_under_a_cuda_12_torch_the_cu13_wheel_is_not_taken():
    # The test extra installs the cu13 wheel only: a torch built for CUDA 12 finds no NCCL wheel of its own, and
    # NCCL is reported missing with the wheel to install rather than taken from the cu13 one.
    result = _run("""
        import sys, types
        sys.modules["torch"] = types.SimpleNamespace(version=types.SimpleNamespace(cuda="12.8"))
        from shmcomm.transport import nccl_library
        nccl_library._on_loader_path = lambda: None
        print(nccl_library.torch_cuda_major(), nccl_library._from_wheels(12))
        nccl_library.load()
    """)
    assert result.stdout.strip() == "12 None", result.stdout + result.stderr
    assert "or install the NCCL wheel of torch's CUDA: pip install nvidia-nccl-cu12\n" in result.stderr
    under_13 = _run("""
        import sys, types
        sys.modules["torch"] = types.SimpleNamespace(version=types.SimpleNamespace(cuda="13.0"))
        from shmcomm.transport import nccl_library
        print(nccl_library.load().found_by)
    """)
    assert under_13.stdout.strip() == "the nvidia-nccl-cu13 wheel", under_13.stdout + under_13.stderr


def test_the_copy_torch_loaded_comes_before_any_wheel():
    result = _run(f"""
        import ctypes, shutil, tempfile, os
        from shmcomm.transport import nccl_library
        copy = os.path.join(tempfile.mkdtemp(), "libnccl.so.2")
        shutil.copy({_wheel_library()!r}, copy)
        ctypes.CDLL(copy)  # what torch does when torch.distributed starts
        print(nccl_library.load().path == copy, nccl_library.find()[1])
        os.unlink(copy)
    """)
    assert result.stdout.strip() == "True the copy already loaded in this process", result.stdout + result.stderr


def test_the_non_blocking_config_matches_ncclh_of_the_wheel(tmp_path):
    """The fields shmcomm declares for ncclConfig_t sit where the wheel's nccl.h puts them (a C program built against
    the header prints their offsets), and the config asks for a non-blocking communicator with NCCL's defaults."""
    header = Path(_wheel_library()).parents[1] / "include" / "nccl.h"
    if not header.exists() or not __import__("shutil").which("cc"):
        pytest.skip("the wheel has no nccl.h, or there is no C compiler")
    library = nccl_library.load()
    fields = ["size", "magic", "version", "blocking", "cgaClusterSize", "minCTAs", "maxCTAs", "netName", "splitShare"]
    program = tmp_path / "offsets.c"
    program.write_text('#include <stdio.h>\n#include <stddef.h>\n#include "nccl.h"\nint main(void) {\n'
                       + "".join('  printf("%%zu\\n", offsetof(ncclConfig_t, %s));\n' % f for f in fields)
                       + '  printf("%u %d\\n", NCCL_API_MAGIC, NCCL_CONFIG_UNDEF_INT);\n  return 0;\n}\n')
    compiler = cuda_kernels.nvcc() or "cc"  # nccl.h includes cuda_runtime.h, which nvcc finds
    built = subprocess.run([compiler, "-I", str(header.parent), "-o", str(tmp_path / "offsets"), str(program)],
                           capture_output=True, text=True, timeout=120)
    if built.returncode != 0 and "cuda_runtime.h" in built.stderr:
        pytest.skip("nccl.h needs the CUDA runtime's headers here")
    assert built.returncode == 0, built.stderr
    lines = subprocess.run([str(tmp_path / "offsets")], capture_output=True, text=True, timeout=60).stdout.split("\n")
    assert [int(v) for v in lines[:len(fields)]] == [library.ffi.offsetof("ncclConfig_t", f) for f in fields]
    assert lines[len(fields)].split() == [str(nccl_library.CONFIG_MAGIC), str(nccl_library.CONFIG_UNDEF_INT)]
    config = library.non_blocking_config()
    assert config.blocking == 0 and config.magic == nccl_library.CONFIG_MAGIC
    assert config.version == nccl_library.CONFIG_VERSION and config.size == library.ffi.offsetof(
        "ncclConfig_t", "splitShare") + 4
    assert config.minCTAs == config.splitShare == nccl_library.CONFIG_UNDEF_INT and config.netName == library.ffi.NULL


class _Recorder:
    """The real library's calls, each recorded by name on its way through."""

    def __init__(self, lib):
        self._lib, self.calls = lib, []

    def __getattr__(self, name):
        call = getattr(self._lib, name)

        def recorded(*args):
            self.calls.append(name)
            return call(*args)
        return recorded


def test_a_call_that_fails_inside_a_group_is_raised_after_the_group_ends_then_the_communicator_aborts():
    from shmcomm.transport import nccl
    from shmcomm.vocabulary.exceptions import BrokenCommunicatorError

    library = nccl_library.NcclLibrary(*nccl_library.find())
    library.lib = _Recorder(library.lib)
    comm = nccl.NcclComm(library, library.ffi.NULL, 0, [0], 5.0)  # NCCL refuses a null communicator, GPU or not
    with pytest.raises(nccl_library.NcclError, match=r"ncclAllReduce failed: invalid argument") as caught:
        with comm.group():
            comm.allreduce(0, 0, 4, "float32", "sum", 0)
            comm.allreduce(0, 0, 4, "float32", "sum", 0)  # not reached: the first failure leaves the group
    called = [name for name in library.lib.calls if name not in ("ncclGetErrorString", "ncclGetLastError")]
    assert called == ["ncclGroupStart", "ncclAllReduce", "ncclGroupEnd", "ncclCommAbort"]
    assert comm.handle is None and comm.broken is caught.value
    with pytest.raises(BrokenCommunicatorError, match="unusable after an earlier failure"):
        comm.broadcast(0, 0, 4, "uint8", 0, 0)


def test_each_nccl_wheel_has_its_extra():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for major, wheel in nccl_library.WHEELS.items():
        assert extras["cuda%d" % major] == [wheel]
    assert extras["cuda"] == extras["cuda13"]  # the CUDA of torch's default Linux wheels


def test_a_call_still_in_progress_is_polled_and_an_error_state_aborts_the_communicator():
    # A non-blocking communicator's call may return ncclInProgress; its end is then polled through
    # ncclCommGetAsyncError, bounded. A null communicator's state is NCCL's "invalid argument", GPU or not: the
    # poll raises with NCCL's words and aborts, instead of waiting.
    from shmcomm.transport import nccl

    library = nccl_library.load()
    comm = nccl.NcclComm(library, library.ffi.NULL, 0, [0, 1], 30.0)
    with pytest.raises(nccl_library.NcclError, match=r"ncclCommInitRank \(rank 0 of 2\): NCCL reported an error "
                                                     r"over ranks 0, 1: invalid argument .*; the NCCL communicator "
                                                     r"was aborted"):
        comm._settle("ncclCommInitRank (rank 0 of 2)", nccl_library.IN_PROGRESS, joining=True)
    assert comm.handle is None
    comm = nccl.NcclComm(library, library.ffi.NULL, 0, [0], 30.0)
    comm._settle("ncclAllReduce", 0)  # a call that returned success is not polled
    assert comm.broken is None
