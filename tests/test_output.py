# SPDX-License-Identifier: Apache-2.0
"""`output=` for allgather, reducescatter and alltoall (blocking and asynchronous, numpy and torch), on one host and
across pretend hosts over MPI; an output that does not fit raises on its rank only, after that rank took part, so the
others get their results at once and the job goes on. Also the sizes that travel with the first window of data:
rows of zero bytes, and alltoall windows around the staging half's edge."""
import os
import subprocess
import sys

import numpy as np
import pytest

import multiproc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST_TIMEOUT = {"SHMCOMM_TIMEOUT": "20"}  # a rank left waiting fails the test in seconds, not minutes

BODY = r'''
import numpy as np

import shmcomm


def expected(size, me):
    rows = [r + 1 for r in range(size)]
    gathered = np.concatenate([np.full((rows[r], 3), r, np.float32) for r in range(size)])
    full = sum(np.arange(size * 4 * 3, dtype=np.float32).reshape(size * 4, 3) + r for r in range(size))
    scattered = full[me * 4:(me + 1) * 4]
    splits = [(j + me) % 3 for j in range(size)]
    sent = np.concatenate([np.full((s, 2), 100 * me + j, np.int64) for j, s in enumerate(splits)])
    received = np.concatenate([np.full(((me + j) % 3, 2), 100 * j + me, np.int64) for j in range(size)])
    return (np.full((rows[me], 3), me, np.float32), gathered, np.arange(size * 4 * 3, dtype=np.float32).reshape(
        size * 4, 3) + me, scattered, sent, splits, received)


def check_outputs():
    size, me = shmcomm.size(), shmcomm.rank()
    mine, gathered, x, scattered, sent, splits, received = expected(size, me)
    out = np.empty_like(gathered)
    assert shmcomm.allgather(mine, output=out) is out
    np.testing.assert_array_equal(out, gathered)
    out = np.empty_like(scattered)
    assert shmcomm.reducescatter(x, op=shmcomm.Sum, output=out) is out
    np.testing.assert_array_equal(out, scattered)
    out = np.empty_like(received)
    got, counts = shmcomm.alltoall(sent, splits=splits, output=out)
    assert got is out and list(counts) == [(me + j) % 3 for j in range(size)]
    np.testing.assert_array_equal(out, received)
    # Asynchronous forms write into the same buffers.
    out = np.zeros_like(gathered)
    assert shmcomm.synchronize(shmcomm.allgather_async(mine, output=out)) is out
    np.testing.assert_array_equal(out, gathered)
    out = np.zeros_like(scattered)
    assert shmcomm.synchronize(shmcomm.reducescatter_async(x, op=shmcomm.Sum, output=out)) is out
    np.testing.assert_array_equal(out, scattered)
    out = np.zeros_like(received)
    assert shmcomm.synchronize(shmcomm.alltoall_async(sent, splits=splits, output=out))[0] is out
    np.testing.assert_array_equal(out, received)
    return True


def check_one_bad_output():
    """Rank 1's output has the wrong shape: it raises, the others get their results, and the job goes on."""
    size, me = shmcomm.size(), shmcomm.rank()
    mine, gathered, x, scattered, sent, splits, received = expected(size, me)
    cases = [("allgather", lambda out: shmcomm.allgather(mine, output=out), gathered),
             ("reducescatter", lambda out: shmcomm.reducescatter(x, op=shmcomm.Sum, output=out), scattered),
             ("alltoall", lambda out: shmcomm.alltoall(sent, splits=splits, output=out)[0], received)]
    for name, call, want in cases:
        if me == 1:
            wrong = np.full((want.shape[0] + 1,) + want.shape[1:], -7, want.dtype)
            try:
                call(wrong)
            except shmcomm.InvalidArgumentError as error:
                assert "output is" in str(error), error
                assert (wrong == -7).all(), "%s wrote into an output it refused" % name
            else:
                raise AssertionError("%s accepted an output of the wrong shape" % name)
        else:
            out = np.empty_like(want)
            assert call(out) is out
            np.testing.assert_array_equal(out, want)
        total = shmcomm.allreduce(np.ones(5, np.float32), op=shmcomm.Sum)
        np.testing.assert_array_equal(total, np.full(5, size, np.float32))
    return True
'''


