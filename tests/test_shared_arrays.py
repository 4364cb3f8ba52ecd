# SPDX-License-Identifier: Apache-2.0
"""shmcomm.shared_empty and the engine's fusion buffer: memory every rank of the host maps, whose in-place allreduce
reads and writes the peers' buffers directly (csrc/coll/window.c). Checked: every dtype and op at 2-4 ranks and at
every offset, bit-identical results, the path taken (the core's count of such allreduces), ranks whose buffers are not
all shared, a disagreement on the shape, the setting that turns it off, memory that outlives the job, the engine's
fused allreduces, and a rank that dies."""
import hashlib
import os
import signal
import threading
import time

import numpy as np
import pytest

import multiproc
from shmcomm.testing.expected import expected_allreduce

FAST_TIMEOUT = {"SHMCOMM_TIMEOUT": "20"}
DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64"]
# 5000 takes the small path (one step) in float32 and float64 on the ranks of these tests: above the size from which
# shared buffers are used (4 KiB per rank sharing a core), under SHMCOMM_SMALL_BYTES. The others cross many pieces
# in every dtype, with ranges of uneven length.
COUNTS = [5000, 100_003, 400_000]


def _probe():
    import shmcomm
    from shmcomm.startup import session
    from shmcomm._native import lib

    shmcomm.init()
    shared = shmcomm.is_shared(shmcomm.shared_empty(1000)[10:])
    assert not shmcomm.is_shared(np.empty(10))
    return shared, bool(lib.smc_comm_single_copy(session.communicator().shm.handle))


@pytest.fixture(scope="module", autouse=True)
def ranks_map_each_other():
    """Ranks map each other's buffers wherever they may read each other's memory (single copy's probe at init:
    pidfd_getfd passes the same ptrace check); where they may not, these tests cannot run."""
    shared, readable = multiproc.run(2, _probe, timeout=60)[0]
    if not readable:
        pytest.skip("the ranks may not read each other's memory here (ptrace rights): no shared buffers")
    assert shared, "the ranks read each other's memory, yet could not map each other's shared buffers"


def _shared_count():
    from shmcomm.startup import session

    return session.communicator().shm.shared_calls()


def _inputs(rank, count, dtype):
    values = np.random.default_rng(1000 * rank + count).integers(1, 4, size=count)  # exact in every dtype and op
    return values.astype(dtype)


def _every_dtype_and_op(size):
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    taken = 0
    for count in COUNTS:
        for dtype in DTYPES if count > 5000 else ["float32", "float64"]:
            # Each rank's data starts at another offset in its array: the offsets need not agree.
            buf = shmcomm.shared_empty(count + 64, dtype)
            data = buf[me * 7:me * 7 + count]
            for op in ("Sum", "Min", "Max", "Product"):
                if op == "Product" and dtype in ("float16", "int8", "uint8"):
                    continue  # 3**n overflows these
                data[:] = _inputs(me, count, dtype)
                expected = expected_allreduce([_inputs(r, count, dtype) for r in range(size)], dtype, op)
                assert shmcomm.allreduce_(data, op=getattr(shmcomm, op)) is data
                np.testing.assert_array_equal(data, np.asarray(expected, dtype), err_msg="%s %s %d" % (dtype, op,
                                                                                                       count))
                taken += 1
    # Average and scaling, and a float sum whose order matters: the digests must agree on every rank.
    buf = shmcomm.shared_empty(300_001, np.float32)
    buf[:] = me + 1
    shmcomm.allreduce_(buf, op=shmcomm.Sum, prescale_factor=0.5, postscale_factor=3.0)
    np.testing.assert_allclose(buf, sum(range(1, size + 1)) * 1.5, rtol=1e-6)
    ints = shmcomm.shared_empty(50_000, np.int64)
    ints[:] = me + 1
    shmcomm.allreduce_(ints, op=shmcomm.Average)
    np.testing.assert_array_equal(ints, int(sum(range(1, size + 1)) / size))
    buf[:] = np.random.default_rng(me).standard_normal(buf.size).astype(np.float32)
    shmcomm.allreduce_(buf, op=shmcomm.Sum)
    assert _shared_count() == taken + 3, (_shared_count(), taken)
    return hashlib.sha256(buf.tobytes()).hexdigest()


@pytest.mark.parametrize("size", [2, 3, 4])
def test_in_place_allreduce_of_shared_arrays(size):
    digests = multiproc.run(size, _every_dtype_and_op, size, timeout=240)
    assert len(set(digests)) == 1, digests


