# SPDX-License-Identifier: Apache-2.0
"""The background engine: agreement whatever the submission order, fusion, join, errors on every rank, failures."""
import json
import os
import signal
import threading
import time

import numpy as np
import pytest

import multiproc


def _any_order(count):
    import shmcomm

    shmcomm.init(engine=True)
    me, n = shmcomm.rank(), shmcomm.size()
    names = ["g%d" % i for i in range(count)]
    rng = np.random.default_rng(me)
    rng.shuffle(names)  # every rank submits in its own order, as gradient hooks do
    handles = {name: shmcomm.allreduce_async(np.full(100 + int(name[1:]), float(name[1:]), np.float32),
                                             op=shmcomm.Sum, name=name) for name in names}
    for name, h in handles.items():
        got = shmcomm.synchronize(h)
        assert got.shape == (100 + int(name[1:]),) and (got == n * float(name[1:])).all()
    inplace = np.arange(10.0) + 2 * me  # averaged in place: arange + (n - 1), exactly
    h = shmcomm.allreduce_async_(inplace, name="inplace")
    assert shmcomm.synchronize(h) is inplace and inplace.tolist() == (np.arange(10.0) + n - 1).tolist()
    # Blocking calls go through the engine too, in the same agreed order.
    assert shmcomm.allgather(np.array([me])).tolist() == list(range(n))
    out, splits = shmcomm.alltoall(np.arange(n) + 10 * me, splits=[1] * n)
    assert out.tolist() == [10 * r + me for r in range(n)] and splits.tolist() == [1] * n
    b = shmcomm.synchronize(shmcomm.broadcast_async(np.array([me, me]), root_rank=n - 1))
    assert b.tolist() == [n - 1] * 2
    rs = shmcomm.synchronize(shmcomm.reducescatter_async(np.ones((n, 2)), op=shmcomm.Sum))
    assert rs.tolist() == [[n, n]]
    shmcomm.barrier()
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_agree_whatever_the_submission_order(size):
    assert multiproc.run(size, _any_order, 60, timeout=120) == [True] * size


def _fusion(path):
    import shmcomm

    shmcomm.init(engine=True)
    shmcomm.start_timeline(path + str(shmcomm.rank()), mark_cycles=True)
    handles = [shmcomm.allreduce_async(np.full(50, i, np.float64), op=shmcomm.Sum, name="f%d" % i) for i in range(40)]
    results = [shmcomm.synchronize(h) for h in handles]
    shmcomm.stop_timeline()
    assert all((r == 2 * i).all() for i, r in enumerate(results))
    with open(path + str(shmcomm.rank())) as f:
        events = json.load(f)  # valid JSON
    return [e["name"] for e in events]


def test_small_tensors_are_fused_and_traced(tmp_path):
    names = multiproc.run(2, _fusion, str(tmp_path / "tl"), env={"SHMCOMM_CYCLE_TIME": "20"})
    for events in names:
        assert "MEMCPY_IN_FUSION_BUFFER" in events and "MEMCPY_OUT_FUSION_BUFFER" in events
        assert "NEGOTIATE_ALLREDUCE" in events and "ALLREDUCE" in events and "CYCLE_START" in events


def test_fusion_threshold_zero_disables_fusion(tmp_path):
    names = multiproc.run(2, _fusion, str(tmp_path / "tl"), env={"SHMCOMM_FUSION_THRESHOLD": "0",
                                                                 "SHMCOMM_CYCLE_TIME": "20"})
    for events in names:
        assert "MEMCPY_IN_FUSION_BUFFER" not in events and "ALLREDUCE" in events