def _outputs():
    namespace = {}
    exec(BODY, namespace)
    import shmcomm

    shmcomm.init()
    return namespace["check_outputs"]()


def _one_bad_output():
    namespace = {}
    exec(BODY, namespace)
    import shmcomm

    shmcomm.init()
    return namespace["check_one_bad_output"]()


@pytest.mark.parametrize("size", [1, 2, 3])
def test_outputs_on_one_host(size):
    assert multiproc.run(size, _outputs, timeout=120, env=FAST_TIMEOUT) == [True] * size


@pytest.mark.parametrize("size,threshold", [(2, None), (3, None), (3, "1")])
def test_one_rank_with_a_bad_output_does_not_hold_the_others(size, threshold):
    """Also by single copy (threshold 1), where the peers write into each other's outputs: the rank that keeps
    nothing still sends its part, and nothing is written into its wrong output."""
    env = dict(FAST_TIMEOUT, **({"SHMCOMM_SINGLE_COPY_BYTES": threshold} if threshold else {}))
    assert multiproc.run(size, _one_bad_output, timeout=120, env=env) == [True] * size


def _output_a_peer_cannot_write():
    import ctypes
    import mmap

    import shmcomm
    from shmcomm import basics
    from shmcomm._native import lib

    shmcomm.init()
    assert lib.smc_comm_pull_from(basics.communicator().shm.handle) == 1  # forced, whatever init's probe found
    me, count = shmcomm.rank(), 1 << 20  # float32: rank 0 reduces the first 2 MiB, rank 1 the second
    area = mmap.mmap(-1, count * 4)
    out = np.frombuffer(area, np.float32)
    if me == 0:  # rank 1's range of rank 0's output cannot be written
        libc = ctypes.CDLL(None, use_errno=True)
        start = ctypes.addressof(ctypes.c_char.from_buffer(area)) + count * 2
        assert libc.mprotect(ctypes.c_void_p(start), ctypes.c_size_t(count * 2), mmap.PROT_READ) == 0
    x = np.full(count, me + 1, np.float32)
    try:
        shmcomm.allreduce(x, op=shmcomm.Sum, output=out)
    except shmcomm.vocabulary.exceptions.SystemError as e:
        failure = str(e)
    else:
        failure = None
    if me == 0:  # its own range is whole; the job goes on, writing into outputs that can be written
        np.testing.assert_array_equal(out[:count // 2], 3)
    np.testing.assert_array_equal(shmcomm.allreduce(x, op=shmcomm.Sum), np.full(count, 3, np.float32))
    return failure


def test_a_pulled_piece_that_cannot_be_written_fails_both_ranks():
    """An allreduce that pulls (csrc/coll/allreduce.c): when rank 1 cannot write its reduced piece into
    rank 0's output, rank 1 says why and rank 0, whose output lacks that piece, names rank 1; neither waits, and the
    next call works."""
    got = multiproc.run(2, _output_a_peer_cannot_write, timeout=60, env=dict(FAST_TIMEOUT, SHMCOMM_PULL_BYTES="1"))
    assert "rank 1 could not write its part of the result into this rank's output" in got[0], got
    assert "writing into rank 0's buffer failed: Bad address" in got[1], got


def test_outputs_across_pretend_hosts(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(BODY + "\nshmcomm.init()\nassert check_outputs() and check_one_bad_output()\n"
                             "print('rank ok', flush=True)\n")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               SHMCOMM_RANKS_PER_HOST="2", **FAST_TIMEOUT)
    run = subprocess.run([mpiexec, "-n", "4", sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("rank ok") == 4


def _torch_outputs(size):
    import torch

    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    out = torch.empty(size, 2, dtype=torch.float64)
    assert shmcomm.allgather(torch.full((1, 2), float(me), dtype=torch.float64), output=out) is out
    assert out[:, 0].tolist() == list(range(size))
    out = torch.empty(2, dtype=torch.float32)
    assert shmcomm.reducescatter(torch.ones(2 * size), op=shmcomm.Sum, output=out) is out
    assert out.tolist() == [size] * 2
    out = torch.empty(size, dtype=torch.int32)
    got = shmcomm.alltoall(torch.full((size,), me, dtype=torch.int32), output=out)
    assert got is out and out.tolist() == list(range(size))
    return True


def test_torch_outputs():
    pytest.importorskip("torch")
    assert multiproc.run(3, _torch_outputs, 3, timeout=120) == [True] * 3


def _edges(size):
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    # Rows of zero bytes: the row counts still travel, and the result has every rank's rows.
    got = shmcomm.allgather(np.empty((me + 2, 0), np.float32))
    assert got.shape == (sum(r + 2 for r in range(size)), 0)
    sent, counts = shmcomm.alltoall(np.empty((2 * size, 0), np.int8), splits=[2] * size)
    assert sent.shape == (2 * size, 0) and list(counts) == [2] * size
    # Alltoall totals on both sides of the first window (the staging half less the counts) and of later windows.
    for total in (1, 1000, 32_767, 32_768, 32_769, 65_535, 65_536, 65_537, 262_143, 262_145, 1_048_577):
        splits = [(total + j + me) // size for j in range(size)]
        x = np.concatenate([np.arange(s, dtype=np.uint8) + (me * 7 + j) for j, s in enumerate(splits)])
        out, counts = shmcomm.alltoall(x, splits=splits)
        from_each = [(total + me + j) // size for j in range(size)]
        assert list(counts) == from_each
        want = np.concatenate([np.arange(s, dtype=np.uint8) + (j * 7 + me) for j, s in enumerate(from_each)])
        np.testing.assert_array_equal(out, want)
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_sizes_that_travel_with_the_data(size):
    assert multiproc.run(size, _edges, size, timeout=120, env=FAST_TIMEOUT) == [True] * size


def _counting_single_copies(body, size):
    from shmcomm import basics

    return body(size), basics.communicator().shm.single_copy_calls()


@pytest.mark.parametrize("threshold", ["0", "1"])
@pytest.mark.parametrize("case", ["broadcast", "allgather", "alltoall"])
def test_staged_and_single_copy_paths_agree(case, threshold):
    """SHMCOMM_SINGLE_COPY_BYTES=0 keeps every size on the staging halves; 1 sends every size by single copy where
    the ranks may read each other's memory (the default sends only inputs of a cache's size or more), whatever init's
    probe found; the core's counter says which way the calls went."""
    import test_collectives

    body = {"broadcast": test_collectives._broadcast, "allgather": test_collectives._allgather,
            "alltoall": test_collectives._alltoall}[case]
    env = dict(FAST_TIMEOUT, SHMCOMM_SINGLE_COPY_BYTES=threshold)
    got = multiproc.run(3, _counting_single_copies, body, 3, timeout=120, env=env)
    assert [ok for ok, _ in got] == [True] * 3, got
    assert all((calls > 0) == (threshold == "1") for _, calls in got), got


def _paths_of_repeated_gathers(size, case):
    import shmcomm
    from shmcomm import basics
    from shmcomm._native import lib

    shmcomm.init()
    shm = basics.communicator().shm
    me = shmcomm.rank()
    rows = 1 << 16  # int32: 256 KiB per rank, whole allgather inputs and alltoall parts from 128 KiB at 2-3 ranks
    x = (np.arange(rows * size, dtype=np.int32) % 997) + 1000 * me
    paths = ""
    for i in range(40):
        before = shm.single_copy_calls()
        if case == "allgather":
            got = shmcomm.allgather(x[:rows])
            want = np.concatenate([(np.arange(rows, dtype=np.int32) % 997) + 1000 * r for r in range(size)])
        else:
            got = shmcomm.alltoall(x)
            whole = np.arange(rows * size, dtype=np.int32) % 997
            want = np.concatenate([(whole + 1000 * r)[me * rows:(me + 1) * rows] for r in range(size)])
        np.testing.assert_array_equal(got, want)
        paths += "S" if shm.single_copy_calls() > before else "s"
    # Inputs from two L2s (allgather) or whole inputs from eight (alltoall) take single copy, learned or not,
    # whatever rank 0 contributes (here one row).
    from shmcomm.env import machine

    l2 = machine.cache_bytes(2) or (1 << 20)
    before = shm.single_copy_calls()
    if case == "allgather":
        big = l2 // 2  # int32 rows
        got = shmcomm.allgather(np.full(1 if me == 0 else big, me, np.int32))
        np.testing.assert_array_equal(got, np.repeat(np.arange(size, dtype=np.int32), [1] + [big] * (size - 1)))
    else:
        big = -(-2 * l2 // size)  # int32 rows to each rank: a whole input of eight L2s
        sends = np.full(big * size if me else size, me, np.int32)
        got = shmcomm.alltoall(sends)
        np.testing.assert_array_equal(got, np.repeat(np.arange(size, dtype=np.int32), [1] + [big] * (size - 1)))
    large = shm.single_copy_calls() > before
    return paths, lib.smc_comm_single_copy_learned(shm.handle), large, lib.smc_comm_single_copy(shm.handle)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("case", ["allgather", "alltoall"])
def test_where_the_kernels_copy_is_slow_each_call_takes_the_path_rank_0_learned(case, size):
    """csrc/coll/path_choice.c through allgather and alltoall: with the defaults, sizes from the single-copy size move
    by single copy from their first call where init found the kernel's copy fast, and elsewhere take each path in
    turn while the ranks learn their costs, then mostly the cheaper, as rank 0 chooses (the others' offers may
    differ: their first window is then staged late). Every result is exact and all ranks took the same path."""
    got = multiproc.run(size, _paths_of_repeated_gathers, size, case, timeout=120, env=FAST_TIMEOUT)
    assert len({paths for paths, *_ in got}) == 1, got
    paths, learned, _, can = got[0]
    assert paths == "S" * 40 if not learned else (paths[:4] == "SsSs" and set(paths[4:]) == {"S", "s"}), got
    assert all(large == can for _, _, large, can in got), got


def _windowed(size):
    import shmcomm
    from shmcomm.startup import session
    from shmcomm._native import ffi

    shmcomm.init()
    me = shmcomm.rank()
    shm = session.communicator().shm  # one host: the communicator is the host's

    def part(sender, dest, count):  # every byte says who sent it, to whom, and where it was
        return ((np.arange(count, dtype=np.int64) * 31 + sender * 7 + dest * 3) % 251).astype(np.uint8)

    rng = np.random.default_rng(2027)  # the same matrices on every rank
    for case in range(10):
        matrix = rng.integers(0, 40_000, (size, size))
        matrix[rng.random((size, size)) < 0.3] = 0  # some pairs send nothing
        if case == 0:
            matrix[:] = 0
        if case == 1:
            matrix[:] = 0
            matrix[size - 1, 0] = 100_003  # one part of many windows, every other part empty
        x = np.concatenate([part(me, d, matrix[me, d]) for d in range(size)])
        want = np.concatenate([part(j, me, matrix[j, me]) for j in range(size)])
        out, counts = shmcomm.alltoall(x, splits=matrix[me].tolist())
        assert list(counts) == list(matrix[:, me])
        np.testing.assert_array_equal(out, want, err_msg="alltoall, case %d" % case)
        got = np.full(want.size, 255, np.uint8)  # the explicit counts' entry (smc_alltoallv)
        shm.alltoallv(ffi.from_buffer(x) if x.size else ffi.NULL, matrix[me].tolist(),
                      ffi.from_buffer(got) if got.size else ffi.NULL, matrix[:, me].tolist(), 5, "alltoallv")
        np.testing.assert_array_equal(got, want, err_msg="alltoallv, case %d" % case)
    return True


@pytest.mark.parametrize("size", [2, 3, 4])
def test_alltoall_through_small_staging_halves(size):
    """Staging halves of 8 KiB: each window carries a chunk per peer, so parts of up to 100 KB take many windows, and
    the parts' sizes differ from pair to pair; both entries must give every byte to the right rank."""
    env = dict(FAST_TIMEOUT, SHMCOMM_SINGLE_COPY_BYTES="0", SHMCOMM_SLOT_BYTES="16384")
    assert multiproc.run(size, _windowed, size, timeout=120, env=env) == [True] * size


def _at(offset, nbytes, dtype, fill=None):
    """An array of nbytes at `offset` bytes past a page: where it sits decides which copy the core takes (see
    csrc/core/copy.h)."""
    room = np.zeros(nbytes + 2 * 4096 + offset, np.uint8)
    start = (-room.ctypes.data) % 4096 + offset
    array = room[start:start + nbytes].view(dtype)
    if fill is not None:
        array[...] = fill
    return array


def _placements(size):
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    # Output 0, 8, 16, 48, 64, 2064 and 4080 bytes past the input modulo a page, at sizes below and above the copies'
    # switch to their own loop (2 KiB) and across a staging half.
    def data(count, plus):  # every byte of every element varies, so no byte lost or stale can pass for the right one
        return ((np.arange(count, dtype=np.int64) * 2654435761 + plus) % (1 << 32)).astype(np.uint32).view(np.int32)

    for nbytes in (2056, 6000, 72_008, 300_000):
        n = nbytes // 4
        for shift in (0, 8, 16, 48, 64, 2064, 4080):
            src = _at(16 + (me % 2) * 32, nbytes, np.int32, data(n, me))
            out = _at(16 + shift, nbytes * size, np.int32, -1)
            got = shmcomm.allgather(src, output=out)
            want = np.concatenate([data(n, r) for r in range(size)])
            np.testing.assert_array_equal(got, want, err_msg="allgather, %d bytes, shift %d" % (nbytes, shift))
            out = _at(16 + shift, nbytes, np.int32, -1)
            shmcomm.broadcast(src, 1, output=out)
            np.testing.assert_array_equal(out, data(n, 1), err_msg="broadcast, %d bytes, shift %d" % (nbytes, shift))
            part = n // size
            send = _at(16, part * size * 4, np.int32, data(part * size, 1000 * me))
            out = _at(16 + shift, part * size * 4, np.int32, -1)
            shmcomm.alltoall(send, output=out)
            want = np.concatenate([data(part * size, 1000 * r)[me * part:(me + 1) * part] for r in range(size)])
            np.testing.assert_array_equal(out, want, err_msg="alltoall, %d bytes, shift %d" % (nbytes, shift))
            out = _at(16 + shift, nbytes, np.int32, -1)
            shmcomm.allreduce(src, op=shmcomm.Sum, output=out)
            np.testing.assert_array_equal(out, sum(data(n, r) for r in range(size)),
                                          err_msg="allreduce, %d bytes, shift %d" % (nbytes, shift))
    return True


@pytest.mark.parametrize("threshold", ["0", "1"])
def test_buffers_at_every_placement(threshold):
    """Outputs a few bytes past the input modulo a page take the core's own copy loop and, by single copy, a bounce
    buffer: both must give the same results as the plain copies, through the staging halves (0) and by single copy
    at every size (1), with a cache small enough that these sizes also take the chunked and streamed copies."""
    env = dict(FAST_TIMEOUT, SHMCOMM_SINGLE_COPY_BYTES=threshold, SHMCOMM_CACHE_BYTES="16384")
    assert multiproc.run(3, _placements, 3, timeout=180, env=env) == [True] * 3


def _single_copy_sizes():
    import shmcomm
    from shmcomm import basics
    from shmcomm.env import machine
    from shmcomm._native import lib

    shmcomm.init()
    handle = basics.communicator().shm.handle
    return (lib.smc_comm_single_copy(handle), lib.smc_comm_single_copy_from(handle, 0),
            lib.smc_comm_single_copy_from(handle, 1), lib.smc_comm_single_copy_learned(handle),
            machine.cache_bytes(2) or (1 << 20))


@pytest.mark.parametrize("size,setting", [(2, None), (3, None), (2, "5000"), (3, "0")])
def test_single_copy_sizes_after_the_probe_are_every_ranks_own(size, setting):
    """Unset, the defaults hold, and where any rank's kernel copy proved slow at init allgathers and alltoalls learn
    whether single copy pays (csrc/coll/cma.c): the same on every rank, since ranks that took different paths would
    wait for each other. A value set is kept as it is, never learned; 0 turns single copy off."""
    env = dict(FAST_TIMEOUT, **({"SHMCOMM_SINGLE_COPY_BYTES": setting} if setting else {}))
    got = multiproc.run(size, _single_copy_sizes, timeout=60, env=env)
    assert len(set(got)) == 1, got
    can, pieces, broadcasts, learned, l2 = got[0]
    if not can:
        assert pieces == broadcasts == learned == 0
        return
    cores = len(os.sched_getaffinity(0))
    if setting is not None:
        assert pieces == broadcasts == int(setting)
    else:
        default = 16384 * -(-size // cores)
        assert broadcasts == (default if size <= cores else max(default, l2)), got
        assert pieces == default, got
    assert learned in (0, 1) and (setting is None or learned == 0), got
