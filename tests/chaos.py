# SPDX-License-Identifier: Apache-2.0
"""Chaos: jobs of 4 ranks, started by shmcommrun, in which one random rank is killed (SIGKILL) or stopped (SIGSTOP)
at a random moment of a random phase: init, collectives of every kind, the engine's negotiation (asynchronous
operations), holding a Soft Memory Box lock, shutdown. Each run checks that every surviving rank raised an error
naming the victim within 10 s (SIGKILL) or SHMCOMM_TIMEOUT + 5 s (SIGSTOP), or finished its shutdown; that the
launcher exited non-zero and its output names the victim; that nothing of the job is left in /dev/shm (its segments,
process sets' included, and MPICH's); and that no process of it is left.

    python tests/chaos.py [--runs 50] [--first-run 0] [--signal KILL|STOP] [--hosts 1|2] [--seed N]

prints one line per run and a summary (with the median and largest time from the signal to the last survivor's error
and to the launcher's exit), and exits non-zero if any run failed. Run i of a campaign depends only on --seed and i,
so a campaign can run in chunks (--first-run 0 --runs 10, --first-run 10 --runs 10, ...). --hosts 2 runs across two
simulated hosts (shmcomm/testing/simhosts.py; needs root and network namespaces); there the launcher gives the
survivors --kill-grace-seconds to report before hydra stops the job.

The job's ranks ignore SIGTERM, so that the launcher's stop (SIGTERM, then SIGKILL after its grace period) does not
end them before they say what they raised (shmcomm.testing.outcomes)."""
import argparse
import faulthandler
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("init", "collectives", "negotiation", "box_lock", "shutdown")
RANKS = 4
TIMEOUT_S = 3.0          # SHMCOMM_TIMEOUT of the jobs: a stopped rank is named within this
START_TIMEOUT_S = 4.0    # SHMCOMM_START_TIMEOUT: a rank killed before it attached is named within this
KILL_BOUND_S = 10.0      # a killed rank is named within this
STOP_MARGIN_S = 5.0      # a stopped rank is named within TIMEOUT_S + this
GRACE_S = 10.0  # --kill-grace-seconds: the survivors' time to report, from the first failure (the issue's 10 s)


# ---- the job (python tests/chaos.py job DIR PHASE) ----

def job(directory, phase):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The controller asks a survivor that has not raised near the bound for its threads' stacks (a post-mortem).
    faulthandler.register(signal.SIGUSR1, open(os.path.join(directory, "stack.%d" % os.getpid()), "w"))
    rank = int(os.environ.get("SHMCOMM_RANK") or os.environ.get("PMI_RANK") or -1)
    _mark(directory, "pid.%d" % os.getpid(), "")
    _mark(directory, "token", os.environ.get("SHMCOMM_JOB_TOKEN", ""))
    import numpy as np

    import shmcomm
    from shmcomm.testing import mpi_segments, outcomes

    try:
        shmcomm.init(engine=phase == "negotiation")
        rank = shmcomm.rank()
        _mark(directory, "rank.%d" % rank, str(os.getpid()))
        _mark(directory, "mpi.%d" % os.getpid(), " ".join(mpi_segments.worlds()))
        n = shmcomm.size()
        if phase == "box_lock":
            box = shmcomm.SoftMemoryBox("chaos", shape=(1024,), create=None)
        step = 0
        while True:
            step += 1
            if phase == "shutdown" and step == 20:
                _mark(directory, "shutdown.%d" % rank, "")
                shmcomm.shutdown()
                return 0
            if phase == "box_lock":
                with box.locked():
                    _mark(directory, "locked.%d" % rank, "")
                    box.write(np.full(1024, rank, np.float32))
                    time.sleep(0.002)
                shmcomm.barrier()
            elif phase == "negotiation":
                handles = [shmcomm.allreduce_async(np.ones(64 + i, np.float32), name="g%d" % i) for i in range(8)]
                handles.append(shmcomm.broadcast_async(np.ones(16), root_rank=step % n, name="b"))
                for h in handles:
                    shmcomm.synchronize(h)
            else:
                _one_of_each(shmcomm, np, n, step)
    except shmcomm.ShmCommError as error:
        _mark(directory, "mpi.%d" % os.getpid(), " ".join(mpi_segments.worlds()))  # MPI may have started
        outcomes.record(directory, rank, error, 0.0)  # seconds: the monotonic clock, shared by the processes
        print("rank %d: %s: %s" % (rank, type(error).__name__, error), file=sys.stderr, flush=True)
        return 1


