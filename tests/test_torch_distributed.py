# SPDX-License-Identifier: Apache-2.0
"""torch.distributed on the "shmcomm" backend: every operation against its definition (the cases of torch's c10d and
distributed tests that apply to a CPU backend), subgroups, asynchronous work, point to point, errors, and DDP without a
hook against one process on the whole batch."""
import os
import re
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import multiproc  # noqa: E402

torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo once, before the forks


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(port, seconds=60):
    import datetime

    import torch.distributed as dist

    import shmcomm.torch  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group("shmcomm", init_method="tcp://127.0.0.1:%d" % port, rank=int(os.environ["SHMCOMM_RANK"]),
                            world_size=int(os.environ["SHMCOMM_SIZE"]), timeout=datetime.timedelta(seconds=seconds))
    assert dist.get_backend() == "shmcomm"
    return dist, dist.get_rank(), dist.get_world_size()


def _on_ranks(n, fn, *args, timeout=90):
    assert multiproc.run(n, fn, _free_port(), *args, timeout=timeout) == [True] * n


def _value(r, shape, dtype):
    """Rank r's tensor: small integers, exact in every dtype and in their sums."""
    base = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64).reshape(shape) % 7 + r + 1
    if dtype == torch.bool:
        return (base + r) % 2 == 0
    if dtype.is_complex:
        return torch.complex(base.double(), -base.double()).to(dtype)
    return base.to(dtype)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]


