# SPDX-License-Identifier: Apache-2.0
"""One rank's bad argument fails the collective on every rank at once: that rank raises its own error, every other
rank raises PeerArgumentError naming it and its error, and the job goes on. On one host (the C core's refusal),
through the engine (the negotiation's), with torch's API, and across hosts (the agreement's); each job runs with a
short SHMCOMM_TIMEOUT, so that a regression, where peers wait for the refusing rank, fails with a TimeoutError
instead of passing slowly."""
import os
import sys
import textwrap

import numpy as np
import pytest

import multiproc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = {"SHMCOMM_TIMEOUT": "5"}

# The cases, as the source of a function that runs them on any number of ranks and checks every rank's outcome.
REFUSALS = textwrap.dedent("""
    import numpy as np, shmcomm

    def numpy_cases(n):
        # (name, call(bad), text of the bad rank's own error). Every call is the same collective on every rank.
        return [
            ("non-contiguous", lambda bad: shmcomm.allreduce(np.ones((4, 4))[:, 1] if bad else np.ones(4)),
             "tensor is required to be contiguous"),
            ("non-contiguous, large", lambda bad: shmcomm.allreduce(np.ones((300_000, 2))[:, 1] if bad else
                                                                    np.ones(300_000)), "contiguous"),
            ("output dtype", lambda bad: shmcomm.allreduce(np.ones(4), output=np.ones(4, np.int32) if bad else None),
             "output is int32[4], expected float64[4]"),
            ("bad op", lambda bad: shmcomm.allreduce(np.ones(3), op=17 if bad else shmcomm.Sum),
             "unknown reduction op 17"),
            ("not reducible", lambda bad: shmcomm.allreduce(np.ones(3, bool if bad else np.float64)), "not supported"),
            ("bad root", lambda bad: shmcomm.broadcast(np.ones(3), root_rank=n + 5 if bad else 0), "root rank"),
            ("bad splits", lambda bad: shmcomm.alltoall(np.ones(n), splits=[2] * n if bad else [1] * n), "splits"),
            ("scalar reducescatter", lambda bad: shmcomm.reducescatter(np.array(1.0) if bad else np.ones(n)),
             "at least one dimension"),
            ("read-only output", lambda bad: shmcomm.broadcast_(np.broadcast_to(np.ones(3), (3,)) if bad else
                                                                np.ones(3), 0), "read-only"),
            ("allgather", lambda bad: shmcomm.allgather(np.ones((3, 3))[:, 1] if bad else np.ones(3)), "contiguous"),
        ]

    EARLY = ("bad root", "read-only output")  # the broadcasts, from rank 0

    def check_refusals(cases, bad_ranks, early_broadcasts=False):
        # Each case once per refusing rank; returns [(case, bad rank, what this rank raised)]. With early_broadcasts
        # (one host, no engine) a small broadcast's root returns once it has published: a refusal by another rank
        # reaches the root, and the ranks that agreed with it, at their next collective, which fails on every rank.
        me, n = shmcomm.rank(), shmcomm.size()
        seen = []
        for bad_rank in bad_ranks:
            for i, (name, call, text) in enumerate(cases):
                later = early_broadcasts and name in EARLY and bad_rank != 0
                try:
                    call(me == bad_rank)
                except shmcomm.InvalidArgumentError as error:
                    assert me == bad_rank, (name, me, error)
                    assert text in str(error), (name, str(error))
                    seen.append((name, bad_rank, "own"))
                except shmcomm.PeerArgumentError as error:
                    assert me != bad_rank and error.rank == bad_rank, (name, me, error)
                    message = str(error)
                    assert "rank %d's call failed its own checks" % bad_rank in message, (name, message)
                    assert "rank %d: " % bad_rank in message and text in message, (name, message)
                    assert not later, (name, me, error)
                    seen.append((name, bad_rank, "peer"))
                else:
                    if not later:
                        raise AssertionError("%s: no error on rank %d (rank %d refused)" % (name, me, bad_rank))
                    seen.append((name, bad_rank, "later"))
                if later:
                    try:
                        shmcomm.allreduce(np.zeros(3))
                    except shmcomm.PeerArgumentError as error:
                        message = str(error)
                        assert error.rank == bad_rank and text in message, (name, message)
                        assert "the broadcast before this allreduce (which no rank ran)" in message, (name, message)
                    else:
                        raise AssertionError("%s: the call after a refused broadcast ran on rank %d" % (name, me))
                # The job goes on.
                got = shmcomm.allreduce(np.full(3, i, np.int64), op=shmcomm.Sum)
                assert got.tolist() == [i * n] * 3, (name, got)
        return seen
""")


