# SPDX-License-Identifier: Apache-2.0
"""The 2D-torus allreduce and the cross-host algorithms, on one machine: a logical grid on shared memory
(SHMCOMM_TORUS_GRID), and MPI-launched jobs whose ranks pretend to sit on several hosts (SHMCOMM_RANKS_PER_HOST), so
the cross-host steps really go through MPI."""
import functools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest

import multiproc
from shmcomm.testing import exact, outcomes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every collective with exact expectations computed outside the library (shmcomm/testing/exact.py), as the program
# of an MPI-launched rank: it writes its report to the directory named by its first argument; "bf16" after it adds
# bfloat16 (as torch tensors, which cost each rank the import of torch).
CHECKS = textwrap.dedent("""
    import sys
    from shmcomm.testing import exact, outcomes
    exact.run_checks(sys.argv[1], bf16=sys.argv[2:3] == ["bf16"])
""")

MISMATCHES = textwrap.dedent("""
    import time, numpy as np, shmcomm
    def check_mismatches():
        # 4 ranks, two to a host (a row). Each case raises MismatchError on every rank within seconds, names what
        # the ranks passed, leaves the input as it was, and the job goes on.
        shmcomm.init()
        me, n = shmcomm.rank(), shmcomm.size()
        host = me // 2
        def allreduce(x, **kw):
            return lambda: shmcomm.allreduce_(x, op=kw.get("op", shmcomm.Sum), postscale_factor=kw.get("post", 1.0))
        cases = [
            ("count across hosts", np.ones(10 + 2 * host, np.float32), {}, "ranks 0,1 passed float32[10]"),
            ("small and three-phase path", np.ones(10 if host == 0 else 100_000, np.float32), {},
             "ranks 2,3 passed float32[100000]"),
            ("one rank, small", np.ones(12 if me == 1 else 10, np.float32), {}, "rank 1 passed float32[12]"),
            ("one rank, three-phase", np.ones(100_001 if me == 3 else 100_000, np.float32), {},
             "rank 3 passed float32[100001]"),
            ("shape across hosts", np.ones((2, 3) if host == 0 else (3, 2), np.float32), {},
             "ranks 2,3 passed float32[3, 2]"),
            ("dtype across hosts", np.ones(10, np.float32 if host == 0 else np.float64), {},
             "ranks 2,3 passed float64[10]"),
            ("op on one rank", np.ones(10, np.float32), {"op": shmcomm.Max if me == 2 else shmcomm.Sum},
             "rank 2 passed float32[10] op max"),
            # Average is a sum to the core's row step: only the signature tells them apart.
            ("Average on one rank, three-phase", np.ones(100_000, np.float32),
             {"op": shmcomm.Average if me == 1 else shmcomm.Sum}, "rank 1 passed float32[100000] op average"),
            ("postscale on one rank", np.ones(10, np.float32), {"post": 2.0 if me == 0 else 1.0},
             "rank 0 passed float32[10] scaled by (pre 1, post 2)"),
            ("broadcast shape", None, "broadcast", "ranks 2,3 passed float32[5]"),
            ("allgather trailing shape", None, "allgather", "ranks 2,3 passed float32[*, 3]"),
            ("barrier against allreduce", None, "barrier", "ranks 2,3 passed barrier"),
        ]
        for name, x, kw, expected in cases:
            before = None if x is None else x.copy()
            if kw == "broadcast":
                call = lambda: shmcomm.broadcast(np.ones(4 + host, np.float32), root_rank=0)
            elif kw == "allgather":
                call = lambda: shmcomm.allgather(np.ones((1, 2 + host), np.float32))
            elif kw == "barrier":
                call = (lambda: shmcomm.barrier()) if host == 1 else (lambda: shmcomm.allreduce(np.ones(3)))
            else:
                call = allreduce(x, **kw)
            start = time.monotonic()
            try:
                call()
            except shmcomm.MismatchError as error:
                text = str(error)
            else:
                raise AssertionError("%s: no error on rank %d" % (name, me))
            assert time.monotonic() - start < 20, (name, time.monotonic() - start)
            assert "ranks disagree" in text and expected in text, (name, text)
            if before is not None:
                assert np.array_equal(x, before), name
            assert shmcomm.allreduce(np.full(5, me, np.float32), op=shmcomm.Sum).tolist() == [n * (n - 1) / 2] * 5
        return True
""")