def _reductions(port):
    dist, me, n = _join(port)
    R = dist.ReduceOp
    every = lambda dtype, shape=(5, 3): [_value(r, shape, dtype) for r in range(n)]  # noqa: E731
    for dtype in DTYPES:
        values = every(dtype)
        cases = {R.SUM: sum(v.double() if not dtype.is_complex else v for v in values)} if dtype != torch.bool else {}
        if dtype.is_floating_point:
            cases[R.AVG] = cases[R.SUM] / n
        if not dtype.is_complex and dtype != torch.bool:
            cases[R.MIN] = torch.stack(values).min(0).values
            cases[R.MAX] = torch.stack(values).max(0).values
            cases[R.PRODUCT] = torch.stack(values).double().prod(0)
        if dtype == torch.bool:
            cases = {R.SUM: torch.stack(values).any(0), R.BOR: torch.stack(values).any(0),
                     R.MIN: torch.stack(values).all(0), R.BAND: torch.stack(values).all(0),
                     R.BXOR: torch.stack(values).sum(0) % 2 == 1}
        if not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool:
            import functools
            for op, f in ((R.BAND, torch.bitwise_and), (R.BOR, torch.bitwise_or), (R.BXOR, torch.bitwise_xor)):
                cases[op] = functools.reduce(f, values)
        for op, want in cases.items():
            if dtype == torch.uint8 and op == R.PRODUCT or dtype == torch.int8 and op == R.PRODUCT:
                continue  # wraps around differently in double
            t = values[me].clone()
            dist.all_reduce(t, op=op)
            assert torch.equal(t, want.to(dtype)), (dtype, op, t, want)
            root = n - 1
            t = values[me].clone()
            dist.reduce(t, dst=root, op=op)
            assert torch.equal(t, want.to(dtype) if me == root else values[me]), ("reduce", dtype, op)
        if dtype in (torch.float32, torch.int64, torch.bfloat16):
            share = torch.empty(2, 3, dtype=dtype)  # reduce_scatter_tensor, equal shares of 2 rows
            whole = torch.cat([_value(r, (2 * n, 3), dtype) for r in range(n)]).view(n, 2 * n, 3)
            dist.reduce_scatter_tensor(share, _value(me, (2 * n, 3), dtype))
            assert torch.equal(share, whole.sum(0)[2 * me:2 * me + 2].to(dtype))
            parts = [_value(me, (4,), dtype) * (k + 1) for k in range(n)]  # reduce_scatter of lists
            out = torch.empty(4, dtype=dtype)
            dist.reduce_scatter(out, parts, op=R.MAX)
            assert torch.equal(out, (_value(n - 1, (4,), dtype) * (me + 1)).to(dtype))
    t = torch.full((3,), 2.0)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))  # PREMUL_SUM, as FSDP uses it
    assert torch.equal(t, torch.full((3,), float(n)))
    group = [torch.full((k + 1,), float(me + k)) for k in range(3)] + [torch.tensor([me], dtype=torch.int64)]
    dist.all_reduce_coalesced(group[:3])
    with dist._coalescing_manager(async_ops=False):
        dist.all_reduce(group[3])
    assert [g.tolist() for g in group] == [[n * (n - 1) / 2 + n * k] * (k + 1) for k in range(3)] + [[n * (n - 1) // 2]]
    dist.destroy_process_group()
    return True


def test_reductions_on_every_dtype_and_op():
    _on_ranks(3, _reductions)


def _data_movement(port):
    dist, me, n = _join(port)
    for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.complex64, torch.uint16, torch.int64):
        mine = _value(me, (2, 3), dtype)
        everyone = [_value(r, (2, 3), dtype) for r in range(n)]
        for root in range(n):
            t = mine.clone()
            dist.broadcast(t, src=root)
            assert torch.equal(t, everyone[root])
        out = [torch.empty(2, 3, dtype=dtype) for _ in range(n)]
        dist.all_gather(out, mine)
        assert all(torch.equal(o, e) for o, e in zip(out, everyone))
        whole = torch.empty(2 * n, 3, dtype=dtype)
        dist.all_gather_into_tensor(whole, mine)
        assert torch.equal(whole, torch.cat(everyone))
        gathered = [torch.empty(2, 3, dtype=dtype) for _ in range(n)] if me == 1 else None
        dist.gather(mine, gathered, dst=1)
        assert me != 1 or all(torch.equal(o, e) for o, e in zip(gathered, everyone))
        got = torch.empty(2, 3, dtype=dtype)
        dist.scatter(got, [e.clone() for e in everyone] if me == 0 else None, src=0)
        assert torch.equal(got, everyone[me])
    # all_gather with a different size on each rank, as NCCL allows
    out = [torch.empty(r + 1) for r in range(n)]
    dist.all_gather(out, torch.full((me + 1,), float(me)))
    assert [o.tolist() for o in out] == [[float(r)] * (r + 1) for r in range(n)]
    # all_to_all_single: equal parts, then uneven splits (rank r sends k+r+1... rows to rank k), rows of 2
    sent = torch.arange(n * 2.0) + 100 * me
    received = torch.empty(n * 2)
    dist.all_to_all_single(received, sent)
    assert received.tolist() == [100.0 * r + 2 * me + i for r in range(n) for i in range(2)]
    counts = lambda src, dst: (src + 2 * dst) % 3  # noqa: E731  (some are zero)
    in_splits = [counts(me, k) for k in range(n)]
    out_splits = [counts(r, me) for r in range(n)]
    sent = torch.stack([torch.tensor([float(me), float(k)]) for k in range(n) for _ in range(counts(me, k))]
                       or [torch.zeros(2)])[:sum(in_splits)]
    received = torch.empty(sum(out_splits), 2)
    dist.all_to_all_single(received, sent, out_splits, in_splits)
    assert received.tolist() == [[float(r), float(me)] for r in range(n) for _ in range(counts(r, me))]
    # all_to_all of lists, each pair its own size
    outs = [torch.empty(r + me + 1, dtype=torch.int64) for r in range(n)]
    dist.all_to_all(outs, [torch.full((me + k + 1,), me * 10 + k) for k in range(n)])
    assert [o.tolist() for o in outs] == [[r * 10 + me] * (r + me + 1) for r in range(n)]
    dist.barrier()
    dist.destroy_process_group()
    return True


def test_data_movement_on_every_dtype():
    _on_ranks(3, _data_movement)


def _subgroups_and_point_to_point(port):
    dist, me, n = _join(port)
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = evens if me % 2 == 0 else odds
    assert dist.get_rank(mine) == me // 2 and dist.get_world_size(mine) == 2
    t = torch.tensor([float(me)])
    dist.all_reduce(t, group=mine)
    assert t.item() == (2.0 if me % 2 == 0 else 4.0)
    t = torch.tensor([float(me)])
    dist.broadcast(t, src=me % 2 + 2, group=mine)  # a global rank, as torch takes it
    assert t.item() == me % 2 + 2
    first_three = dist.new_group([0, 1, 2])
    if me < 3:
        whole = torch.empty(3)
        dist.all_gather_into_tensor(whole, torch.tensor([float(me)]), group=first_three)
        assert whole.tolist() == [0.0, 1.0, 2.0]
    else:
        assert first_three == dist.GroupMember.NON_GROUP_MEMBER
    # blocking send and recv, then a ring of isend/irecv (every rank sends first), then batch_isend_irecv
    if me == 0:
        dist.send(torch.tensor([7.0, 8.0]), dst=3, tag=5)
    elif me == 3:
        got = torch.empty(2)
        dist.recv(got, src=0, tag=5)
        assert got.tolist() == [7.0, 8.0]
    for rounds in range(3):
        outgoing = torch.full((1000,), float(me * 10 + rounds))
        incoming = torch.empty(1000)
        works = [dist.isend(outgoing, (me + 1) % n), dist.irecv(incoming, (me - 1) % n)]
        for w in works:
            w.wait()
        assert torch.equal(incoming, torch.full((1000,), float((me - 1) % n * 10 + rounds)))
    incoming = torch.empty(3, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, torch.full((3,), me), (me + 1) % n),
           dist.P2POp(dist.irecv, incoming, (me - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert incoming.tolist() == [(me - 1) % n] * 3
    if me % 2 == 0:  # point to point inside a subgroup: its group ranks
        dist.send(torch.tensor([float(me)]), group_dst=1 - me // 2, group=evens) if me == 0 else None
        if me == 2:
            got = torch.empty(1)
            dist.recv(got, group_src=0, group=evens)
            assert got.item() == 0.0
    dist.destroy_process_group()
    return True


def test_subgroups_and_point_to_point():
    _on_ranks(4, _subgroups_and_point_to_point)


def _asynchronous_work(port):
    dist, me, n = _join(port)
    t = torch.ones(4)
    work = dist.all_reduce(t, async_op=True)
    chained = work.get_future().then(lambda f: f.value()[0] * 10)  # as DDP's hooks chain futures
    assert work.wait() and work.is_completed()
    assert torch.equal(chained.wait(), torch.full((4,), 10.0 * n))
    works = [dist.broadcast(torch.full((2,), float(me)), src=r, async_op=True) for r in range(n)]
    assert all(w.wait() for w in works)
    whole = torch.empty(2 * n)
    dist.all_gather_into_tensor(whole, torch.full((2,), float(me)), async_op=True).wait()
    assert whole.tolist() == [float(r) for r in range(n) for _ in range(2)]
    dist.destroy_process_group()
    return True


def test_asynchronous_work_and_futures():
    _on_ranks(2, _asynchronous_work)


def _errors(port):
    from shmcomm import InvalidArgumentError, MismatchError, NotSupportedError, PeerArgumentError

    dist, me, n = _join(port)
    with pytest.raises(MismatchError):  # every rank raises, and the job goes on
        dist.all_reduce(torch.ones(3 + me))
    with pytest.raises(NotSupportedError, match="integer or bool"):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BXOR)
    with pytest.raises(NotSupportedError, match="cannot reduce"):
        dist.all_reduce(torch.ones(2, dtype=torch.uint32))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        dist.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(NotSupportedError, match="CPU and CUDA tensors"):
        dist.group.WORLD.allreduce([torch.ones(2, device="meta")], dist.AllreduceOptions())
    with pytest.raises(InvalidArgumentError, match="output must hold"):
        dist.all_gather_into_tensor(torch.empty(3), torch.ones(2))
    # one rank's bad output fails the call on every rank at once, not at the timeout
    with pytest.raises(InvalidArgumentError if me == 1 else PeerArgumentError, match="output must hold"):
        dist.all_gather_into_tensor(torch.empty(2 * n + me), torch.ones(2))
    with pytest.raises(InvalidArgumentError if me == 0 else PeerArgumentError, match="contiguous"):
        dist.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n, 2)[:, 0] if me == 0 else torch.ones(2 * n))
    with pytest.raises(InvalidArgumentError, match="cannot send to itself"):  # torch's own check comes first
        dist.group.WORLD.send([torch.ones(1)], me, 0)
    # A receiver expecting another size raises; the sender, whose send returns once the message is out (as gloo's and
    # MPI's do), hears of it at its next message on that channel, which fails on both sides.
    if me == 0:
        dist.send(torch.ones(2), dst=1)
        with pytest.raises(MismatchError, match="the broadcast before this broadcast"):
            dist.send(torch.ones(2), dst=1)
        dist.send(torch.ones(2), dst=1)
    else:
        with pytest.raises(MismatchError):
            dist.recv(torch.empty(3), src=0)
        with pytest.raises(MismatchError, match="the broadcast before this broadcast"):
            dist.recv(torch.empty(2), src=0)
        got = torch.empty(2)
        dist.recv(got, src=0)
        assert got.tolist() == [1.0, 1.0]
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [float(n)] * 2
    dist.destroy_process_group()
    return True


def test_errors_raise_on_every_rank_and_the_job_goes_on():
    _on_ranks(2, _errors)


def _killed(port):
    import time

    from shmcomm import RankFailure

    dist, me, n = _join(port)
    dist.barrier()
    if me == 1:
        os._exit(3)
    began = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1") as failure:
        dist.all_reduce(torch.ones(1024))
    assert failure.value.rank == 1 and time.monotonic() - began < 20
    return True


def test_a_killed_rank_is_named():
    results = multiproc.run(2, _killed, _free_port(), timeout=90, check=False)
    assert results[0] == ("ok", True), results
    assert results[1][0] == "died"


def _stuck(port, released):
    import time

    import shmcomm

    dist, me, n = _join(port, seconds=2)  # the group's timeout bounds shmcomm's waits
    dist.barrier()
    if me == 1:
        released.wait(60)  # never comes to the collective
        return True
    began = time.monotonic()
    with pytest.raises(shmcomm.TimeoutError, match="rank 1"):
        dist.all_reduce(torch.ones(8))
    waited = time.monotonic() - began
    released.set()
    assert 1.5 < waited < 15, waited
    return True


def test_the_groups_timeout_bounds_every_wait():
    released = multiproc.Event()
    assert multiproc.run(2, _stuck, _free_port(), released, timeout=90) == [True, True]


def _silent_sender(port, released):
    import time

    import shmcomm

    dist, me, n = _join(port, seconds=2)
    if me == 0:
        released.wait(60)  # never sends
        return True
    began = time.monotonic()
    with pytest.raises(shmcomm.TimeoutError):  # the channel's start waits for the sender no longer than the group's
        dist.recv(torch.empty(2), src=0)
    waited = time.monotonic() - began
    released.set()
    assert 1.5 < waited < 15, waited
    return True


def test_a_receive_from_a_silent_sender_times_out_with_the_group():
    released = multiproc.Event()
    assert multiproc.run(2, _silent_sender, _free_port(), released, timeout=90) == [True, True]


def _groups_meet_horovod_sets(port, again):
    import shmcomm

    dist, me, n = _join(port)
    everyone = dist.new_group(list(range(n)))  # a second group of every rank: its own channels
    for group in (None, everyone):
        t = torch.full((2,), float(me))
        if me == 0:
            dist.send(t, 1, group=group)
        elif me == 1:
            dist.recv(t, 0, group=group)
            assert t.tolist() == [0.0, 0.0]
    first_two = dist.new_group([0, 1])
    numbered = shmcomm.add_process_set([0, 1])  # Horovod's sets are numbered alike on every rank, groups or not
    later = shmcomm.add_process_set([0, 2])
    if me in (0, 2):
        assert shmcomm.allreduce(np.ones(1), op=shmcomm.Sum, process_set=later).tolist() == [2.0]
    assert numbered.process_set_id + 1 == later.process_set_id and first_two is not None
    work = dist.isend(torch.ones(3), 1) if me == 0 else dist.irecv(torch.empty(3), 0) if me == 1 else None
    dist.destroy_process_group()  # with a message under way: its channel closes once it has gone
    if work is not None:
        work.wait()
    dist.init_process_group("shmcomm", init_method="tcp://127.0.0.1:%d" % again, rank=me, world_size=n)
    t = torch.full((2,), 5.0) if me == 0 else torch.empty(2)
    if me < 2:
        (dist.send if me == 0 else dist.recv)(t, 1 - me)  # the same channel's name, opened again
        assert t.tolist() == [5.0, 5.0]
    dist.destroy_process_group()
    return True


def _through_the_store(port, hosts, secret_ranks):
    """take_place on a real TCPStore, each rank standing on the host `hosts` names for it."""
    import datetime
    import time

    from shmcomm import env
    from shmcomm.startup import rendezvous

    rank, size = int(os.environ["SHMCOMM_RANK"]), int(os.environ["SHMCOMM_SIZE"])
    rendezvous.socket.gethostname = lambda: hosts[rank]
    env._secret.clear()  # a secret the test process read before the fork is not this rank's
    if rank in secret_ranks:
        os.environ[env.SECRET] = "ab" * 32
    store = torch.distributed.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=30))
    try:
        rendezvous.take_place(store, rank, size)
        outcome = None
    except ValueError as error:
        outcome = "refused: %s" % error
    store.add("done", 1)
    while rank == 0 and store.add("done", 0) < size:  # rank 0 holds the store until every rank has read it
        time.sleep(0.01)
    if outcome is not None:
        return outcome
    topo = env.topology()
    record = rendezvous.joined()
    return [topo.rank, topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size, topo.token,
            env.job_secret().hex(), record["hosts"], record["addresses"]]