def _numpy_refusals(bad_ranks, early_broadcasts):
    namespace = {}
    exec(REFUSALS, namespace)
    namespace["shmcomm"].init()
    return namespace["check_refusals"](namespace["numpy_cases"](namespace["shmcomm"].size()), bad_ranks,
                                       early_broadcasts)


def _expect(seen, bad_ranks, early_broadcasts):
    """Every rank went through every case; the refusing rank raised its own error, the others PeerArgumentError
    (or, after an early broadcast's, at their next collective)."""
    def kind(rank, name, bad):
        if rank == bad:
            return "own"
        return "later" if early_broadcasts and name in ("bad root", "read-only output") and bad != 0 else "peer"

    for rank, outcomes in enumerate(seen):
        assert sorted({bad for _, bad, _ in outcomes}) == sorted(bad_ranks)
        assert all(got == kind(rank, name, bad) for name, bad, got in outcomes), (rank, outcomes)


@pytest.mark.parametrize("engine", ["0", "1"])
def test_a_bad_argument_on_one_rank_fails_every_rank_at_once(engine):
    """Blocking numpy collectives, straight on the communicator and through the engine."""
    bad_ranks = [1, 0, 2]
    early = engine == "0"  # the engine's negotiation fails a refused broadcast on every rank before it runs
    seen = multiproc.run(3, _numpy_refusals, bad_ranks, early, env=dict(SHORT, SHMCOMM_ENGINE=engine), timeout=120)
    _expect(seen, bad_ranks, early)


def _two_ranks_refuse():
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    try:
        shmcomm.allreduce(np.ones((4, 4))[:, 1] if me in (1, 2) else np.ones(4))
    except shmcomm.PeerArgumentError as error:
        assert me in (0, 3) and error.rank == 1, str(error)
        assert "rank 1: " in str(error) and "rank 2: " in str(error), str(error)
    except shmcomm.InvalidArgumentError:
        assert me in (1, 2)
    return shmcomm.allreduce(np.ones(2), op=shmcomm.Sum).tolist()


def test_several_refusing_ranks_are_all_named():
    assert multiproc.run(4, _two_ranks_refuse, env=SHORT) == [[4.0, 4.0]] * 4


def _core_refusal():
    """The core's own argument checks refuse too: a dtype code it does not know, on rank 1 only."""
    import shmcomm
    from shmcomm import basics
    from shmcomm._native import ffi, lib

    shmcomm.init()
    me = shmcomm.rank()
    data = np.ones(4, np.float32)
    ptr = ffi.from_buffer(data)
    shm = basics.communicator().shm
    try:
        shm.allreduce(ptr, ptr, 4, 99 if me == 1 else lib.SMC_FLOAT32, lib.SMC_SUM, 1.0, 1.0, 1, 0, "allreduce")
    except shmcomm.InvalidArgumentError as error:
        assert me == 1 and "unknown dtype 99" in str(error)
    except shmcomm.PeerArgumentError as error:
        assert me != 1 and error.rank == 1 and "unknown dtype 99" in str(error), str(error)
    else:
        raise AssertionError("no error on rank %d" % me)
    assert data.tolist() == [1.0] * 4  # nothing ran
    return shmcomm.allreduce(np.ones(2), op=shmcomm.Sum).tolist()


def test_the_core_refuses_its_own_bad_arguments_on_every_rank():
    assert multiproc.run(3, _core_refusal, env=SHORT) == [[3.0, 3.0]] * 3


