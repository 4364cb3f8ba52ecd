# SPDX-License-Identifier: Apache-2.0
"""Batch-size control: backward_passes_per_step changes between steps, the learning rate follows linearly, and a
job on 2 or 4 ranks ends with the weights of one process taking each step on the whole global batch."""
import os
import re
import subprocess
import sys

import pytest

import multiproc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Four ranks on two cores take twice as long as two; the default run keeps two, -m long adds four.
@pytest.mark.long
@pytest.mark.parametrize("n,schedule", [(2, "0:1,3:2,6:4"), (4, "0:2,2:1,4:3")])
def test_growing_batch_matches_one_process_on_the_same_schedule(n, schedule):
    pytest.importorskip("sklearn")
    run = subprocess.run([sys.executable, "-m", "shmcomm.runner", "-np", str(n), sys.executable,
                          "examples/torch_batch_size_control.py", "--schedule", schedule, "--epochs", "7", "--check"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    stages = {int(e): int(p) for e, p in (s.split(":") for s in schedule.split(","))}
    lines = re.findall(r"epoch (\d+): global batch (\d+) \((\d+) passes of 16 on \d+ ranks\), lr ([\d.]+)", run.stdout)
    assert len(lines) == 7, run.stdout
    for epoch, batch, passes, lr in lines:
        want = [p for e, p in sorted(stages.items()) if e <= int(epoch)][-1]
        assert int(passes) == want and int(batch) == n * 16 * want
        assert abs(float(lr) - 0.05 * want / stages[0]) < 1e-9  # linear in the global batch
    gap = float(run.stdout.split("from one process on the same schedule: ")[1].split()[0])
    assert gap < 1e-5, run.stdout


def _misuse():
    import torch

    import shmcomm.torch as hvd

    hvd.init()
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=2,
                                   named_parameters=model.named_parameters())
    with pytest.raises(ValueError, match="epoch 0"):
        hvd.BatchSizeSchedule(opt, {1: 2})
    with pytest.raises(ValueError, match="positive"):
        opt.set_backward_passes_per_step(0)
    model(torch.ones(2, 3)).sum().backward()  # one of two passes
    with pytest.raises(ValueError, match="middle of a step"):
        opt.set_backward_passes_per_step(4)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.set_backward_passes_per_step(1)  # between steps: fine
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    return opt.backward_passes_per_step


def test_passes_change_between_steps_only():
    pytest.importorskip("torch")
    assert multiproc.run(2, _misuse) == [1, 1]
