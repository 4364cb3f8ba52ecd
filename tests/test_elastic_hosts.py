# SPDX-License-Identifier: Apache-2.0
"""Elastic jobs across simulated hosts (network namespaces, tests/test_simhosts.py): shmcommrun --min-np/--max-np
with a discovery script naming several hosts starts workers on each (through the simulated hosts' ssh stand-in),
and the worlds they form span the hosts (shared memory inside each, TCP between them).

A rank killed on the second host makes the survivors on both hosts roll back and re-form; a host the script adds
gets a worker that joins with the state; a host the script drops has its worker retired at a commit; every sample of
every epoch goes into exactly one committed step and every rank ends with the same weights. Below --min-np the job
ends with an error. Skipped with the reason where simulated hosts cannot be made."""
import os
import re
import subprocess
import sys
import time

import pytest

from test_elastic import compare_with_undisturbed
from test_torus import CHECKS, PROCESS_SETS_ACROSS_HOSTS, run_checks_job

from shmcomm.testing import exact
from test_simhosts import job_env, open_hosts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "elastic_hosts_job.py")

pytestmark = pytest.mark.slow


def _discovery(tmp_path, text):
    (tmp_path / "hosts").write_text(text)
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\ncat %s\n" % (tmp_path / "hosts"))
    script.chmod(0o755)
    return str(script)


def _shmcommrun(sim, script, args, timeout=240):
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "shmcomm.runner", "--launcher-agent", sim.agent,
                          "--host-discovery-script", script] + args, cwd=ROOT, env=job_env(),
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    return run, time.monotonic() - start


@pytest.fixture(scope="module")
def three_hosts():
    sim = open_hosts(3)
    try:
        yield sim
    finally:
        sim.close()


@pytest.mark.long
@pytest.mark.timeout(600)  # about a minute, slower beside other work
def test_a_rank_lost_on_one_host_a_host_added_and_a_host_dropped(three_hosts, tmp_path):
    pytest.importorskip("torch")
    script = _discovery(tmp_path, "simhost0:2\nsimhost1:2\n")
    run, _ = _shmcommrun(three_hosts, script, ["-np", "4", "--min-np", "2", "--max-np", "6", "--elastic-timeout",
                                               "60", sys.executable, JOB, str(tmp_path), "2", "20"])
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    # The last rank gives up its slot and kills itself at once: the launcher reports the death, or, when its discovery
    # ran between the two, retires the worker whose slot went and takes its exit for the retirement. Either way the
    # job saw the rank lost (the recoveries below).
    assert re.search(r"worker 3 \(rank 3\) was killed by signal 9 \(SIGKILL\) on simhost1|worker 3 on simhost1 is "
                     r"retired", run.stderr), out
    assert "started 1 worker(s) on simhost2" in run.stderr, out
    assert "worker 2 on simhost1 is retired" in run.stderr, out
    summary = re.search(r"<stdout>: epochs (\d+) every sample once \[(.*)\] recoveries (\S+)", run.stdout)
    assert summary and int(summary.group(1)) >= 2, out
    assert set(summary.group(2).split(", ")) == {"True"}, out  # no sample skipped or processed twice, any epoch
    assert summary.group(3).split(",")[:3] == ["lost", "added", "added"], out
    done = re.findall(r"<stdout>: done rank (\d) size (\d) host (\S+) digest (\S+) sizes (\S+) token (\w+)", run.stdout)
    assert sorted(d[0] for d in done) == ["0", "1", "2"], out  # the retired worker left before the end
    assert {d[1] for d in done} == {"3"} and {d[4] for d in done} == {"4,3,4,3"}, out
    assert sorted(d[2] for d in done) == ["simhost0", "simhost0", "simhost2"], out
    assert len({d[3] for d in done}) == 1, out  # the same weights on every rank, the newcomer's included
    tokens = {d[5] for d in done}
    assert len(tokens) == 1, out
    job = tokens.pop().split("g")[0]  # the job's token, before its generation's number ("...g3")
    # Every generation's segments are gone; only this job's names are looked at, since other jobs share /dev/shm.
    assert not [n for n in os.listdir("/dev/shm") if job in n]


def test_every_collective_in_an_elastic_world_across_hosts(three_hosts, tmp_path):
    """exact.run_checks on 3 ranks over 2 hosts (2 + 1) under the elastic launcher: every collective and dtype over
    the TCP mesh, against the expected values, the same bits on every rank, 16-bit sums rounded once."""
    script = _discovery(tmp_path, "simhost0:2\nsimhost1:1\n")
    program = CHECKS + "\nimport shmcomm, socket\nprint('on', socket.gethostname(), shmcomm.local_size(), " \
                       "shmcomm.cross_size(), shmcomm.basics.communicator().across.carrier, flush=True)\n"
    reports, stdout = run_checks_job(lambda job, out: _shmcommrun(three_hosts, script, [
        "-np", "3", "--min-np", "3", sys.executable, job, out, "bf16"])[0], 3, program)
    exact.assert_identical(reports)
    exact.assert_rounds_once(reports)
    assert sorted(re.findall(r"<stdout>: on (.*)", stdout)) == ["simhost0 2 2 tcp", "simhost0 2 2 tcp",
                                                                "simhost1 1 2 tcp"], stdout


@pytest.mark.long
def test_process_sets_across_the_hosts_of_an_elastic_world(three_hosts, tmp_path):
    """Sets that span the hosts of a world that met without MPI connect their members through the world's listeners:
    every collective on them, straight and through the engine, a mismatch raised on every member, a refusal heard."""
    script = _discovery(tmp_path, "simhost0:2\nsimhost1:2\n")
    job = tmp_path / "job.py"
    job.write_text(PROCESS_SETS_ACROSS_HOSTS + "print('across', shmcomm.basics.communicator().across.carrier)\n")
    run, _ = _shmcommrun(three_hosts, script, ["-np", "4", "--min-np", "4", sys.executable, str(job)])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("sets ok") == 4 and run.stdout.count("across tcp") == 4, run.stdout[-3000:]


@pytest.mark.long
def test_below_min_np_across_hosts_the_job_ends_with_an_error(three_hosts, tmp_path):
    """A host drops out of the script's output and the job has too few workers left: an error, not a hang."""
    script = _discovery(tmp_path, "simhost0:1\nsimhost1:1\n")
    program = ("import os, time, shmcomm; shmcomm.init(); print('size', shmcomm.size(), flush=True);\n"
               "if shmcomm.rank() == 1: open(%r, 'w').write('simhost0:1\\n')\ntime.sleep(600)"
               % str(tmp_path / "hosts"))
    run, elapsed = _shmcommrun(three_hosts, script, ["-np", "2", "--min-np", "2", "--elastic-timeout", "3",
                                                     sys.executable, "-c", program], timeout=120)
    assert run.returncode != 0, run.stdout + run.stderr
    assert "fewer than --min-np 2" in run.stderr, run.stderr
    assert elapsed < 60


@pytest.mark.long
@pytest.mark.timeout(1500)  # two jobs of 2-3 minutes each across simulated hosts, slower beside other work
def test_example_across_hosts_reaches_the_accuracy_of_an_undisturbed_run(three_hosts, tmp_path):
    """The headline case across 2 hosts: 4 ranks, rank 1 killed every 50 steps and a replacement gained back on its
    host each time; the same accuracy as the undisturbed job across the same hosts."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    script = _discovery(tmp_path, "simhost0:2\nsimhost1:2\n")
    compare_with_undisturbed(tmp_path, lambda args, timeout: _shmcommrun(three_hosts, script, args, timeout),
                             "2 simulated hosts")