def _errors():
    import shmcomm

    shmcomm.init(engine=True)
    me = shmcomm.rank()
    h = shmcomm.allreduce_async(np.ones(4), name="dup")
    with pytest.raises(ValueError, match="already being processed"):
        shmcomm.allreduce_async(np.ones(4), name="dup")
    shmcomm.synchronize(h)
    bad = shmcomm.allreduce_async(np.ones((2, 3 + me), np.float32), name="shape")
    good = shmcomm.allreduce_async(np.ones(3), name="fine", op=shmcomm.Sum)
    with pytest.raises(shmcomm.MismatchError, match=r"rank 0: allreduce float32\[2, 3\].*rank 1: allreduce "
                                                    r"float32\[2, 4\]"):
        shmcomm.synchronize(bad)
    assert shmcomm.synchronize(good).tolist() == [2.0] * 3  # the other request in flight is unaffected
    with pytest.raises(shmcomm.MismatchError, match="op Sum.*op Max"):
        shmcomm.allreduce(np.ones(2), op=[shmcomm.Sum, shmcomm.Max][me], name="ops")
    with pytest.raises(shmcomm.InvalidArgumentError, match="contiguous"):
        shmcomm.allreduce_async(np.ones((3, 3))[:, 0])  # bad input raises at submission, in the caller
    assert shmcomm.allreduce(np.ones(2), op=shmcomm.Sum).tolist() == [2.0, 2.0]
    return True


def test_errors_reach_every_rank_and_the_engine_goes_on():
    assert multiproc.run(2, _errors) == [True, True]


def _steady_state():
    import shmcomm
    from shmcomm import engine

    shmcomm.init(engine=True)
    me = shmcomm.rank()
    negotiator = engine.current().negotiator
    plans = []
    for step in range(6):  # the same three tensors every step, as a training loop submits them
        handles = [shmcomm.allreduce_async(np.full(5, float(i + step)), op=shmcomm.Sum, name="w%d" % i)
                   for i in range(3)]
        assert [shmcomm.synchronize(h).tolist() for h in handles] == [[2.0 * (i + step)] * 5 for i in range(3)]
        plans.append(dict(negotiator.plans))  # the plans themselves, kept alive: a rebuilt one is another object
    # The verdict is remembered and reused, not rebuilt: a pending list seen again keeps its plan. Which lists a
    # step's cycles see depends on when the engine's cycle meets the submissions, so compare per list.
    assert plans[-1] and all(before[wire] is after[wire] for before, after in zip(plans, plans[1:])
                             for wire in before.keys() & after.keys()), plans
    assert any(wire in plans[-1] for later in plans[1:-1] for wire in later), plans
    # A remembered verdict must not hide a new disagreement: same name, another shape on one rank.
    with pytest.raises(shmcomm.MismatchError, match=r"w0: ranks disagree"):
        shmcomm.allreduce(np.ones(5 + me), name="w0")
    assert shmcomm.allreduce(np.full(5, 1.0), op=shmcomm.Sum, name="w0").tolist() == [2.0] * 5
    return True


def test_steady_state_reuses_the_agreed_plan_and_still_sees_mismatches():
    assert multiproc.run(2, _steady_state) == [True, True]


def _long_messages():
    import shmcomm
    from shmcomm import basics

    shmcomm.init()
    me, n = shmcomm.rank(), shmcomm.size()
    comm = basics.communicator()
    for lengths in ([0] * n, [5] * n, [2040 + r for r in range(n)], [3000 * r for r in range(n)], [70000] * n):
        got = comm.allgather_bytes(bytes([me + 1]) * lengths[me])
        assert got == [bytes([r + 1]) * lengths[r] for r in range(n)], lengths
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_negotiation_messages_of_any_length(size):
    # One fixed block settles messages that fit it; longer ones send their rest in a second exchange.
    assert multiproc.run(size, _long_messages) == [True] * size


def _idle_engine():
    import shmcomm
    from shmcomm import engine

    shmcomm.init(engine=True)
    shmcomm.allreduce(np.ones(2), name="warm")
    eng = engine.current()
    start = eng._cycle
    if shmcomm.rank() == 0:  # pending on one rank only, and nobody waits for it yet: nothing can happen
        handle = shmcomm.allreduce_async(np.ones(3), op=shmcomm.Sum, name="queued")
    time.sleep(0.5)
    cycles = eng._cycle - start
    if shmcomm.rank() != 0:
        handle = shmcomm.allreduce_async(np.ones(3), op=shmcomm.Sum, name="queued")
    assert shmcomm.synchronize(handle).tolist() == [2.0] * 3  # waiting wakes the engines at once
    return cycles