def _one_of_each(shmcomm, np, n, step):
    shmcomm.allreduce(np.ones(32, np.float32))
    shmcomm.allreduce(np.ones(300_000, np.float32))  # the pipelined path
    shmcomm.broadcast(np.ones(1000), root_rank=step % n)
    shmcomm.allgather(np.ones((2, 3)))
    shmcomm.reducescatter(np.ones((n * 2, 5)))
    shmcomm.alltoall(np.ones(n * 3))
    shmcomm.barrier()


def _mark(directory, name, text):
    path = os.path.join(directory, name)
    with open("%s.%d.tmp" % (path, os.getpid()), "w") as f:  # ranks may write the same marker at once
        f.write(text)
    os.replace("%s.%d.tmp" % (path, os.getpid()), path)


# ---- the controller ----

def one_run(rng, signum, sim=None, phases=None):
    """Starts a job, picks a victim and a moment, signals it, and returns the list of what went wrong (empty: the
    run passed), a summary, and the seconds from the signal to the last survivor's error (None if none raised) and
    to the launcher's exit."""
    from shmcomm.testing import outcomes

    phase = rng.choice(PHASES)
    phase = phase if phases is None or phase in phases else phases[rng.randrange(len(phases))]
    victim = rng.randrange(RANKS)
    directory = tempfile.mkdtemp(prefix="chaos-")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               SHMCOMM_TIMEOUT=str(TIMEOUT_S), SHMCOMM_START_TIMEOUT=str(START_TIMEOUT_S))
    for name in [k for k in env if k.startswith(("SHMCOMM_RANK", "HOROVOD_", "PMI_"))]:
        del env[name]
    launch = [sys.executable, "-m", "shmcomm.runner", "--kill-grace-seconds", str(GRACE_S)]
    launch += sim.shmcommrun_args(RANKS // 2) if sim is not None else ["-np", str(RANKS)]
    command = launch + [sys.executable, os.path.abspath(__file__), "job", directory, phase]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    problems = []
    pid = _wait_for_victim(directory, victim, phase, rng, proc)
    killed_at = time.monotonic()
    if pid is not None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pid = None
    bound = KILL_BOUND_S if signum == signal.SIGKILL else TIMEOUT_S + STOP_MARGIN_S
    post_mortem = threading.Timer(bound - 1.0, _ask_for_stacks, (directory, pid))
    post_mortem.start()
    try:
        output, _ = proc.communicate(timeout=60)
        ended = time.monotonic() - killed_at
    except subprocess.TimeoutExpired:
        ended = None
        os.killpg(proc.pid, signal.SIGKILL)
        problems.append("the launcher did not exit within 60 s")
        for rank_pid in _pids(directory):  # the ranks may have process groups of their own
            try:
                os.kill(rank_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:  # a process of another group (mpiexec's) may still hold the output open
            output, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            output = ""
    with open(os.path.join(directory, "launcher.out"), "w") as f:  # kept for a failed run's post-mortem
        f.write(output)
    post_mortem.cancel()
    if pid is None:
        problems.append("the victim (rank %d) could not be signalled: the job %s:\n%s" % (
            victim, "ended first" if proc.returncode is not None else "never started it", output[-3000:]))
        return problems, (phase, victim, proc.returncode, {}, []), None, ended
    raised = outcomes.read(directory)
    survivors = [r for r in range(RANKS) if r != victim]
    shut_down = {r for r in survivors if os.path.exists(os.path.join(directory, "shutdown.%d" % r))}
    aborted = [r for r in survivors if r not in raised and sim is not None and _aborted_by_mpich(output, r)]
    for r in survivors:
        got = raised.get(r)
        if got is None:
            if phase != "shutdown" and r not in aborted:
                problems.append("rank %d raised nothing" % r)
            continue
        # A rank stopped or killed before MPI had started everywhere holds the others in MPI, which cannot say which
        # rank is missing: the launcher's notice names it (startup/notices.py).
        named = _names(got, victim)
        late = got["seconds"] - killed_at
        if not named:
            problems.append("rank %d raised %s without naming rank %d: %s" % (r, got["type"], victim,
                                                                               got["message"][:300]))
        if late > bound:
            problems.append("rank %d raised %.1f s after the signal (bound %.0f s)" % (r, late, bound))
    if proc.returncode == 0:
        problems.append("the launcher exited 0")
    elif not _text_names(output, victim) and not (phase == "shutdown" and shut_down):
        problems.append("the launcher's output does not name rank %d:\n%s" % (victim, output[-2000:]))
    if sim is not None and proc.returncode != 0:  # the launcher's own last word names it too
        final = [line for line in output.splitlines() if line.startswith("shmcommrun: mpiexec exited")]
        if not final or not _text_names(final[-1], victim):
            problems.append("the launcher's last line does not name rank %d: %s" % (victim, final[-1:]))
    problems += _leftovers(directory, sim)
    if problems:
        problems.append("output in %s" % os.path.join(directory, "launcher.out"))
    else:
        shutil.rmtree(directory, ignore_errors=True)
    times = [raised[r]["seconds"] - killed_at for r in survivors if r in raised]
    return problems, (phase, victim, proc.returncode, raised, aborted), max(times) if times else None, ended


def _ask_for_stacks(directory, victim_pid):
    """Near the bound, asks every rank still alive that has not raised for its stacks (stack.PID in the run's
    directory), to tell where a late survivor waits."""
    from shmcomm.testing import outcomes

    raised = outcomes.read(directory)
    for pid in _pids(directory):
        if pid != victim_pid and _alive(pid) and _rank_of(pid) not in raised:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass


def _aborted_by_mpich(output, rank):
    """Whether MPICH itself aborted `rank` on a connection that the victim reset (its error stack in the rank's
    output). MPICH 5's libfabric module raises every failed completion as a fatal error, which aborts the process
    whatever the communicator's error handler (MPIDI_OFI_handle_cq_error: MPIR_ERR_SETFATALANDJUMP), so no library
    above it can raise instead. Across simulated hosts a rank killed in init does that to a survivor in about one run
    of fifteen; the launcher still names the killed rank."""
    pattern = r"^\[%d\]<stderr>: .*OFI poll failed \(.*Connection reset by peer\)" % rank
    return re.search(pattern, output, re.M) is not None


def _names(raised, victim):
    """Whether an error names the victim: RankFailure.rank, or its message (_text_names)."""
    return raised["rank"] == victim or _text_names(raised["message"], victim)


def _text_names(text, victim):
    """Whether a text names rank `victim`: "rank V", or a list: "ranks 1, V are gone", init's "missing ranks: V"."""
    return re.search(r"\brank %d\b" % victim, text) is not None or any(
        str(victim) in found.replace(" ", "").split(",")
        for found in re.findall(r"(?:missing ranks: |\branks )(\d+(?:, \d+)*)", text))


def _wait_for_victim(directory, victim, phase, rng, proc, limit=30.0):
    """The victim's pid at the chosen moment, or None if the job ended or never got there."""
    deadline = time.monotonic() + limit
    if phase == "init":  # a random moment between process start and the end of init
        pids = _pids_by_rank(directory, deadline, proc, victim, rank_file=False)
        # Not before every rank ignores SIGTERM (its pid file comes after): the launcher's stop would end a rank that
        # had not got there yet before it could raise.
        while len(_pids(directory)) < RANKS and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.8))
        return pids
    pid = _pids_by_rank(directory, deadline, proc, victim, rank_file=True)
    if pid is None:
        return None
    if phase == "box_lock":
        marker = os.path.join(directory, "locked.%d" % victim)
        while not os.path.exists(marker) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.001)
    elif phase == "shutdown":
        marker = os.path.join(directory, "shutdown.%d" % victim)
        while not os.path.exists(marker) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.01))
    else:
        time.sleep(rng.uniform(0.05, 1.5))
    return pid if proc.poll() is None else None


