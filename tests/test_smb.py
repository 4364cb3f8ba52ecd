# SPDX-License-Identifier: Apache-2.0
"""Soft Memory Box across processes: visibility, exact concurrent accumulation, versions, locks, bounds."""
import time

import numpy as np
import pytest

import multiproc


def _share_and_see():
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    if me == 0:
        box = shmcomm.SoftMemoryBox("params", shape=(4, 5), dtype=np.float64, create=True)
        assert box.version == 0 and (box.read() == 0).all()  # a new box is zero-filled
        box.write(np.arange(20.0).reshape(4, 5))
    shmcomm.barrier()
    box = shmcomm.SoftMemoryBox("params", timeout=5)  # attach by name
    assert box.dtype == np.float64 and box.count == 20
    np.testing.assert_array_equal(box.read().reshape(-1), np.arange(20.0))
    np.testing.assert_array_equal(box.view().reshape(-1), np.arange(20.0))
    np.testing.assert_array_equal(box.read(offset=3, count=2), [3.0, 4.0])
    shmcomm.barrier()
    if me == 1:
        box.write(np.array([-1.0, -2.0]), offset=18)
    shmcomm.barrier()
    assert box.read(offset=18, count=2).tolist() == [-1.0, -2.0]
    same = shmcomm.SoftMemoryBox("params", shape=(4, 5), dtype=np.float64)  # create-or-attach
    with pytest.raises(shmcomm.BoxExistsError):
        shmcomm.SoftMemoryBox("params", shape=(3,), dtype=np.float64)
    with pytest.raises(shmcomm.BoxExistsError):
        shmcomm.SoftMemoryBox("params", shape=(4, 5), dtype=np.float64, create=True)
    same.close()
    return box.version


def test_boxes_are_shared_by_name():
    versions = multiproc.run(2, _share_and_see)
    assert versions == [2, 2]


def _hammer(size, rounds):
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    box = shmcomm.SoftMemoryBox("sum", shape=(1000,), dtype=np.int64)
    fbox = shmcomm.SoftMemoryBox("fsum", shape=(70_000,), dtype=np.float32)
    shmcomm.barrier()
    one = np.full(1000, me + 1, dtype=np.int64)
    ones = np.ones(70_000, dtype=np.float32)
    for _ in range(rounds):
        box.accumulate(one)
        fbox.accumulate(ones)
    shmcomm.barrier()
    return box.read().tolist(), fbox.read()[::999].tolist(), box.version


def test_concurrent_accumulate_loses_no_update():
    size, rounds = 4, 300
    results = multiproc.run(size, _hammer, size, rounds, timeout=120)
    want = rounds * sum(range(1, size + 1))
    for values, fvalues, version in results:
        assert values == [want] * 1000
        assert fvalues == [float(size * rounds)] * len(fvalues)
        assert version == size * rounds


def _axpby():
    import shmcomm

    shmcomm.init()
    box = shmcomm.SoftMemoryBox("w", shape=(3,), dtype=np.float32)
    box.write(np.array([1.0, 2.0, 3.0]))
    v = box.accumulate(np.array([10.0, 10.0, 10.0]), alpha=0.5, beta=2.0)  # w = 2w + 0.5*10
    np.testing.assert_allclose(box.read(), [7.0, 9.0, 11.0])
    assert v == 2
    ints = shmcomm.SoftMemoryBox("i", shape=(2,), dtype=np.int8)
    ints.write(np.array([127, -128], dtype=np.int8))
    ints.accumulate(np.array([1, -1], dtype=np.int8))  # exact integer sums wrap like the C type
    assert ints.read().tolist() == [-128, 127]
    with pytest.raises(shmcomm.InvalidArgumentError, match="outside box"):
        box.write(np.ones(2, np.float32), offset=2)
    with pytest.raises(shmcomm.InvalidArgumentError, match="outside box"):
        box.read(offset=4, count=1)
    with pytest.raises(shmcomm.InvalidArgumentError, match="holds int8"):
        ints.accumulate(np.ones(2, dtype=np.float32))  # would truncate: refused
    with pytest.raises(shmcomm.BoxNotFoundError):
        shmcomm.SoftMemoryBox("absent", timeout=0.05)
    with pytest.raises(shmcomm.InvalidArgumentError):
        shmcomm.SoftMemoryBox("x" * 100, shape=(1,))
    with pytest.raises(shmcomm.InvalidArgumentError):
        box.unlock()  # not held
    box.destroy()
    with pytest.raises(shmcomm.BoxNotFoundError):
        shmcomm.SoftMemoryBox("w", timeout=0.01)
    again = shmcomm.SoftMemoryBox("w", shape=(2,), dtype=np.float32)  # the space is reused, zeroed
    assert again.read().tolist() == [0.0, 0.0]
    with pytest.raises(shmcomm.OutOfMemoryError, match="arena is full"):
        shmcomm.SoftMemoryBox("huge", shape=(1 << 40,), dtype=np.uint8)
    return True