def test_engine_does_not_cycle_while_nobody_waits():
    # With a 1 ms cycle time a busy-cycling engine would negotiate hundreds of times in 0.5 s, on the cores the
    # training needs; it sleeps on the doorbell instead (bounded by a 0.1 s timer: 5 cycles, 3x that for a busy
    # machine).
    cycles = multiproc.run(2, _idle_engine)
    assert all(c <= 15 for c in cycles), cycles


def _waits_of_the_engine():
    import shmcomm
    from shmcomm import engine

    shmcomm.init(engine=True)
    shmcomm.allreduce(np.ones(2), name="warm")
    comm = engine.current().comm
    calls, real = [], comm.set_spin

    def recording(spin_us, yield_us):
        calls.append((time.monotonic(), spin_us, yield_us))
        real(spin_us, yield_us)

    comm.set_spin = recording  # what every cycle sets for its waits
    if shmcomm.rank() == 0:  # waits for rank 1, which computes meanwhile
        got = shmcomm.synchronize(shmcomm.allreduce_async(np.ones(3), op=shmcomm.Sum, name="x"))
        computing = calls
    else:
        time.sleep(0.5)
        computing = list(calls)
        got = shmcomm.synchronize(shmcomm.allreduce_async(np.ones(3), op=shmcomm.Sum, name="x"))
    assert got.tolist() == [2.0] * 3
    return [c[1:] for c in computing], comm.tuning.spin_us, comm.tuning.yield_us


def test_an_engine_yields_while_its_caller_waits_and_polls_briefly_while_it_computes():
    """While its caller waits, a rank's engine waits yielding the core (the wake-ups of sleeping waits were most of a
    fused allreduce's time); while its caller computes, it polls briefly and sleeps, even though a peer's caller
    waits, so that the core stays the computation's."""
    (waiting, spin, yield_us), (computing, *_) = multiproc.run(2, _waits_of_the_engine)
    assert waiting and computing, (waiting, computing)  # both engines cycled meanwhile
    assert any(y == max(yield_us, 1000) and s <= min(spin, 50) for s, y in waiting), waiting
    assert all(y == yield_us and s <= min(spin, 50) for s, y in computing), computing


def _join(size):
    import shmcomm

    shmcomm.init(engine=True)
    me = shmcomm.rank()
    if me == 0:
        last = shmcomm.join()  # out of data at once
        return ("joined", last)
    steps = 3 if me == 1 else 5
    for _ in range(steps):
        got = shmcomm.allreduce(np.full(4, 3.0), name="grad")  # Average: joined ranks count as zeros
    if me == 2:  # ranks 0 and 1 have joined by now: only allreduce can go on without them
        with pytest.raises(shmcomm.MismatchError, match="ranks 0, 1 have called join"):
            shmcomm.allgather(np.ones(2), name="gather")
    return (got.tolist(), shmcomm.join())


def test_join_contributes_zeros_and_returns_the_last_rank():
    results = multiproc.run(3, _join, 3, timeout=60)
    assert results[0] == ("joined", 2)
    assert results[1][1] == 2 and results[2][1] == 2
    assert results[1][0] == [2.0] * 4  # ranks 1 and 2 contribute, the divisor stays 3
    assert results[2][0] == [1.0] * 4  # only rank 2 left


