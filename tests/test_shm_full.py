# SPDX-License-Identifier: Apache-2.0
"""A full /dev/shm is an OutOfMemoryError naming it, never a SIGBUS: jobs run in a private mount namespace whose
/dev/shm is a small tmpfs (Docker's default is 64 MiB)."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_namespaces = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                      reason="a private /dev/shm needs root and unshare")


def _in_small_shm(size, script, ranks=2, **env):
    """Runs `shmcommrun -np ranks python script` with a tmpfs of `size` on /dev/shm, seen by this job alone."""
    launch = "mount -t tmpfs -o size=%s tmpfs /dev/shm && exec %s -m shmcomm.runner -np %d %s %s" % (
        size, sys.executable, ranks, sys.executable, script)
    environ = dict(os.environ, PYTHONPATH=ROOT, **env)
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", launch], env=environ,
                          capture_output=True, text=True, timeout=120)


@needs_namespaces
def test_a_box_larger_than_dev_shm_is_refused_and_the_job_goes_on(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, shmcomm
        shmcomm.init()
        try:
            box = shmcomm.SoftMemoryBox("big", shape=(200 << 18,), dtype=np.float32)  # 200 MiB
            box.write(np.ones(200 << 18, np.float32))
            print("written", flush=True)
        except shmcomm.OutOfMemoryError as error:
            print("refused:", error, flush=True)
        small = shmcomm.SoftMemoryBox("small", shape=(1024,), dtype=np.float32)
        small.accumulate(np.ones(1024, np.float32))
        shmcomm.barrier()
        assert small.read().tolist() == [2.0] * 1024
        assert shmcomm.allreduce(np.ones(4), op=shmcomm.Sum).tolist() == [2.0] * 4
        print("goes on", flush=True)
    """))
    run = _in_small_shm("64m", script)
    assert run.returncode == 0, run.stdout + run.stderr
    refused = [line for line in run.stdout.splitlines() if "refused:" in line]
    assert len(refused) == 2 and run.stdout.count("goes on") == 2, run.stdout + run.stderr
    for line in refused:
        assert "box create: /dev/shm is full: 209715200 bytes of shared memory asked for" in line, line
        assert "--shm-size" in line and "free" in line, line


@needs_namespaces
def test_init_in_a_dev_shm_too_small_for_the_staging_slots_names_it(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import shmcomm\nshmcomm.init()\nprint('started', flush=True)\n")
    run = _in_small_shm("4m", script, SHMCOMM_SLOT_BYTES=str(4 << 20), SHMCOMM_START_TIMEOUT="10")
    assert run.returncode != 0 and "started" not in run.stdout, run.stdout + run.stderr
    assert "init: /dev/shm is full" in run.stdout + run.stderr, run.stdout + run.stderr
    assert "SIGBUS" not in run.stdout + run.stderr and "signal 7" not in run.stdout + run.stderr
