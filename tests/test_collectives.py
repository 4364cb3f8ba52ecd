# SPDX-License-Identifier: Apache-2.0
"""Broadcast, allgather, reduce-scatter, alltoall and barrier, with uneven shapes and every root."""
import numpy as np
import pytest

import multiproc

SIZES = [1, 2, 3, 4]


def _broadcast(size):
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    for root in range(size):
        for count in (0, 1, 13, 700_001):  # 700k float64 = 5.6 MB: many staging steps
            x = np.arange(count, dtype=np.float64) + 1000 * me
            want = np.arange(count, dtype=np.float64) + 1000 * root
            np.testing.assert_array_equal(shmcomm.broadcast(x, root_rank=root), want)
            assert shmcomm.broadcast_(x, root) is x
            np.testing.assert_array_equal(x, want)
        flags = np.array([me == root] * 3)  # bool moves even though it does not reduce
        assert shmcomm.broadcast(flags, root).all()
    return True


@pytest.mark.parametrize("size", SIZES)
def test_broadcast_every_root(size):
    assert multiproc.run(size, _broadcast, size, timeout=120) == [True] * size


def _early_broadcasts(calls):
    """Small broadcasts return early (the root once it has published, a receiver once it has read): back to back from
    rotating roots, with other collectives between, no rank may overwrite a half another still reads."""
    import shmcomm

    shmcomm.init()
    me, n = shmcomm.rank(), shmcomm.size()
    rng = np.random.default_rng(7)  # the same sequence of calls on every rank
    for i in range(calls):
        root, count = int(rng.integers(n)), int(rng.choice([1, 3, 64, 1000, 4000]))
        x = np.full(count, -1.0) if me != root else np.arange(count, dtype=np.float64) + 1_000_000 * i
        np.testing.assert_array_equal(shmcomm.broadcast_(x, root), np.arange(count, dtype=np.float64) + 1_000_000 * i)
        if i % 7 == 3:
            assert shmcomm.allreduce(np.full(5, i), op=shmcomm.Sum).tolist() == [n * i] * 5
        if i % 11 == 5:
            assert shmcomm.allgather(np.full((1, 2), me + i)).tolist() == [[r + i] * 2 for r in range(n)]
    return True


@pytest.mark.parametrize("size", [2, 4])
def test_early_broadcasts_back_to_back_keep_every_value(size):
    assert multiproc.run(size, _early_broadcasts, 3000, timeout=120) == [True] * size


def _allgather(size):
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    for rows in (lambda r: r + 1, lambda r: 0 if r % 2 else 3, lambda r: 200_000 * (r + 1)):
        x = np.full((rows(me), 3), me, dtype=np.int16)
        got = shmcomm.allgather(x)
        want = np.concatenate([np.full((rows(r), 3), r, dtype=np.int16) for r in range(size)])
        np.testing.assert_array_equal(got, want)
    scalar = shmcomm.allgather(np.array(me + 0.5))
    np.testing.assert_array_equal(scalar, np.arange(size) + 0.5)
    return True


@pytest.mark.parametrize("size", SIZES)
def test_allgather_uneven(size):
    assert multiproc.run(size, _allgather, size, timeout=120) == [True] * size


def _reducescatter(size):
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    for rows in (size, 2 * size + 1, 1, 0, 100_003):
        x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + me
        got = shmcomm.reducescatter(x, op=shmcomm.Sum)
        full = sum(np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + r for r in range(size))
        shares = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
        start = sum(shares[:me])
        np.testing.assert_array_equal(got, full[start:start + shares[me]])
    avg = shmcomm.reducescatter(np.full((size * 2, 2), float(me), dtype=np.float64))  # default op: Average
    np.testing.assert_allclose(avg, np.full((2, 2), (size - 1) / 2))
    return True


@pytest.mark.parametrize("size", SIZES)
def test_reducescatter_uneven(size):
    assert multiproc.run(size, _reducescatter, size, timeout=120) == [True] * size


def _alltoall(size):
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    even = np.repeat(np.arange(size) + 10 * me, 2).astype(np.int64)
    got = shmcomm.alltoall(even)
    np.testing.assert_array_equal(got, np.repeat(np.arange(size) * 10 + me, 2))
    # Explicit splits: rank me sends (j + me) % 3 rows to rank j.
    splits = [(j + me) % 3 for j in range(size)]
    rows = np.concatenate([np.full((s, 2), 100 * me + j, dtype=np.float32) for j, s in enumerate(splits)])
    out, received = shmcomm.alltoall(rows, splits=splits)
    want_counts = [(me + j) % 3 for j in range(size)]
    np.testing.assert_array_equal(received, want_counts)
    want = np.concatenate([np.full(((me + j) % 3, 2), 100 * j + me, dtype=np.float32) for j in range(size)])
    np.testing.assert_array_equal(out, want)
    big = np.full((size * 150_000,), me, dtype=np.float64)  # 1.2 MB per peer: several steps
    np.testing.assert_array_equal(shmcomm.alltoall(big), np.repeat(np.arange(size, dtype=np.float64), 150_000))
    shmcomm.barrier()
    return True


@pytest.mark.parametrize("size", SIZES)
def test_alltoall_splits(size):
    assert multiproc.run(size, _alltoall, size, timeout=120) == [True] * size