def _results_freed_at_once():
    import gc
    import weakref

    import shmcomm

    shmcomm.init(engine=True)
    gc.disable()  # what only the cyclic collector frees stays alive meanwhile
    try:
        alive = []
        for i, submit in enumerate([lambda x: shmcomm.allreduce_async(x, op=shmcomm.Sum, name="a"),
                                    lambda x: shmcomm.broadcast_async(x, root_rank=0, name="b"),
                                    lambda x: shmcomm.allgather_async(x, name="g"),
                                    lambda x: shmcomm.alltoall_async(x, name="t")]):
            x = np.ones(shmcomm.size() * 4, np.float32)
            out = shmcomm.synchronize(submit(x))
            results, sent = weakref.ref(out), weakref.ref(x)
            del out, x
            alive.append((i, results() is not None, sent() is not None))
        return alive
    finally:
        gc.enable()


def test_an_asynchronous_result_is_freed_once_the_caller_drops_it():
    # A handle and its request pointing at each other made cyclic garbage that held a result, possibly a large
    # tensor, until the collector's next full pass.
    for alive in multiproc.run(2, _results_freed_at_once, timeout=60):
        assert alive == [(i, False, False) for i in range(4)]


def test_join_needs_the_engine():
    def body():
        import shmcomm

        shmcomm.init()
        with pytest.raises(shmcomm.ShmCommError, match="engine"):
            shmcomm.join()
        return True

    assert multiproc.run(1, body) == [True]


def _interrupted_while_waiting(ready):
    import shmcomm

    shmcomm.init(engine=True)
    if shmcomm.rank() == 1:
        assert ready.wait(60)  # rank 0 has been interrupted: only now submit what it waits for
        got = shmcomm.allreduce(np.ones(3), op=shmcomm.Sum, name="late")
        return got.tolist(), shmcomm.allreduce(np.ones(2), op=shmcomm.Sum, name="after").tolist()
    handle = shmcomm.allreduce_async(np.ones(3), op=shmcomm.Sum, name="late")
    # Python's own Ctrl-C handler, also where pytest was started with SIGINT ignored (a background job of a shell).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        shmcomm.synchronize(handle)  # interrupted while it waits; the engine's cycles go on
    took = time.monotonic() - started
    ready.set()
    got = shmcomm.synchronize(handle)  # the engine went on: the same handle completes once rank 1 submits
    return got.tolist(), shmcomm.allreduce(np.ones(2), op=shmcomm.Sum, name="after").tolist(), took


def test_ctrl_c_while_a_caller_waits_leaves_the_engine_running():
    """Ctrl-C in synchronize() raises KeyboardInterrupt at once, and the engine goes on: the same handle completes
    later. (A caller that ran the engine's cycles itself failed this: an interrupt inside a cycle stops it halfway.)"""
    (got, after, took), (got1, after1) = multiproc.run(2, _interrupted_while_waiting, multiproc.Event(), timeout=120)
    assert got == got1 == [2.0] * 3 and after == after1 == [2.0] * 2 and took < 5, (got, after, took)


def _rank_dies_under_engine():
    import shmcomm

    shmcomm.init(engine=True)
    if shmcomm.rank() == 1:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        while time.monotonic() - start < 30:
            shmcomm.synchronize(shmcomm.allreduce_async(np.ones(1000), name="loop"))
    except shmcomm.RankFailure as e:
        with pytest.raises(shmcomm.RankFailure):
            shmcomm.allreduce_async(np.ones(3), name="after")  # the engine refuses new work with the same error
        return (e.rank, time.monotonic() - start)
    return None


def test_dead_rank_fails_pending_handles_on_the_others():
    results = multiproc.run(2, _rank_dies_under_engine, timeout=60, check=False)
    assert results[1][0] == "died"
    status, (rank, took) = results[0]
    assert status == "ok" and rank == 1 and took < 10


