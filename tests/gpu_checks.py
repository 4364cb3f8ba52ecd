# SPDX-License-Identifier: Apache-2.0
"""The checks of CUDA tensors in shmcomm.torch that run on every rank of a job (tests/test_gpu.py launches it with
shmcommrun on a machine with a GPU): `python tests/gpu_checks.py [check ...]`. Each rank takes the GPU
local_rank % device_count (so ranks share one when there are more ranks than GPUs). Each check asserts exact
expectations computed here from what every rank contributes, and prints "ok <check>"; any failure exits non-zero.
EXPECT_PATH (nccl or host) names the path the job must have taken."""
import copy
import os
import signal
import sys
import threading
import time

import torch

import shmcomm
import shmcomm.torch as hvd


def device():
    return torch.device("cuda", torch.cuda.current_device())


def arange(n, me, dtype):
    return (torch.arange(n, dtype=torch.float64) + me).to(dtype)


def check_path():
    comm = shmcomm.basics.communicator().device_comm
    want = os.environ.get("EXPECT_PATH")
    assert comm is not None and (want is None or comm.path == want), (comm and comm.path, want)
    if os.environ.get("EXPECT_TORUS"):
        assert comm.row is not None and comm.column is not None
        assert (comm.row.size, comm.column.size) == tuple(int(v) for v in os.environ["EXPECT_TORUS"].split("x"))


def check_collectives():
    me, n, dev = hvd.rank(), hvd.size(), device()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the collectives follow the caller's current stream, not the default one
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int16):
            x = arange(10, me, dtype).to(dev)
            got = hvd.allreduce(x, op=hvd.Sum, name="sum.%s" % dtype)
            want = sum(arange(10, r, torch.float64) for r in range(n)).to(dtype)
            assert got.device == dev and torch.equal(got.cpu(), want), (dtype, got, want)
        x = arange(1000, me, torch.float32).to(dev)
        total = sum(arange(1000, r, torch.float64) for r in range(n))
        assert torch.allclose(hvd.allreduce(x, op=hvd.Average).cpu().double(), total / n)
        scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
        assert torch.allclose(scaled.cpu().double(), total * 2.0)
        assert torch.equal(hvd.allreduce(x, op=hvd.Min).cpu(), arange(1000, 0, torch.float32))
        assert torch.equal(hvd.allreduce(x, op=hvd.Max).cpu(), arange(1000, n - 1, torch.float32))
        y = x.clone()
        assert hvd.allreduce_(y, op=hvd.Sum) is y and torch.equal(y.cpu(), total.float())
        # A group of small tensors: fused on the device.
        group = [torch.full((k + 1,), float(me + k), device=dev) for k in range(20)]
        for k, out in enumerate(hvd.grouped_allreduce(group, op=hvd.Sum)):
            assert torch.equal(out.cpu(), torch.full((k + 1,), float(sum(r + k for r in range(n)))))
        # Allgather of unequal rows.
        gathered = hvd.allgather(torch.full((me + 1, 3), float(me), device=dev))
        want = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(n)])
        assert torch.equal(gathered.cpu(), want)
        # Broadcast, new tensor and in place.
        b = arange(5, me, torch.float32).to(dev)
        assert torch.equal(hvd.broadcast(b, root_rank=n - 1).cpu(), arange(5, n - 1, torch.float32))
        assert torch.equal(hvd.broadcast_(b, root_rank=0).cpu(), arange(5, 0, torch.float32))
        # Reducescatter, even and uneven rows (the first rows % n ranks get a row more).
        for rows in (2 * n, 2 * n + 1):
            t = (torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + me).to(dev)
            got = hvd.reducescatter(t, op=hvd.Sum)
            share = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
            start = sum(share[:me])
            full = sum(torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + r for r in range(n))
            assert torch.equal(got.cpu(), full[start:start + share[me]]), (rows, got)
        # Alltoall: rank `me` sends dest + 1 rows to each dest, each row holding 100 * me + dest.
        splits = torch.tensor([d + 1 for d in range(n)])
        rows = torch.cat([torch.full((d + 1, 2), float(100 * me + d)) for d in range(n)]).to(dev)
        received, counts = hvd.alltoall(rows, splits=splits)
        assert counts.tolist() == [me + 1] * n
        assert torch.equal(received.cpu(), torch.cat([torch.full((me + 1, 2), float(100 * r + me)) for r in range(n)]))
        # Asynchronous handles.
        handle = hvd.allreduce_async(x, op=hvd.Sum, name="async")
        while not hvd.poll(handle):
            time.sleep(0.001)
        assert torch.equal(hvd.synchronize(handle).cpu(), total.float())
    side.synchronize()
    check_path()


