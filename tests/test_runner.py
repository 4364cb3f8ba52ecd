# SPDX-License-Identifier: Apache-2.0
"""Tests of the shmcommrun launcher, run as a subprocess with small inline rank programs (no C core needed)."""

import json
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 60  # for any one launcher run; the tests that measure stopping speed check their own bound
IDENTITY = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")


def launcher_env(**changes):
    """The test's environment less any shmcomm job's identity, with `changes` (None: unset)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for name in list(env):  # a test run under shmcommrun must not leak its own identity into these checks
        if name.startswith(("SHMCOMM_", "HOROVOD_")):
            del env[name]
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def launcher_args(*args):
    return [sys.executable, "-m", "shmcomm.runner", *map(str, args)]


def rank_program(source):
    """The command of a rank that runs this Python source."""
    return [sys.executable, "-c", textwrap.dedent(source)]


def launch(*args, timeout=TIMEOUT, env=None):
    """Runs the launcher; env: changes to its environment (launcher_env)."""
    return subprocess.run(launcher_args(*args), cwd=REPO, env=launcher_env(**(env or {})), capture_output=True,
                          text=True, timeout=timeout)


def rank_lines(output, label="stdout"):
    """{rank: [lines]} from the launcher's prefixed output."""
    lines = {}
    for line in output.splitlines():
        match = re.match(rf"\[(\d+)\]<{label}>: (.*)\Z", line)
        if match:
            lines.setdefault(int(match.group(1)), []).append(match.group(2))
    return lines


class LiveLauncher:
    """A launcher run whose stdout the test reads while it runs, to act once the ranks are up."""

    def __init__(self, *args):
        self.process = subprocess.Popen(launcher_args(*args), cwd=REPO, env=launcher_env(), text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines = {"stdout": queue.Queue(), "stderr": queue.Queue()}
        self.stdout = []
        self.stderr = []
        threading.Thread(target=self._read, args=(self.process.stdout, self.stdout, "stdout"), daemon=True).start()
        self.stderr_reader = threading.Thread(target=self._read, args=(self.process.stderr, self.stderr, "stderr"),
                                              daemon=True)
        self.stderr_reader.start()

    def _read(self, pipe, sink, label):
        for line in pipe:
            sink.append(line)
            self.lines[label].put(line)

    def wait_for_lines(self, containing, count, timeout=30, stream="stdout"):
        deadline = time.monotonic() + timeout
        seen = 0
        while seen < count:
            try:
                line = self.lines[stream].get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.process.kill()
                pytest.fail(f"only {seen} of {count} lines with {containing!r}; {stream}: "
                            f"{''.join(getattr(self, stream))}")
            seen += containing in line

    def finish(self, timeout=TIMEOUT):
        try:
            returncode = self.process.wait(timeout=timeout)
        finally:
            self.process.kill()
        self.stderr_reader.join(5)
        return returncode, "".join(self.stdout), "".join(self.stderr)


def test_env_contract():
    keys = [f"{prefix}_{name}" for prefix in ("SHMCOMM", "HOROVOD") for name in IDENTITY]
    keys += ["SHMCOMM_JOB_TOKEN", "PYTHONUNBUFFERED"]
    program = rank_program(f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))")
    tokens = []
    for _ in range(2):
        result = launch("-np", 3, *program)
        assert result.returncode == 0, result.stderr
        envs = {rank: json.loads(lines[0]) for rank, lines in rank_lines(result.stdout).items()}
        assert sorted(envs) == [0, 1, 2]
        hostname = envs[0]["SHMCOMM_HOSTNAME"]
        assert hostname
        for rank, env in envs.items():
            expected = {"RANK": rank, "SIZE": 3, "LOCAL_RANK": rank, "LOCAL_SIZE": 3, "CROSS_RANK": 0,
                        "CROSS_SIZE": 1, "HOSTNAME": hostname}
            for name, value in expected.items():
                assert env[f"SHMCOMM_{name}"] == str(value)
                assert env[f"HOROVOD_{name}"] == str(value)
            assert env["PYTHONUNBUFFERED"] == "1"
        token = envs[0]["SHMCOMM_JOB_TOKEN"]
        assert re.fullmatch(r"[0-9a-f]{32}", token)
        assert all(env["SHMCOMM_JOB_TOKEN"] == token for env in envs.values())
        tokens.append(token)
    assert tokens[0] != tokens[1]


