# SPDX-License-Identifier: Apache-2.0
"""Buffers that peers reach by the kernel's copy are collapsed into transparent huge pages the second time they are
used so (csrc/coll/huge_pages.c, SHMCOMM_HUGE_PAGES): allgather's output, alltoall's input and broadcast's buffer,
with exact results before and after; a range is collapsed once, one used once is left alone, and
SHMCOMM_HUGE_PAGES=0 leaves every buffer as it is."""
import ctypes
import mmap
import os
import re

import numpy as np
import pytest

import multiproc

MADV_COLLAPSE = 25
HUGE = 2 << 20
# Every collective of these tests by single copy, at every size.
SINGLE = {"SHMCOMM_SINGLE_COPY_BYTES": "1", "SHMCOMM_TIMEOUT": "30"}


def _collapse_works():
    """Whether this kernel collapses an ordinary private mapping into a huge page (Linux 6.1's MADV_COLLAPSE)."""
    if not os.path.exists("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"):
        return False
    region = mmap.mmap(-1, 2 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.write(b"\1" * (2 * HUGE))
        start = (ctypes.addressof(ctypes.c_char.from_buffer(region)) + HUGE - 1) & ~(HUGE - 1)
        return _libc().madvise(start, HUGE, MADV_COLLAPSE) == 0
    finally:
        region.close()


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def _private(nbytes, offset=64):
    """float32 array on a private anonymous mapping of its own, `offset` bytes into it (as malloc's arrays start):
    4 KiB pages, unlike numpy's own arrays of 4 MiB and more, for which numpy asks for huge pages. A page without
    access follows it, so that the kernel keeps it apart from the next mapping (its smaps lines are its own)."""
    page = mmap.PAGESIZE
    span = -(-(nbytes + offset) // page) * page
    region = mmap.mmap(-1, span + page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert _libc().mprotect(base + span, page, 0) == 0, os.strerror(ctypes.get_errno())
    array = np.frombuffer(region, dtype=np.uint8, count=nbytes, offset=offset).view(np.float32)
    array[:] = 0  # touched: on 4 KiB pages now
    return array


def _huge_kib(array):
    """KiB of transparent huge pages in the mappings that hold `array`."""
    low, high = array.ctypes.data, array.ctypes.data + array.nbytes
    inside, total = False, 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span.group(1), 16) < high and int(span.group(2), 16) > low
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


def _collapses():
    from shmcomm.startup import session

    return session.communicator().shm.huge_collapses()


def _twice_each():
    """Each collective twice on the same buffers, then once on fresh ones; returns what each step collapsed and the
    huge pages found afterwards."""
    import shmcomm

    shmcomm.init()
    size, me = shmcomm.size(), shmcomm.rank()
    count = (8 << 20) // 4  # 8 MiB: at least three whole huge pages at any offset
    steps = {}
    mine = _private(count // size * 4)
    mine[:] = np.arange(count // size, dtype=np.float32) + me
    out = _private(count * 4)
    before = _collapses()
    for _ in range(2):
        shmcomm.allgather(mine, output=out)
        expected = np.concatenate([np.arange(count // size, dtype=np.float32) + r for r in range(size)])
        np.testing.assert_array_equal(out, expected)
    steps["allgather"] = (_collapses() - before, _huge_kib(out))

    sent = _private(count * 4)
    sent[:] = np.arange(count, dtype=np.float32) % 1009 + 10000 * me
    received = np.empty(count, np.float32)
    part = count // size
    before = _collapses()
    for _ in range(2):
        shmcomm.alltoall(sent, output=received)
        for j in range(size):
            np.testing.assert_array_equal(received[j * part:(j + 1) * part],
                                          np.arange(me * part, (me + 1) * part, dtype=np.float32) % 1009 + 10000 * j)
    steps["alltoall"] = (_collapses() - before, _huge_kib(sent))

    buffer = _private(count * 4)
    before = _collapses()
    for k in range(2):
        buffer[:] = np.arange(count, dtype=np.float32) + k if me == 0 else -1
        shmcomm.broadcast_(buffer, 0)
        np.testing.assert_array_equal(buffer, np.arange(count, dtype=np.float32) + k)
    steps["broadcast"] = (_collapses() - before, _huge_kib(buffer))

    fresh = [_private(count * 4) for _ in range(3)]  # all alive: three different places
    before = _collapses()
    for output in fresh:
        shmcomm.allgather(mine, output=output)
    steps["fresh"] = (_collapses() - before, sum(_huge_kib(o) for o in fresh))
    np.testing.assert_array_equal(fresh[-1], expected)
    return steps


def _always():
    """Whether this kernel gives every anonymous mapping huge pages unasked (then no buffer here is on 4 KiB pages)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.fixture(scope="module")
def collapsing():
    if not _collapse_works():
        pytest.skip("this kernel does not collapse pages into transparent huge pages (MADV_COLLAPSE: Linux 6.1)")
    if _always():
        pytest.skip("transparent huge pages are 'always' here: buffers are on huge pages without being offered")


def test_reused_buffers_are_collapsed_once_and_results_stay_exact(collapsing):
    for rank, steps in enumerate(multiproc.run(2, _twice_each, timeout=120, env=SINGLE)):
        for op in ("allgather", "alltoall", "broadcast"):
            collapsed, huge_kib = steps[op]
            assert collapsed == 1, (op, steps)
            # 8 MiB holds three whole huge pages at least; of broadcast's, rank 1 offers the half the root writes into
            assert huge_kib >= (1 if op == "broadcast" and rank == 1 else 3) * (HUGE >> 10), (rank, op, steps)
        assert steps["fresh"] == (0, 0), steps  # used once each: left on 4 KiB pages


def test_huge_pages_off_leaves_every_buffer_as_it_is(collapsing):
    for steps in multiproc.run(2, _twice_each, timeout=120, env=dict(SINGLE, SHMCOMM_HUGE_PAGES="0")):
        assert all(steps[op] == (0, 0) for op in steps), steps