# 2x3 (wider than tall, as 1x3 is) runs with -m long.
GRIDS = [("2x2", None), pytest.param("2x3", None, marks=pytest.mark.long),
         pytest.param("3x2", None, marks=pytest.mark.long), pytest.param("4x2", None, marks=pytest.mark.long),
         ("1x3", None), ("3x1", None), ("3x2", "0")]


@functools.lru_cache(maxsize=None)
def _grid_reports(grid, small):
    """Every rank's exact.run_checks report on a logical grid; run once for the tests that read it."""
    x, y = (int(v) for v in grid.split("x"))
    env = {"SHMCOMM_TORUS_GRID": grid}
    if small is not None:
        env["SHMCOMM_TORUS_SMALL_BYTES"] = small
    return tuple(multiproc.run(x * y, exact.run_checks, env=env, timeout=180))


@pytest.mark.parametrize("grid,small", GRIDS)
def test_logical_grid_on_shared_memory(grid, small):
    """small="0": every size takes the three-phase path, also the tiny counts that leave some ranks no slice."""
    exact.assert_identical(_grid_reports(grid, small))


@pytest.mark.parametrize("grid,small", GRIDS)
def test_16_bit_sums_round_once_on_a_logical_grid(grid, small):
    x, y = (int(v) for v in grid.split("x"))
    exact.assert_rounding_is_visible(x * y)
    exact.assert_rounds_once(_grid_reports(grid, small))


def test_mismatches_on_a_logical_grid():
    def body():
        namespace = {}
        exec(MISMATCHES, namespace)
        return namespace["check_mismatches"]()

    assert multiproc.run(4, body, env={"SHMCOMM_TORUS_GRID": "2x2", "SHMCOMM_TIMEOUT": "60"}, timeout=120) == [True] * 4


def _column_failure(small, everyone):
    import shmcomm
    from shmcomm import basics

    shmcomm.init()
    me = shmcomm.rank()
    torus = basics.communicator().torus
    count = 10 if small else 100_000  # the small path's leader-only column, or every rank's column slice

    def broken(*_):
        raise RuntimeError("link down")
    # Column 0 (the rows' first ranks, which alone cross on the small path), or every rank (a host-wide failure).
    failing = everyone or me % 2 == 0
    if failing:
        torus.column.allreduce = torus.column.allreduce_slice = broken
    data = np.arange(count, dtype=np.float32) + me
    start = time.monotonic()
    with pytest.raises((RuntimeError, shmcomm.ShmCommError)) as info:
        shmcomm.allreduce_(data, op=shmcomm.Sum)
    elapsed = time.monotonic() - start
    text = str(info.value)
    if failing:
        assert text == "link down"
    else:
        # The small path names the lowest rank that failed; the slices' failure is known to the row only.
        assert "the cross-host step failed on " + ("rank 0" if small else "another rank") in text, text
    assert (data == np.arange(count, dtype=np.float32) + me).all()  # in place, and still the input: nothing lost
    torus.column.__dict__.pop("allreduce", None)  # repaired: the row and the columns go on
    torus.column.__dict__.pop("allreduce_slice", None)
    return elapsed


@pytest.mark.parametrize("small,everyone", [(True, False), (False, False), (False, True)])
def test_a_failed_cross_host_step_is_reported_to_the_whole_row_at_once(small, everyone):
    def body():
        import shmcomm

        elapsed = _column_failure(small, everyone)
        assert shmcomm.allreduce(np.ones(10, np.float32), op=shmcomm.Sum).tolist() == [4.0] * 10
        return elapsed

    times = multiproc.run(4, body, env={"SHMCOMM_TORUS_GRID": "2x2", "SHMCOMM_TIMEOUT": "60"})
    assert max(times) < 10, times  # not the timeout


