# SPDX-License-Identifier: Apache-2.0
"""An unchanged DistributedDataParallel training loop whose gradient traffic goes through shmcomm.

    shmcommrun -np 2 python examples/torch_ddp_hook.py

torch.distributed still sets up the job (gloo, with a file rendezvous named after the job token); one line,
register_comm_hook, hands the gradient buckets to shmcomm's shared-memory allreduce."""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import shmcomm.torch as hvd


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args()

    hvd.init()
    path = os.path.join(tempfile.gettempdir(), "shmcomm_ddp_%s" % os.environ.get("SHMCOMM_JOB_TOKEN", "solo"))
    dist.init_process_group("gloo", init_method="file://" + path, rank=hvd.rank(), world_size=hvd.size())

    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0))  # writers mixed
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)[order]
    y = torch.tensor(digits.target)[order]
    shard = slice(dist.get_rank(), None, dist.get_world_size())
    x_train, y_train = x[:1400][shard], y[:1400][shard]
    x_test, y_test = x[1400:], y[1400:]

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    model.register_comm_hook(state=None, hook=hvd.allreduce_hook)  # the only shmcomm-specific line
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
    if dist.get_rank() == 0:
        print("DDP with the shmcomm hook on %d ranks: test accuracy %.2f%%" % (dist.get_world_size(), 100 * accuracy),
              flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
