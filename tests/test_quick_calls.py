# SPDX-License-Identifier: Apache-2.0
"""The quick calls of csrc/py/quick_calls.c: a numpy allreduce or broadcast in one C call. They must agree with the
full path bit for bit (a rank on each path in one collective: same tag, same result), cover every dtype the core
reduces, leave every other array to the full path, and release the interpreter lock while they wait."""
import sys

import numpy as np
import pytest

import multiproc

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="the quick calls need Python 3.11's buffer API")
FAST_TIMEOUT = {"SHMCOMM_TIMEOUT": "20"}


class Plain(np.ndarray):
    """An ndarray subclass: the quick calls take exact ndarrays only, so a rank passing this takes the full path."""


def _mixed_paths():
    import shmcomm
    from shmcomm.quick_path import world

    shmcomm.init()
    size, me = shmcomm.size(), shmcomm.rank()
    calls = []
    real = world.allreduce
    world.allreduce = lambda *args: calls.append(args[0].dtype) or real(*args)
    dtypes = [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int16, np.int32, np.int64, np.longlong]
    for step, (dtype, shape) in enumerate((d, s) for d in dtypes for s in [(), (5,), (2, 3), (2, 1, 4)]):
        mine = np.array(np.arange(int(np.prod(shape))).reshape(shape) % 7 + me, dtype=dtype)  # 0-d included
        x = mine.view(Plain) if me == 1 else mine  # rank 1 on the full path, the others on the quick one
        want = sum((np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) % 7 + r) for r in range(size))
        got = shmcomm.allreduce(x, op=shmcomm.Sum)
        assert got.dtype == np.dtype(dtype) and got.shape == shape
        np.testing.assert_array_equal(np.asarray(got), want.astype(dtype))
        top = shmcomm.allreduce(x, op=shmcomm.Max)
        np.testing.assert_array_equal(np.asarray(top), (np.arange(int(np.prod(shape))).reshape(shape) % 7
                                                        + size - 1).astype(dtype))
        root = step % size
        sent = shmcomm.broadcast(x, root)
        np.testing.assert_array_equal(np.asarray(sent), (np.arange(int(np.prod(shape))).reshape(shape) % 7
                                                         + root).astype(dtype))
    average = shmcomm.allreduce_(np.full((3, 2), me + 1.0), op=shmcomm.Average)
    np.testing.assert_allclose(average, np.full((3, 2), (size + 1) / 2))
    scaled = shmcomm.allreduce(np.ones(4, np.float32), op=shmcomm.Sum, prescale_factor=2, postscale_factor=0.5)
    np.testing.assert_array_equal(scaled, np.full(4, size, np.float32))
    world.allreduce = real
    return len(calls)


@pytest.mark.parametrize("size", [2, 3])
def test_a_rank_on_the_full_path_and_ranks_on_the_quick_one_agree(size):
    counts = multiproc.run(size, _mixed_paths, timeout=120, env=FAST_TIMEOUT)
    assert counts[1] == 2  # rank 1 passed a subclass to all but the last two
    assert all(c == 9 * 4 * 2 + 2 for r, c in enumerate(counts) if r != 1), counts


def _left_to_the_full_path():
    """Arrays the quick calls must not take give the full path's results (bool and bfloat16 broadcast, byte-swapped,
    non-contiguous inputs), and Adasum never reaches them."""
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    flags = np.array([me == 0, True, False])
    np.testing.assert_array_equal(shmcomm.broadcast(flags, 0), [True, True, False])
    swapped = np.arange(4, dtype=">f4") + me
    np.testing.assert_array_equal(shmcomm.broadcast(swapped, 1), np.arange(4) + 1)
    strided = (np.arange(8, dtype=np.float32) + me)[::2]
    np.testing.assert_array_equal(shmcomm.allreduce(strided.copy(), op=shmcomm.Sum), np.arange(0, 8, 2) * 2 + 1)
    try:
        import ml_dtypes
    except ImportError:
        return True
    half = np.ones(3, ml_dtypes.bfloat16) * (me + 1)
    np.testing.assert_array_equal(shmcomm.allreduce(half, op=shmcomm.Sum).astype(np.float32), [3.0] * 3)
    return True


def test_arrays_outside_the_quick_calls_take_the_full_path():
    assert multiproc.run(2, _left_to_the_full_path, timeout=120, env=FAST_TIMEOUT) == [True, True]


