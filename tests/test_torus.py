# SPDX-License-Identifier: Apache-2.0
"""The 2D-torus allreduce and the cross-host algorithms, on one machine: a logical grid on shared memory
(SHMCOMM_TORUS_GRID), and MPI-launched jobs whose ranks pretend to sit on several hosts (SHMCOMM_RANKS_PER_HOST), so
the cross-host steps really go through MPI."""
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import multiproc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECKS = textwrap.dedent("""
    import numpy as np, shmcomm
    def check_all():
        shmcomm.init()
        me, n = shmcomm.rank(), shmcomm.size()
        for count in (0, 1, 7, 1001, 300_007):  # counts that do not divide by the row size take the remainder path
            for dtype in (np.float32, np.float64, np.int32, np.int8, np.float16):
                x = (np.arange(count) % 3 + me).astype(dtype)
                for op, fold in ((shmcomm.Sum, np.sum), (shmcomm.Max, np.max), (shmcomm.Min, np.min)):
                    if count > 1001 and op != shmcomm.Sum:
                        continue
                    want = fold(np.stack([(np.arange(count) % 3 + q).astype(dtype).astype(np.float64)
                                          for q in range(n)]), axis=0) if count else np.zeros(0)
                    got = shmcomm.allreduce(x, op=op)
                    assert np.array_equal(got.astype(np.float64), want), (count, dtype, op)
        avg = shmcomm.allreduce(np.full(5, float(me)), op=shmcomm.Average, prescale_factor=2.0, postscale_factor=0.5)
        assert np.allclose(avg, (n - 1) / 2)
        ints = shmcomm.allreduce(np.full(3, 4 * n, np.int64))  # Average of integers: exact division
        assert ints.tolist() == [4 * n] * 3
        assert shmcomm.allgather(np.full((me % 2 + 1, 2), me)).shape == (sum(r % 2 + 1 for r in range(n)), 2)
        assert shmcomm.broadcast(np.array([me, me]), root_rank=n - 1).tolist() == [n - 1] * 2
        rows = shmcomm.reducescatter(np.ones((2 * n + 1, 3)), op=shmcomm.Sum)
        assert rows.shape[0] == 2 + (1 if me < 1 else 0) and (rows == n).all()
        out, got = shmcomm.alltoall(np.arange(n) + 10 * me, splits=[1] * n)
        assert out.tolist() == [10 * r + me for r in range(n)]
        shmcomm.barrier()
        return True
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


def _grid_body():
    namespace = {}
    exec(CHECKS, namespace)
    return namespace["check_all"]()


@pytest.mark.parametrize("grid,small", [("2x2", None), ("2x3", None), ("3x2", None), ("4x2", None), ("1x3", None),
                                        ("3x1", None), ("3x2", "0")])
def test_logical_grid_on_shared_memory(grid, small):
    """small="0": every size takes the three-phase path, also the tiny counts that leave some ranks no slice."""
    x, y = (int(v) for v in grid.split("x"))
    env = {"SHMCOMM_TORUS_GRID": grid}
    if small is not None:
        env["SHMCOMM_TORUS_SMALL_BYTES"] = small
    assert multiproc.run(x * y, _grid_body, env=env, timeout=180) == [True] * (x * y)


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
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    args = [str(a) for a in (args if isinstance(args, list) else [args])]
    return subprocess.run([mpiexec, "-n", str(ranks), sys.executable] + args, env=env, capture_output=True,
                          text=True, timeout=240)


needs_mpiexec = pytest.mark.skipif(not os.path.exists(MPIEXEC) and shutil.which("mpiexec") is None,
                                   reason="no mpiexec")


@needs_mpiexec
@pytest.mark.parametrize("algo", ["torus", "ring", "mpi"])
def test_mismatches_across_pretend_hosts(tmp_path, algo):
    script = tmp_path / "job.py"
    script.write_text(MISMATCHES + "\nassert check_mismatches()\nprint('rank ok', flush=True)\n")
    run = _mpiexec(script, 4, SHMCOMM_RANKS_PER_HOST="2", SHMCOMM_ALLREDUCE_ALGO=algo, SHMCOMM_TIMEOUT="60")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("rank ok") == 4


@needs_mpiexec
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


@needs_mpiexec
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


def _stuck_rank_job(call, sleep):
    """Rank 2 of 4 stays away longer than the others' timeout; they make `call` and record what they raise."""
    return textwrap.dedent("""
        import os, sys, time, numpy as np, shmcomm
        from shmcomm import basics
        shmcomm.init()
        me = shmcomm.rank()
        if me == 2:
            time.sleep(%s)
            raise SystemExit(0)
        start = time.monotonic()
        try:
            %s
        except shmcomm.ShmCommError as error:
            with open(os.path.join(sys.argv[1], "raised%%d" %% me), "w") as f:  # hydra may split stdout lines
                f.write("%%s %%.1f %%s" %% (type(error).__name__, time.monotonic() - start, error))
    """) % (sleep, call)


def _run_stuck_rank_job(tmp_path, call, sleep, timeout):
    script = tmp_path / "job.py"
    script.write_text(_stuck_rank_job(call, sleep))
    run = _mpiexec([script, tmp_path], 4, SHMCOMM_RANKS_PER_HOST="2", SHMCOMM_TIMEOUT=str(timeout))
    assert run.returncode == 0, run.stdout + run.stderr
    return {int(f.name[6:]): f.read_text().split(None, 2) for f in tmp_path.glob("raised*")}, run


@needs_mpiexec
def test_negotiation_across_hosts_times_out_on_a_stuck_rank(tmp_path):
    raised, run = _run_stuck_rank_job(tmp_path, "basics.communicator().allgather_bytes(b'x' * 10)", 5, 2)
    assert sorted(raised) == [0, 1, 3], run.stdout + run.stderr
    for kind, seconds, text in raised.values():
        assert kind == "TimeoutError" and float(seconds) < 6 and "negotiation: timed out" in text, text


@needs_mpiexec
def test_a_rank_that_does_not_come_times_the_others_out_by_name(tmp_path):
    """MPI waits have no deadline of their own: the column's watchdog gives them SHMCOMM_TIMEOUT's."""
    raised, run = _run_stuck_rank_job(tmp_path, "shmcomm.allreduce(np.ones(10, np.float32))", 8, 3)
    assert sorted(raised) == [0, 1, 3], run.stdout + run.stderr
    assert all(float(seconds) < 8 for _, seconds, _ in raised.values()), raised
    # Rank 2's column partner and its row partner name it; rank 1 hears that its host's first rank failed.
    assert raised[0][0] == "TimeoutError" and "waiting for rank 2" in raised[0][2], raised
    assert raised[3][0] == "TimeoutError" and "waiting for rank 2" in raised[3][2], raised
    assert "failed on rank 0" in raised[1][2], raised


@needs_mpiexec
@pytest.mark.parametrize("ranks,per_host,algo", [(4, 2, "torus"), (4, 2, "ring"), (4, 2, "mpi"), (6, 2, "auto"),
                                                 (6, 3, "auto"), (5, 2, "auto")])
def test_across_pretend_hosts_over_mpi(tmp_path, ranks, per_host, algo):
    script = tmp_path / "job.py"
    script.write_text(CHECKS + "\nassert check_all()\nprint('rank ok', flush=True)\n")
    run = _mpiexec(script, ranks, SHMCOMM_RANKS_PER_HOST=str(per_host), SHMCOMM_ALLREDUCE_ALGO=algo)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("rank ok") == ranks
