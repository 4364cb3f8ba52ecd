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

from shmcomm.transport import nccl_library

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
    assert library.found_by in ("the nvidia-nccl-cu13 wheel", "the nvidia-nccl-cu12 wheel")
    assert library.path == _wheel_library()
    wheel = library.found_by.split()[1]
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
        nccl_library._from_wheels = lambda: None
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
        nccl_library._from_wheels = lambda: None
        nccl_library._on_loader_path = lambda: None
        nccl_library.load()
    """)
    assert result.returncode != 0
    assert "NCCL not found: set SHMCOMM_NCCL_LIBRARY to libnccl.so.2, or install nvidia-nccl-cu13" in result.stderr


def test_version_codes_decode_both_layouts():
    assert nccl_library.version_tuple(23203) == (2, 32, 3)  # 2.9 and later: major*10000 + minor*100 + patch
    assert nccl_library.version_tuple(2804) == (2, 8, 4)  # before 2.9: major*1000 + minor*100 + patch
