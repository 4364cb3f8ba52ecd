# SPDX-License-Identifier: Apache-2.0
"""A rank killed mid-collective under the launcher: the others raise RankFailure naming it, the job stops non-zero,
/dev/shm is clean."""
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from shmcomm.testing import outcomes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = textwrap.dedent("""
    import os, signal, sys, threading, time, numpy as np, shmcomm
    from shmcomm.testing import outcomes
    # The launcher stops the other ranks with SIGTERM once one dies: ignored here, so that each rank says what it
    # raised itself (SIGKILL would follow after the grace period).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    shmcomm.init()
    me = shmcomm.rank()
    print("segment", os.environ["SHMCOMM_JOB_TOKEN"], flush=True)
    if me == 1:
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    x = np.ones(1 << 20, np.float32)
    started = time.monotonic()
    try:
        while True:
            shmcomm.allreduce_(x)
    except shmcomm.ShmCommError as error:
        outcomes.record(sys.argv[1], me, error, started)
        raise SystemExit(3)
""")


def test_sigkill_mid_collective_stops_the_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "shmcomm.runner", "-np", "3", sys.executable, str(script),
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert run.returncode != 0
    assert "rank 1" in run.stderr and ("signal 9" in run.stderr or "SIGKILL" in run.stderr), run.stderr
    assert took < 20
    # Each survivor's own error: RankFailure naming rank 1.
    raised = outcomes.read(tmp_path)
    assert sorted(raised) == [0, 2], run.stdout + run.stderr
    for outcome in raised.values():
        assert outcome["type"] == "RankFailure" and outcome["rank"] == 1, outcome
        assert "rank 1" in outcome["message"] and "died" in outcome["message"], outcome
    token = run.stdout.split("segment ")[1].split()[0]
    assert not [n for n in os.listdir("/dev/shm") if token in n]


STOPPED_LAST = textwrap.dedent("""
    import os, signal, numpy as np, shmcomm
    shmcomm.init()
    print("segment", os.environ["SHMCOMM_JOB_TOKEN"], "pid", os.getpid(), flush=True)
    shmcomm.allreduce(np.ones(16, np.float32))
    me = shmcomm.rank()
    shmcomm.shutdown()
    if me == 1:  # stopped after its shutdown: the others end well, nothing is left to time out on it
        os.kill(os.getpid(), signal.SIGSTOP)
""")


@pytest.mark.slow
def test_a_rank_stopped_after_the_others_ended_fails_the_job(tmp_path):
    """The launcher waits for a stopped rank no longer than SHMCOMM_TIMEOUT once the others have ended: it names
    it, kills it and exits non-zero."""
    script = tmp_path / "job.py"
    script.write_text(STOPPED_LAST)
    run = subprocess.run([sys.executable, "-m", "shmcomm.runner", "-np", "3", sys.executable, str(script)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, SHMCOMM_TIMEOUT="2"))
    assert run.returncode != 0, run.stdout + run.stderr
    assert "rank 1 (pid" in run.stderr and "is stopped" in run.stderr and "SHMCOMM_TIMEOUT" in run.stderr, run.stderr
    pid = int(next(line for line in run.stdout.splitlines() if line.startswith("[1]")).split("pid ")[1])
    assert not os.path.exists("/proc/%d" % pid) or open("/proc/%d/stat" % pid).read().split(") ")[1][0] == "Z"
    token = run.stdout.split("segment ")[1].split()[0]
    assert not [n for n in os.listdir("/dev/shm") if token in n]


def test_the_launcher_names_a_killed_rank_before_one_that_mpi_aborted_after_it():
    """Across hosts MPICH's network module aborts a survivor whose connection a dying rank reset, and that rank's
    guard may report first: the launcher's last word still names the killed rank first (the output of a run of
    tests/chaos.py that this happened in)."""
    from shmcomm.runner.mpi_launch import _Report

    lines = [
        "[0]<stderr>: Abort(807596687) on node 0: Fatal error in internal_Testall: Other MPI error, error stack:",
        "[0]<stderr>: MPIDI_OFI_handle_cq_error(593): OFI poll failed (default nic=eth0: Connection reset by peer)",
        "[0]<stderr>: shmcommrun: rank 0 on simhost0 exited with code 143; stopping the job in 10 s",
        "[2]<stderr>: shmcommrun: rank 2 on simhost1 was killed by signal 9; stopping the job in 10 s",
        "[3]<stderr>: rank 3: RankFailure: broadcast: rank 2 (pid 29448) died; ranks 0, 2 are gone (the process ended)",
    ]
    report = _Report()
    for line in lines:
        report.read(line)
    assert report.summary() == ("rank 2 on simhost1 was killed by signal 9 (MPI aborted rank 0 after it) first; "
                                "the first error found ranks 0, 2 gone")
    plain = _Report()  # no abort by MPI: the first guard line, as it came
    for line in lines[2:]:
        plain.read(line)
    assert plain.summary().startswith("rank 0 on simhost0 exited with code 143 first")