def _torch_refusals():
    import torch

    import shmcomm.torch as hvd

    hvd.init()
    me, n = hvd.rank(), hvd.size()
    cases = [
        ("allreduce", lambda bad: hvd.allreduce(torch.ones(4, 4).t() if bad else torch.ones(4, 4)), "contiguous"),
        ("allreduce_async", lambda bad: hvd.synchronize(hvd.allreduce_async(
            torch.ones(4, 4).t() if bad else torch.ones(4, 4), name="a")), "contiguous"),
        ("allreduce_async_ op", lambda bad: hvd.synchronize(hvd.allreduce_async_(
            torch.ones(4), op=42 if bad else hvd.Sum, name="b")), "unknown reduction op"),
        ("grouped", lambda bad: hvd.grouped_allreduce([torch.ones(2), torch.ones(3, 3).t() if bad else
                                                       torch.ones(3, 3)], name="g"), "contiguous"),
        ("broadcast_", lambda bad: hvd.broadcast_(torch.ones(3), root_rank=n + 1 if bad else 0), "root rank"),
        ("alltoall", lambda bad: hvd.alltoall(torch.ones(n), splits=torch.tensor([2] * n if bad else [1] * n)),
         "splits"),
        ("allgather", lambda bad: hvd.allgather(torch.ones(3, 3).t() if bad else torch.ones(3, 3)), "contiguous"),
        ("reducescatter", lambda bad: hvd.reducescatter(torch.ones(n, 2).t() if bad else torch.ones(2, n)),
         "contiguous"),
    ]
    seen = []
    for name, call, text in cases:
        try:
            call(me == 1)
        except hvd.PeerArgumentError as error:
            assert me != 1 and error.rank == 1 and text in str(error), (name, str(error))
            seen.append("peer")
        except ValueError as error:
            assert me == 1 and text in str(error), (name, str(error))
            seen.append("own")
        else:
            raise AssertionError("%s: no error on rank %d" % (name, me))
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [n, n]
    return seen


def test_torch_sync_and_async_collectives_refuse_on_every_rank():
    pytest.importorskip("torch")
    seen = multiproc.run(3, _torch_refusals, env=SHORT, timeout=120)
    assert seen == [["peer"] * 8, ["own"] * 8, ["peer"] * 8]


@pytest.mark.parametrize("algo", ["torus", "ring", "mpi"])
@pytest.mark.parametrize("engine", ["0", "1"])
def test_a_bad_argument_fails_every_rank_across_pretend_hosts(tmp_path, algo, engine):
    from test_torus import _mpiexec

    script = tmp_path / "job.py"
    script.write_text(REFUSALS + textwrap.dedent("""
        import os, sys
        shmcomm.init()
        seen = check_refusals(numpy_cases(shmcomm.size()), [3, 0, 2])
        with open(os.path.join(sys.argv[1], "rank%d" % shmcomm.rank()), "w") as f:  # hydra may split stdout lines
            f.write("".join(o[2][0] for o in seen))
    """))
    run = _mpiexec([script, tmp_path], 4, SHMCOMM_RANKS_PER_HOST="2", SHMCOMM_ALLREDUCE_ALGO=algo,
                   SHMCOMM_ENGINE=engine, **SHORT)
    assert run.returncode == 0, run.stdout + run.stderr
    # Each case with rank 3, then rank 0, then rank 2 refusing: "o" where a rank raised its own error, "p" where it
    # raised PeerArgumentError.
    expected = {3: "o" * 10 + "p" * 20, 0: "p" * 10 + "o" * 10 + "p" * 10, 2: "p" * 20 + "o" * 10, 1: "p" * 30}
    assert {r: (tmp_path / ("rank%d" % r)).read_text() for r in range(4)} == expected


def test_a_bad_argument_fails_every_rank_on_a_logical_grid():
    seen = multiproc.run(4, _numpy_refusals, [3, 0], False, env=dict(SHORT, SHMCOMM_TORUS_GRID="2x2"), timeout=120)
    _expect(seen, [3, 0], False)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
