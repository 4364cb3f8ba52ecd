# SPDX-License-Identifier: Apache-2.0
"""An elastic job across simulated hosts for tests/test_elastic_hosts.py: `elastic_hosts_job.py DIR EPOCHS KILL_AT`.

DIR/hosts is what the test's discovery script prints; it starts as simhost0:2 and simhost1:2. The job trains a
linear model on 240 samples through an ElasticSampler, 4 a rank and step, every step committed, and changes its
hosts on the way:
- at step KILL_AT the last rank (on simhost1) gives up its slot, adds a host (simhost2:1), and kills itself;
- once the world has grown back to 4 ranks, rank 0 drops simhost1 from the hosts: its worker is retired.
Training goes on past EPOCHS until both have happened (at most 150 s). A process set of ranks [0, 1] (simhost0's)
is used at every step, so every re-formed world must have registered it again. Rank 0 prints, for every epoch,
whether each sample went into exactly one committed step; every rank prints its host, its weights' digest and the
sizes its world has had."""
import hashlib
import os
import signal
import socket
import sys
import time

import numpy as np
import torch

import shmcomm.torch as hvd
from shmcomm import env

SAMPLES, BATCH = 240, 4


def set_hosts(directory, text):
    path = os.path.join(directory, "hosts")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def once(directory, name):
    """True the first time a name is claimed in DIR (a rolled-back step runs again, its side effects must not)."""
    try:
        os.close(os.open(os.path.join(directory, name), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def main():
    directory, epochs, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    hvd.init()
    pair = hvd.add_process_set([0, 1])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(x, seed=2)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0,
                                   sizes=[hvd.size()], counts=np.zeros(SAMPLES, np.int64), exact=[])
    deadline = time.monotonic() + 150

    def done():
        return state.epoch >= epochs and state.sizes[-4:] == [4, 3, 4, 3]

    @hvd.elastic.run
    def train(state):
        while not done():
            assert time.monotonic() < deadline, "the hosts did not change as planned within 150 s: %s" % state.sizes
            for i, batch in enumerate(state.sampler.batches(BATCH)):
                if state.step == kill_at and hvd.rank() == hvd.size() - 1 and once(directory, "killed"):
                    set_hosts(directory, "simhost0:2\nsimhost1:1\nsimhost2:1\n")
                    os.kill(os.getpid(), signal.SIGKILL)
                if state.sizes[-3:] == [4, 3, 4] and hvd.rank() == 0 and once(directory, "dropped"):
                    set_hosts(directory, "simhost0:2\nsimhost2:1\n")
                optimizer.zero_grad()
                if batch:
                    ((model(x[batch]) - y[batch]) ** 2).mean().backward()
                optimizer.step()
                if pair.included():
                    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=pair).item() == 2.0
                for indices in hvd.allgather_object(batch, name="batch"):
                    state.counts[indices] += 1
                state.sampler.record_batch(i, BATCH)
                if state.sizes[-1] != hvd.size():
                    state.sizes.append(hvd.size())
                state.step += 1
                time.sleep(0.02)  # a step of a real model: the hosts change while the job trains
                state.commit()
            state.exact.append(bool((state.counts == 1).all()))
            state.counts[:] = 0
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    if hvd.rank() == 0:
        print("epochs %d every sample once %s recoveries %s" % (state.epoch, state.exact,
                                                                 ",".join(r[0] for r in state.recoveries)), flush=True)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print("done rank %d size %d host %s digest %s sizes %s token %s" % (
        hvd.rank(), hvd.size(), socket.gethostname(), digest, ",".join(map(str, state.sizes)),
        env.job_token()), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
