# SPDX-License-Identifier: Apache-2.0
"""The path each call takes, read from the library's debug log (SHMCOMM_LOG_LEVEL=debug, the "shmcomm" logger), not
from timings: which allreduce algorithm `auto` and SHMCOMM_TORUS_MIN_BYTES choose, the torus's small and three-phase
paths, and the engine's fusion of queued allreduces."""
import logging
import re
import textwrap

import numpy as np
import pytest

import multiproc
from test_torus import _mpiexec

SIZES = (16, 64 << 10, 1 << 20)  # bytes: a small message, the largest small-path one's neighbourhood, a large one

JOB = textwrap.dedent("""
    import numpy as np, shmcomm
    shmcomm.init()
    me, n = shmcomm.rank(), shmcomm.size()
    for nbytes in %r:
        x = np.full(nbytes // 4, me + 1, np.float32)
        assert np.array_equal(shmcomm.allreduce(x, op=shmcomm.Sum), np.full(nbytes // 4, n * (n + 1) / 2)), nbytes
    print("rank ok", flush=True)
""" % (SIZES,))

_CHOSEN = re.compile(r"^\[(\d+)\] shmcomm DEBUG shmcomm\.algorithms: allreduce of (\d+) bytes: (\w+)$")
_TORUS = re.compile(r"^\[(\d+)\] shmcomm DEBUG shmcomm\.algorithms: torus: (\d+) bytes take the ([\w-]+) path$")


def _paths(stderr, pattern):
    """{rank: [(bytes, path), ...]} from the ranks' debug log."""
    found = {}
    for line in stderr.splitlines():
        m = pattern.match(line.strip())
        if m:
            found.setdefault(int(m.group(1)), []).append((int(m.group(2)), m.group(3)))
    return found


@pytest.mark.parametrize("min_bytes,expected", [
    (0, ["torus", "torus", "torus"]),
    (4096, ["mpi", "torus", "torus"]),     # SHMCOMM_TORUS_MIN_BYTES sends the smallest to MPI's own allreduce
])
def test_auto_across_pretend_hosts_takes_the_torus_and_its_small_path_up_to_the_limit(tmp_path, min_bytes, expected):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    run = _mpiexec(script, 4, SHMCOMM_RANKS_PER_HOST="2", SHMCOMM_LOG_LEVEL="debug",
                   SHMCOMM_TORUS_MIN_BYTES=str(min_bytes), SHMCOMM_TORUS_SMALL_BYTES=str(256 << 10))
    assert run.returncode == 0 and run.stdout.count("rank ok") == 4, run.stdout + run.stderr
    chosen = _paths(run.stderr, _CHOSEN)
    assert chosen == {r: list(zip(SIZES, expected)) for r in range(4)}, run.stderr
    torus = _paths(run.stderr, _TORUS)
    small = [(nbytes, "small" if nbytes <= 256 << 10 else "three-phase") for nbytes, algo in zip(SIZES, expected)
             if algo == "torus"]
    assert torus == {r: small for r in range(4)}, run.stderr


def test_uneven_hosts_take_the_mpi_library(tmp_path):
    """5 ranks, 2 per host: the last host has one rank, no torus is possible, auto takes MPI's allreduce."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    run = _mpiexec(script, 5, SHMCOMM_RANKS_PER_HOST="2", SHMCOMM_LOG_LEVEL="debug")
    assert run.returncode == 0 and run.stdout.count("rank ok") == 5, run.stdout + run.stderr
    assert _paths(run.stderr, _CHOSEN) == {r: [(nbytes, "mpi") for nbytes in SIZES] for r in range(5)}
    assert _paths(run.stderr, _TORUS) == {}


def _grid_paths():
    import shmcomm

    records = _capture("shmcomm.algorithms")
    shmcomm.init()
    for nbytes in SIZES:
        shmcomm.allreduce_(np.ones(nbytes // 4, np.float32))
    return [r.getMessage() for r in records]


def test_a_logical_grid_takes_the_torus_at_every_size_whatever_the_minimum():
    """SHMCOMM_TORUS_MIN_BYTES is about MPI across hosts; a grid on one host has none."""
    got = multiproc.run(4, _grid_paths, env={"SHMCOMM_TORUS_GRID": "2x2", "SHMCOMM_TORUS_MIN_BYTES": "1000000",
                                             "SHMCOMM_TORUS_SMALL_BYTES": "1000"})
    want = ["allreduce algorithm: auto (torus possible)"]
    for nbytes in SIZES:
        want += ["allreduce of %d bytes: torus" % nbytes,
                 "torus: %d bytes take the %s path" % (nbytes, "small" if nbytes <= 1000 else "three-phase")]
    assert got == [want] * 4


def _capture(logger_name):
    """The records the named logger emits from now on, in a list (the standard logging API, as an application
    would use it)."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger(logger_name)
    logger.addHandler(Keep())
    logger.setLevel(logging.DEBUG)
    return records


