# SPDX-License-Identifier: Apache-2.0
"""Horovod's timeline test step by step (test/parallel/test_timeline.py in Horovod's repository), on every rank:
HOROVOD_TIMELINE and HOROVOD_TIMELINE_MARK_CYCLES=1 at init, one named allreduce, 0.1 s, and the file must already
hold the tensor, its negotiation, the allreduce and a cycle mark, as an array that parses once closed; after
shutdown it must be a closed array. Rank r > 0 reads its own file, <path>.<r>.

    HOROVOD_TIMELINE=PATH HOROVOD_TIMELINE_MARK_CYCLES=1 shmcommrun -np 2 python tests/timeline_step.py

prints each rank's report as one JSON line: {"missing": [names not in the file after 0.1 s], "closed": bool}."""
import json
import os
import time

EXPECTED = ("allreduce.test_allreduce", "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START")


def step():
    import torch

    import shmcomm.torch as hvd

    hvd.init()
    hvd.allreduce(torch.tensor([1, 2, 3], dtype=torch.float32), name="test_allreduce")
    time.sleep(0.1)
    path = os.environ["HOROVOD_TIMELINE"]
    path = path if hvd.rank() == 0 else "%s.%d" % (path, hvd.rank())
    with open(path) as f:
        text = f.read()
    missing = [name for name in EXPECTED if name not in text]
    json.loads(text.rstrip().rstrip(",") + "]")  # readable while the job runs
    hvd.shutdown()
    with open(path) as f:
        closed = json.load(f)
    return {"missing": missing, "closed": closed[-1]["name"] == "timeline_end"}


if __name__ == "__main__":
    print(json.dumps(step()), flush=True)