def test_grid_that_does_not_fit_is_refused():
    def body():
        import shmcomm

        with pytest.raises(ValueError, match="does not fit 4 ranks"):
            shmcomm.init()
        return True

    assert multiproc.run(4, body, env={"SHMCOMM_TORUS_GRID": "3x2"}) == [True] * 4


MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _mpiexec(args, ranks, **env):
    """Runs `python args...` (a script and its arguments) on `ranks` MPI ranks."""
    mpiexec = MPIEXEC if os.path.exists(MPIEXEC) else shutil.which("mpiexec")
    assert mpiexec, "no mpiexec beside Python or on PATH: the mpich wheel, a dependency, provides it"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    args = [str(a) for a in (args if isinstance(args, list) else [args])]
    return subprocess.run([mpiexec, "-n", str(ranks), sys.executable] + args, env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.parametrize("algo", ["torus", "ring", "mpi"])
def test_mismatches_across_pretend_hosts(tmp_path, algo):
    script = tmp_path / "job.py"
    script.write_text(MISMATCHES + "\nassert check_mismatches()\nprint('rank ok', flush=True)\n")
    run = _mpiexec(script, 4, SHMCOMM_RANKS_PER_HOST="2", SHMCOMM_ALLREDUCE_ALGO=algo, SHMCOMM_TIMEOUT="60")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("rank ok") == 4


PROCESS_SETS_ACROSS_HOSTS = """
import numpy as np, torch, shmcomm
import shmcomm.torch as hvd
shmcomm.init()  # first without the engine: each call goes straight to its set's communicator
me = shmcomm.rank()
sets = {(1, 2): shmcomm.add_process_set([1, 2]),  # a rank on each host
        (0, 1, 3): shmcomm.add_process_set([0, 1, 3]),  # two ranks on one host, one on the other
        (2, 3): shmcomm.add_process_set([2, 3])}  # one host's


def check(ranks, ps, engine):
    n, i = len(ranks), ranks.index(me)
    x = np.arange(6, dtype=np.float32) + me
    assert shmcomm.allreduce(x, op=shmcomm.Sum, process_set=ps).tolist() == sum(np.arange(6.0) + r for r in ranks).tolist()
    assert shmcomm.allreduce(x, op=shmcomm.Max, process_set=ps).tolist() == (np.arange(6.0) + max(ranks)).tolist()
    b = np.full(3, float(me))
    shmcomm.broadcast_(b, ranks[-1], process_set=ps)
    assert b.tolist() == [float(ranks[-1])] * 3, b
    g = shmcomm.allgather(np.full((i + 1, 2), me, dtype=np.int64), process_set=ps)
    assert g[:, 0].tolist() == [r for k, r in enumerate(ranks) for _ in range(k + 1)], g
    got = shmcomm.alltoall(np.arange(n, dtype=np.int32) + 10 * me, process_set=ps)
    assert got.tolist() == [10 * r + i for r in ranks], got
    got, counts = shmcomm.alltoall(np.arange(2 * n, dtype=np.int32), splits=[2] * n, process_set=ps)
    assert got.tolist() == [2 * i, 2 * i + 1] * n and counts.tolist() == [2] * n, (got, counts)
    share = shmcomm.reducescatter(np.full((n, 2), float(me)), op=shmcomm.Sum, process_set=ps)
    assert share.tolist() == [[float(sum(ranks))] * 2], share
    shmcomm.barrier(process_set=ps)
    if engine:  # asynchronous, several at once, as a training loop's gradients go
        handles = [hvd.allreduce_async(torch.full((k + 1,), float(me)), op=hvd.Sum, name="t%d" % k, process_set=ps)
                   for k in range(5)]
        for k, h in enumerate(handles):
            assert hvd.synchronize(h).tolist() == [float(sum(ranks))] * (k + 1)
    try:  # a mismatch raises on every member, naming job ranks, and the set goes on
        shmcomm.allreduce(np.ones(2 + i), op=shmcomm.Sum, process_set=ps)
    except shmcomm.MismatchError as error:
        assert "rank %d" % ranks[-1] in str(error), error
    else:
        raise AssertionError("a mismatch was taken")
    try:  # a root outside the set on one member: it raises its own error, the others hear which rank refused
        shmcomm.broadcast_(np.ones(2), ranks[0] if i else 99, process_set=ps)
    except shmcomm.PeerArgumentError as error:
        assert i and "rank %d's call failed its own checks" % ranks[0] in str(error), error
    except (shmcomm.InvalidArgumentError, ValueError) as error:
        assert i == 0, error
    else:
        raise AssertionError("a refusal was taken")
    assert shmcomm.allreduce(np.ones(2), op=shmcomm.Sum, process_set=ps).tolist() == [float(n)] * 2


for engine in (False, True):
    if engine:
        hvd.init()  # every rank at once: the engine starts, and the calls go through it
    for ranks, ps in sets.items():
        if me in ranks:
            check(ranks, ps, engine)
    assert shmcomm.allreduce(np.ones(2), op=shmcomm.Sum).tolist() == [4.0, 4.0]
shmcomm.remove_process_set(sets[1, 2])
print("sets ok", flush=True)
"""
# torch.distributed's groups and send/recv across hosts rest on such sets (members-only ones, and two-rank channels).
TORCH_GROUPS_ACROSS_HOSTS = """
import sys, torch.distributed as dist
dist.init_process_group("shmcomm", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=me, world_size=4)
across = dist.new_group([1, 2])
if me in (1, 2):
    t = torch.full((3,), float(me))
    dist.all_reduce(t, group=across)
    assert t.tolist() == [3.0] * 3, t
    gathered = torch.empty(2)
    dist.all_gather_into_tensor(gathered, torch.tensor([float(me)]), group=across)
    assert gathered.tolist() == [1.0, 2.0], gathered
    message = torch.arange(5.0) * me
    if me == 1:
        dist.send(message, 2)
        dist.recv(message, 2)
        assert message.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0], message
    else:
        got = torch.empty(5)
        dist.recv(got, 1)
        assert got.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0], got
        dist.send(message, 1)
dist.barrier()
dist.destroy_process_group()
print("rank ok", flush=True)
"""


def test_a_process_set_across_hosts_runs_every_collective_on_mpi(tmp_path):
    """In an MPI job a set may span hosts: its members on each host share a segment, and an MPI communicator of all
    of them (MPI_Comm_create_group) carries the collectives across hosts, after the agreement."""
    script = tmp_path / "job.py"
    script.write_text(PROCESS_SETS_ACROSS_HOSTS + TORCH_GROUPS_ACROSS_HOSTS)
    with socket.socket() as probe:  # a free port for torch's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run = _mpiexec([script, port], 4, SHMCOMM_RANKS_PER_HOST="2", SHMCOMM_TIMEOUT="30", SHMCOMM_START_TIMEOUT="30")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("sets ok") == 4 and run.stdout.count("rank ok") == 4


def test_a_process_set_across_hosts_is_refused_where_mpi_runs_serialized(tmp_path):
    """Such a set's MPI calls may come from threads (its creation under the deadline, torch's channels): with MPI
    serialized (HOROVOD_MPI_THREADS_DISABLE) every rank refuses it alike, and one host's set still works."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, shmcomm
        shmcomm.init()
        try:
            shmcomm.add_process_set([1, 2])
        except shmcomm.NotSupportedError as error:
            assert "spans hosts (ranks [1] | [2]), but MPI runs serialized" in str(error), error
        else:
            raise AssertionError("a set across hosts was taken with MPI serialized")
        pair = shmcomm.add_process_set([2, 3])
        if shmcomm.rank() in (2, 3):
            assert shmcomm.allreduce(np.ones(2), op=shmcomm.Sum, process_set=pair).tolist() == [2.0, 2.0]
        print("rank ok", flush=True)
    """))
    run = _mpiexec(script, 4, SHMCOMM_RANKS_PER_HOST="2", HOROVOD_MPI_THREADS_DISABLE="1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("rank ok") == 4


def test_settings_that_choose_paths_must_agree_across_hosts(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, sys, shmcomm
        rank = int(os.environ["PMI_RANK"])
        os.environ["SHMCOMM_TORUS_SMALL_BYTES"] = "1000" if rank >= 2 else "2000"
        try:
            shmcomm.init()
        except ValueError as error:
            with open(os.path.join(sys.argv[1], "refused%d" % rank), "w") as f:  # hydra may split stdout lines
                f.write(str(error))
    """))
    run = _mpiexec([script, tmp_path], 4, SHMCOMM_RANKS_PER_HOST="2")
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in range(4):
        text = (tmp_path / ("refused%d" % rank)).read_text()
        assert ("rank 0: SHMCOMM_TORUS_SMALL_BYTES=2000; rank 2: SHMCOMM_TORUS_SMALL_BYTES=1000; "
                "rank 3: SHMCOMM_TORUS_SMALL_BYTES=1000)") in text, text


def test_negotiation_messages_of_every_length_across_pretend_hosts(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import shmcomm
        from shmcomm import basics
        shmcomm.init()
        me, world = shmcomm.rank(), basics.communicator()
        for length in (lambda r: 0, lambda r: 5 + r, lambda r: 2040 + r, lambda r: 3000 * r, lambda r: 70000):
            got = world.allgather_bytes(bytes([65 + me]) * length(me))
            assert got == [bytes([65 + r]) * length(r) for r in range(4)], [len(g) for g in got]
        print("rank ok", flush=True)
    """))
    run = _mpiexec(script, 4, SHMCOMM_RANKS_PER_HOST="2")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("rank ok") == 4