def _torch_tensors(size):
    import torch

    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) + me
    total = shmcomm.allreduce(t, op=shmcomm.Sum)
    assert isinstance(total, torch.Tensor) and torch.equal(total, (torch.arange(6.0).reshape(2, 3) * size
                                                                   + sum(range(size))))
    shmcomm.allreduce_(t, op=shmcomm.Max)
    assert torch.equal(t, torch.arange(6.0).reshape(2, 3) + size - 1)
    g = shmcomm.allgather(torch.full((me + 1,), me, dtype=torch.int64))
    assert g.tolist() == [r for r in range(size) for _ in range(r + 1)]
    b = shmcomm.broadcast(torch.tensor([me, me], dtype=torch.int32), root_rank=size - 1)
    assert b.tolist() == [size - 1] * 2
    out, splits = shmcomm.alltoall(torch.arange(size) + 10 * me, splits=torch.ones(size, dtype=torch.int32))
    assert isinstance(splits, torch.Tensor) and splits.tolist() == [1] * size
    assert out.tolist() == [10 * r + me for r in range(size)]
    return True


def test_torch_cpu_tensors():
    pytest.importorskip("torch")
    assert multiproc.run(3, _torch_tensors, 3, timeout=120) == [True] * 3


def _torch_allreduce_kinds():
    import torch

    import shmcomm

    shmcomm.init()
    me, n = shmcomm.rank(), shmcomm.size()
    # the quick call through a numpy view (float32, a leaf that requires grad, an output given) and the full path
    # (bfloat16, a Parameter) give the same sums; in place keeps the tensor; a view that is not contiguous is refused
    plain = torch.full((5,), float(me))
    assert shmcomm.allreduce_(plain, op=shmcomm.Sum) is plain and plain.tolist() == [float(sum(range(n)))] * 5
    leaf = torch.full((3,), 1.0, requires_grad=True)
    total = shmcomm.allreduce(leaf, op=shmcomm.Sum)
    assert total.tolist() == [float(n)] * 3 and leaf.tolist() == [1.0] * 3
    out = torch.empty(4, dtype=torch.int64)
    assert shmcomm.allreduce(torch.full((4,), me), op=shmcomm.Max, output=out) is out and out.tolist() == [n - 1] * 4
    for tensor in (torch.full((6,), 2.0, dtype=torch.bfloat16), torch.nn.Parameter(torch.full((2,), 2.0))):
        assert shmcomm.allreduce(tensor, op=shmcomm.Sum).tolist() == [2.0 * n] * tensor.numel()
    with pytest.raises(shmcomm.InvalidArgumentError, match="contiguous"):
        shmcomm.allreduce(torch.full((4, 4), 2.0)[:, 1], op=shmcomm.Sum)
    with pytest.raises(shmcomm.MismatchError):  # a failed quick call explains itself as the full path does
        shmcomm.allreduce_(torch.ones(2 + me), op=shmcomm.Sum)
    return True


def test_torch_tensors_take_the_quick_allreduce_and_keep_their_semantics():
    pytest.importorskip("torch")
    assert multiproc.run(2, _torch_allreduce_kinds, timeout=120) == [True] * 2


def _into_output():
    import shmcomm

    shmcomm.init()
    x = np.arange(100_000, dtype=np.float32)
    out = np.empty_like(x)
    assert shmcomm.allreduce(x, op=shmcomm.Sum, output=out) is out
    np.testing.assert_array_equal(out, x * 2)
    assert shmcomm.broadcast(x + shmcomm.rank(), 1, output=out) is out
    np.testing.assert_array_equal(out, x + 1)
    with pytest.raises(shmcomm.InvalidArgumentError, match="output is float64"):
        shmcomm.allreduce(x, output=np.empty(100_000))
    with pytest.raises(shmcomm.InvalidArgumentError, match="output is float32"):
        shmcomm.allreduce(x, output=np.empty(10, np.float32))
    return True


def test_results_into_a_given_output():
    assert multiproc.run(2, _into_output) == [True, True]


def _torch_reducescatter_with_empty_shares(size):
    import torch

    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    rows = size - 1  # the last rank's share is empty
    full = sum(torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + r for r in range(size))
    got = shmcomm.reducescatter(torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + me, op=shmcomm.Sum)
    assert torch.equal(got, full[me:me + 1]), (me, got)
    return True


def _reducescatter_into_no_output_where_the_share_is_empty(size):
    """The core itself: the rank whose share is empty passes NULL as its output (XLA does, for an empty result)."""
    import shmcomm
    from shmcomm import basics
    from shmcomm._native import ffi, lib

    shmcomm.init()
    me = shmcomm.rank()
    counts = [2] * (size - 1) + [0]
    data = np.arange(sum(counts), dtype=np.float32) + me
    out = np.zeros(counts[me], np.float32)
    dst = ffi.from_buffer(out) if counts[me] else ffi.NULL
    basics.communicator().shm.reducescatter(ffi.from_buffer(data), dst, counts, lib.SMC_FLOAT32, lib.SMC_SUM, 1.0, 1.0,
                                            1, 0, "reducescatter")
    full = sum(np.arange(sum(counts), dtype=np.float32) + r for r in range(size))
    return out.tolist() == full[2 * me:2 * me + counts[me]].tolist()


def test_reducescatter_takes_no_output_on_a_rank_whose_share_is_empty():
    assert multiproc.run(3, _reducescatter_into_no_output_where_the_share_is_empty, 3, timeout=60) == [True] * 3


def test_reducescatter_of_torch_tensors_leaves_some_ranks_none():
    """An empty torch tensor's data pointer is NULL: the ranks whose share is empty must still take part."""
    pytest.importorskip("torch")
    assert multiproc.run(3, _torch_reducescatter_with_empty_shares, 3, timeout=60) == [True] * 3