def _reducescatter(size):
    import shmcomm
    from shmcomm.startup import session

    shmcomm.init()
    me = shmcomm.rank()
    shared_from = session.communicator().shm.tuning.shared_from_bytes
    taken = 0
    for rows in (7, 1001, 40_003):  # rows not divisible by the ranks: the first ranks get a row more
        for dtype in ("float32", "int64", "float16"):
            shared = shmcomm.shared_empty((rows, 3), dtype)
            shared[:] = _inputs(me, rows * 3, dtype).reshape(rows, 3)
            plain = shared.copy()
            for op in ("Sum", "Max"):
                got = shmcomm.reducescatter(shared, op=getattr(shmcomm, op))
                want = shmcomm.reducescatter(plain, op=getattr(shmcomm, op))  # the ordinary path
                np.testing.assert_array_equal(got, want, err_msg="%s %s %d" % (dtype, op, rows))
                taken += shared.nbytes >= shared_from
            # An output inside the input (here the last rank's, at its own share, as MPI's in-place reduce-scatter)
            # takes the ordinary path, on every rank: the peers read all of the input during the call.
            at = sum(rows // size + (r < rows % size) for r in range(me))
            out = shared[at:at + want.shape[0]] if me == size - 1 else np.empty_like(want)
            np.testing.assert_array_equal(shmcomm.reducescatter(shared, op=shmcomm.Max, output=out), want)
    return _shared_count() == taken and taken > 0


@pytest.mark.parametrize("size", [2, 3])
def test_reducescatter_of_shared_arrays(size):
    """A reduce-scatter whose inputs are shared arrays reduces each rank's share straight out of every rank's."""
    assert multiproc.run(size, _reducescatter, size, timeout=120) == [True] * size


def _broadcast_and_allgather(size):
    import shmcomm
    from shmcomm.startup import session
    from shmcomm._native import lib

    shmcomm.init()
    me = shmcomm.rank()
    shm = session.communicator().shm
    shared_from, half = shm.tuning.shared_from_bytes, shm.tuning.slot_bytes // 2  # slot sizes here: whole pages
    single = lib.smc_comm_single_copy_from(shm.handle, 0) or float("inf")
    broadcast_single = lib.smc_comm_single_copy_from(shm.handle, 1) or float("inf")
    taken, want_taken = _shared_count(), 0
    for count in (300, 5000, 100_003, 400_000):  # under the shared path's size, one staging step, single copy
        for dtype in ("float32", "int16"):
            data = _inputs(me, count, dtype)
            buf = shmcomm.shared_empty(count + 64, dtype)
            for root in (0, size - 1):
                # Each rank's buffer at another offset; one rank's an ordinary array; then every rank's shared.
                for plain_rank in (1, -1):
                    mine = np.empty(count, dtype) if me == plain_rank else buf[me * 5:me * 5 + count]
                    mine[:] = data
                    assert shmcomm.broadcast_(mine, root) is mine
                    np.testing.assert_array_equal(mine, _inputs(root, count, dtype),
                                                  err_msg="broadcast %s %d root %d" % (dtype, count, root))
                    # A broadcast of one staging step keeps to it: the shared path would synchronise once more.
                    want_taken += (plain_rank < 0 and mine.nbytes >= shared_from
                                   and (mine.nbytes >= broadcast_single or mine.nbytes > half))
            # Allgather into shared outputs: from an ordinary input, in place, and with one rank's output ordinary.
            rows = [count // size + (r < count % size) for r in range(size)]
            at = sum(rows[:me])
            part = data[:rows[me]]
            want = np.concatenate([_inputs(r, count, dtype)[:rows[r]] for r in range(size)])
            out = buf[7:7 + count] if me % 2 else buf[:count]
            got = shmcomm.allgather(part, output=out)
            np.testing.assert_array_equal(got, want, err_msg="allgather %s %d" % (dtype, count))
            out[:] = 0
            out[at:at + rows[me]] = part
            np.testing.assert_array_equal(shmcomm.allgather(out[at:at + rows[me]], output=out), want)
            plain = np.empty(count, dtype) if me == 0 else out
            np.testing.assert_array_equal(shmcomm.allgather(part, output=plain), want)
            want_taken += 2 * (max(rows) * np.dtype(dtype).itemsize >= single and out.nbytes >= shared_from)
    return _shared_count() - taken == want_taken and want_taken > 0


@pytest.mark.parametrize("size, settings", [(2, {}), (3, {}),
                                            (2, {"SHMCOMM_SINGLE_COPY_BYTES": "0", "SHMCOMM_SLOT_BYTES": "65536"})])
def test_broadcast_and_allgather_of_shared_arrays(size, settings):
    """A broadcast of shared arrays copies the root's straight into every rank's; an allgather into shared outputs
    copies each rank's input straight into every rank's output; a rank with an ordinary array sends every rank down
    the ordinary path. Without single copy and with small staging halves, broadcasts of several staging steps take
    the shared path, and a root whose buffer alone is shared sends its first step late (allgather then keeps to the
    staging path)."""
    assert multiproc.run(size, _broadcast_and_allgather, size, timeout=180, env=settings) == [True] * size


def _alltoall(size):
    import shmcomm
    from shmcomm.startup import session
    from shmcomm._native import lib

    shmcomm.init()
    me = shmcomm.rank()
    shm = session.communicator().shm
    shared_from, single = shm.tuning.shared_from_bytes, lib.smc_comm_single_copy_from(shm.handle, 0)
    assert single > 0, "single copy is set on: the test reads the shared path's count against its threshold"

    def sends(i, count):  # rows rank i sends to each rank: uneven, and different for every sender
        return [count // size + i + 2 * j for j in range(size)]

    taken, want_taken = _shared_count(), 0
    for count in (300, 20_000, 100_003, 400_000):  # under single copy's threshold, and over it
        for dtype in ("float32", "int16"):
            inputs = [_inputs(i, sum(sends(i, count)), dtype) for i in range(size)]
            want = np.concatenate([inputs[i][sum(sends(i, count)[:me]):][:sends(i, count)[me]] for i in range(size)])
            buf = shmcomm.shared_empty(max(x.size for x in inputs) + 64, dtype)
            for plain_rank in (size - 1, -1):  # one rank's input an ordinary array; then every rank's shared
                mine = np.empty_like(inputs[me]) if me == plain_rank else buf[me * 5:me * 5 + inputs[me].size]
                mine[:] = inputs[me]
                got, received = shmcomm.alltoall(mine, splits=sends(me, count))
                np.testing.assert_array_equal(got, want, err_msg="alltoall %s %d" % (dtype, count))
                assert list(received) == [sends(i, count)[me] for i in range(size)]
                out = np.zeros_like(want)
                assert shmcomm.alltoall(mine, splits=sends(me, count), output=out)[0] is out
                np.testing.assert_array_equal(out, want)
                # Decided on the mean part of the largest input (SHMCOMM_SINGLE_COPY_BYTES is set: no probe's rule);
                # each part a plain copy where its sender's input is shared and named (at least shared_from).
                itemsize = np.dtype(dtype).itemsize
                by_single_copy = max(x.size for x in inputs) * itemsize // size >= single
                peers_shared = any(i != me and i != plain_rank and inputs[i].size * itemsize >= shared_from
                                   for i in range(size))
                want_taken += 2 * (by_single_copy and peers_shared)
    return _shared_count() - taken == want_taken and want_taken > 0


@pytest.mark.parametrize("size", [2, 3])
def test_alltoall_of_shared_inputs(size):
    """An alltoall by single copy reads each part of a shared input straight out of its sender's mapping, at any
    offset and with uneven splits; a part whose sender's input is an ordinary array goes through the kernel's copy,
    alone (every other part still read from the mappings)."""
    env = {"SHMCOMM_SINGLE_COPY_BYTES": "16384"}
    assert multiproc.run(size, _alltoall, size, timeout=180, env=env) == [True] * size


def _not_all_shared(size):
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    for count in (5000, 250_000):  # the small path and the pipelined one
        shared = shmcomm.shared_empty(count, np.float32)
        # Rank 0 reduces an ordinary array, the others their shared ones; then out of place; then all shared. Each
        # call must take the same steps on every rank, and give the right sum.
        plain = np.empty(count, np.float32)
        for case, data in (("one plain", plain if me == 0 else shared), ("out of place", None), ("all", shared)):
            data_in = np.arange(count, dtype=np.float32) + me
            want = sum(np.arange(count, dtype=np.float32) + r for r in range(size))
            if data is None:  # out of place reads the shared array, writes another: the ordinary path
                shared[:] = data_in
                got = shmcomm.allreduce(shared, op=shmcomm.Sum)
            else:
                data[:] = data_in
                got = shmcomm.allreduce_(data, op=shmcomm.Sum)
            np.testing.assert_array_equal(got, want, err_msg="%s, %d" % (case, count))
    return _shared_count()


def test_ranks_whose_buffers_are_not_all_shared_take_the_ordinary_path():
    assert multiproc.run(3, _not_all_shared, 3, timeout=120) == [2, 2, 2]


def _shapes_disagree():
    import shmcomm

    shmcomm.init()
    me = shmcomm.rank()
    with pytest.raises(shmcomm.MismatchError, match="shared buffer: ranks disagree"):
        shmcomm.shared_empty(1000 + me, np.float32)
    with pytest.raises(shmcomm.MismatchError, match="shared buffer: ranks disagree"):
        shmcomm.shared_empty((2, 500) if me == 0 else (500, 2), np.float32)  # the same bytes, another shape
    with pytest.raises(shmcomm.InvalidArgumentError):
        shmcomm.shared_empty(-1)
    with pytest.raises(shmcomm.InvalidArgumentError):
        shmcomm.shared_empty("ten")
    with pytest.raises(shmcomm.InvalidArgumentError):
        shmcomm.shared_empty(10, "no such dtype")
    assert shmcomm.shared_empty((0, 3)).shape == (0, 3)
    # The job goes on: a shared array made after the disagreements works.
    buf = shmcomm.shared_empty(100_000, np.float64)
    buf[:] = me
    shmcomm.allreduce_(buf, op=shmcomm.Max)
    assert (buf == shmcomm.size() - 1).all()
    return _shared_count()


def test_a_disagreement_on_the_shape_raises_on_every_rank():
    assert multiproc.run(2, _shapes_disagree, timeout=60, env=FAST_TIMEOUT) == [1, 1]


def _switched_off():
    import shmcomm

    shmcomm.init()
    buf = shmcomm.shared_empty(200_000, np.float32)
    assert not shmcomm.is_shared(buf)
    buf[:] = 1
    shmcomm.allreduce_(buf, op=shmcomm.Sum)
    assert (buf == shmcomm.size()).all()
    return _shared_count()


def test_shared_buffers_switched_off_are_plain_memory():
    assert multiproc.run(2, _switched_off, timeout=60, env={"SHMCOMM_SHARED_BUFFERS": "0"}) == [0, 0]


def _outlives_the_job():
    import shmcomm

    shmcomm.init()
    buf = shmcomm.shared_empty(200_000, np.float32)
    buf[:] = shmcomm.rank()
    view = buf[10:20]
    del buf
    shmcomm.shutdown()
    view[:] = 5  # still this process's memory
    shmcomm.init()  # a new world: the old array is ordinary memory to it
    again = np.resize(view, 200_000).astype(np.float32)
    shmcomm.allreduce_(again, op=shmcomm.Sum)
    return float(view.sum()), float(again[0]), _shared_count()


def test_shared_arrays_outlive_shutdown():
    assert multiproc.run(2, _outlives_the_job, timeout=60) == [(50.0, 10.0, 0)] * 2


def _fused_in_the_engine(size):
    import shmcomm

    shmcomm.init(engine=True)
    me = shmcomm.rank()
    with pytest.raises(shmcomm.NotSupportedError, match="engine"):
        shmcomm.shared_empty(10)
    tensors = [np.full(n, me + 1, np.float32) for n in (70_000, 130_000, 5, 260_000)]
    for _ in range(3):  # the buffer grows in the first step, every rank alike
        handles = [shmcomm.allreduce_async(t, op=shmcomm.Sum, name="t%d" % i) for i, t in enumerate(tensors)]
        for t, h in zip(tensors, handles):
            np.testing.assert_array_equal(shmcomm.synchronize(h), np.full(t.size, sum(range(1, size + 1))))
    return _shared_count() > 0


@pytest.mark.parametrize("size", [2, 3])
def test_the_engines_fusion_buffer_is_shared(size):
    assert multiproc.run(size, _fused_in_the_engine, size, timeout=120) == [True] * size


def _dies_before_the_call(victim):
    import shmcomm

    shmcomm.init()
    buf = shmcomm.shared_empty(1_000_000, np.float32)
    if shmcomm.rank() == victim:
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        time.sleep(10)
    start = time.monotonic()
    with pytest.raises(shmcomm.RankFailure) as info:
        while time.monotonic() - start < 30:
            shmcomm.allreduce_(buf, op=shmcomm.Sum)
    return info.value.rank, "died" in str(info.value), time.monotonic() - start < 15


def test_a_rank_that_dies_is_named():
    results = multiproc.run(3, _dies_before_the_call, 2, timeout=60, check=False, env=FAST_TIMEOUT)
    assert results[2][0] == "died"
    assert results[0] == results[1] == ("ok", (2, True, True)), results
