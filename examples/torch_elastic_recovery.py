# SPDX-License-Identifier: Apache-2.0
"""Elastic training that survives lost workers: Horovod's elastic API on scikit-learn's bundled digits.

    shmcommrun -np 4 --min-np 2 --max-np 4 python examples/torch_elastic_recovery.py --chaos /tmp/elastic-events
    shmcommrun -np 4 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh \
        python examples/torch_elastic_recovery.py --chaos /shared/events    # across its hosts (DIR shared)

With --chaos DIR the job hurts itself: every 50 steps, while it has more than 2 ranks, rank 1 kills itself with
SIGKILL. The survivors roll back to their last commit and go on as a smaller world, renumbered; the launcher starts
a replacement (-np says how many workers to keep; a --host-discovery-script would say it instead), which joins at
the survivors' first commit after it has started, and receives the state. Every step is committed. At the end of
each epoch rank 0 checks that every sample went into exactly one committed step; it reports, for each loss, the time
from the kill to training again, and at the end the test accuracy and the job's time."""
import argparse
import os
import signal
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import shmcomm.torch as hvd


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank and step")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank: scaled by the number of ranks")
    parser.add_argument("--chaos", metavar="DIR", help="lose rank 1 every 50 steps (DIR records the kills)")
    return parser.parse_args()


def chaos(args, step):
    """Kills rank 1 at steps 50, 100, ... (while there are more than 2 ranks). Each kill happens once, although the
    step that saw it is rolled back and run again."""
    marker = os.path.join(args.chaos, "kill.%d" % step)
    if step % 50 == 0 and step > 0 and hvd.rank() == 1 and hvd.size() > 2 and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(repr(time.time()))
        print("step %d: rank 1 kills itself" % step, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def main():
    args = parse_args()
    started = time.time()
    if args.chaos:
        os.makedirs(args.chaos, exist_ok=True)
    hvd.init()
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    train_x, train_y, test_x, test_y = x[:1500], y[:1500], x[1500:], y[1500:]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_x, seed=1)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0,
                                   counts=np.zeros(len(train_x), dtype=np.int64))
    losses = []

    def on_reset():
        for group in optimizer.param_groups:  # the global batch follows the number of ranks
            group["lr"] = args.lr * hvd.size()
        kind, seconds, size = state.recoveries[-1]
        if hvd.rank() != 0:
            return
        text = "step %d: re-formed with %d ranks, %.2f s after %s" % (
            state.step, size, seconds, "the failure was noticed" if kind == "lost" else "the workers changed")
        marker = os.path.join(args.chaos or ".", "kill.%d" % state.step)
        if kind == "lost" and args.chaos and os.path.exists(marker):
            with open(marker) as f:
                text += "; training again %.2f s after the kill" % (time.time() - float(f.read()))
        print(text, flush=True)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, args.epochs):
            for i, batch in enumerate(state.sampler.batches(args.batch_size)):
                if args.chaos:
                    chaos(args, state.step)
                optimizer.zero_grad()
                if batch:  # at an epoch's end some ranks may have no sample left: they contribute zeros
                    loss = F.cross_entropy(model(train_x[batch]), train_y[batch])
                    loss.backward()
                    losses.append(loss.item())
                optimizer.step()
                for indices in hvd.allgather_object(batch, name="batch"):
                    state.counts[indices] += 1
                state.sampler.record_batch(i, args.batch_size)
                state.step += 1
                state.commit()
            if hvd.rank() == 0:
                once = bool((state.counts == 1).all())
                print("epoch %d: every sample in exactly one committed step: %s (loss %.4f, %d ranks)"
                      % (state.epoch, once, np.mean(losses[-50:]), hvd.size()), flush=True)
            state.counts[:] = 0
            state.epoch += 1  # committed as the next epoch: a re-formed world goes on from there
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    if hvd.rank() == 0:
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
        print("test accuracy %.1f%% after %d steps; job time %.1f s" % (100 * accuracy, state.step,
                                                                       time.time() - started), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
