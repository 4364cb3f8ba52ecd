# SPDX-License-Identifier: Apache-2.0
"""A rank killed mid-collective under the launcher: the others name it, the job stops non-zero, /dev/shm is clean."""
import os
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = textwrap.dedent("""
    import os, signal, threading, numpy as np, shmcomm
    shmcomm.init()
    print("segment", os.environ["SHMCOMM_JOB_TOKEN"], flush=True)
    if shmcomm.rank() == 1:
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    x = np.ones(1 << 20, np.float32)
    while True:
        shmcomm.allreduce_(x)
""")


def test_sigkill_mid_collective_stops_the_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "shmcomm.runner", "-np", "3", sys.executable, str(script)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert run.returncode != 0
    assert "rank 1" in run.stderr and ("signal 9" in run.stderr or "SIGKILL" in run.stderr), run.stderr
    assert took < 20
    token = run.stdout.split("segment ")[1].split()[0]
    assert not [n for n in os.listdir("/dev/shm") if token in n]