def _stuck_rank_job(call, then="pass"):
    """Rank 2 of 4 stays away until the others have made `call` and recorded what they raised (however long their
    timeout takes), after running the lines `then`; they record it in files (shmcomm/testing/outcomes.py): hydra
    may split stdout lines."""
    return textwrap.dedent("""
        import sys, time, numpy as np, shmcomm
        from shmcomm import basics
        from shmcomm.testing import outcomes
        shmcomm.init()
        me = shmcomm.rank()
        if me == 2:
            outcomes.wait_for(sys.argv[1], [0, 1, 3], timeout=120)
            raise SystemExit(0)
        start = time.monotonic()
        try:
            %s
        except shmcomm.ShmCommError as error:
            %s
            outcomes.record(sys.argv[1], me, error, start)
    """) % (call, textwrap.indent(then, " " * 4).lstrip())


def _run_stuck_rank_job(tmp_path, call, timeout, per_host=2, then="pass"):
    script = tmp_path / "job.py"
    script.write_text(_stuck_rank_job(call, then))
    run = _mpiexec([script, tmp_path], 4, SHMCOMM_RANKS_PER_HOST=str(per_host), SHMCOMM_TIMEOUT=str(timeout))
    assert run.returncode == 0, run.stdout + run.stderr
    raised = outcomes.read(tmp_path)
    assert sorted(raised) == [0, 1, 3], run.stdout + run.stderr
    # Within SHMCOMM_TIMEOUT, with room for a loaded machine: rank 2 would have stayed away for minutes.
    assert all(r["seconds"] < 4 * timeout for r in raised.values()), raised
    return raised