def test_accumulate_rule_bounds_and_lifecycle():
    assert multiproc.run(1, _axpby) == [True]


def _versions_and_locks():
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    box = shmcomm.SoftMemoryBox("v", shape=(4,), dtype=np.float64)
    shmcomm.barrier()
    if me == 0:
        time.sleep(0.2)
        box.write(np.full(4, 5.0))
        with box.locked():  # the lock is recursive: operations inside it do not deadlock
            box.accumulate(np.ones(4))
            box.accumulate(np.ones(4))
            held_until = time.monotonic() + 0.3
            time.sleep(0.3)
        return held_until
    seen = box.wait_version(1, timeout=10)  # sleeps until rank 0 writes
    assert seen >= 1
    with pytest.raises(shmcomm.TimeoutError):
        box.wait_version(100, timeout=0.1)
    box.wait_version(3, timeout=10)
    box.lock(timeout=10)
    acquired = time.monotonic()
    box.unlock()
    # While rank 0 held the lock nobody could see the first accumulate without the second.
    assert box.read().tolist() == [7.0] * 4
    return acquired


def test_versions_wake_waiters_and_locks_exclude():
    held_until, acquired = multiproc.run(2, _versions_and_locks)
    assert acquired >= held_until - 0.05


def _dead_holder(locked):
    import os
    import signal

    import shmcomm

    shmcomm.init()
    box = shmcomm.SoftMemoryBox("l", shape=(1,), dtype=np.float32)
    shmcomm.barrier()
    if shmcomm.rank() == 1:
        box.lock()
        locked.set()
        os.kill(os.getpid(), signal.SIGKILL)
    assert locked.wait(60)  # rank 1 holds the lock, and dies holding it (or has died already)
    version = box.accumulate(np.ones(1, np.float32))  # the dead holder's lock passes on; no deadlock
    return box.read().tolist(), version


def test_lock_of_a_dead_holder_is_recovered():
    results = multiproc.run(2, _dead_holder, multiproc.Event(), check=False)
    # The taker that recovered the lock bumped the version (1), then accumulated (2): readers can tell.
    assert results[0] == ("ok", ([1.0], 2)) and results[1][0] == "died"


def _bad_spans():
    import shmcomm

    shmcomm.init()
    box = shmcomm.SoftMemoryBox("spans", shape=(8,), dtype=np.float32)
    calls = {
        "read offset": lambda: box.read(offset=-1),
        "read count": lambda: box.read(count=-2),
        "read offset type": lambda: box.read(offset=1.5),
        "write offset": lambda: box.write(np.ones(2, np.float32), offset=-3),
        "accumulate offset": lambda: box.accumulate(np.ones(2, np.float32), offset=-1),
        "past the end": lambda: box.write(np.ones(2, np.float32), offset=7),
    }
    raised = {}
    for name, call in calls.items():
        with pytest.raises(shmcomm.InvalidArgumentError) as info:
            call()
        raised[name] = str(info.value)
    assert box.read().tolist() == [0.0] * 8  # nothing was touched
    return raised


def test_negative_offsets_and_counts_are_invalid_arguments():
    """Not cffi's OverflowError: the library's typed error, naming the box and the argument."""
    raised = multiproc.run(1, _bad_spans)[0]
    assert "offset must be a non-negative integer, got -1" in raised["read offset"]
    assert "count must be a non-negative integer, got -2" in raised["read count"]
    assert "got 1.5" in raised["read offset type"]
    assert all("box 'spans'" in text for text in raised.values()), raised