def test_ranks_on_several_hosts_agree_their_places_through_torchs_store():
    """torchrun across hosts: hosts, local and cross ranks, one token and one secret from rank 0, a listener per rank;
    ranks of a host that are not consecutive, or a secret on some ranks only, are refused on every rank alike."""
    got = multiproc.run(3, _through_the_store, _free_port(), ["a", "a", "b"], ())
    assert [g[:5] for g in got] == [[0, 0, 2, 0, 2], [1, 1, 2, 0, 2], [2, 0, 1, 1, 2]]
    assert len({g[5] for g in got}) == 1 and len({g[6] for g in got}) == 1 and len(got[0][6]) == 64
    assert all(g[7] == ["a", "a", "b"] and g[8] == got[0][8] for g in got) and len(set(got[0][8])) == 3
    for hosts, secret_ranks, text in [(["a", "b", "a"], (), "the ranks of each host must be consecutive"),
                                      (["a", "a", "b"], (0,), "is set on rank(s) [0] but not on rank(s) [1, 2]")]:
        got = multiproc.run(3, _through_the_store, _free_port(), hosts, secret_ranks)
        assert all(g.startswith("refused: ") and text in g for g in got), got


def test_groups_channels_and_horovod_process_sets_live_side_by_side():
    assert multiproc.run(3, _groups_meet_horovod_sets, _free_port(), _free_port(), timeout=90) == [True] * 3


