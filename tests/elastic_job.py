# SPDX-License-Identifier: Apache-2.0
"""An elastic job for tests/test_elastic.py: `elastic_job.py DIR STEPS [KILL_AT] [GROW_AT]`.

Trains a linear model on per-step data that depends only on the step, so every world size takes the same steps.
DIR/slots is what the test's discovery script reports. With GROW_AT, training goes on past STEPS until the world
is back to its first size. At step KILL_AT rank 1 lowers the slots by one and kills
itself; at GROW_AT rank 0 raises them by one. A process set of ranks [0, 1] is registered before training and used
at every step, so a re-formed world must have registered it again. At the end each rank prints its size, the
weights' digest and the sizes its world has had.

ELASTIC_JOB_DIE_FORMING=W: elastic worker W kills itself when it has joined its second membership and is about to
form that world (after the launcher told everyone of it, before its shared memory is attached), so that the others
wait for a rank that will never come until a newer membership replaces the one they are forming."""
import os
import signal
import sys
import time

import torch

import shmcomm.torch as hvd
from shmcomm.startup import bootstrap
from shmcomm import env


def die_forming_second_world():
    """Wraps bootstrap.build_world so that this worker dies (SIGKILL) the second time it forms a world."""
    build_world, formed = bootstrap.build_world, []

    def build_or_die(generation):
        formed.append(generation)
        if len(formed) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return build_world(generation)
    bootstrap.build_world = build_or_die


def bump(directory, delta):
    path = os.path.join(directory, "slots")
    with open(path) as f:
        slots = int(f.read())
    with open(path + ".tmp", "w") as f:
        f.write("%d\n" % (slots + delta))
    os.replace(path + ".tmp", path)


def main():
    directory, steps = sys.argv[1], int(sys.argv[2])
    kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    grow_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    if os.environ.get("ELASTIC_JOB_DIE_FORMING") == str(env.elastic_worker()):
        die_forming_second_world()
    hvd.init()
    pair = hvd.add_process_set([0, 1])
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0, sizes=[hvd.size()])
    deadline = time.monotonic() + 120

    @hvd.elastic.run
    def train(state):
        # With GROW_AT, training goes on until the new worker has joined (it takes seconds to start).
        while state.step < steps or (grow_at >= 0 and state.sizes[-1] < state.sizes[0]):
            assert time.monotonic() < deadline, "the world did not grow back within 120 s"
            if state.step == kill_at and hvd.rank() == 1 and not os.path.exists(os.path.join(directory, "killed")):
                open(os.path.join(directory, "killed"), "w").close()
                bump(directory, -1)
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step == grow_at and hvd.rank() == 0 and not os.path.exists(os.path.join(directory, "grown")):
                open(os.path.join(directory, "grown"), "w").close()
                bump(directory, +1)
            g = torch.Generator().manual_seed(state.step)
            x = torch.randn(8, 4, generator=g)
            optimizer.zero_grad()
            ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
            optimizer.step()
            if pair.included():
                assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=pair).item() == 2.0
            if state.sizes[-1] != hvd.size():
                state.sizes.append(hvd.size())
            state.step += 1
            state.commit()

    train(state)
    digest = float(sum(p.double().sum() for p in model.parameters()))
    print("done size %d set %s digest %.12f sizes %s" % (hvd.size(), pair.process_set_id, digest,
                                                          ",".join(map(str, state.sizes))), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
