# SPDX-License-Identifier: Apache-2.0
"""ShmCaffe's training modes on scikit-learn's 8x8 digits: synchronous, asynchronous and hybrid.

    shmcommrun -np 2 python examples/torch_elastic.py --mode async
    shmcommrun -np 4 python examples/torch_elastic.py --mode hybrid --slow-rank 3 --slow-factor 3

--mode sync: DistributedOptimizer (every step waits for every rank). --mode async: ElasticAveragingOptimizer (each
rank steps alone and exchanges with a centre in a job-wide Soft Memory Box). --mode hybrid: synchronous inside each
host, asynchronous between hosts. --mode local: each rank trains alone, without communicating (the baseline against
which the others' communication time per step is measured). --slow-rank R --slow-factor F makes rank R sleep so
that each of its steps takes F times as long, as a slower server would.

--duration S --phase-seconds P measures step rates instead of time to accuracy: the job trains for S seconds, and
the slow rank is slowed only in every other phase of P seconds (the first unslowed), so that every rank's step rate
with and without the slow rank comes from the same job, interleaved in time.

Rank 0 evaluates the centre (sync, local: its model) every --eval-every of its steps and stops the job once the test
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
from shmcomm.smb import averaging as elastic

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_digits import DigitsNet, dataset  # noqa: E402


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return correct


class Stopper:
    """Whether rank 0 has called time. sync: a broadcast every check (every rank checks at the same step). async and
    local: a box every rank looks at alone. hybrid: the host's first rank looks at the box and tells its host through
    a box of the host (its ranks step together, so they must stop at the same step)."""

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
        if self.mode in ("async", "local"):
            return self.box.version > 0
        self.checks += 1
        if hvd.rank() == self.root:
            self.host_box.write(torch.tensor([float(self.box.version > 0)]).numpy())
        else:
            self.host_box.wait_version(self.checks)
        return bool(self.host_box.read()[0] > 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["sync", "async", "hybrid", "local"], default="async")
    parser.add_argument("--epochs", type=int, default=40,
                        help="at most; the run stops at the target (with --duration: no limit)")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank (sync: scaled by the number of ranks)")
    parser.add_argument("--alpha", type=float, default=0.2, help="elastic moving rate")
    parser.add_argument("--period", type=int, default=1, help="steps between exchanges with the centre")
    parser.add_argument("--eval-every", type=int, default=10, help="rank 0's steps between evaluations")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-factor", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=0.0,
                        help="train this many seconds and report step rates, not the time to --target (0: off)")
    parser.add_argument("--phase-seconds", type=float, default=2.0,
                        help="with --duration: the slow rank is slowed in every other phase of this length")
    args = parser.parse_args()
    if args.duration and not 0 < 3 * args.phase_seconds <= args.duration:
        parser.error("--duration must hold at least three phases of --phase-seconds")

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
    elif args.mode != "local":
        optimizer = hvd.ElasticAveragingOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                  alpha=args.alpha, period=args.period, hybrid=args.mode == "hybrid")
    stopper = Stopper(args.mode)
    judge = DigitsNet()  # rank 0 evaluates the centre in it

    def centre_accuracy():
        if args.mode in ("sync", "local"):
            return accuracy(model, x_test, y_test)
        judge.load_state_dict(optimizer.centre_state_dict(), strict=False)
        return accuracy(judge, x_test, y_test)

    steps_per_epoch = len(y_train) // args.batch_size
    reached_s, steps, busy_s, stop_called = None, 0, 0.0, False
    # Phases count from rank 0's clock: every rank switches at the same moment where clocks agree (one machine, or
    # hosts kept in step by NTP to milliseconds, against phases of seconds).
    origin = hvd.broadcast_object(time.time(), 0, name="example.origin") if args.duration else 0.0
    phase_steps = {}

    def phase_now():  # odd phases are the slowed ones; without --duration every step is
        return int((time.time() - origin) / args.phase_seconds) if args.duration else 1

    started = time.perf_counter()
    for epoch in range(args.epochs if not args.duration else 1 << 30):
        perm = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(1000 * rank + epoch))
        for s in range(steps_per_epoch):
            t0 = time.perf_counter()
            idx = perm[s * args.batch_size:(s + 1) * args.batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            optimizer.step()
            phase = phase_now()
            if rank == args.slow_rank and args.slow_factor > 1 and phase % 2:
                time.sleep((args.slow_factor - 1) * (time.perf_counter() - t0))
                phase = phase_now()
            busy_s += time.perf_counter() - t0
            steps += 1
            phase_steps[phase] = phase_steps.get(phase, 0) + 1
            if steps % args.eval_every:
                continue
            if rank == 0 and args.duration:
                if not stop_called and time.perf_counter() - started >= args.duration:
                    stopper.stop()
                    stop_called = True
            elif rank == 0 and reached_s is None and centre_accuracy() >= args.target:
                reached_s = time.perf_counter() - started
                stopper.stop()
            if stopper.stopped():
                break
        else:
            continue
        break
    wall_s = time.perf_counter() - started
    if args.duration:
        # Whole phases only: not the first (warming up), nor the one this rank stopped in.
        last = phase_now()
        plain = [phase_steps.get(k, 0) for k in range(2, last, 2)]
        slowed = [phase_steps.get(k, 0) for k in range(1, last, 2)]
        phased = hvd.allgather_object((rank, sum(plain) / (max(1, len(plain)) * args.phase_seconds),
                                       sum(slowed) / (max(1, len(slowed)) * args.phase_seconds)))
    if args.mode in ("async", "hybrid"):
        optimizer.finish()
    rates = hvd.allgather_object((rank, steps, steps / busy_s if busy_s else 0.0, steps / wall_s))
    final = centre_accuracy() if rank == 0 else None
    hvd.barrier()  # every rank's pushes are in before the boxes' servers go
    if rank == 0:
        for r, n, rate, overall in sorted(rates):
            print("rank %d: %d steps, %.1f steps/s while stepping, %.1f steps/s overall" % (r, n, rate, overall))
        if args.duration:
            for r, plain, slowed in sorted(phased):
                print("rank %d phases: %.1f steps/s unslowed, %.1f steps/s with rank %d slowed, ratio %.3f"
                      % (r, plain, slowed, args.slow_rank, slowed / plain if plain else 0.0))
        reached = "%.2f s" % reached_s if reached_s is not None else "not reached"
        if args.duration:
            reached = "not measured (step rates over %.0f s)" % args.duration
        print("mode %s, ranks %d, hosts %d: time to %.0f%%: %s; final centre accuracy %.2f%%"
              % (args.mode, size, hvd.cross_size(), 100 * args.target, reached, 100 * final), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
