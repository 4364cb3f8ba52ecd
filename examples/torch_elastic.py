# SPDX-License-Identifier: Apache-2.0
"""ShmCaffe's training modes on scikit-learn's 8x8 digits: synchronous, asynchronous and hybrid.

    shmcommrun -np 2 python examples/torch_elastic.py --mode async
    shmcommrun -np 4 python examples/torch_elastic.py --mode hybrid --slow-rank 3 --slow-factor 3

--mode sync: DistributedOptimizer (every step waits for every rank). --mode async: ElasticAveragingOptimizer (each
rank steps alone and exchanges with a centre in a job-wide Soft Memory Box). --mode hybrid: synchronous inside each
host, asynchronous between hosts. --slow-rank R --slow-factor F makes rank R sleep so that each of its steps takes F
times as long, as a slower server would.

Rank 0 evaluates the centre (sync: its model) every --eval-every of its steps and stops the job once the test
accuracy reaches --target; it prints the wall time to the target and the final accuracy, and every rank's step
rate."""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import shmcomm
import shmcomm.torch as hvd
from shmcomm import averaging as elastic

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_digits import DigitsNet, dataset  # noqa: E402


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return correct


class Stopper:
    """Whether rank 0 has called time. sync: a broadcast every check (every rank checks at the same step). async:
    a box every rank looks at alone. hybrid: the host's first rank looks at the box and tells its host through a
    box of the host (its ranks step together, so they must stop at the same step)."""

    def __init__(self, mode):
        self.mode = mode
        self.box = shmcomm.SoftMemoryBox("example.stop", shape=(1,), dtype="float32", home=0)
        if mode == "hybrid":
            host_set = elastic.host_process_set()
            self.root = min(host_set.ranks) if host_set.process_set_id else 0
            self.host_box = shmcomm.SoftMemoryBox("example.stop.host", shape=(1,), dtype="float32", local=True)
            self.checks = 0
        hvd.barrier()

    def stop(self):
        self.box.write(torch.ones(1).numpy())

    def stopped(self):
        if self.mode == "sync":
            return bool(hvd.broadcast(torch.tensor([float(self.box.version > 0)]), 0, name="example.stop")[0])
        if self.mode == "async":
            return self.box.version > 0
        self.checks += 1
        if hvd.rank() == self.root:
            self.host_box.write(torch.tensor([float(self.box.version > 0)]).numpy())
        else:
            self.host_box.wait_version(self.checks)
        return bool(self.host_box.read()[0] > 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["sync", "async", "hybrid"], default="async")
    parser.add_argument("--epochs", type=int, default=40, help="at most; the run stops at the target")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank (sync: scaled by the number of ranks)")
    parser.add_argument("--alpha", type=float, default=0.2, help="elastic moving rate")
    parser.add_argument("--period", type=int, default=1, help="steps between exchanges with the centre")
    parser.add_argument("--eval-every", type=int, default=10, help="rank 0's steps between evaluations")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-factor", type=float, default=1.0)
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(42 + rank)
    (x_train, y_train), (x_test, y_test) = dataset()
    x_train, y_train = x_train[rank::size], y_train[rank::size]
    model = DigitsNet()
    lr = args.lr * (size if args.mode == "sync" else hvd.local_size() if args.mode == "hybrid" else 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if args.mode == "sync":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    else:
        optimizer = hvd.ElasticAveragingOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                  alpha=args.alpha, period=args.period, hybrid=args.mode == "hybrid")
    stopper = Stopper(args.mode)
    judge = DigitsNet()  # rank 0 evaluates the centre in it

    def centre_accuracy():
        if args.mode == "sync":
            return accuracy(model, x_test, y_test)
        judge.load_state_dict(optimizer.centre_state_dict(), strict=False)
        return accuracy(judge, x_test, y_test)

    steps_per_epoch = len(y_train) // args.batch_size
    reached_s, steps, busy_s = None, 0, 0.0
    started = time.perf_counter()
    for epoch in range(args.epochs):
        perm = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(1000 * rank + epoch))
        for s in range(steps_per_epoch):
            t0 = time.perf_counter()
            idx = perm[s * args.batch_size:(s + 1) * args.batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            optimizer.step()
            if rank == args.slow_rank and args.slow_factor > 1:
                time.sleep((args.slow_factor - 1) * (time.perf_counter() - t0))
            busy_s += time.perf_counter() - t0
            steps += 1
            if steps % args.eval_every:
                continue
            if rank == 0 and reached_s is None and centre_accuracy() >= args.target:
                reached_s = time.perf_counter() - started
                stopper.stop()
            if stopper.stopped():
                break
        else:
            continue
        break
    wall_s = time.perf_counter() - started
    if args.mode != "sync":
        optimizer.finish()
    rates = hvd.allgather_object((rank, steps, steps / busy_s if busy_s else 0.0, steps / wall_s))
    final = centre_accuracy() if rank == 0 else None
    hvd.barrier()  # every rank's pushes are in before the boxes' servers go
    if rank == 0:
        for r, n, rate, overall in sorted(rates):
            print("rank %d: %d steps, %.1f steps/s while stepping, %.1f steps/s overall" % (r, n, rate, overall))
        reached = "%.2f s" % reached_s if reached_s is not None else "not reached"
        print("mode %s, ranks %d, hosts %d: time to %.0f%%: %s; final centre accuracy %.2f%%"
              % (args.mode, size, hvd.cross_size(), 100 * args.target, reached, 100 * final), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