# A rank raises at its fourth step: the launcher's last line and the other rank's error name it and its exception,
# whichever rank exits first (on one host both orders come: the survivor often exits before the failed rank's
# teardown ends).
STEP_LOOP = """
    import {module}
    {api}.init()
    for step in range(10):
        if {api}.rank() == 1 and step == 3:
            raise ValueError("bad batch at step 3")
        {step}
"""
RAISES = {
    "numpy": STEP_LOOP.format(module="numpy as np, shmcomm", api="shmcomm",
                              step='shmcomm.allreduce(np.ones(4), name="grad")'),
    "jax": STEP_LOOP.format(module="jax.numpy as jnp, shmcomm.jax as sj", api="sj",
                            step='sj.allreduce(jnp.ones(4), name="grad")'),
    "torch": STEP_LOOP.format(module="torch, shmcomm.torch as hvd", api="hvd", step="""opt.zero_grad()
        model(torch.ones(8, 4)).sum().backward()
        opt.step()""").replace("hvd.init()\n", """hvd.init()
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
"""),
}
BLAMED = "shmcommrun: the job failed: rank 1 failed first (ValueError: bad batch at step 3)"


def _blame_once(api):
    run = subprocess.run([sys.executable, "-m", "shmcomm.runner", "-np", "2", sys.executable, "-c",
                          textwrap.dedent(RAISES[api])], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.stderr.splitlines()[-1] == BLAMED, run.stderr[-3000:]
    # Rank 0 raised (it noticed before the launcher stopped it) or was stopped: what it raised names rank 1's cause.
    for line in run.stderr.splitlines():
        if line.startswith("[0]<stderr>: shmcomm.vocabulary.exceptions."):
            assert re.search(r"RankFailure: .*rank 1 (\(pid \d+\) )?failed \(ValueError: bad batch at step 3\)\Z",
                             line), line
    assert "also failed: rank 1" not in run.stderr, run.stderr[-3000:]


def _blamed_each_time(api, runs):
    if api == "jax":
        pytest.importorskip("jax")
    for _ in range(runs):
        _blame_once(api)


@pytest.mark.parametrize("api", ["numpy", "torch", "jax"])
def test_the_rank_that_raised_is_named_whichever_exits_first(api):
    _blamed_each_time(api, 2 if api == "numpy" else 1)  # the second tier repeats each


# Rank 1's bad root is its own error; rank 0's PeerArgumentError, raised at its next collective (a broadcast's root
# returns once it has published) and uncaught, only reports it. Rank 1 leaves later, so a report counted as rank 0's
# own cause would come first and be blamed.
BAD_ARGUMENT = """
    import signal, time, numpy as np, shmcomm
    shmcomm.init()
    if shmcomm.rank() == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # still here to raise when the launcher stops the job
        try:
            shmcomm.broadcast(np.ones(3), root_rank=7)
        except shmcomm.InvalidArgumentError:
            time.sleep(1)
            raise
    shmcomm.broadcast(np.ones(3), root_rank=0)
    shmcomm.barrier()
"""


def test_a_peers_bad_argument_is_blamed_on_that_peer():
    run = subprocess.run([sys.executable, "-m", "shmcomm.runner", "-np", "2", sys.executable, "-c",
                          textwrap.dedent(BAD_ARGUMENT)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "[0]<stderr>: shmcomm.vocabulary.exceptions.PeerArgumentError: " in run.stderr, run.stderr[-3000:]
    last = run.stderr.splitlines()[-1]
    assert last.startswith("shmcommrun: the job failed: rank 1 failed first (InvalidArgumentError: "), last
    assert "root rank" in last, last


@pytest.mark.long
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("api", ["numpy", "torch", "jax"])
def test_the_rank_that_raised_is_named_20_times(api):
    _blamed_each_time(api, 20)


# A rank that raises exits without its teardown tracing every live object (failure_reports): its open files must
# still hold what it wrote, even one kept only by a reference cycle, which only a garbage collection would flush.
CYCLE_KEEPS_A_FILE = """
    import atexit, gc, signal, sys, numpy as np, shmcomm
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 raises its RankFailure, not stopped by the launcher
    class Log:
        def __init__(self, path):
            self.me, self.file = self, open(path, "w")
    shmcomm.init()
    log = Log(sys.argv[1] + str(shmcomm.rank()))
    log.file.write("written before the failure\\n")
    atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, flush=True))
    if shmcomm.rank() == 1:
        raise ValueError("bad batch")
    shmcomm.allreduce(np.ones(4), name="grad")
"""


def test_a_failed_ranks_files_keep_what_it_wrote(tmp_path):
    run = subprocess.run([sys.executable, "-m", "shmcomm.runner", "-np", "2", sys.executable, "-c",
                          textwrap.dedent(CYCLE_KEEPS_A_FILE), str(tmp_path / "log")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.stderr.splitlines()[-1] == "shmcommrun: the job failed: rank 1 failed first (ValueError: bad batch)"
    for rank in (0, 1):  # both raised: rank 0's RankFailure is uncaught too
        assert f"[{rank}]<stdout>: frozen True" in run.stdout, run.stdout  # the fast exit was taken
        assert (tmp_path / f"log{rank}").read_text() == "written before the failure\n"
