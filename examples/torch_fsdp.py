# SPDX-License-Identifier: Apache-2.0
"""Fully sharded data parallel training (FSDP2's fully_shard) with torch.distributed on the shmcomm backend.

    shmcommrun -np 2 python examples/torch_fsdp.py

Every rank holds a shard of each layer's parameters; the forward pass gathers them (all_gather_into_tensor) and the
backward pass reduces and scatters the gradients (reduce_scatter_tensor), both through shmcomm's shared memory. The
only shmcomm-specific lines are the import and the backend's name."""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shmcomm.torch  # noqa: F401  (registers the "shmcomm" backend)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("shmcomm")  # shmcommrun sets the rank, world size and rendezvous address
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))

    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0))  # writers mixed
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)[order]
    y = torch.tensor(digits.target)[order]
    shard = slice(rank, None, size)
    x_train, y_train = x[:1400][shard], y[:1400][shard]
    x_test, y_test = x[1400:], y[1400:]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)  # each layer gathers its parameters only while it runs
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    for epoch in range(args.epochs):
        perm = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        for s in range(len(y_train) // args.batch_size):
            idx = perm[s * args.batch_size:(s + 1) * args.batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    if rank == 0:
        shards = sum(p.to_local().numel() for p in model.parameters())
        print("FSDP2 on the shmcomm backend, %d ranks, %d parameters held here of %d: test accuracy %.2f%%"
              % (size, shards, sum(p.numel() for p in model.parameters()), 100 * accuracy), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