def _pids_by_rank(directory, deadline, proc, victim, rank_file):
    while time.monotonic() < deadline and proc.poll() is None:
        if rank_file:
            path = os.path.join(directory, "rank.%d" % victim)
            if os.path.exists(path):
                return int(open(path).read())
        else:
            # Before init a rank knows its number from the launcher's environment only; read it from /proc.
            for name in os.listdir(directory):
                if name.startswith("pid.") and not name.endswith(".tmp"):
                    pid = int(name.split(".")[1])
                    if _rank_of(pid) == victim:
                        return pid
        time.sleep(0.002)
    return None


def _rank_of(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            variables = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return None
    value = variables.get(b"SHMCOMM_RANK") or variables.get(b"PMI_RANK")
    return int(value) if value is not None else None


def _leftovers(directory, sim):
    """What the run left: processes (the ranks, and any process whose command names the run's directory: the
    launcher, hydra, the rank guards; on simulated hosts anything still in their namespaces), and files in /dev/shm
    (the job's segments, whatever their suffix, and MPICH's of the worlds its ranks named)."""
    from shmcomm.testing import mpi_segments

    problems = []
    pids = _pids(directory)
    deadline = time.monotonic() + 10
    alive = pids
    while time.monotonic() < deadline:
        alive = sorted(set(p for p in pids if _alive(p)) | set(_stragglers(directory, sim)))
        if not alive:
            break
        time.sleep(0.05)
    if alive:
        problems.append("processes left behind: %s" % ", ".join("%d (%s)" % (p, _command(p)[:80]) for p in alive))
    token_path = os.path.join(directory, "token")
    token = open(token_path).read() if os.path.exists(token_path) else None
    # MPICH's segments by the worlds the job's ranks named: other jobs on the machine make and leave their own.
    worlds = set()
    for name in os.listdir(directory):
        if name.startswith("mpi.") and not name.endswith(".tmp"):
            worlds.update(open(os.path.join(directory, name)).read().split())
    deadline = time.monotonic() + 5
    left = None
    while time.monotonic() < deadline:
        left = sorted(n for n in os.listdir("/dev/shm") if token and token in n) + mpi_segments.left(worlds)
        if not left:
            break
        time.sleep(0.05)
    if left:
        problems.append("left in /dev/shm: %s" % left)
    return problems


def _stragglers(directory, sim):
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid() and directory in _command(int(pid)) and _alive(int(pid)):
            found.append(int(pid))
    if sim is not None:
        for ns in sim.namespaces:
            listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
            found += [int(p) for p in listed.split() if _alive(int(p))]
    return found


def _command(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _pids(directory):
    return [int(n.split(".")[1]) for n in os.listdir(directory) if n.startswith("pid.") and not n.endswith(".tmp")]


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def campaign(runs, signum, hosts=1, seed=None, out=sys.stdout, first_run=0, phases=None):
    """Runs runs first_run .. first_run + runs - 1 of the campaign `seed`; returns (failures, lines)."""
    seed = random.randrange(1 << 30) if seed is None else seed
    sim = None
    if hosts > 1:
        from shmcomm.testing.simhosts import SimulatedHosts

        sim = SimulatedHosts(hosts).__enter__()
    failures, lines, errors_at, ends_at = [], [], [], []
    try:
        for i in range(first_run, first_run + runs):
            started = time.monotonic()
            rng = random.Random(seed * 1_000_003 + i)  # run i is the same whichever chunk runs it
            problems, (phase, victim, code, raised, aborted), error_s, end_s = one_run(rng, signum, sim, phases)
            errors_at += [error_s] if error_s is not None else []
            ends_at += [end_s] if end_s is not None else []
            kinds = sorted({v["type"] for v in raised.values()}) + ["rank %d aborted by MPICH" % r for r in aborted]
            line = ("run %2d seed %d: SIG%s rank %d in %-11s -> launcher %s, survivors raised %s (last %s s), "
                    "launcher ended %s s, run %.1f s: %s") % (
                i, seed, signal.Signals(signum).name[3:], victim, phase, code, ",".join(kinds) or "-",
                "-" if error_s is None else "%.1f" % error_s, "-" if end_s is None else "%.1f" % end_s,
                time.monotonic() - started, "ok" if not problems else "FAILED: " + "; ".join(problems))
            print(line, file=out, flush=True)
            lines.append(line)
            if problems:
                failures.append(line)
    finally:
        if sim is not None:
            sim.close()
    summary = "%d of %d runs passed" % (len(lines) - len(failures), len(lines))
    for name, values in (("the last survivor's error", errors_at), ("the launcher's exit", ends_at)):
        if values:
            summary += "; signal to %s: median %.1f s, largest %.1f s" % (name, statistics.median(values),
                                                                            max(values))
    print(summary, file=out, flush=True)
    return failures, lines


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "job":
        sys.exit(job(sys.argv[2], sys.argv[3]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--first-run", type=int, default=0, help="the campaign's first run to do (chunks)")
    parser.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    parser.add_argument("--hosts", type=int, choices=(1, 2), default=1)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--phase", action="append", choices=PHASES, help="only these phases (repeatable)")
    args = parser.parse_args()
    failures, lines = campaign(args.runs, getattr(signal, "SIG" + args.signal), args.hosts, args.seed,
                               first_run=args.first_run, phases=args.phase)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