def _awkward_tensors(port):
    dist, me, n = _join(port)
    words = torch.tensor([0xF0F0 | me, 0xFFFF], dtype=torch.uint32)  # moved as bytes, reduced bitwise
    dist.all_reduce(words, op=dist.ReduceOp.BAND)
    assert words.tolist() == [0xF0F0, 0xFFFF]
    params = [torch.nn.Parameter(torch.full((k + 1,), float(me))) for k in range(3)]  # written in place, as gloo
    dist.all_reduce_coalesced(params)
    assert [p.tolist() for p in params] == [[float(sum(range(n)))] * (k + 1) for k in range(3)]
    outputs = [torch.zeros(2, requires_grad=True) for _ in range(n)]
    dist.all_gather(outputs, torch.full((2,), float(me)))
    assert [o.tolist() for o in outputs] == [[float(r)] * 2 for r in range(n)]
    # all_to_all_single without output splits: equal parts out, whatever the input splits
    sent = torch.tensor([[float(me)]] * 3)  # one row to rank 0, two to rank 1, from both
    received = torch.empty(2 * (me + 1), 1)
    dist.all_to_all_single(received, sent, None, [1, 2])
    assert received.reshape(-1).tolist() == [0.0] * (me + 1) + [1.0] * (me + 1), received
    dist.destroy_process_group()
    return True


