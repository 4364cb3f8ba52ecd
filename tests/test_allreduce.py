# SPDX-License-Identifier: Apache-2.0
"""Allreduce over every dtype and op, world sizes 1-4, small and large counts, in place and out of place."""
import hashlib
import sys

import numpy as np
import pytest

import multiproc
from shmcomm.testing import exact
from shmcomm.testing.expected import expected_allreduce

DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64"]
COUNTS = [0, 1, 7, 1000, 40_001, 1_200_003]  # 1.2 M float32 crosses many staging steps


def _inputs(rank, count, dtype):
    # Small integers keep every sum and product exact in every dtype.
    rng = np.random.default_rng(1000 * rank + count)
    values = rng.integers(1, 4, size=count)
    return values.astype(dtype)


def _all_ops_all_dtypes(size, largest=COUNTS[-1]):
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    for dtype in DTYPES:
        for count in [c for c in COUNTS if c <= largest]:
            for op in ("Sum", "Min", "Max", "Product"):
                if count > 40_001 and (op != "Sum" or dtype not in ("float32", "int64", "float16")):
                    continue  # large counts: enough to cover the pipelined path per element size
                x = _inputs(me, count, dtype)
                # Integer products wrap like the C types.
                expected = expected_allreduce([_inputs(r, count, dtype) for r in range(size)], dtype, op)
                got = shmcomm.allreduce(x, op=getattr(shmcomm, op))
                assert got.dtype == x.dtype and got.shape == x.shape
                np.testing.assert_array_equal(got.astype(np.float64), np.asarray(expected, dtype).astype(np.float64),
                                              err_msg="%s %s count=%d" % (dtype, op, count))
                inplace = x.copy()
                assert shmcomm.allreduce_(inplace, op=getattr(shmcomm, op)) is inplace
                np.testing.assert_array_equal(inplace, got)
    return True


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_dtype_and_op(size):
    assert multiproc.run(size, _all_ops_all_dtypes, size, timeout=240) == [True] * size


def _one_step_sizes():
    import torch

    import shmcomm
    from shmcomm import basics

    shmcomm.init()
    me, shm = shmcomm.rank(), basics.communicator().shm
    taken = []
    for make, count in ((lambda v: v.astype(np.float32), 1024), (lambda v: v.astype(np.float16), 512),
                        (lambda v: v.astype(np.float16), 1024), (lambda v: torch.from_numpy(v).bfloat16(), 512),
                        (lambda v: torch.from_numpy(v).bfloat16(), 1024)):
        values = [np.arange(count, dtype=np.float32) % 13 + r for r in range(2)]
        before = shm.pieces()
        got = shmcomm.allreduce(make(values[me]), op=shmcomm.Sum)
        taken.append(shm.pieces() - before)
        got = got.float().numpy() if isinstance(got, torch.Tensor) else got.astype(np.float32)
        np.testing.assert_array_equal(got, values[0] + values[1])
    return taken


def test_sixteen_bit_floats_take_one_step_up_to_a_quarter_of_the_size():
    """Under SHMCOMM_SMALL_BYTES=4096 a float32 allreduce of 4 KiB takes the one-step path (no pieces), float16 and
    bfloat16 ones up to 1 KiB only: 2 KiB of them take the steps (their reduction converts every element to float
    and back, so reducing every rank's whole input on every rank costs them more). Sums exact either way."""
    assert multiproc.run(2, _one_step_sizes, env={"SHMCOMM_SMALL_BYTES": "4096"}) == [[0, 0, 1, 0, 1]] * 2


def _largest(piece):
    """The largest array of a run with SHMCOMM_PIECE_BYTES=piece: pieces of a cache line take a synchronised step per
    line, and the 40,001-element arrays already cross hundreds of them, where the largest would cross tens of
    thousands, minutes beside other work."""
    return 40_001 if piece is not None and int(piece) < 1000 else COUNTS[-1]