def test_negotiation_across_hosts_times_out_on_a_stuck_rank(tmp_path):
    raised = _run_stuck_rank_job(tmp_path, "basics.communicator().allgather_bytes(b'x' * 10)", 2)
    for r in raised.values():
        assert r["type"] == "TimeoutError" and r["seconds"] >= 2 and "negotiation: timed out" in r["message"], r


@pytest.mark.long
def test_a_rank_that_does_not_come_times_the_others_out_by_name(tmp_path):
    """MPI waits have no deadline of their own: the column's watchdog gives them SHMCOMM_TIMEOUT's."""
    raised = _run_stuck_rank_job(tmp_path, "shmcomm.allreduce(np.ones(10, np.float32))", 3)
    # Rank 2's column partner and its row partner name it; rank 1 hears that its host's first rank failed.
    assert raised[0]["type"] == "TimeoutError" and "waiting for rank 2" in raised[0]["message"], raised
    assert raised[3]["type"] == "TimeoutError" and "waiting for rank 2" in raised[3]["message"], raised
    assert "failed on rank 0" in raised[1]["message"], raised


@pytest.mark.parametrize("count", [10, pytest.param(25_000, marks=pytest.mark.long)])
def test_a_rank_that_does_not_come_times_the_quick_call_across_hosts_out_by_name(tmp_path, count):
    """One rank per host: the small allreduce is one C call (csrc/py/quick_crossing.c), whose rounds keep the same
    deadline; after the timeout the transport refuses the next call, quick or not. (Two per host: the test above.)
    100 KB take the rounds by halving (agreement.HALVING_BYTES), with the same partners in the same order."""
    refused = textwrap.dedent("""\
        try:
            shmcomm.allreduce(np.ones(10, np.float32))
            error = AssertionError("a second call was not refused")
        except shmcomm.BrokenCommunicatorError:
            pass""")
    raised = _run_stuck_rank_job(tmp_path, "shmcomm.allreduce(np.ones(%d, np.float32))" % count, 3, per_host=1,
                                 then=refused)
    # Rank 2's partners in recursive doubling (3, then 0) name it; rank 1 waits for rank 3, which waited for 2.
    for r in (0, 3):
        assert raised[r]["type"] == "TimeoutError" and "waiting for rank 2" in raised[r]["message"], raised
    assert raised[1]["type"] == "TimeoutError", raised


