# SPDX-License-Identifier: Apache-2.0
"""The timeline as Horovod's own test reads it (tests/timeline_step.py): 0.1 s after a named allreduce the file
holds its events, and after shutdown it is a closed JSON array. Twice here; with -m long, 20 times idle, 20 times
beside 2 CPU-bound processes, and across two simulated hosts."""
import json
import os
import subprocess
import sys

import pytest

import multiproc
import timeline_step
from test_simhosts import job_env, open_hosts, rank_lines

from shmcomm.testing import cpu_load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASSED = {"missing": [], "closed": True}


def _runs(tmp_path, runs):
    for run in range(runs):
        path = str(tmp_path / ("timeline%d.json" % run))
        env = {"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
        reports = multiproc.run(2, timeline_step.step, env=env, prefix="HOROVOD_", timeout=120)
        assert reports == [PASSED] * 2, (run, reports)


def test_horovods_timeline_test_passes_twice(tmp_path):
    _runs(tmp_path, 2)


def _numpy_allreduce(path):
    import numpy as np

    import shmcomm

    shmcomm.init()  # no engine asked for: the timeline starts it, so that blocking calls are recorded too
    shmcomm.allreduce(np.ones(3), op=shmcomm.Sum, name="blocking")
    with open(path if shmcomm.rank() == 0 else "%s.%d" % (path, shmcomm.rank())) as f:
        return '"name": "allreduce.blocking"' in f.read()  # at once: the call returns after the flush


def test_a_blocking_numpy_call_is_in_the_file_when_it_returns(tmp_path):
    path = str(tmp_path / "timeline.json")
    assert multiproc.run(2, _numpy_allreduce, path, env={"SHMCOMM_TIMELINE": path}) == [True, True]


@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("busy", [0, 2])
def test_horovods_timeline_test_passes_20_times(tmp_path, busy):
    with cpu_load.spinning(busy):
        _runs(tmp_path, 20)


@pytest.mark.long
@pytest.mark.timeout(600)
def test_horovods_timeline_test_passes_across_two_simulated_hosts(tmp_path):
    sim = open_hosts(2)
    try:
        path = str(tmp_path / "timeline.json")
        done = subprocess.run([sys.executable, "-m", "shmcomm.runner", *sim.shmcommrun_args(1), sys.executable,
                               os.path.join(ROOT, "tests", "timeline_step.py")], cwd=ROOT,
                              env=job_env(HOROVOD_TIMELINE=path, HOROVOD_TIMELINE_MARK_CYCLES="1"),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        reports = {rank: json.loads(lines[-1]) for rank, lines in rank_lines(done.stdout).items()}
        assert reports == {0: PASSED, 1: PASSED}, done.stdout[-3000:]
    finally:
        sim.close()