def _torch_tensors():
    """CPU tensors take the quick call through kept views of their memory, bfloat16 ones as their int16 bits with the
    core told the type; rank 1 passes Parameters (the full path). Results equal the float32 reduction rounded once."""
    import torch

    import shmcomm
    from shmcomm.quick_path import world

    shmcomm.init()
    size, me = shmcomm.size(), shmcomm.rank()
    typed = []
    real = world.allreduce

    def quick(*args):  # what the call was told of the type, where it took it (not NotImplemented)
        got = real(*args)
        typed.append(args[5] if got is not NotImplemented else "declined")
        return got
    world.allreduce = quick
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for shape in [(), (7,), (3, 1000)]:
            for op in (shmcomm.Sum, shmcomm.Min, shmcomm.Max):
                ranks = [(torch.randn(shape, generator=torch.Generator().manual_seed(r)) * 3).to(dtype)
                         for r in range(size)]
                reduce = {shmcomm.Max: lambda xs: torch.stack(xs).max(0).values,
                          shmcomm.Min: lambda xs: torch.stack(xs).min(0).values}.get(op, sum)
                want = reduce([x.float() for x in ranks]).to(dtype)  # in rank order, in float32, rounded once
                mine = ranks[me].clone()
                x = torch.nn.Parameter(mine, requires_grad=False) if me == 1 else mine
                assert torch.equal(shmcomm.allreduce(x, op=op), want), (dtype, shape, op)
                assert torch.equal(shmcomm.allreduce_(x, op=op), want) and torch.equal(mine, want), (dtype, shape, op)
    errors = []
    for wrong in (torch.ones(3 + me, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16 if me else torch.int16)):
        try:
            shmcomm.allreduce_(wrong, op=shmcomm.Sum)
        except shmcomm.MismatchError as error:
            errors.append(type(error).__name__)
    world.allreduce = real
    return typed, errors


def test_torch_tensors_take_the_quick_call_bfloat16_too():
    for rank, (typed, errors) in enumerate(multiproc.run(3, _torch_tensors, timeout=120, env=FAST_TIMEOUT)):
        quick = 0 if rank == 1 else 2 * 3 * 3  # per dtype: two calls per op and shape, on the quick ranks
        assert typed[:3 * quick] == [1] * quick + [None] * 2 * quick, typed  # bfloat16 first: its type told (1)
        # another length, another dtype: every rank raises (the wrong tensors are plain tensors on every rank)
        assert typed[3 * quick:] == [1, 1 if rank else None] and errors == ["MismatchError"] * 2, (typed, errors)


def _threads_run_while_waiting():
    import threading
    import time

    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    shmcomm.barrier()
    if me == 1:
        time.sleep(1.0)  # rank 0 waits in a quick allreduce meanwhile
        return shmcomm.allreduce_(np.ones(2), op=shmcomm.Sum).tolist()
    ticks = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    start = ticks[0]
    time.sleep(0.2)  # the counter has the lock to itself: its rate
    before = ticks[0]
    waited = time.monotonic()
    result = shmcomm.allreduce_(np.ones(2), op=shmcomm.Sum).tolist()
    waited = time.monotonic() - waited
    during = ticks[0] - before
    stop.set()
    counter.join()
    return result, (before - start) / 0.2, during, waited


def test_the_interpreter_lock_is_released_while_a_quick_call_waits():
    """Rank 0 waits about 0.8 s in a quick allreduce for rank 1. With the lock held the counting thread would stand
    still (it could count for one switch interval, 5 ms, around the call); released, it counts most of the wait."""
    (result, rate, during, waited), other = multiproc.run(2, _threads_run_while_waiting, timeout=60,
                                                          env=FAST_TIMEOUT)
    assert result == other == [2.0, 2.0]
    assert waited > 0.5, waited
    assert during > 0.25 * rate, (during, rate)


def test_kept_tensor_views_follow_the_memory_and_never_hold_a_tensor():
    """vocabulary/buffers.held_view: one view per tensor memory, shape and dtype, found again; a tensor given new
    memory gets a view of that; nothing keeps a tensor alive; bfloat16 comes as its bits with the core's code."""
    torch = pytest.importorskip("torch")
    import gc
    import weakref

    from shmcomm.vocabulary import dtypes
    from shmcomm.vocabulary.buffers import held_view

    def over(kept, tensor):
        view = kept[0]
        return view.__array_interface__["data"][0] == tensor.data_ptr() and view.shape == tuple(tensor.shape)

    t = torch.arange(6.0).reshape(2, 3)
    first = held_view(t)
    assert over(first, t) and first[1] is None and held_view(t) is first  # kept
    first[0][0, 0] = 7.0
    assert t[0, 0] == 7.0
    t.set_(torch.arange(4.0))  # new memory under the same tensor
    assert over(held_view(t), t)
    bits = torch.ones(3, dtype=torch.bfloat16)
    assert over(held_view(bits), bits) and held_view(bits)[0].dtype == np.int16
    assert held_view(bits)[1] == dtypes.BFLOAT16 and held_view(bits.view(torch.int16))[1] is None
    assert held_view(torch.arange(6.0).reshape(2, 3).t()) is None  # not contiguous
    assert held_view(torch.ones(2, dtype=torch.bool)) is None and held_view(np.ones(2)) is None
    gone = torch.ones(5)
    held_view(gone)
    alive = weakref.ref(gone)
    del gone
    gc.collect()
    assert alive() is None
