# SPDX-License-Identifier: Apache-2.0
"""Multi-host launches on simulated hosts (network namespaces on a private bridge, one host name each): MPI
groups ranks by host and talks across the bridge, shmcommrun starts ranks across hosts with the job's
environment and fails when a rank fails, and no namespace, bridge or veth outlives a test.

Needs root, iproute2 and util-linux; skipped with the reason elsewhere, unless SHMCOMM_REQUIRE_SIMHOSTS=1 (CI),
and failed, not skipped, wherever those are there but the hosts cannot be made. Every subprocess is bounded."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from shmcomm.runner.mpi_launch import find_mpiexec  # noqa: E402
from shmcomm.testing import simhosts  # noqa: E402

JOB_TIMEOUT = 60
MPIEXEC = find_mpiexec()  # the mpich wheel's, a dependency: tests that need it fail without it
# CI's machines can make simulated hosts; there a missing prerequisite fails the tests instead of skipping them.
REQUIRE_SIMHOSTS = os.environ.get("SHMCOMM_REQUIRE_SIMHOSTS") == "1"


def job_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHMCOMM_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run(args, timeout=JOB_TIMEOUT, **extra_env):
    return subprocess.run([str(a) for a in args], cwd=REPO, env=job_env(**extra_env), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def python_program(source):
    return [sys.executable, "-c", textwrap.dedent(source)]


def leftovers(suffix):
    """What of the instance with this suffix still exists."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    found = [n for n in names if n.startswith(f"{simhosts.NAME_PREFIX}-{suffix}-")]
    found += re.findall(rf"{simhosts.NAME_PREFIX}[bv]{suffix}\d*", links)
    found += [p for p in (os.path.join(simhosts.STATE_DIR, suffix),) if os.path.exists(p)]
    if os.path.isdir(simhosts.NETNS_CONFIG_DIR):
        found += [n for n in os.listdir(simhosts.NETNS_CONFIG_DIR) if suffix in n]
    return found


def processes_in(namespace):
    return subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10).stdout.split()


def open_hosts(n_hosts, **options):
    """Simulated hosts, or a skip where this machine lacks what they need (root, `ip`, `tc`, `unshare`) and
    SHMCOMM_REQUIRE_SIMHOSTS is not 1. Where it has it all, a failure to make them fails the test: a broken `ip` or
    `tc` command must not look like a skip."""
    missing = simhosts.missing_prerequisite()
    if missing is not None and not REQUIRE_SIMHOSTS:
        pytest.skip(missing)
    return simhosts.SimulatedHosts(n_hosts, **options).__enter__()


@pytest.fixture(scope="module")
def sim():
    hosts = open_hosts(2)
    simhosts.cleanup_stale()  # what killed runs left; the instance just made has a live owner and stays
    try:
        yield hosts
    finally:
        hosts.close()
        assert leftovers(hosts.suffix) == []


def rank_lines(output):
    """{rank: [lines]} from shmcommrun's prefixed stdout."""
    ranks = {}
    for line in output.splitlines():
        match = re.match(r"\[(\d+)\]<stdout>: (.*)\Z", line)
        if match:
            ranks.setdefault(int(match.group(1)), []).append(match.group(2))
    return ranks


def rank_json(output):
    return {rank: json.loads(lines[0]) for rank, lines in rank_lines(output).items()}


PLACEMENT_AND_ALLREDUCE = """
    import json, os, socket
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    data = np.full(1 << 20, comm.rank + 1, dtype=np.float32)
    comm.Allreduce(MPI.IN_PLACE, data, MPI.SUM)
    report = {"rank": comm.rank, "processor": MPI.Get_processor_name(), "hostname": socket.gethostname(),
              "local_size": comm.Split_type(MPI.COMM_TYPE_SHARED).size,
              "allreduce_ok": bool((data == comm.size * (comm.size + 1) / 2).all())}
    os.write(1, (json.dumps(report) + "\\n").encode())  # one write: hydra forwards whatever each read returns
"""