def test_bytes_tensors_that_require_grad_and_equal_received_parts():
    _on_ranks(2, _awkward_tensors)


def test_views_refuse_what_they_cannot_carry():
    from shmcomm import NotSupportedError
    from shmcomm.torch import tensor_views
    from shmcomm.vocabulary.buffers import host_view

    with pytest.raises(NotSupportedError, match="complex factor"):
        tensor_views.reduction(torch.ones(2), torch.distributed._make_nccl_premul_sum(torch.tensor([1 + 2j])),
                                 "all_reduce")
    assert host_view(torch.ones(2, 2).to_sparse()) is None and host_view(torch.ones(2)) is not None


def test_kept_views_follow_each_tensors_memory_and_never_hold_a_tensor():
    import gc
    import weakref

    import torch.distributed as dist

    import shmcomm
    from shmcomm import InvalidArgumentError
    from shmcomm.torch.tensor_views import HostViews

    def over(view, tensor):  # the view is the tensor's memory, whole and flat
        return view.__array_interface__["data"][0] == tensor.data_ptr() and view.size == tensor.numel() \
            and view.dtype == tensor.numpy().dtype and view.ndim == 1

    views = HostViews()
    t = torch.arange(6.0).reshape(2, 3)
    first = views.data(t, "x")
    assert over(first, t) and views.data(t, "x") is first  # kept
    first[0] = 7.0
    assert t[0, 0] == 7.0
    t.set_(torch.arange(4.0))  # new memory under the same tensor
    assert over(views.data(t, "x"), t)
    p = torch.zeros(4)
    views.data(p, "x")
    p.untyped_storage().resize_(0)  # as FSDP frees and regrows a parameter's memory
    p.untyped_storage().resize_(16)
    assert over(views.data(p, "x"), p)
    t.data = t.view(torch.int32)  # the same memory, another dtype
    assert over(views.data(t, "x"), t) and views.data(t, "x").dtype == np.int32
    m = torch.arange(6.0).reshape(2, 3)
    views.data(m, "x")
    m.t_()  # the same memory, no longer contiguous
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        views.data(m, "x")
    assert views.plain(torch.ones(2), dist.ReduceOp.AVG)[1] is shmcomm.Average
    assert views.plain(torch.ones(2), dist.ReduceOp.RedOpType.MAX)[1] is shmcomm.Max
    assert views.plain(torch.ones(2), dist._make_nccl_premul_sum(2.0)) is None  # a factor: the full path
    assert views.plain(torch.ones(2, dtype=torch.bool), dist.ReduceOp.SUM) is None
    bits = torch.ones(2, 2, dtype=torch.bfloat16)  # numpy has no bfloat16: the tensor itself, flat, for the collectives
    flat, _ = views.plain(bits, dist.ReduceOp.SUM)
    assert flat.dtype is torch.bfloat16 and flat.shape == (4,) and flat.data_ptr() == bits.data_ptr()
    assert views.plain(bits.t(), dist.ReduceOp.SUM) is None  # not contiguous: the full path says so
    gone = torch.ones(3)
    views.data(gone, "x")
    ref = weakref.ref(gone)
    del gone
    gc.collect()
    assert ref() is None
    kept = [torch.ones(i + 1) for i in range(3 * HostViews.KEPT)]
    assert all(over(views.data(k, "x"), k) for k in kept) and len(views._views) <= HostViews.KEPT


