# SPDX-License-Identifier: Apache-2.0
"""shmcomm.torch collectives with Horovod's API: every op in its blocking, asynchronous and grouped forms,
gradients, errors, join, process sets, objects, the timeline and the stall warning."""
import io
import json
import sys
import time

import pytest

torch = pytest.importorskip("torch")
import multiproc  # noqa: E402


def _init(**kwargs):
    import shmcomm.torch as hvd

    torch.set_num_threads(1)  # one core per rank on small machines
    hvd.init(**kwargs)
    return hvd


def _data(rank, shape, dtype, seed=0):
    """Rank `rank`'s tensor: every rank can compute every other rank's, so results are checked exactly."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-9, 10, shape, generator=g).to(dtype)


def _every_op():
    hvd = _init()
    n, me = hvd.size(), hvd.rank()
    for dtype in (torch.int32, torch.int64, torch.float32, torch.float64):
        for dims in ((7,), (3, 5), (2, 3, 4)):
            xs = [_data(r, dims, dtype) for r in range(n)]
            total = sum(xs)
            assert torch.equal(hvd.allreduce(xs[me], op=hvd.Sum), total)
            assert torch.equal(hvd.allreduce(xs[me], average=False), total)
            want_avg = (total / n) if dtype.is_floating_point else torch.div(total, n, rounding_mode="trunc")
            assert torch.allclose(hvd.allreduce(xs[me]), want_avg.to(dtype))  # default: Average
            assert torch.allclose(hvd.allreduce(xs[me], average=True), want_avg.to(dtype))
            assert torch.equal(hvd.allreduce(xs[me], op=hvd.Min), torch.stack(xs).min(0).values)
            assert torch.equal(hvd.allreduce(xs[me], op=hvd.Max), torch.stack(xs).max(0).values)
            assert torch.equal(hvd.allreduce(xs[me], op=hvd.Product), torch.stack(xs).prod(0))
    x = _data(me, (4, 3), torch.float64)
    total = sum(_data(r, (4, 3), torch.float64) for r in range(n))
    assert torch.allclose(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), total * 0.5)
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y and torch.equal(y, total)
    assert torch.equal(hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum, name="a")), total)
    y = x.clone()
    assert hvd.synchronize(hvd.allreduce_async_(y, op=hvd.Sum)) is y and torch.equal(y, total)
    _check_fp16_compression(hvd)
    leaf = torch.ones(3, requires_grad=True)  # a tensor requiring grad works in place, as in Horovod
    hvd.allreduce_(leaf, op=hvd.Sum)
    assert torch.equal(leaf.detach(), torch.full((3,), float(n)))
    param = torch.nn.Parameter(torch.full((2,), float(me)))
    hvd.broadcast_(param, root_rank=n - 1)
    assert torch.equal(param.detach(), torch.full((2,), float(n - 1)))
    with pytest.raises(ValueError):
        hvd.allreduce(x, op=hvd.Sum, average=True)
    with pytest.raises(ValueError, match="Adasum"):
        hvd.reducescatter(x, op=hvd.Adasum)

    xs = [_data(me, (i + 2, 3), torch.float32, seed=i) for i in range(3)]
    totals = [sum(_data(r, (i + 2, 3), torch.float32, seed=i) for r in range(n)) for i in range(3)]
    for got in (hvd.grouped_allreduce(xs, op=hvd.Sum), hvd.synchronize(hvd.grouped_allreduce_async(xs, op=hvd.Sum))):
        assert all(torch.equal(g, t) for g, t in zip(got, totals))
    ys = [t.clone() for t in xs]
    assert all(a is b for a, b in zip(hvd.grouped_allreduce_(ys, op=hvd.Sum, name="g"), ys))
    zs = [t.clone() for t in xs]
    hvd.synchronize(hvd.grouped_allreduce_async_(zs, average=False))
    assert all(torch.equal(a, t) and torch.equal(b, t) for a, b, t in zip(ys, zs, totals))

    rows = [r + 1 for r in range(n)]  # uneven first dimension
    parts = [torch.full((rows[r], 2), float(r)) for r in range(n)]
    assert torch.equal(hvd.allgather(parts[me]), torch.cat(parts))
    assert torch.equal(hvd.synchronize(hvd.allgather_async(parts[me], name="ag")), torch.cat(parts))
    for got in (hvd.grouped_allgather([parts[me], parts[me] * 2]),
                hvd.synchronize(hvd.grouped_allgather_async([parts[me], parts[me] * 2]))):
        assert torch.equal(got[0], torch.cat(parts)) and torch.equal(got[1], torch.cat(parts) * 2)

    for root in range(n):
        mine = torch.full((3, 2), float(me))
        want = torch.full((3, 2), float(root))
        assert torch.equal(hvd.broadcast(mine, root), want) and torch.equal(mine, torch.full((3, 2), float(me)))
        assert torch.equal(hvd.synchronize(hvd.broadcast_async(mine, root, name="b%d" % root)), want)
        assert hvd.broadcast_(mine, root) is mine and torch.equal(mine, want)
        mine = torch.full((3, 2), float(me))
        assert hvd.synchronize(hvd.broadcast_async_(mine, root)) is mine and torch.equal(mine, want)

    splits = torch.tensor([r + 1 for r in range(n)], dtype=torch.int32)  # rank r gets r + 1 rows from everyone
    sent = torch.cat([torch.full((r + 1, 2), float(me)) for r in range(n)])
    out, received = hvd.alltoall(sent, splits)
    assert received.tolist() == [me + 1] * n
    assert torch.equal(out, torch.cat([torch.full((me + 1, 2), float(r)) for r in range(n)]))
    out2, received2 = hvd.synchronize(hvd.alltoall_async(sent, splits))
    assert torch.equal(out2, out) and received2.tolist() == received.tolist()
    even = torch.arange(2 * n, dtype=torch.float32) + 100 * me
    want = torch.cat([torch.arange(2 * me, 2 * me + 2, dtype=torch.float32) + 100 * r for r in range(n)])
    assert torch.equal(hvd.alltoall(even), want)
    assert torch.equal(hvd.synchronize(hvd.alltoall_async(even)), want)

    for count in (2 * n, 2 * n + 1):  # even and uneven rows: the first (rows % n) ranks get one more
        xs = [_data(r, (count, 3), torch.float64) for r in range(n)]
        total = sum(xs)
        shares = [count // n + (1 if r < count % n else 0) for r in range(n)]
        lo = sum(shares[:me])
        assert torch.equal(hvd.reducescatter(xs[me], op=hvd.Sum), total[lo:lo + shares[me]])
        assert torch.allclose(hvd.reducescatter(xs[me]), total[lo:lo + shares[me]] / n)  # default: Average
        got = hvd.synchronize(hvd.reducescatter_async(xs[me], op=hvd.Sum))
        assert torch.equal(got, total[lo:lo + shares[me]])
        for got in (hvd.grouped_reducescatter([xs[me], 2 * xs[me]], op=hvd.Sum),
                    hvd.synchronize(hvd.grouped_reducescatter_async([xs[me], 2 * xs[me]], op=hvd.Sum))):
            assert torch.equal(got[0], total[lo:lo + shares[me]]) and torch.equal(got[1], 2 * got[0])
    hvd.barrier()
    assert hvd.synchronize(12345) is None  # unknown handles: as Horovod
    with pytest.raises(ValueError):
        hvd.poll(12345)
    assert hvd.is_homogeneous() and hvd.nccl_built() == 0 and not hvd.gloo_built()
    assert hvd.mpi_built() and not hvd.mpi_enabled()  # mpi4py is a dependency; one host never uses it
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_every_op(size):
    assert multiproc.run(size, _every_op, timeout=90) == [True] * size


def _fp16_inputs(rank, shape):
    """float32 values of either sign in [1/16, 4), few of them float16 values: compression rounds them, and their
    float16 roundings add up exactly in float32 over up to 8 ranks."""
    g = torch.Generator().manual_seed(500 + rank)
    magnitude = torch.exp2(torch.rand(shape, generator=g) * 6 - 4)
    return torch.where(torch.rand(shape, generator=g) < 0.5, -magnitude, magnitude)


def _check_fp16_compression(hvd):
    """Compression.fp16 sends float16: the inputs are rounded to float16, summed in float32, and the result (times
    1/n for Average, a factor rounded to float32) is rounded once to float16, then returned as float32."""
    n, me = hvd.size(), hvd.rank()
    xs = [_fp16_inputs(r, (4 * n + 1, 3)) for r in range(n)]
    total = sum(x.half().float() for x in xs)
    shares = [(4 * n + 1) // n + (1 if r < (4 * n + 1) % n else 0) for r in range(n)]
    mine = slice(sum(shares[:me]), sum(shares[:me + 1]))
    for op, factor in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / n)):
        want = (total * torch.tensor(factor, dtype=torch.float32)).half().float()
        assert not torch.equal(want, sum(xs) * factor)  # without the compression the result would differ
        got = hvd.allreduce(xs[me], op=op, compression=hvd.Compression.fp16)
        assert got.dtype == torch.float32 and torch.equal(got, want), (op, (got - want).abs().max())
        got = hvd.reducescatter(xs[me], op=op, compression=hvd.Compression.fp16)
        assert got.dtype == torch.float32 and torch.equal(got, want[mine]), op
    grouped = hvd.grouped_allreduce([xs[me], 2 * xs[me]], op=hvd.Sum, compression=hvd.Compression.fp16)
    assert torch.equal(grouped[0], total.half().float()) and torch.equal(grouped[1], (2 * total).half().float())


def _fp16_compression():
    _check_fp16_compression(_init())
    return True


def test_fp16_compression_rounds_the_inputs_and_the_result_once():
    assert multiproc.run(4, _fp16_compression, timeout=60) == [True] * 4


def _poll_is_asynchronous(polled):
    hvd = _init()
    if hvd.rank() == 1:
        assert polled.wait(60)  # rank 0's request cannot finish before this rank submits
    handle = hvd.allreduce_async(torch.ones(1000), op=hvd.Sum, name="late")
    seen = [hvd.poll(handle)]
    polled.set()
    deadline = time.monotonic() + 10
    while not seen[-1] and time.monotonic() < deadline:
        time.sleep(0.005)
        seen.append(hvd.poll(handle))
    assert torch.equal(hvd.synchronize(handle), torch.full((1000,), 2.0))
    return seen[0], seen[-1]


def test_poll_false_then_true():
    results = multiproc.run(2, _poll_is_asynchronous, multiproc.Event(), timeout=60)
    assert results[0] == (False, True) and results[1][1] is True


def _gradients():
    hvd = _init()
    n, me = hvd.size(), hvd.rank()
    x0 = [_data(r, (n + 1, 3), torch.float64, seed=7) for r in range(n)]   # rows divisible or not: both work
    w = [_data(r, (n + 1, 3), torch.float64, seed=8) for r in range(n)]
    rows = [r + 2 for r in range(n)]
    g0 = [_data(r, (rows[r], 2), torch.float64, seed=9) for r in range(n)]
    cases = [  # (function, this rank's input, the weights of its output, factor of Horovod's rule)
        (lambda t: hvd.allreduce(t, op=hvd.Sum), x0[me], w[me], 1.0),
        (lambda t: hvd.allreduce(t, prescale_factor=0.5, postscale_factor=3.0), x0[me], w[me], 1.0),
        (lambda t: hvd.allgather(t), g0[me], _data(me, (sum(rows), 2), torch.float64, 3), 1.0 / n),
        (lambda t: hvd.broadcast(t, 1), x0[me], w[me], 1.0 / n),
        (lambda t: hvd.reducescatter(t, op=hvd.Sum), x0[me], None, float(n)),
        (lambda t: hvd.reducescatter(t), x0[me], None, float(n)),
        (lambda t: hvd.alltoall(t, torch.tensor([1] * (n - 1) + [2], dtype=torch.int32))[0], x0[me], None, 1.0),
        (lambda t: hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum)[1], x0[me], w[me], 1.0),
    ]
    for fn, x, weight, factor in cases:
        x = x.clone().requires_grad_()
        out = fn(x)
        weight = _data(me, out.shape, torch.float64, 5) if weight is None else weight
        (out * weight).sum().backward()

        def objective(value):  # sum over ranks of <weight_r, out_r>
            with torch.no_grad():
                return float(hvd.allreduce((fn(value) * weight).sum().reshape(1), op=hvd.Sum))

        eps = 1e-3
        for owner in range(n):
            for index in (0, x.numel() - 1):
                plus, minus = x.detach().clone(), x.detach().clone()
                if me == owner:
                    plus.view(-1)[index] += eps
                    minus.view(-1)[index] -= eps
                numeric = (objective(plus) - objective(minus)) / (2 * eps)
                if me == owner:
                    assert abs(float(x.grad.view(-1)[index]) - factor * numeric) < 1e-6, (fn, index)
    t = torch.ones(5, requires_grad=True)  # Horovod's own expectation for broadcast
    hvd.broadcast(t, 0).backward(torch.ones(5))
    assert torch.equal(t.grad, torch.full((5,), 1.0 if me == 0 else 0.0))
    return True


def test_gradients_numerically():
    assert multiproc.run(2, _gradients, timeout=90) == [True, True]


def _errors(tried):
    hvd = _init()
    me = hvd.rank()
    for owner in range(hvd.size()):  # the owner's first request is surely in flight: the others submit after
        if me != owner:
            assert tried[owner].wait(60)
        first = hvd.allreduce_async(torch.ones(10), name="duplicate_name.%d" % owner)
        if me == owner:
            with pytest.raises(ValueError):
                hvd.allreduce_async(torch.ones(10), name="duplicate_name.%d" % owner)
            tried[owner].set()
        hvd.synchronize(first)
    raised = []
    for bad in (torch.ones(4 + me), torch.ones(4, dtype=torch.float32 if me else torch.float64)):
        with pytest.raises(hvd.HorovodInternalError) as info:
            hvd.allreduce(bad, name="mismatch")
        assert isinstance(info.value, RuntimeError)
        raised.append(str(info.value))
    with pytest.raises(RuntimeError):
        hvd.broadcast(torch.ones(3), root_rank=me)  # roots disagree
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum, name="after"), torch.full((3,), 2.0))
    with pytest.raises(ValueError):
        hvd.allreduce(torch.ones(4, 4).t())  # not contiguous
    with pytest.raises(RuntimeError):
        hvd.reducescatter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="MPI"):
        hvd.init(comm=object())
    with pytest.raises(ValueError, match="subset"):
        hvd.init(comm=[0])
    hvd.init(comm=[1, 0])  # every rank: fine
    return raised


def test_errors_on_every_rank_then_a_working_op():
    results = multiproc.run(2, _errors, [multiproc.Event() for _ in range(2)], timeout=60)
    for messages in results:
        assert "mismatch" in messages[0] and len(messages) == 2


def _own_error_after_a_peer_left(left):
    """Rank 0 shuts down; rank 1, whose engine has seen it go (a good call fails naming it), still gets its own bad
    argument's error for a bad call, not the engine's: the bad call is what its caller must fix."""
    from shmcomm.vocabulary.exceptions import RankFailure
    hvd = _init()
    if hvd.rank() == 0:
        hvd.shutdown()
        left.set()
        return None
    assert left.wait(60)
    with pytest.raises(RankFailure):
        hvd.allreduce(torch.ones(1), name="good")
    with pytest.raises(ValueError, match="contiguous"):
        hvd.allreduce(torch.ones(4, 4).t())
    return None


def test_a_bad_argument_raises_its_own_error_after_a_peer_left():
    multiproc.run(2, _own_error_after_a_peer_left, multiproc.Event(), timeout=60)


def _join():
    hvd = _init()
    me = hvd.rank()
    if me == 2:
        return hvd.join(), None
    got = hvd.allreduce(torch.full((4,), float(me + 1)), name="while_joined")  # rank 2 gives zeros
    assert torch.allclose(got, torch.full((4,), (1.0 + 2.0) / 3))  # the divisor stays 3
    with pytest.raises(RuntimeError) as info:
        hvd.allgather(torch.ones(1), name="gather_while_joined")
    if me == 1:
        # Join last: this allreduce completes only once rank 0 has joined too (both others then give zeros).
        alone = hvd.allreduce(torch.full((4,), 6.0), name="after_the_others_joined")
        assert torch.equal(alone, torch.full((4,), 2.0))  # the divisor stays 3
    return hvd.join(), str(info.value)


def test_join():
    results = multiproc.run(3, _join, timeout=60)
    assert [last for last, _ in results] == [1, 1, 1]
    assert all("join" in message for _, message in results[:2])


def _objects_and_sets(arrived, removing):
    import shmcomm.torch as hvd

    first = hvd.ProcessSet([0, 1])
    _init(process_sets=[first])
    me = hvd.rank()
    assert first.process_set_id is not None and first.size() == 2
    obj = hvd.broadcast_object({"rank": me, "f": lambda v: v + 1} if me == 1 else None, root_rank=1)
    assert obj["rank"] == 1 and obj["f"](1) == 2
    everyone = hvd.allgather_object("x" * (10 + 50 * me))  # sizes differ: offsets must add up
    assert everyone == ["x" * (10 + 50 * r) for r in range(3)]
    if me == 1:  # the rank outside the set registers it last: the others must not use it before
        assert all(event.wait(60) for event in arrived)
    else:
        arrived[me // 2].set()
    ps = hvd.add_process_set([0, 2])
    assert ps.included() == (me != 1) and ps.size() == 2 and ps.rank() == {0: 0, 1: -1, 2: 1}[me]
    if ps.included():
        assert torch.equal(hvd.allreduce(torch.full((3,), float(me)), op=hvd.Sum, process_set=ps),
                           torch.full((3,), 2.0))
        assert torch.equal(hvd.allgather(torch.tensor([me]), process_set=ps), torch.tensor([0, 2]))
        assert torch.equal(hvd.broadcast(torch.tensor([me]), 2, process_set=ps), torch.tensor([2]))
        assert hvd.broadcast_object(me, root_rank=2, process_set=ps) == 2
        hvd.barrier(process_set=ps)
    if first.included():
        assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=first), torch.full((2,), 2.0))
    if me == 2:
        assert removing.wait(60)  # still using the set while rank 1 removes it
        assert torch.equal(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps), torch.full((1,), 2.0))
    elif me == 0:
        hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps)
    else:
        removing.set()
    assert hvd.remove_process_set(ps) is True
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), 3.0))
    return True


def test_objects_and_process_sets():
    events = [multiproc.Event() for _ in range(3)]
    assert multiproc.run(3, _objects_and_sets, events[:2], events[2], timeout=60) == [True] * 3


def _timeline(directory):
    hvd = _init()
    path = "%s/timeline.%d.json" % (directory, hvd.rank())
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(100), name="test_allreduce")
    hvd.stop_timeline()
    with open(path) as f:
        text = f.read()
    json.loads(text)
    return all(s in text for s in ("allreduce.test_allreduce", "NEGOTIATE_ALLREDUCE", '"ALLREDUCE"',
                                   "start_time_since_epoch_in_micros", "CYCLE_START"))


def test_timeline(tmp_path):
    assert multiproc.run(2, _timeline, str(tmp_path), timeout=60) == [True, True]


def _stall(warned):
    sys.stderr = captured = io.StringIO()  # before init: the engine's stall inspector writes here
    hvd = _init()
    if hvd.rank() == 1:
        assert warned.wait(60)  # submits only once rank 0 has warned about it
    handle = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="slow_tensor")
    if hvd.rank() == 0:
        deadline = time.monotonic() + 30
        while "stall warning" not in captured.getvalue() and time.monotonic() < deadline:
            hvd.poll(handle)  # a caller that waits keeps the engine cycling, and checking for stalls
            time.sleep(0.01)
        warned.set()
    assert torch.equal(hvd.synchronize(handle), torch.full((3,), 2.0))
    return captured.getvalue()


def test_stall_warning_names_tensor_and_rank():
    text = multiproc.run(2, _stall, multiproc.Event(), timeout=60, env={"SHMCOMM_STALL_CHECK_TIME_SECONDS": "1"})[0]
    assert "allreduce.slow_tensor" in text and "rank 1" in text, text