def _fused(count):
    import shmcomm

    records = _capture("shmcomm.engine")
    shmcomm.init(engine=True)
    handles = [shmcomm.allreduce_async(np.full(10, i, np.float32), name="g%d" % i, op=shmcomm.Sum)
               for i in range(count)]
    results = [shmcomm.synchronize(h) for h in handles]
    assert all(np.array_equal(r, np.full(10, 2 * i)) for i, r in enumerate(results))
    return [r.getMessage() for r in records]


def test_the_engine_fuses_queued_allreduces_into_one():
    """Requests queued while nobody waits gather into one bucket; the wait negotiates them in one cycle, fused."""
    for log in multiproc.run(2, _fused, 5, env={"SHMCOMM_FUSION_THRESHOLD": str(1 << 20)}):
        fused = [m for m in log if "fused allreduce" in m]
        assert any("fused allreduce [allreduce.g0, allreduce.g1, allreduce.g2, allreduce.g3, allreduce.g4]" in m
                   for m in fused), log


def test_a_fusion_threshold_of_zero_runs_each_allreduce_alone():
    for log in multiproc.run(2, _fused, 3, env={"SHMCOMM_FUSION_THRESHOLD": "0"}):
        groups = re.findall(r"fused allreduce \[([^]]*)\]", " ".join(log))
        assert sorted(groups) == ["allreduce.g0", "allreduce.g1", "allreduce.g2"], log


def _log_level(level):
    import shmcomm

    shmcomm.init()
    return logging.getLogger("shmcomm").level


def test_log_level_sets_the_shmcomm_logger_and_bad_values_are_refused():
    assert multiproc.run(2, _log_level, "x", env={"HOROVOD_LOG_LEVEL": "trace"}) == [logging.DEBUG] * 2
    assert multiproc.run(1, _log_level, "x", env={"SHMCOMM_LOG_LEVEL": "error"}) == [logging.ERROR]
    with pytest.raises(multiproc.RankError, match="SHMCOMM_LOG_LEVEL='loud'"):
        multiproc.run(1, _log_level, "x", env={"SHMCOMM_LOG_LEVEL": "loud"})


def _bucket(nbytes):
    import shmcomm

    records = _capture("shmcomm.engine")
    shmcomm.init(engine=True)
    handle = shmcomm.allreduce_async(np.ones(nbytes // 4, np.float32), name="grad", op=shmcomm.Sum)
    assert shmcomm.synchronize(handle).tolist() == [2.0] * (nbytes // 4)
    return [r.getMessage() for r in records if "negotiating now" in r.getMessage()]


def test_a_full_bucket_starts_the_negotiation_without_a_waiting_caller():
    """SHMCOMM_BUCKET_BYTES: the request that fills the bucket flushes it; below it, requests wait for a caller."""
    full = "allreduce.grad: bucket full (SHMCOMM_BUCKET_BYTES=64), negotiating now"
    assert multiproc.run(2, _bucket, 64, env={"SHMCOMM_BUCKET_BYTES": "64"}) == [[full]] * 2
    assert multiproc.run(2, _bucket, 64, env={"SHMCOMM_BUCKET_BYTES": "65"}) == [[]] * 2