def _ddp(port):
    dist, me, n = _join(port)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    alone = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    alone.load_state_dict(net.state_dict())
    if me == 1:
        with torch.no_grad():  # DDP's start broadcasts rank 0's parameters
            for p in net.parameters():
                p.add_(1.0)
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0005)  # several buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_alone = torch.optim.SGD(alone.parameters(), lr=0.05)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (4 * n,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[4 * me:4 * me + 4]), y[4 * me:4 * me + 4]).backward()
        opt.step()
        opt_alone.zero_grad()
        torch.nn.functional.cross_entropy(alone(x), y).backward()  # the mean over the whole batch
        opt_alone.step()
    for mine, reference in zip(net.parameters(), alone.parameters()):
        assert torch.allclose(mine, reference, rtol=1e-12, atol=1e-12), (mine - reference).abs().max()
    dist.destroy_process_group()
    return True


def test_ddp_without_a_hook_matches_one_process_on_the_whole_batch():
    _on_ranks(2, _ddp)


def _fsdp2_and_dtensor(port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist, me, n = _join(port)
    mesh = init_device_mesh("cpu", (n,))
    full = torch.arange(6.0 * 5).reshape(6, 5)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(sharded.to_local(), full[6 // n * me:6 // n * (me + 1)])
    replicated = sharded.redistribute(mesh, [Replicate()])
    assert torch.equal(replicated.to_local(), full)
    assert torch.equal(replicated.redistribute(mesh, [Shard(1)]).full_tensor(), full)

    def make():
        return torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4)).double()

    torch.manual_seed(0)
    model, alone = make(), make()
    alone.load_state_dict(model.state_dict())
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, opt_alone = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(alone.parameters(), lr=0.1)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4 * n, 8, generator=g, dtype=torch.float64)
        y = torch.randn(4 * n, 4, generator=g, dtype=torch.float64)
        loss = ((model(x[4 * me:4 * me + 4]) - y[4 * me:4 * me + 4]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        reference = ((alone(x) - y) ** 2).mean()
        reference.backward()
        opt_alone.step()
        opt_alone.zero_grad()
        assert abs(loss.item() - reference.item()) <= 1e-12 * abs(reference.item()), (step, loss, reference)
    dist.destroy_process_group()
    return True


def test_fsdp2_and_dtensor_match_one_process():
    _on_ranks(2, _fsdp2_and_dtensor, timeout=120)


LAUNCHED = """
import os, sys
import torch, torch.distributed as dist
import shmcomm, shmcomm.torch
if len(sys.argv) > 1:  # mpiexec, torch's rendezvous given as for gloo: MPI's numbers and an address
    dist.init_process_group("shmcomm", init_method="tcp://127.0.0.1:" + sys.argv[1],
                            rank=int(os.environ["PMI_RANK"]), world_size=int(os.environ["PMI_SIZE"]))
else:  # torchrun's env://, or a plain mpiexec's (torch/mpi_rendezvous.py)
    dist.init_process_group("shmcomm")
me, n = dist.get_rank(), dist.get_world_size()
t = torch.full((3,), float(me))
dist.all_reduce(t)
got = torch.empty(n)
dist.all_to_all_single(got, torch.arange(float(n)) + 10 * me)
print("rank %d of %d: %s %s shmcomm %d of %d on %d local" % (me, n, t.tolist(), got.tolist(), shmcomm.rank(),
                                                           shmcomm.size(), shmcomm.local_size()), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.long  # torchrun and mpiexec start slowly; the default run starts the backend under shmcommrun
@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec", "mpiexec, init_method"])
def test_torchrun_and_mpiexec_start_the_backend(tmp_path, launcher):
    """init_process_group("shmcomm") as such under torchrun and under a plain mpiexec (whose env:// rendezvous
    shmcomm gives torch), and with an init_method and MPI's numbers under mpiexec, as for gloo."""
    import subprocess
    import sys

    from benchmarks import backends

    script = tmp_path / "job.py"
    script.write_text(LAUNCHED)
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
                   str(_free_port()), str(script)]
    else:
        mpiexec = backends.find_mpiexec()
        if mpiexec is None:
            pytest.skip("no mpiexec beside the interpreter or on PATH")
        command = [mpiexec, "-n", "3", sys.executable, str(script)] + (
            [str(_free_port())] if launcher.endswith("init_method") else [])
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHMCOMM_", "HOROVOD_")) and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK")}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = sorted(re.findall(r"rank \d of 3: .*? on 3 local", run.stdout))  # the ranks share one stdout
    assert lines == ["rank %d of 3: [3.0, 3.0, 3.0] %s shmcomm %d of 3 on 3 local"
                     % (r, [10.0 * k + r for k in range(3)], r) for r in range(3)], run.stdout + run.stderr