def check_optimizer():
    """DistributedOptimizer on a CUDA model: each rank's step on its quarter of the batch equals one process's step
    on the whole batch (the mean loss over equal shares is the mean of the shares' means)."""
    me, n, dev = hvd.rank(), hvd.size(), device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dev)
    reference = copy.deepcopy(model)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(4 * n, 8, generator=generator).to(dev)
    targets = torch.randn(4 * n, 4, generator=generator).to(dev)
    mine = slice(4 * me, 4 * (me + 1))
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs[mine]), targets[mine]).backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(inputs), targets).backward()
        reference_optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (name, (p - q).abs().max().item())


def check_dead_rank():
    """Rank 1 is killed while the others run large allreduces: they raise an error that names it, and exit 3."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # say what was raised before the launcher's SIGKILL
    me = hvd.rank()
    if me == 1:
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    x = torch.ones(64 << 20, device=device())
    try:
        while True:
            hvd.allreduce_(x, op=hvd.Sum)
            torch.cuda.current_stream().synchronize()
    except shmcomm.ShmCommError as error:
        print("raised %s rank=%s: %s" % (type(error).__name__, getattr(error, "rank", None), error), flush=True)
        raise SystemExit(3)


def check_backend():
    """torch.distributed on the "shmcomm" backend with CUDA tensors: the world group's collectives give what every
    rank contributes, and DDP's gradients equal one process's on the whole batch."""
    import torch.distributed as dist

    me, n, dev = hvd.rank(), hvd.size(), device()
    dist.init_process_group("shmcomm")  # shmcommrun gives torch its rendezvous
    x = arange(1000, me, torch.float32).to(dev)
    dist.all_reduce(x)
    assert torch.equal(x.cpu(), sum(arange(1000, r, torch.float32) for r in range(n)))
    whole = torch.empty(2 * n, device=dev)
    dist.all_gather_into_tensor(whole, torch.full((2,), float(me), device=dev))
    assert whole.tolist() == [float(r) for r in range(n) for _ in range(2)]
    share = torch.empty(3, device=dev)
    dist.reduce_scatter_tensor(share, torch.arange(3.0 * n, device=dev))
    assert share.tolist() == [float(n * (3 * me + i)) for i in range(3)]
    got = torch.empty(n, device=dev)
    dist.all_to_all_single(got, torch.arange(float(n), device=dev) + 10 * me)
    assert got.tolist() == [10.0 * r + me for r in range(n)]
    b = torch.full((4,), float(me), device=dev)
    dist.broadcast(b, src=n - 1)
    assert b.tolist() == [float(n - 1)] * 4
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4).to(dev)
    reference = copy.deepcopy(net)
    model = torch.nn.parallel.DistributedDataParallel(net)
    data = torch.randn(4 * n, 8, generator=torch.Generator().manual_seed(2)).to(dev)
    model(data[4 * me:4 * me + 4]).pow(2).mean().backward()
    reference(data).pow(2).mean().backward()
    for p, q in zip(net.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), (p.grad - q.grad).abs().max().item()
    dist.destroy_process_group()


CHECKS = {"collectives": check_collectives, "optimizer": check_optimizer, "backend": check_backend,
          "dead_rank": check_dead_rank}

if __name__ == "__main__":
    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    for name in sys.argv[1:] or ["collectives", "optimizer", "backend"]:
        CHECKS[name]()
        print("ok", name, flush=True)