# A torch.distributed script as torchrun would run it: nothing but the environment tells it who it is.
TORCH_DISTRIBUTED = """
    import json, os
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    x = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(x)
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")
    print(json.dumps({"sum": x.tolist(), "env": {n: os.environ[n] for n in names}}))
    dist.destroy_process_group()
"""


def test_a_plain_torch_distributed_script_runs_with_torchruns_variables():
    result = launch("-np", 3, *rank_program(TORCH_DISTRIBUTED), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = {rank: json.loads(lines[-1]) for rank, lines in rank_lines(result.stdout).items()}
    for rank, report in reports.items():
        assert report["sum"] == [6.0, 6.0, 6.0]
        assert report["env"] == {"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank),
                                 "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    assert sorted(reports) == [0, 1, 2]


def test_one_line_says_the_job_started_unless_quiet():
    program = rank_program("import os; print(os.environ['SHMCOMM_JOB_TOKEN'])")
    result = launch("-np", 2, *program)
    assert result.returncode == 0, result.stderr
    token = rank_lines(result.stdout)[0][0]
    assert result.stderr == "shmcommrun: 2 ranks on this host, job %s\n" % token[:8]
    result = launch("--quiet", "-np", 2, *program)
    assert result.returncode == 0 and result.stderr == ""


def test_output_is_prefixed_per_stream_and_keeps_a_partial_last_line():
    program = rank_program("""
        import sys
        print("first line")
        sys.stderr.write("an error line\\n")
        sys.stdout.buffer.write(b"bad byte \\xff here\\n")
        sys.stdout.write("no newline at the end")
    """)
    result = launch("-np", 2, *program)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert rank_lines(result.stdout)[rank] == ["first line", "bad byte \ufffd here", "no newline at the end"]
        assert rank_lines(result.stderr, "stderr")[rank] == ["an error line"]
    assert "<stderr>" not in result.stdout and "<stdout>" not in result.stderr


class RawLauncher:
    """A launcher run whose stdout the test reads as it comes, unfinished lines included."""

    def __init__(self, *args):
        self.process = subprocess.Popen(launcher_args(*args), cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE)
        self.out = b""
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for data in iter(lambda: os.read(self.process.stdout.fileno(), 4096), b""):
            with self._changed:
                self.out += data
                self._changed.notify_all()

    def wait_for(self, text, timeout=60):
        with self._changed:
            if not self._changed.wait_for(lambda: text.encode() in self.out, timeout):
                self.process.kill()
                pytest.fail("no %r in the launcher's output: %r" % (text, self.out))

    def finish(self):
        try:
            returncode = self.process.wait(timeout=TIMEOUT)
        finally:
            self.process.kill()
        time.sleep(0.1)
        return returncode, self.out.decode(), self.process.stderr.read().decode()


def _after(path):
    """Rank code that waits until the test has made `path` (the test saw the output before it)."""
    return "while not os.path.exists(%r): time.sleep(0.01)\n" % str(path)


def test_unfinished_lines_and_progress_bars_reach_the_output_as_they_are_written(tmp_path):
    assert_output_as_written(tmp_path, "-np", 2)


def assert_output_as_written(tmp_path, *placement):
    """Rank 0 draws a progress bar while rank 1 prints a line: each update reaches the launcher's output while the
    rank runs, and rank 1's line ends rank 0's unfinished one, which goes on under its prefix."""
    go = [tmp_path / ("go%d" % k) for k in range(3)]
    program = rank_program("""
        import os, sys, time
        rank = int(os.environ["RANK"])
        def out(text):
            sys.stdout.write(text)
            sys.stdout.flush()
        if rank == 0:
            out("\\r 10%%")
            %s
            out("\\r 50%%")
            %s
            out("\\r100%%\\n")
        else:
            %s
            out("rank 1 speaks\\n")
    """ % (_after(go[0]), _after(go[2]), _after(go[1])))
    job = RawLauncher(*placement, *program)
    job.wait_for("[0]<stdout>:  10%")  # a bar's update before its line ends, while the rank runs
    go[0].touch()
    job.wait_for("[0]<stdout>:  50%")
    go[1].touch()
    job.wait_for("rank 1 speaks\n")  # another rank's line ends the unfinished one first
    go[2].touch()
    returncode, out, err = job.finish()
    assert returncode == 0, err
    assert out == ("\r[0]<stdout>:  10%\r[0]<stdout>:  50%\n[1]<stdout>: rank 1 speaks\n"
                   "\r[0]<stdout>: 100%\n"), repr(out)


def test_a_line_cut_by_another_ranks_line_goes_on_under_its_prefix_and_keeps_no_empty_line():
    import io

    from shmcomm.runner.console import end_line, write_console

    stream = io.StringIO()
    rank = {r: ((r, "stdout"), lambda r=r: "[%d]<stdout>: " % r) for r in (0, 1)}
    for r, text in [(0, "a print() writes its text"), (1, "and its newline apart"), (0, "\n"), (1, "\n"),
                    (0, "half a line"), (1, "cut\n"), (0, " and the rest\n"), (1, "\r 10%"), (1, "\r 20%")]:
        write_console(stream, text, *rank[r])
    end_line(stream, rank[1][0])
    assert stream.getvalue() == ("[0]<stdout>: a print() writes its text\n[1]<stdout>: and its newline apart\n"
                                 "[0]<stdout>: half a line\n[1]<stdout>: cut\n[0]<stdout>:  and the rest\n"
                                 "\r[1]<stdout>:  10%\r[1]<stdout>:  20%\n")


def test_failing_rank_stops_the_others_and_sets_the_exit_code():
    program = rank_program("""
        import os, sys, time
        if os.environ["SHMCOMM_RANK"] == "1":
            time.sleep(0.5)
            sys.exit(3)
        time.sleep(60)
    """)
    started = time.monotonic()
    result = launch("-np", 4, *program)
    assert time.monotonic() - started < 15
    assert result.returncode == 3
    assert re.search(r"rank 1 \(pid \d+\) exited with code 3; stopping the other 3 ranks", result.stderr)


def test_rank_killed_by_a_signal():
    program = rank_program("""
        import os, signal, time
        if os.environ["SHMCOMM_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    started = time.monotonic()
    result = launch("-np", 2, *program)
    assert time.monotonic() - started < 15
    assert result.returncode == 137
    assert "rank 1" in result.stderr and "was killed by signal 9 (SIGKILL)" in result.stderr


def test_ranks_that_ignore_sigterm_are_killed_after_the_grace_period(tmp_path):
    ready = tmp_path / "rank1-ignores-sigterm"
    program = rank_program(f"""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.environ["SHMCOMM_RANK"] == "0":
            while not os.path.exists({str(ready)!r}):
                time.sleep(0.05)
            sys.exit(5)
        open({str(ready)!r}, "w").close()
        time.sleep(60)
    """)
    started = time.monotonic()
    result = launch("-np", 2, "--kill-grace-seconds", 0.5, *program)
    assert time.monotonic() - started < 15
    assert result.returncode == 5
    assert "SIGKILL" in result.stderr


def test_sigterm_to_the_launcher_is_forwarded_to_the_ranks():
    # The handler only notes the signal: a print inside it can land in the middle of the main thread's print to the
    # same stream, which Python refuses ("reentrant call"), and the rank then dies without its line.
    program = rank_program("""
        import signal, time
        got = []
        signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
        print("ready", flush=True)
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        if got:
            print("rank got SIGTERM", flush=True)
    """)
    launcher = LiveLauncher("-np", 3, *program)
    launcher.wait_for_lines("ready", 3)
    launcher.process.send_signal(signal.SIGTERM)
    returncode, stdout, stderr = launcher.finish(timeout=15)
    assert returncode == 143, stderr
    assert sorted(rank_lines(stdout)) == [0, 1, 2]
    assert all("rank got SIGTERM" in lines for lines in rank_lines(stdout).values())
    assert "received SIGTERM" in stderr


def test_second_ctrl_c_kills_at_once():
    program = rank_program("""
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """)
    launcher = LiveLauncher("-np", 2, "--kill-grace-seconds", 30, *program)
    launcher.wait_for_lines("ready", 2)
    started = time.monotonic()
    launcher.process.send_signal(signal.SIGINT)
    launcher.wait_for_lines("received SIGINT", 1, stream="stderr")  # the first one was taken as the first
    launcher.process.send_signal(signal.SIGINT)
    returncode, _, stderr = launcher.finish(timeout=15)
    assert time.monotonic() - started < 10
    assert returncode == 130, stderr
    assert "received SIGINT again" in stderr


def test_output_filename_writes_raw_output_per_rank(tmp_path):
    program = rank_program("""
        import os, sys
        print("out of", os.environ["SHMCOMM_RANK"])
        sys.stderr.write("err of " + os.environ["SHMCOMM_RANK"])
    """)
    result = launch("-np", 2, "--output-filename", tmp_path / "two", *program)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert (tmp_path / "two" / f"rank.{rank}" / "stdout").read_text() == f"out of {rank}\n"
        assert (tmp_path / "two" / f"rank.{rank}" / "stderr").read_text() == f"err of {rank}"

    result = launch("-np", 11, "--output-filename", tmp_path / "eleven", "sh", "-c", "echo $SHMCOMM_RANK")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "eleven").iterdir()) == [f"rank.{r:02d}" for r in range(11)]
    assert (tmp_path / "eleven" / "rank.07" / "stdout").read_text() == "7\n"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
@pytest.mark.parametrize("failing", [True, False])
def test_job_segments_are_removed_and_other_jobs_are_left_alone(failing):
    """The host segment, a process set's, and a host's across hosts (shmcomm-TOKEN-G, shmcomm-TOKEN_s1-G,
    shmcomm-TOKEN_h0-G) go; another job's stay, even one whose token starts with this job's."""
    decoy = Path(f"/dev/shm/shmcomm-{secrets.token_hex(16)}-1")
    decoy.write_bytes(b"another job's segment")
    program = rank_program(f"""
        import os, sys, time
        token, rank, size = os.environ["SHMCOMM_JOB_TOKEN"], int(os.environ["SHMCOMM_RANK"]), 3
        with open("/dev/shm/shmcomm-" + token + ["", "_s1", "_h0"][rank] + "-1", "wb") as segment:
            segment.write(b"data")
        if rank == 0:
            with open("/dev/shm/shmcomm-" + token + "x-1", "wb") as segment:  # a job whose token starts with it
                segment.write(b"another job's segment")
        print("token", token, flush=True)
        if rank == 1:
            while len([n for n in os.listdir("/dev/shm") if n.startswith("shmcomm-" + token)]) < size + 1:
                time.sleep(0.05)
            sys.exit(1 if {failing!r} else 0)
        time.sleep(60 if {failing!r} else 0)
    """)
    token = None
    try:
        result = launch("-np", 3, *program)
        assert result.returncode == (1 if failing else 0), result.stderr
        token = rank_lines(result.stdout)[0][0].split()[1]
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"shmcomm-{token}")] == [f"shmcomm-{token}x-1"]
        assert decoy.read_bytes() == b"another job's segment"
    finally:
        decoy.unlink()
        for name in os.listdir("/dev/shm"):
            if token and name.startswith(f"shmcomm-{token}x"):
                os.unlink(f"/dev/shm/{name}")


def _has(module):
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def test_each_rank_gets_its_share_of_the_cores_as_math_threads():
    cores = len(os.sched_getaffinity(0))
    program = rank_program('import os; print(os.environ["OMP_NUM_THREADS"])')
    for ranks in (1, 2, 3):
        result = launch("-np", ranks, *program, env={"OMP_NUM_THREADS": None})
        assert result.returncode == 0, result.stderr
        assert rank_lines(result.stdout) == {r: [str(max(1, cores // ranks))] for r in range(ranks)}
    result = launch("-np", 2, *program, env={"OMP_NUM_THREADS": "7"})  # set: left as it is
    assert rank_lines(result.stdout) == {0: ["7"], 1: ["7"]}


def test_a_single_host_job_never_loads_mpi():
    """Every kind of collective, the engine, shmcomm.torch and a logical grid: mpi4py is never imported and no MPI
    library is mapped. Nor is ml_dtypes, which nobody asked for: its import costs 1.3-1.5 s of CPU."""
    program = rank_program("""
        import sys, numpy as np, shmcomm
        shmcomm.init()
        shmcomm.allreduce(np.ones(300_000, np.float32))
        shmcomm.allgather(np.ones(3))
        shmcomm.synchronize(shmcomm.allreduce_async(np.ones(3), name="async"))
        shmcomm.barrier()
        if sys.argv[1:] == ["torch"]:
            import torch, shmcomm.torch as hvd
            hvd.init()
            hvd.allreduce(torch.ones(3))
        with open("/proc/self/maps") as f:
            libraries = f.read()
        print("mpi4py" in sys.modules, "libmpi" in libraries, "ml_dtypes" in sys.modules, flush=True)
    """)
    for options, ranks, extra in ((["-np", 2], 2, ["torch"] if _has("torch") else []),
                                  (["-np", 4, "--torus-grid", "2x2"], 4, [])):
        result = launch(*options, *program, *extra)
        assert result.returncode == 0, result.stderr
        assert rank_lines(result.stdout) == {r: ["False False False"] for r in range(ranks)}, (options, result.stdout)


def test_bad_host_lists_are_refused_and_localhost_stays_local(tmp_path):
    # Other hosts go through mpiexec (tests/test_simhosts.py); malformed lists and too few slots are usage errors.
    result = launch("-np", 4, "-H", "localhost:1,some-other-host:1", "true")
    assert result.returncode == 2 and "slots" in result.stderr
    assert launch("-np", 2, "-H", "localhost:x", "true").returncode == 2
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# local only\nlocalhost slots=2\n")
    # This host's names start the ranks here, as without -H: no mpiexec, the local launcher's identity.
    program = rank_program('import os; print(os.environ.get("SHMCOMM_LAUNCHER"), os.environ.get("SHMCOMM_RANK"))')
    for hosts in (["--hostfile", hostfile], ["-H", "localhost:4"]):
        result = launch("-np", 2, *hosts, *program)
        assert result.returncode == 0, result.stderr
        assert rank_lines(result.stdout) == {0: ["None 0"], 1: ["None 1"]}, result.stdout
        assert "mpiexec" not in result.stderr


def test_command_not_found_exits_127():
    result = launch("-np", 2, "shmcomm-no-such-command-xyz")
    assert result.returncode == 127
    assert "shmcomm-no-such-command-xyz" in result.stderr and "not found" in result.stderr


@pytest.mark.parametrize("args", [[], ["true"], ["-np", "0", "true"], ["-np", "2"],
                                  ["-np", "2", "--torus-grid", "2by1", "true"],
                                  ["-np", "2", "--allreduce-algo", "tree", "true"]])
def test_usage_errors_exit_2(args):
    result = launch(*args)
    assert result.returncode == 2
    assert "usage:" in result.stderr


def test_tunable_flags_reach_the_ranks_env():
    flags = ["--fusion-threshold-mb", "1.5", "--cycle-time-ms", "3.5", "--cache-capacity", "64",
             "--timeline-filename", "/tmp/timeline.json", "--timeline-mark-cycles", "--no-stall-check",
             "--stall-check-warning-time-seconds", "30", "--stall-check-shutdown-time-seconds", "90",
             "--log-level", "debug", "--start-timeout", "20", "--timeout", "40", "--allreduce-algo", "Torus",
             "--torus-grid", "2x1", "--torus-small-bytes", "4096"]
    expected = {"FUSION_THRESHOLD": str(int(1.5 * 1024 * 1024)), "CYCLE_TIME": "3.5", "CACHE_CAPACITY": "64",
                "TIMELINE": "/tmp/timeline.json", "TIMELINE_MARK_CYCLES": "1", "STALL_CHECK_DISABLE": "1",
                "STALL_CHECK_TIME_SECONDS": "30", "STALL_SHUTDOWN_TIME_SECONDS": "90", "LOG_LEVEL": "DEBUG",
                "ALLREDUCE_ALGO": "torus", "TORUS_GRID": "2x1", "TORUS_SMALL_BYTES": "4096"}
    program = rank_program("import json, os; print(json.dumps(dict(os.environ)))")
    result = launch("-np", 2, *flags, *program)
    assert result.returncode == 0, result.stderr
    for lines in rank_lines(result.stdout).values():
        env = json.loads(lines[0])
        for name, value in expected.items():
            assert env[f"SHMCOMM_{name}"] == value
            assert env[f"HOROVOD_{name}"] == value
        assert env["SHMCOMM_START_TIMEOUT"] == "20" and env["SHMCOMM_TIMEOUT"] == "40"


def test_the_launcher_offers_the_algorithms_the_library_knows():
    from shmcomm.env import ALGORITHMS
    from shmcomm.runner.cli import ALLREDUCE_ALGORITHMS

    assert ALLREDUCE_ALGORITHMS == ALGORITHMS


def test_orphaned_mpi_segments_are_removed_but_not_live_or_older_ones(tmp_path):
    from shmcomm.runner.cleanup import remove_orphaned_mpi_segments

    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    (proc / "123").mkdir(parents=True)
    # What counts is a file's ctime, which nothing can set back (os.utime moves it to now) and which the kernel takes
    # from a clock that may lag time.time() by a tick: hence the pauses around the job's start.
    older = shm / "mpich_shm_old_0"
    older.write_bytes(b"x")  # made before the job started
    time.sleep(0.05)
    since = time.time()
    time.sleep(0.05)
    orphan, live, other = shm / "mpich_shm_dead_0", shm / "mpich_shm_live_0", shm / "shmcomm-notmpi"
    channels = shm / "mpich_vci_dead_0"
    for f in (orphan, live, other, channels):
        f.write_bytes(b"x")  # made during the job
    # A live process maps `live` (as /proc/PID/maps lists it); nothing maps `orphan`.
    (proc / "123" / "maps").write_text("7f0000000000-7f0000001000 rw-s 00000000 00:1a 42    %s\n"
                                       "7f0000002000-7f0000003000 rw-p 00000000 00:00 0 \n" % live)
    assert remove_orphaned_mpi_segments(since, str(shm), str(proc)) == ["mpich_shm_dead_0", "mpich_vci_dead_0"]
    assert sorted(os.listdir(shm)) == ["mpich_shm_live_0", "mpich_shm_old_0", "shmcomm-notmpi"]


def test_a_jobs_mpi_segments_are_found_by_the_world_its_ranks_name(tmp_path):
    from shmcomm.testing import mpi_segments

    maps = tmp_path / "maps"
    maps.write_text("7f0000000000-7f0000001000 rw-s 00000000 00:1a 42    /dev/shm/mpich_shm_9a3f_0 (deleted)\n"
                    "7f0000002000-7f0000003000 rw-s 00000000 00:1a 43    /dev/shm/mpich_vci_9a3f_0\n"
                    "7f0000004000-7f0000005000 rw-p 00000000 00:00 0 \n"
                    "7f0000006000-7f0000007000 r-xp 00000000 08:01 7    /usr/lib/libmpi.so.12\n")
    assert mpi_segments.worlds(str(maps)) == ["9a3f"]
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("mpich_shm_9a3f_1", "mpich_vci_9a3f_0", "mpich_shm_9a3f0_0", "mpich_shm_77_0", "shmcomm-9a3f-1"):
        (shm / name).write_bytes(b"x")
    # Another world whose id starts with this one's is not this job's.
    assert mpi_segments.left(["9a3f"], str(shm)) == ["mpich_shm_9a3f_1", "mpich_vci_9a3f_0"]
    assert mpi_segments.left([], str(shm)) == []


def test_a_failed_jobs_mpi_segment_is_removed_once_its_last_rank_lets_go(tmp_path):
    """After a failed job its last ranks may still be exiting: a segment they still map is looked at again until
    linger_s has passed, and removed once nothing maps it; without lingering it stays."""
    import threading

    from shmcomm.runner.cleanup import remove_orphaned_mpi_segments

    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    (proc / "77").mkdir(parents=True)
    since = time.time()
    time.sleep(0.05)
    segment = shm / "mpich_shm_exiting_0"
    segment.write_bytes(b"x")
    maps = proc / "77" / "maps"
    maps.write_text("7f0000000000-7f0000001000 rw-s 00000000 00:1a 42    %s\n" % segment)
    assert remove_orphaned_mpi_segments(since, str(shm), str(proc)) == [] and segment.exists()
    exits = threading.Timer(0.3, maps.write_text, ("",))  # the rank lets go of it
    exits.start()
    started = time.monotonic()
    assert remove_orphaned_mpi_segments(since, str(shm), str(proc), linger_s=10) == ["mpich_shm_exiting_0"]
    assert not segment.exists() and time.monotonic() - started < 5
    exits.join()