def test_mpi_ranks_group_by_simulated_host_and_talk_over_the_bridge(sim):
    assert MPIEXEC, "no mpiexec beside Python or on PATH: the mpich wheel, a dependency, provides it"
    before = sim.link_bytes()
    result = run([MPIEXEC, *sim.mpiexec_args(2), *python_program(PLACEMENT_AND_ALLREDUCE)])
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = {r["rank"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, info in ranks.items():
        expected = sim.hosts[rank // 2]
        assert info["hostname"] == expected and info["processor"] == expected, info
        assert info["local_size"] == 2 and info["allreduce_ok"], info
    # 4 MiB per rank were reduced across hosts: that much must have crossed each host's link, not shared memory.
    sent = [after[0] - start[0] for start, after in zip(before, sim.link_bytes())]
    assert all(count >= 4 << 20 for count in sent), sent


ENVIRONMENT_REPORT = """
    import json, os, socket
    print(json.dumps({"host": socket.gethostname(), **{k: v for k, v in os.environ.items()
                      if k.startswith(("SHMCOMM_", "HOROVOD_", "OMP_NUM_THREADS"))}}), flush=True)
"""


def test_shmcommrun_starts_ranks_across_hosts_with_the_job_environment(sim):
    result = run([sys.executable, "-m", "shmcomm.runner", *sim.shmcommrun_args(2), "--verbose", "--timeout", "7",
                  "--fusion-threshold-mb", "2", "--cycle-time-ms", "3", *python_program(ENVIRONMENT_REPORT)],
                 SHMCOMM_RANK="99", HOROVOD_SIZE="99")  # an enclosing job's identity must not leak in
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mpiexec command:" in result.stderr and "-launcher-exec" in result.stderr
    token = re.match(r"shmcommrun: 4 ranks on 2 hosts, job ([0-9a-f]{8})\n", result.stderr).group(1)
    ranks = rank_json(result.stdout)
    assert sorted(ranks) == [0, 1, 2, 3], result.stdout
    tokens = {env["SHMCOMM_JOB_TOKEN"] for env in ranks.values()}
    assert len(tokens) == 1 and re.fullmatch(token + r"[0-9a-f]{24}", tokens.pop())
    for rank, env in ranks.items():
        assert env["host"] == sim.hosts[rank // 2]
        assert env["SHMCOMM_LAUNCHER"] == "mpi" and env["SHMCOMM_TIMEOUT"] == "7"
        assert env["SHMCOMM_FUSION_THRESHOLD"] == env["HOROVOD_FUSION_THRESHOLD"] == str(2 << 20)
        assert env["SHMCOMM_CYCLE_TIME"] == env["HOROVOD_CYCLE_TIME"] == "3"
        assert "SHMCOMM_RANK" not in env and "HOROVOD_SIZE" not in env
        # The simulated hosts share this machine's cores: the 4 ranks share them out (the launcher's own rule, cores
        # over ranks per host, is test_launcher_flags' business)
        assert env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 4))


@pytest.mark.long
def test_a_failing_rank_fails_the_job_promptly(sim):
    failing = """
        import os, sys, time
        if os.environ["PMI_RANK"] == "3":
            segment = "/dev/shm/shmcomm-%s_h1-1" % os.environ["SHMCOMM_JOB_TOKEN"]
            open(segment, "w").close()  # as a rank that dies before unlinking its host's segment
            print(segment, flush=True)
            sys.exit(5)
        time.sleep(60)
    """
    start = time.monotonic()
    result = run([sys.executable, "-m", "shmcomm.runner", *sim.shmcommrun_args(2), *python_program(failing)])
    assert result.returncode != 0, result.stdout + result.stderr
    assert time.monotonic() - start < 30, "the other ranks were not stopped"
    assert "rank 3 on simhost1 exited with code 5" in result.stderr
    segment = rank_lines(result.stdout)[3][0]
    assert segment.startswith("/dev/shm/shmcomm-") and not os.path.exists(segment)
    deadline = time.monotonic() + 10
    while any(processes_in(ns) for ns in sim.namespaces):  # hydra stops the sleeping ranks too
        assert time.monotonic() < deadline, "ranks still run after the job failed"
        time.sleep(0.1)


RAISES = """
    import os, signal, stat, sys, time, shmcomm
    shmcomm.init()
    if shmcomm.rank() == 3:
        reports = os.environ["SHMCOMM_ERROR_REPORT_DIR"]
        if sys.argv[1] == "cut":
            os.kill(os.getppid(), signal.SIGSTOP)  # its guard, which forwards its stderr: none of it gets out
            while open("/proc/%d/stat" % os.getppid()).read().rpartition(") ")[2][:1] != "T":
                time.sleep(0.01)  # the signal is on its way, not yet taken
        raise RuntimeError("distinctive-message-1234 (reports in %s, mode %o)"
                           % (reports, stat.S_IMODE(os.stat(reports).st_mode)))
    time.sleep(60)
"""


def test_unfinished_lines_and_progress_bars_reach_the_output_as_they_are_written(sim, tmp_path):
    from test_runner import assert_output_as_written

    assert_output_as_written(tmp_path, *sim.shmcommrun_args(1))


@pytest.mark.parametrize("how", ["forwarded", "cut"])
def test_an_uncaught_exception_reaches_the_launchers_output_once(sim, how):
    """MPI_Abort, which the rank's excepthook calls, has hydra kill the job while the traceback may still be on its
    way to the launcher; the launcher prints the copy the rank saved where it did not come through (always, when
    the rank's guard is stopped and forwards nothing), and once only where it did."""
    result = run([sys.executable, "-m", "shmcomm.runner", *sim.shmcommrun_args(2), *python_program(RAISES), how])
    assert result.returncode != 0, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    raised = [line for line in lines if line.startswith("[3]<stderr>: RuntimeError: distinctive-message-1234 ")]
    assert len(raised) == 1, result.stderr
    assert lines[lines.index(raised[0]) - 2] == "[3]<stderr>: Traceback (most recent call last):", result.stderr
    reports, mode = re.search(r"\(reports in (\S+), mode (\d+)\)", raised[0]).groups()
    assert mode == "700" and not os.path.exists(reports), raised[0]
    if how == "cut":
        assert "shmcommrun: rank 3 died of an uncaught exception, whose traceback MPI_Abort cut off" in result.stderr
    summary = next(line for line in lines if "mpiexec exited with code" in line)
    assert "rank 3 " in summary, result.stderr


def test_the_launcher_prints_the_saved_reports_that_did_not_come_through(tmp_path, capfd):
    """A saved report whose last lines came through the rank's stderr is not printed again; one that came through in
    part, or only on stdout, is printed whole with its rank; a report still being written is left alone."""
    from shmcomm.runner.mpi_launch import _Report

    traceback = ["Traceback (most recent call last):", '  File "job.py", line 3, in <module>', "ValueError: bad"]
    for rank in (1, 2, 3):
        (tmp_path / f"rank{rank}").write_text("\n".join(traceback) + "\n")
    (tmp_path / "rank4.partial").write_text("Traceback (most recent call last):\n")  # never renamed: not whole
    report = _Report()
    for line in ["[1]<stderr>: something before\n"] + [f"[1]<stderr>: {line}\n" for line in traceback] + \
            [f"[2]<stderr>: {traceback[0]}\n", "[3]<stdout>: " + traceback[-1] + "\n",
             "[1]<stderr>: Abort(1) on node 1 (rank 1 in comm 0): application called MPI_Abort\n"]:
        report.read(line)
    report.print_lost_reports(str(tmp_path))
    printed = capfd.readouterr().err.splitlines()
    assert [line for line in printed if line.startswith("shmcommrun: ")] == [
        f"shmcommrun: rank {rank} died of an uncaught exception, whose traceback MPI_Abort cut off from the job's "
        "output; the rank saved it:" for rank in (2, 3)]
    assert [line for line in printed if not line.startswith("shmcommrun: ")] == \
        [f"[{rank}]<stderr>: {line}" for rank in (2, 3) for line in traceback]
    assert report.summary() == "ranks 1, 2, 3 died of uncaught exceptions"


def test_a_rank_saves_its_report_privately_and_only_where_asked(tmp_path, monkeypatch):
    from shmcomm import RankFailure
    from shmcomm.startup import failure_reports

    monkeypatch.setenv("SHMCOMM_ERROR_REPORT_DIR", str(tmp_path))
    error = ValueError("\u00e9")
    text = failure_reports.save_uncaught(5, ValueError, error, None)
    assert sorted(os.listdir(tmp_path)) == ["rank5", "rank5.cause"]
    assert all((tmp_path / name).stat().st_mode & 0o777 == 0o600 for name in os.listdir(tmp_path))
    assert text == "ValueError: \u00e9\n" and (tmp_path / "rank5").read_bytes() == text.encode()
    assert failure_reports.cause(5) == "ValueError: \u00e9" and failure_reports.first_cause(str(tmp_path)) == (5, text[:-1])
    failure_reports.save_uncaught(6, RankFailure, RankFailure("rank 5 failed", 5), None)  # a peer's failure: no cause
    assert sorted(os.listdir(tmp_path)) == ["rank5", "rank5.cause", "rank6"]
    monkeypatch.setenv("SHMCOMM_ERROR_REPORT_DIR", str(tmp_path / "elsewhere"))  # as on a remote host: no such place
    failure_reports.save_uncaught(7, ValueError, error, None)
    assert sorted(os.listdir(tmp_path)) == ["rank5", "rank5.cause", "rank6"]


def test_teardown_kills_what_runs_inside_and_leaves_nothing():
    hosts = open_hosts(2, rate="1gbit")
    try:
        assert len(set(hosts.addresses)) == 2 and hosts.bridge_address not in hosts.addresses
        stray = subprocess.Popen([hosts.agent, "-x", hosts.hosts[1], "sleep 60"], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not processes_in(hosts.namespaces[1]):
            assert time.monotonic() < deadline, "the agent did not start the command in the namespace"
            time.sleep(0.05)
        qdiscs = subprocess.run(["tc", "qdisc", "show", "dev", hosts.veths[0]], capture_output=True, text=True,
                                timeout=10).stdout
        assert "tbf" in qdiscs
    finally:
        hosts.close()
    assert stray.wait(timeout=10) != 0
    assert leftovers(hosts.suffix) == [] and not os.path.exists(hosts.agent)


def test_host_cpus_split_this_machine():
    assert simhosts.host_cpus(2, [0, 1, 2, 3]) == ["0,1", "2,3"]
    assert simhosts.host_cpus(3, [0, 1]) == ["0", "1", "0"]
    assert simhosts.host_cpus(1, [4, 5]) == ["4,5"]
    assert simhosts.host_cpus(3, [0, 1, 2, 3]) == ["0,1", "2", "3"]
    with pytest.raises(ValueError):
        simhosts.host_cpus(2, [])


def test_hosts_with_their_own_cpus_run_there():
    hosts = open_hosts(2, own_cpus=True)
    try:
        for host, cpus in zip(hosts.hosts, hosts.cpus):
            program = "'import os, socket; print(socket.gethostname(), sorted(os.sched_getaffinity(0)))'"
            seen = subprocess.run([hosts.agent, host, sys.executable, "-c", program], stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=30)
            assert seen.returncode == 0, seen.stderr
            expected = [host, str(sorted(int(c) for c in cpus.split(",")))]
            assert seen.stdout.strip().split(None, 1) == expected, seen.stdout
    finally:
        hosts.close()


OWNER = """
    import os, sys, time
    from shmcomm.testing.simhosts import SimulatedHosts
    hosts = SimulatedHosts(1).__enter__()
    print(hosts.suffix, flush=True)
    if sys.argv[1] == "crash":
        os._exit(3)  # no teardown at all, as after SIGKILL
    time.sleep(60)
"""


def start_owner(mode):
    open_hosts(1).close()  # skips here, with the reason, where namespaces cannot be made
    owner = subprocess.Popen(python_program(OWNER) + [mode], cwd=REPO, env=job_env(), stdout=subprocess.PIPE,
                             text=True)
    return owner, owner.stdout.readline().strip()


def test_sigterm_tears_the_hosts_down():
    owner, suffix = start_owner("wait")
    try:
        assert leftovers(suffix)
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(timeout=20) == 128 + signal.SIGTERM
        assert leftovers(suffix) == []
    finally:
        owner.kill()
        owner.wait(timeout=10)


def test_cleanup_stale_removes_what_a_killed_run_left():
    owner, suffix = start_owner("crash")
    owner.wait(timeout=20)
    assert leftovers(suffix), "the crashed owner left nothing to clean up"
    assert suffix in simhosts.cleanup_stale()
    assert leftovers(suffix) == []


def local_agent(tmp_path):
    """An ssh stand-in that runs hydra's proxy here, as ssh to another host would, and logs its arguments: the
    launcher's multi-host path without namespaces. Returns the agent and its log."""
    log = tmp_path / "agent.log"
    agent = tmp_path / "agent"
    agent.write_text(f'#!/bin/sh\necho "$@" >> {log}\n'
                     'while [ $# -gt 0 ]; do case "$1" in -p) shift 2;; -*) shift;; *) break;; esac; done\n'
                     'shift; exec /bin/sh -c "$*"\n')
    agent.chmod(0o755)
    return agent, log


def test_an_unreachable_host_is_named_before_mpiexec_starts(tmp_path):
    agent = tmp_path / "agent"
    agent.write_text('#!/bin/sh\necho "far-b: no route to host" >&2\nexit 255\n')
    agent.chmod(0o755)
    result = run([sys.executable, "-m", "shmcomm.runner", "-np", 2, "-H", "far-b:2", "--launcher-agent", agent,
                  "true"])
    assert result.returncode == 1
    assert result.stderr == "shmcommrun: error: cannot reach host far-b: far-b: no route to host\n"


def test_hostfile_ssh_port_and_interface_reach_hydra(tmp_path):
    agent, log = local_agent(tmp_path)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts\nfar-a slots=1\n\nfar-b slots=1  # the second\n")
    result = run([sys.executable, "-m", "shmcomm.runner", "-np", 2, "--hostfile", hostfile, "-p", 2222,
                  "--network-interfaces", "lo", "--verbose", "--launcher-agent", agent,
                  *python_program('import os; print("ok", os.environ["SHMCOMM_LAUNCHER"])')])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "-iface lo -genv UCX_NET_DEVICES lo -genv FI_TCP_IFACE lo" in result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>: ok mpi", "[1]<stdout>: ok mpi"]
    calls = log.read_text().splitlines()
    checks = [call for call in calls if call.endswith(" true")]  # each host reached before mpiexec starts
    assert sorted(checks) == ["-p 2222 far-a true", "-p 2222 far-b true"]
    calls = [call for call in calls if call not in checks]
    assert len(calls) == 2 and all(" -p 2222 " in call for call in calls)
    assert {call.split(" -p 2222 ")[1].split()[0] for call in calls} == {"far-a", "far-b"}


def test_mpi_args_reach_mpiexec_last(tmp_path):
    """--mpi-args goes to mpiexec as it is, after the launcher's own options (so that it can override them)."""
    agent, _ = local_agent(tmp_path)
    result = run([sys.executable, "-m", "shmcomm.runner", "-np", 2, "-H", "far-a:1,far-b:1", "--verbose",
                  "--launcher-agent", agent, "--mpi-args", "-genv MPI_ARGS_MARK 'two words' -genv PYTHONUNBUFFERED 0",
                  *python_program('import os; print(os.environ.get("MPI_ARGS_MARK"), os.environ["PYTHONUNBUFFERED"])')])
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>: two words 0", "[1]<stdout>: two words 0"]
    command = next(line for line in result.stderr.splitlines() if "mpiexec command:" in line)
    assert "-genv MPI_ARGS_MARK 'two words' -genv PYTHONUNBUFFERED 0 " + sys.executable in command, command


def test_bad_host_lists_are_usage_errors(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("far-a slots=two\n")
    for args in (["-np", 4, "-H", "far-a:1,far-b:1"], ["-np", 1, "--hostfile", hostfile],
                 ["-np", 1, "-H", "far-a:1", "--hostfile", hostfile]):
        result = run([sys.executable, "-m", "shmcomm.runner", *args, "true"], timeout=30)
        assert result.returncode == 2, (args, result.stderr)