def _pieces(size, largest, piece=None):
    import shmcomm
    from shmcomm import basics

    _all_ops_all_dtypes(size, largest)
    me = shmcomm.rank()
    for count in (0, 5, 1001, 70_003):  # reduce-scatter ranges of every length, cut into many pieces
        x = np.arange(count * size, dtype=np.float64) + me
        got = shmcomm.reducescatter(x, op=shmcomm.Sum)
        full = sum(np.arange(count * size, dtype=np.float64) + r for r in range(size))
        np.testing.assert_array_equal(got, full[me * count:(me + 1) * count])
    # The path taken: a step per piece of `piece` bytes, rounded down to whole cache lines; by default, pulled steps
    # take the tuning's pieces and staged ones a half's share (a synchronisation each).
    shm = basics.communicator().shm
    share = shm.tuning.slot_bytes // 2 // size // 64 * 64
    pulled = shm.pulled_calls()
    before = shm.pieces()
    shmcomm.reducescatter(np.ones(70_003 * size), op=shmcomm.Sum)
    pulled = shm.pulled_calls() > pulled
    if piece is not None:
        section = int(piece) // 64 * 64
    else:
        section = min(shm.tuning.piece_bytes or share, share) // 64 * 64 if pulled else share
    per_piece = section // 8
    assert shm.pieces() - before == -(-70_003 // per_piece), (shm.pieces() - before, per_piece, pulled)
    return True


@pytest.mark.parametrize("piece", ["1000", pytest.param("64", marks=pytest.mark.long)])
def test_pieces_smaller_than_a_half(piece):
    """SHMCOMM_PIECE_BYTES cuts each rank's range into many steps, down to one cache line per step (1000 rounds
    down to 960 bytes: 480, 240 and 120 elements of 2, 4 and 8 bytes)."""
    assert multiproc.run(3, _pieces, 3, _largest(piece), piece, timeout=240,
                         env={"SHMCOMM_PIECE_BYTES": piece}) == [True] * 3


def _pieces_and_scaling(size, largest, piece):
    from shmcomm import basics

    _pieces(size, largest, piece)
    digest = _average_and_scaling(size)
    return digest, basics.communicator().shm.pulled_calls()


@pytest.mark.parametrize("size,pull,piece", [(2, "0", None), (3, "1", None), (2, "1", "1000"),
                                             pytest.param(4, "1", "64", marks=pytest.mark.long)])
def test_pulled_and_staged_pieces(size, pull, piece):
    """Both ways of handing out the reduced pieces (csrc/coll/allreduce.c), whatever init's probe found: through the
    staging halves (SHMCOMM_PULL_BYTES=0) and pulled (a set threshold forces it), each rank reading its range of the
    peers' inputs and writing it into their outputs, at every pipelined size, with more ranks than the default pulls
    for and down to one cache line per piece. Every dtype and op, in place and out of place, and reduce-scatters;
    the core's counter says which way the calls went."""
    env = {"SHMCOMM_PULL_BYTES": pull, **({"SHMCOMM_PIECE_BYTES": piece} if piece else {})}
    got = multiproc.run(size, _pieces_and_scaling, size, _largest(piece), piece, timeout=240, env=env)
    assert len({digest for digest, _ in got}) == 1, got
    pulled = [calls for _, calls in got]
    assert pulled == [pulled[0]] * size and (pulled[0] > 0) == (pull == "1"), pulled


def _pulled_or_staged(size, pulling_ranks):
    """Allreduces and reduce-scatters of 80 KiB and more where the ranks in `pulling_ranks` would pull
    (SHMCOMM_PULL_BYTES=1) and the others would not (0): they pull only if all would, and the results are the same
    either way. Returns how many calls pulled on this rank, of how many."""
    import os

    import shmcomm
    from shmcomm import basics

    me = int(os.environ["SHMCOMM_RANK"])
    os.environ["SHMCOMM_PULL_BYTES"] = "1" if me in pulling_ranks else "0"
    shmcomm.init()
    shm = basics.communicator().shm
    before = shm.pulled_calls()
    calls = 0
    for count in (40_001, 300_007, 1_200_003):
        for dtype in ("float32", "int64", "float16"):
            x = _inputs(me, count, dtype)
            want = np.asarray(expected_allreduce([_inputs(r, count, dtype) for r in range(size)], dtype, "Sum"), dtype)
            np.testing.assert_array_equal(shmcomm.allreduce(x, op=shmcomm.Sum), want)
            inplace = x.copy()
            shmcomm.allreduce_(inplace, op=shmcomm.Sum)
            np.testing.assert_array_equal(inplace, want)
            # Input and output apart, inside one array: the output's bytes before and after stay as they were.
            room = np.full(3 * count, 7, dtype)
            room[:count] = x
            shmcomm.allreduce(room[:count], op=shmcomm.Sum, output=room[count + 5:2 * count + 5])
            np.testing.assert_array_equal(room[count + 5:2 * count + 5], want)
            assert (room[count:count + 5] == 7).all() and (room[2 * count + 5:] == 7).all()
            calls += 3
    # Prescale, postscale and Average take the same path.
    x = np.full(300_000, me + 1.0)
    np.testing.assert_allclose(shmcomm.allreduce(x, prescale_factor=2.0, postscale_factor=0.5),
                               sum(range(1, size + 1)) / size)
    calls += 1
    # Reduce-scatter pulls its own range and writes nothing into the peers' outputs, with rows that do not divide
    # evenly (the first ranks get one more) and an output of its own.
    for rows in (20_001, 300_001):
        x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + me
        full = sum(np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + r for r in range(size))
        share = [rows // size + (r < rows % size) for r in range(size)]
        mine = full[sum(share[:me]):sum(share[:me + 1])]
        np.testing.assert_array_equal(shmcomm.reducescatter(x, op=shmcomm.Sum), mine)
        out = np.full_like(mine, -1)
        shmcomm.reducescatter(x, op=shmcomm.Sum, output=out)
        np.testing.assert_array_equal(out, mine)
        calls += 2
    from shmcomm._native import lib

    return shm.pulled_calls() - before, calls, lib.smc_comm_pull_from(shm.handle)


@pytest.mark.parametrize("size,pulling", [(2, (0, 1)), (2, (1,)), (3, (0, 1, 2)), (3, (0, 2))])
def test_ranks_pull_only_where_every_rank_would(size, pulling):
    """csrc/coll/allreduce.c, pulled: where every rank would pull, every allreduce and reduce-scatter does (a set
    SHMCOMM_PULL_BYTES forces the path, whatever init's speed probe found); where one would not, none does, the
    others take their first copy late and the results are the same."""
    got = multiproc.run(size, _pulled_or_staged, size, pulling, timeout=180)
    calls = got[0][1]
    if len(pulling) < size:
        assert [p for p, _, _ in got] == [0] * size, got
        return
    assert got[0][2] == 1, got  # the forced threshold, not the probe's verdict
    assert [p for p, _, _ in got] == [calls] * size, got


def _dies_while_pulling(victim):
    import os
    import signal
    import threading
    import time

    import shmcomm
    from shmcomm import basics

    shmcomm.init()
    me = shmcomm.rank()
    x = np.ones(1 << 20, np.float32)  # 4 MiB: 8 pieces of each rank's range
    if me == victim:  # killed in the middle of its calls, whichever step it is in
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(shmcomm.RankFailure) as info:
        while time.monotonic() - start < 30:
            shmcomm.allreduce_(x, op=shmcomm.Max)
            shmcomm.reducescatter(x, op=shmcomm.Max)
    return info.value.rank, time.monotonic() - start < 15, basics.communicator().shm.pulled_calls() > 0


def test_a_rank_that_dies_while_pulling_is_named():
    """Killed while the ranks read each other's inputs and write into each other's outputs by the kernel's copy:
    the survivor raises RankFailure naming it within the timeout instead of waiting, and leaves no segment behind
    (multiproc checks)."""
    results = multiproc.run(2, _dies_while_pulling, 1, timeout=60, check=False,
                            env={"SHMCOMM_TIMEOUT": "10", "SHMCOMM_PULL_BYTES": str(128 << 10)})
    assert results[1][0] == "died", results
    assert results[0][0] == "ok" and results[0][1] == (1, True, True), results


def _outputs_past_the_cache(size):
    """Out-of-place allreduces whose results bypass the cache (SHMCOMM_SHARED_CACHE_BYTES at its floor: every
    pipelined size), into outputs at every offset from a 16-byte boundary: the same bits as in place; and
    reduce-scatters, whose outputs bypass it the same way."""
    import shmcomm

    _all_ops_all_dtypes(size)
    me = shmcomm.rank()
    digests = []
    for count in (40_001, 300_003):
        x = np.random.default_rng(me + count).standard_normal(count).astype(np.float32)
        for shift in range(4):
            out = np.empty(count + 4, np.float32)[shift:shift + count]
            assert shmcomm.allreduce(x, op=shmcomm.Sum, output=out) is out
            inplace = x.copy()
            shmcomm.allreduce_(inplace, op=shmcomm.Sum)
            assert out.tobytes() == inplace.tobytes(), (count, shift)
        digests.append(hashlib.sha256(out.tobytes()).hexdigest())
    for count in (1001, 70_003):
        every = [np.random.default_rng(10 * r + count).integers(0, 100, count * size).astype(np.float32)
                 for r in range(size)]
        got = shmcomm.reducescatter(every[me], op=shmcomm.Sum)
        np.testing.assert_array_equal(got, np.sum(every, axis=0)[me * count:(me + 1) * count])
    return digests


@pytest.mark.parametrize("size,pull", [(2, "0"), (2, "1"), (3, "1")])
def test_outputs_that_bypass_the_cache(size, pull):
    """Staged and pulled, the reduced pieces reach an output apart from the input by streaming stores (csrc/coll/
    allreduce.c, bypasses) where the data outgrow the last-level cache: forced here at every pipelined size, for
    allreduces and reduce-scatters."""
    env = {"SHMCOMM_PULL_BYTES": pull, "SHMCOMM_SHARED_CACHE_BYTES": "4096"}
    digests = multiproc.run(size, _outputs_past_the_cache, size, timeout=240, env=env)
    assert all(d == digests[0] for d in digests), digests


def _average_and_scaling(size):
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    # Average on integers is exact when it divides, as Horovod's tests expect.
    ints = np.arange(10, dtype=np.int32) * size
    np.testing.assert_array_equal(shmcomm.allreduce(ints), np.arange(10) * size)
    # ... and truncates toward zero otherwise.
    odd = np.array([me + 1, -(me + 1)], dtype=np.int64)
    total = sum(range(1, size + 1))
    np.testing.assert_array_equal(shmcomm.allreduce(odd, op=shmcomm.Average), [int(total / size), -int(total / size)])
    # float Average, pre- and postscale.
    x = np.full(1000, float(me + 1), dtype=np.float32)
    np.testing.assert_allclose(shmcomm.allreduce(x), total / size, rtol=1e-6)
    np.testing.assert_allclose(shmcomm.allreduce(x, op=shmcomm.Sum, prescale_factor=0.5, postscale_factor=3.0),
                               total * 1.5, rtol=1e-6)
    np.testing.assert_allclose(shmcomm.allreduce(x, average=False), total, rtol=1e-6)
    # fp16: many ranks of 60000 sum past the format's range -> inf; a prescale keeps it finite.
    big = np.full(16, 60000.0, dtype=np.float16)
    assert np.isinf(shmcomm.allreduce(big, op=shmcomm.Sum)).all() == (size > 1)
    np.testing.assert_allclose(shmcomm.allreduce(big, op=shmcomm.Sum, prescale_factor=1.0 / size), 60000.0, rtol=1e-3)
    # fp16 accumulates in float and rounds once: 0.1 summed over ranks is the rounded exact sum.
    tenth = np.full(8, 0.1, dtype=np.float16)
    want = np.float16(np.float32(np.float16(0.1)) * size)
    assert shmcomm.allreduce(tenth, op=shmcomm.Sum)[0] == want
    # Results are bit-identical on every rank, even for float sums whose order matters: the test compares digests
    # of all their bytes.
    noisy = np.random.default_rng(me).standard_normal(300_001).astype(np.float32)
    got = shmcomm.allreduce(noisy, op=shmcomm.Sum)
    every = [np.random.default_rng(r).standard_normal(300_001).astype(np.float32) for r in range(size)]
    np.testing.assert_allclose(got, np.sum(every, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)
    return hashlib.sha256(got.tobytes()).hexdigest()


@pytest.mark.parametrize("size", [1, 2, 3])
def test_average_scaling_and_fp16(size):
    digests = multiproc.run(size, _average_and_scaling, size, timeout=120)
    assert len(set(digests)) == 1, digests


@pytest.mark.parametrize("size", [3, 4])
def test_exact_checks_on_one_host(size):
    """shmcomm/testing/exact.py: every collective, dtype (bfloat16 too, where torch is) and op against expectations
    computed with numpy, and the digests of every rank's results compared here."""
    reports = multiproc.run(size, exact.run_checks, timeout=180)
    exact.assert_identical(reports)
    exact.assert_rounding_is_visible(size)
    exact.assert_rounds_once(reports)


def _rounding_only():
    import shmcomm

    shmcomm.init()
    report = exact.Report(shmcomm.rank(), shmcomm.size())
    exact.check_rounding(shmcomm, report, ["float16", "bfloat16"] if "torch" in sys.modules else ["float16"])
    return report.as_dict()


def test_16_bit_sums_round_once_with_eight_ranks():
    reports = multiproc.run(8, _rounding_only, timeout=120)
    exact.assert_identical(reports)
    exact.assert_rounding_is_visible(8)
    exact.assert_rounds_once(reports)


def _bfloat16_torch(size):
    import torch

    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    x = torch.full((5000,), 1.5, dtype=torch.bfloat16) * (me + 1)
    got = shmcomm.allreduce(x, op=shmcomm.Sum)
    assert got.dtype == torch.bfloat16
    want = torch.tensor(float(1.5 * sum(range(1, size + 1))), dtype=torch.bfloat16)
    assert torch.equal(got, torch.full((5000,), want.item(), dtype=torch.bfloat16))
    return True


def test_bfloat16_with_torch():
    pytest.importorskip("torch")
    assert multiproc.run(3, _bfloat16_torch, 3, timeout=120) == [True] * 3


def _many_ranks(size):
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    for count in (1, 4096, 300_000):
        got = shmcomm.allreduce(np.full(count, me, dtype=np.float64), op=shmcomm.Sum)
        assert (got == sum(range(size))).all()
    shmcomm.barrier()
    return True


def test_eight_ranks_on_two_cores():
    assert multiproc.run(8, _many_ranks, 8, timeout=120) == [True] * 8


def _paths_of_repeated_calls(size):
    import shmcomm
    from shmcomm import basics

    shmcomm.init()
    shm = basics.communicator().shm
    me = shmcomm.rank()
    x = np.arange(1 << 18, dtype=np.float32) % 251 + me  # 1 MiB: pulled or staged, never the one-step path
    want = sum(np.arange(1 << 18, dtype=np.float32) % 251 + r for r in range(size))
    paths = ""
    for i in range(60):
        before = shm.pulled_calls()
        if i % 2:
            y = x.copy()
            shmcomm.allreduce_(y, op=shmcomm.Sum)
        else:
            y = shmcomm.allreduce(x, op=shmcomm.Sum)
        np.testing.assert_array_equal(y, want)
        paths += "P" if shm.pulled_calls() > before else "s"
    return paths


def test_where_the_kernels_copy_is_slow_each_rank_learns_whether_pulling_pays():
    """csrc/coll/path_choice.c through the core: with the defaults at two ranks, a size pulls from its first call
    where init found the kernel's copy fast, and elsewhere takes each path in turn while it learns their costs, then
    mostly the cheaper. Every call's result is exact, and both ranks always took the same path."""
    paths = multiproc.run(2, _paths_of_repeated_calls, 2, timeout=120)
    assert paths[0] == paths[1], paths
    assert paths[0] == "P" * 60 or (paths[0][:4] == "PsPs" and set(paths[0][4:]) == {"P", "s"}), paths