def _peer_leaves(left, failing):
    import shmcomm
    from shmcomm.startup import failure_reports

    os.environ.pop("SHMCOMM_ERROR_REPORT_DIR", None)  # no saved reports: what rank 0 says comes from the engine
    shmcomm.init(engine=True)
    shmcomm.barrier()
    if shmcomm.rank() == 1:
        if failing:  # what the hook of a rank that dies of an exception saves before the exit handlers shut down
            failure_reports.save_uncaught(1, ValueError, ValueError("bad batch"), None)
        shmcomm.shutdown()
        left.set()
        return "left"
    assert left.wait(60)
    expected = "rank 1 failed \\(ValueError: bad batch\\)" if failing else "rank 1 has shut down"
    with pytest.raises(shmcomm.RankFailure, match=expected):
        shmcomm.allreduce(np.ones(2), name="late")
    return "raised"


@pytest.mark.parametrize("failing", [False, True], ids=["shut-down", "failed"])
def test_a_rank_that_shuts_down_is_named_with_its_cause(failing):
    """A rank that left on an exception of its own (MPI_Abort runs the exit handlers, which shut shmcomm down) is
    named as failed, with its cause, where its peers cannot read its saved report."""
    assert multiproc.run(2, _peer_leaves, multiproc.Event(), failing) == ["raised", "left"]


def _process_sets():
    import shmcomm

    shmcomm.init(engine=True)
    me = shmcomm.rank()
    evens = shmcomm.add_process_set([0, 2])
    odds = shmcomm.add_process_set([1, 3])
    mine = evens if me % 2 == 0 else odds
    assert mine.included() and mine.size() == 2 and mine.rank() == me // 2
    got = shmcomm.allreduce(np.array([float(me)]), op=shmcomm.Sum, process_set=mine, name="ps")
    b = shmcomm.broadcast(np.array([me]), root_rank=mine.ranks[1], process_set=mine, name="psb")
    everyone = shmcomm.allreduce(np.array([1.0]), op=shmcomm.Sum, name="all")
    with pytest.raises(shmcomm.InvalidArgumentError, match="not in process set"):
        shmcomm.allreduce(np.ones(1), process_set=odds if mine is evens else evens)
    shmcomm.remove_process_set(evens)
    shmcomm.remove_process_set(odds)
    return got.tolist(), b.tolist(), everyone.tolist()


def test_process_sets():
    results = multiproc.run(4, _process_sets, timeout=60)
    assert results[0] == ([2.0], [2], [4.0]) and results[2] == ([2.0], [2], [4.0])
    assert results[1] == ([4.0], [3], [4.0]) and results[3] == ([4.0], [3], [4.0])


def _stall_shutdown(failed):
    import shmcomm

    shmcomm.init(engine=True)
    if shmcomm.rank() == 1:
        assert failed.wait(60)  # never submits "never"
    else:
        start = time.monotonic()
        with pytest.raises(shmcomm.ShmCommError, match=r"allreduce\.never: gave up after \d+ s: ranks 1 never "
                                                       r"submitted it \(stall shutdown time\)") as info:
            shmcomm.allreduce(np.ones(3), name="never")
        assert type(info.value) is shmcomm.ShmCommError
        assert time.monotonic() - start >= 2  # not before SHMCOMM_STALL_SHUTDOWN_TIME_SECONDS
        failed.set()
    assert shmcomm.allreduce(np.ones(2), op=shmcomm.Sum, name="after").tolist() == [2.0, 2.0]  # the engine goes on
    return True


@pytest.mark.parametrize("prefix", ["SHMCOMM_", pytest.param("HOROVOD_", marks=pytest.mark.long)])
def test_stall_shutdown_time_fails_the_request_and_the_engine_goes_on(prefix):
    env = {prefix + "STALL_CHECK_TIME_SECONDS": "1", prefix + "STALL_SHUTDOWN_TIME_SECONDS": "2"}
    assert multiproc.run(2, _stall_shutdown, multiproc.Event(), env=env, timeout=60) == [True, True]


def _timeline_files(path, ranks):
    """Rank 0 writes `path`, rank r > 0 `path.r`: each a valid JSON array of Chrome-trace events, named after its
    rank. Returns {rank: events}."""
    files = {r: path if r == 0 else "%s.%d" % (path, r) for r in range(ranks)}
    events = {}
    for r, name in files.items():
        with open(name) as f:
            events[r] = json.load(f)
        assert events[r][0]["args"]["name"] == "shmcomm rank %d" % r, events[r][0]
    return events


