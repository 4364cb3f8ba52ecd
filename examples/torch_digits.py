# SPDX-License-Identifier: Apache-2.0
"""Horovod-style data-parallel training of a small CNN on scikit-learn's bundled 8x8 digits (no download).

    shmcommrun -np 2 python examples/torch_digits.py

Each rank trains on its shard of the training set. DistributedOptimizer averages the gradients as backward produces
them; rank 0's initial weights and optimizer state are broadcast first, so every rank takes identical steps. The
learning rate scales with the number of ranks (the global batch grows with it), so any -np reaches the same accuracy.
At the end the ranks check they hold identical weights and rank 0 reports test accuracy."""
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import shmcomm.torch as hvd


class DigitsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def dataset(seed=0):
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    return (x[:split], y[:split]), (x[split:], y[split:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="for one rank; scaled by the number of ranks")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(42 + hvd.rank())  # deliberately different: the broadcast below makes the models equal
    (x_train, y_train), (x_test, y_test) = dataset()
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

    model = DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    steps = len(y_train) // args.batch_size
    bar = None
    if hvd.rank() == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.epochs * steps, desc="training", unit="step", mininterval=0.5)
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(1000 + epoch))
        for s in range(steps):
            idx = perm[s * args.batch_size:(s + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, loss="%.3f" % loss.item(), refresh=False)
    if bar is not None:
        bar.close()

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="final_weights")
    identical = all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))
    if hvd.rank() == 0:
        print("ranks %d, weights identical on all ranks: %s, test accuracy %.2f%%"
              % (hvd.size(), identical, 100 * accuracy), flush=True)
    hvd.shutdown()
    if not identical:
        raise SystemExit("weights differ between ranks")


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
