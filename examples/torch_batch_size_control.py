# SPDX-License-Identifier: Apache-2.0
"""Batch-size control in the style of Sony's ImageNet run: the global batch grows at chosen epochs while the job
runs, by accumulating more backward passes per step; the learning rate follows linearly.

    shmcommrun -np 2 python examples/torch_batch_size_control.py --schedule 0:1,3:2,6:4

Trains an MLP on scikit-learn's bundled 8x8 digits (no download). Each rank takes its share of every global batch.
With --check, rank 0 then replays the same schedule in this one process, each step on the whole global batch at
once, and prints how far the two runs' weights are apart."""
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import shmcomm.torch as hvd


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="0:1,3:2,6:4", help="epoch:passes per step, comma-separated")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank and backward pass")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate at the first stage's global batch")
    parser.add_argument("--check", action="store_true", help="compare with the same schedule in one process")
    return parser.parse_args()


def data():
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    return x, torch.tensor(digits.target)


def model_for_seed():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def global_batches(epoch, samples, size, batch, passes):
    """The epoch's global batches: for each step, [per rank [per pass the sample indices]], one order everywhere."""
    order = np.random.default_rng(epoch).permutation(samples)
    per_step = size * passes * batch
    return [order[s * per_step:(s + 1) * per_step].reshape(passes, size, batch).transpose(1, 0, 2)
            for s in range(samples // per_step)]


def train(args, schedule, rank, size, distributed):
    """Trains with the schedule; distributed: this rank's share under DistributedOptimizer, else every step's
    whole global batch in this process (the reference)."""
    x, y = data()
    model = model_for_seed()
    # The learning rate of the first stage's global batch; later stages scale it by their passes (linear rule).
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                         backward_passes_per_step=schedule[0],
                                         average_aggregated_gradients=True) if distributed else sgd
    control = hvd.BatchSizeSchedule(optimizer, schedule) if distributed else None
    passes_now = schedule[0]
    for epoch in range(args.epochs):
        if distributed:
            passes = control.set_epoch(epoch)
        else:  # what BatchSizeSchedule does, by hand
            passes = [p for e, p in sorted(schedule.items()) if e <= epoch][-1]
            for group in sgd.param_groups:
                group["lr"] *= passes / passes_now
            passes_now = passes
        losses = []
        for step in global_batches(epoch, len(x), size, args.batch_size, passes):
            if distributed:
                for i in step[rank]:
                    loss = F.cross_entropy(model(x[i]), y[i])
                    loss.backward()
                    losses.append(loss.item())
            else:
                everything = step.reshape(-1)
                loss = F.cross_entropy(model(x[everything]), y[everything])
                loss.backward()
                losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        if rank == 0 and distributed:
            accuracy = (model(x).argmax(1) == y).float().mean().item()
            print("epoch %d: global batch %d (%d passes of %d on %d ranks), lr %.3f, loss %.4f, accuracy %.1f%%"
                  % (epoch, size * passes * args.batch_size, passes, args.batch_size, size, sgd.param_groups[0]["lr"],
                     np.mean(losses), 100 * accuracy), flush=True)
    return model


def main():
    args = parse_args()
    schedule = {int(e): int(p) for e, p in (item.split(":") for item in args.schedule.split(","))}
    hvd.init()
    model = train(args, schedule, hvd.rank(), hvd.size(), distributed=True)
    if args.check and hvd.rank() == 0:
        reference = train(args, schedule, 0, hvd.size(), distributed=False)
        gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
        print("largest weight difference from one process on the same schedule: %.2e" % gap, flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