def _traced(ranks):
    import shmcomm

    shmcomm.init(engine=True)
    me = shmcomm.rank()
    got = shmcomm.allreduce(np.full(4, float(me)), op=shmcomm.Sum, name="traced")
    assert got.tolist() == [ranks * (ranks - 1) / 2] * 4
    return True


@pytest.mark.parametrize("prefix", ["SHMCOMM_", "HOROVOD_"])
def test_timeline_variable_writes_a_file_per_rank(tmp_path, prefix):
    path = str(tmp_path / "timeline.json")
    env = {prefix + "TIMELINE": path, prefix + "TIMELINE_MARK_CYCLES": "1"}
    assert multiproc.run(3, _traced, 3, env=env) == [True] * 3
    for events in _timeline_files(path, 3).values():  # complete once the ranks shut down
        names = [e["name"] for e in events]
        processes = [e["args"]["name"] for e in events if e["name"] == "process_name"]
        assert "allreduce.traced" in processes and "NEGOTIATE_ALLREDUCE" in names and "ALLREDUCE" in names
        assert "CYCLE_START" in names
    assert sorted(os.listdir(tmp_path)) == ["timeline.json", "timeline.json.1", "timeline.json.2"]


def _horovod_names():
    import shmcomm

    assert not [k for k in os.environ if k.startswith("SHMCOMM_")]
    shmcomm.init()
    me = shmcomm.rank()
    assert (shmcomm.size(), shmcomm.local_rank(), shmcomm.local_size()) == (2, me, 2)
    assert (shmcomm.cross_rank(), shmcomm.cross_size()) == (0, 1)
    assert shmcomm.allreduce(np.full(3, float(me + 1)), op=shmcomm.Sum).tolist() == [3.0] * 3
    with pytest.raises(shmcomm.OutOfMemoryError, match="arena is full"):  # HOROVOD_SMB_BYTES=65536
        shmcomm.SoftMemoryBox("big", shape=(1 << 17,), dtype=np.uint8)
    return shmcomm.join()  # HOROVOD_ENGINE=1: the engine runs from init(), as join() needs


def test_horovod_names_are_read():
    """A job described only by HOROVOD_* variables: the identity and job token, and tuning names (the engine, the
    Soft Memory Box room; the timeline, stall and timeout names in their own tests)."""
    env = {"HOROVOD_ENGINE": "1", "HOROVOD_SMB_BYTES": "65536"}
    last = multiproc.run(2, _horovod_names, env=env, prefix="HOROVOD_")
    assert last[0] == last[1] in (0, 1)


def _live_timeline(path):
    import shmcomm

    shmcomm.init(engine=True)
    shmcomm.allreduce(np.ones(4), op=shmcomm.Sum, name="watched")
    # The job goes on (no shutdown): the file must show the operation within a second, as an unclosed JSON array,
    # which the trace format allows. 3 s of polling: room for a busy machine.
    deadline = time.monotonic() + 3.0
    while True:
        with open(path if shmcomm.rank() == 0 else "%s.%d" % (path, shmcomm.rank())) as f:
            text = f.read().rstrip()
        events = json.loads(text.rstrip(",") + "]") if text.endswith(",") else []
        if any(e.get("args", {}).get("name") == "allreduce.watched" for e in events) and \
                any(e["name"] == "ALLREDUCE" and e["ph"] == "E" for e in events):
            return True
        if time.monotonic() > deadline:
            return text[-500:]
        time.sleep(0.05)


def test_the_timeline_is_readable_while_the_job_runs(tmp_path):
    path = str(tmp_path / "live.json")
    assert multiproc.run(2, _live_timeline, path, env={"SHMCOMM_TIMELINE": path}) == [True, True]