# Three hosts of two (6, 2) run with -m long: two hosts of three and the uneven (5, 2) take the same paths. Four
# hosts of one halve on the small path (agreement.HALVING_BYTES).
PRETEND_HOSTS = [(4, 2, "torus"), (4, 2, "ring"), pytest.param(4, 2, "mpi", marks=pytest.mark.long),
                 pytest.param(6, 2, "auto", marks=pytest.mark.long),
                 pytest.param(6, 3, "auto", marks=pytest.mark.long), (5, 2, "auto"),
                 pytest.param(4, 1, "auto", marks=pytest.mark.long)]


def run_checks_job(launch, ranks, program=CHECKS):
    """Writes `program` (CHECKS) and runs it with launch(script, out_dir), which returns the finished process;
    returns every rank's report, read from out_dir, and the job's stdout."""
    out = tempfile.mkdtemp(prefix="shmcomm-checks-")
    try:
        script = os.path.join(out, "job.py")
        with open(script, "w") as f:
            f.write(program)
        run = launch(script, out)
        assert run.returncode == 0, run.stdout + run.stderr
        return tuple(exact.read_reports(out, ranks)), run.stdout
    finally:
        shutil.rmtree(out, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def _pretend_host_reports(ranks, per_host, algo):
    """Every rank's exact.run_checks report from an MPI job, run once for the tests that read them. Without bfloat16,
    whose torch import would double each job's time: the simulated hosts check it on the same paths."""
    return run_checks_job(lambda script, out: _mpiexec([script, out], ranks, SHMCOMM_RANKS_PER_HOST=str(per_host),
                                                        SHMCOMM_ALLREDUCE_ALGO=algo), ranks)[0]


@pytest.mark.parametrize("ranks,per_host,algo", PRETEND_HOSTS)
def test_across_pretend_hosts_over_mpi(ranks, per_host, algo):
    exact.assert_identical(_pretend_host_reports(ranks, per_host, algo))


@pytest.mark.parametrize("ranks,per_host,algo", PRETEND_HOSTS)
def test_16_bit_sums_round_once_across_pretend_hosts(ranks, per_host, algo):
    exact.assert_rounding_is_visible(ranks)
    exact.assert_rounds_once(_pretend_host_reports(ranks, per_host, algo))
