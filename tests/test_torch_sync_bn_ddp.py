# SPDX-License-Identifier: Apache-2.0
"""SyncBatchNorm against one BatchNorm over the whole batch; DDP with shmcomm's communication hook against DDP
over gloo."""
import socket

import pytest

torch = pytest.importorskip("torch")
import multiproc  # noqa: E402

# torch.optim imports torch._dynamo on first use (a second or more): pay once here, not in every forked rank.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

BATCH = [3, 5]  # uneven on purpose


def _rank_batch(r, rows, seed):
    g = torch.Generator().manual_seed(seed * 10 + r)
    return torch.randn(rows, 4, 2, 3, generator=g, dtype=torch.float64) * (r + 1) + r


def _sync_bn():
    import shmcomm.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    me, n = hvd.rank(), hvd.size()
    sbn = hvd.SyncBatchNorm(4).double()
    ref = torch.nn.BatchNorm2d(4).double()
    with torch.no_grad():
        for m in (sbn, ref):
            m.weight.copy_(torch.tensor([1.0, 2.0, -0.5, 0.3]))
            m.bias.copy_(torch.tensor([0.1, -0.2, 0.0, 1.0]))
    for step, rows in enumerate([BATCH, [4, 0]]):  # the second step: rank 1 has no samples at all
        xs = [_rank_batch(r, rows[r], step) for r in range(n)]
        ws = [_rank_batch(r + 7, rows[r], step) for r in range(n)]  # weights of the loss
        x = xs[me].clone().requires_grad_()
        y = sbn(x)
        (y * ws[me]).sum().backward()
        xr = torch.cat(xs).requires_grad_()
        yr = ref(xr)
        (yr * torch.cat(ws)).sum().backward()
        lo = sum(rows[:me])
        assert torch.allclose(y, yr[lo:lo + rows[me]], atol=1e-12)
        assert torch.allclose(x.grad, xr.grad[lo:lo + rows[me]], atol=1e-10)
        for mine, theirs in ((sbn.weight, ref.weight), (sbn.bias, ref.bias)):  # local parts add up
            assert torch.allclose(hvd.allreduce(mine.grad, op=hvd.Sum), theirs.grad, atol=1e-10)
            mine.grad = theirs.grad = None
        assert torch.allclose(sbn.running_mean, ref.running_mean, atol=1e-12)
        assert torch.allclose(sbn.running_var, ref.running_var, atol=1e-12)
    assert int(sbn.num_batches_tracked) == 2
    sbn.eval()
    ref.eval()
    x = _rank_batch(me, 2, 9)
    assert torch.allclose(sbn(x), ref(x), atol=1e-12)  # running statistics, nothing exchanged
    return True


def test_sync_batch_norm_matches_one_batch_norm():
    assert multiproc.run(2, _sync_bn, timeout=60) == [True, True]


def _ddp(port):
    import torch.distributed as dist

    import shmcomm.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    me, n = hvd.rank(), hvd.size()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=me, world_size=n)
    try:
        results = []
        for hook in (None, hvd.allreduce_hook):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                      torch.nn.ReLU(), torch.nn.Linear(32, 3))
            model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.002)  # several buckets
            if hook is not None:
                model.register_comm_hook(state=None, hook=hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for step in range(4):
                g = torch.Generator().manual_seed(step * 10 + me)
                x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            results.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        assert torch.allclose(results[0], results[1], atol=1e-6), (results[0] - results[1]).abs().max()
        every = hvd.allgather(results[1].unsqueeze(0))
        assert torch.equal(every[0], every[1])
    finally:
        dist.destroy_process_group()
    return True


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_hook_matches_gloo():
    assert multiproc.run(2, _ddp, _free_port(), timeout=90) == [True, True]
