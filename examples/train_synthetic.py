# SPDX-License-Identifier: Apache-2.0
"""Data-parallel training of a small classifier, every rank on its own shard, gradients averaged by shmcomm.

    shmcommrun -np 2 python examples/train_synthetic.py

The data is a three-armed spiral made on the spot (no download). Rank 0 broadcasts the initial weights, each step
every rank computes gradients on its shard and shmcomm averages them in place, so all ranks take the same step.
At the end the ranks prove they hold identical weights, and rank 0 reports held-out accuracy."""
import argparse
import math

import numpy as np
import torch

import shmcomm


def spiral(n_per_class, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for c in range(classes):
        r = np.linspace(0.05, 1.0, n_per_class)
        t = np.linspace(c * 2 * math.pi / classes, (c + 2.2) * 2 * math.pi / classes, n_per_class)
        t = t + rng.normal(0, 0.12, n_per_class)
        xs.append(np.stack([r * np.sin(t), r * np.cos(t)], 1))
        ys.append(np.full(n_per_class, c))
    x, y = np.concatenate(xs).astype(np.float32), np.concatenate(ys)
    order = rng.permutation(len(y))
    return torch.from_numpy(x[order]), torch.from_numpy(y[order])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    shmcomm.init()
    rank, size = shmcomm.rank(), shmcomm.size()
    torch.manual_seed(1234 + rank)  # different on purpose: the broadcast below must make them equal

    x, y = spiral(1200)
    split = int(0.8 * len(y))
    x_train, y_train = x[rank:split:size], y[rank:split:size]  # this rank's shard
    x_test, y_test = x[split:], y[split:]

    model = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 3))
    for p in model.parameters():
        shmcomm.broadcast_(p.data, root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    steps = len(y_train) // args.batch_size
    for epoch in range(args.epochs):
        perm = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        total = 0.0
        for s in range(steps):
            idx = perm[s * args.batch_size:(s + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            loss.backward()
            for p in model.parameters():
                shmcomm.allreduce_(p.grad, op=shmcomm.Average)
            optimizer.step()
            total += loss.item()
        mean_loss = shmcomm.allreduce(torch.tensor([total / steps]), op=shmcomm.Average).item()
        if rank == 0 and (epoch % 10 == 9 or epoch == args.epochs - 1):
            print("epoch %3d  loss %.4f" % (epoch + 1, mean_loss), flush=True)

    flat = torch.cat([p.data.reshape(-1) for p in model.parameters()])
    everyone = shmcomm.allgather(flat.unsqueeze(0))
    identical = all(torch.equal(everyone[0], everyone[r]) for r in range(size))
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    if rank == 0:
        print("ranks %d, weights identical on all ranks: %s, test accuracy %.1f%%" % (size, identical, 100 * accuracy))
    shmcomm.shutdown()
    if not identical:
        raise SystemExit("weights differ between ranks")


if __name__ == "__main__":
    main()
