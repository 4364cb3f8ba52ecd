# SPDX-License-Identifier: Apache-2.0
"""What each rank of a failure test raised, written by the rank to a file and read by the test process (read).

Ranks of a job whose output the launcher or hydra forwards cannot be relied on to print whole lines before they are
stopped, so each rank writes its own file:

    except shmcomm.ShmCommError as error:
        outcomes.record(directory, shmcomm.rank(), error, started)
"""
import json
import os
import time


def record(directory, rank, error, started=None):
    """Writes what `rank` raised: the exception's type, the rank it names (RankFailure.rank, else None), the seconds
    since `started` (a time.monotonic() value) and its message."""
    outcome = {"type": type(error).__name__, "rank": getattr(error, "rank", None), "message": str(error),
               "seconds": None if started is None else time.monotonic() - started}
    path = os.path.join(directory, "raised.%d" % rank)
    with open(path + ".tmp", "w") as f:
        json.dump(outcome, f)
    os.replace(path + ".tmp", path)


def read(directory):
    """What the ranks recorded in `directory`: {rank: {"type", "rank", "seconds", "message"}}."""
    outcomes = {}
    for name in os.listdir(directory):
        if name.startswith("raised.") and not name.endswith(".tmp"):
            with open(os.path.join(directory, name)) as f:
                outcomes[int(name.split(".")[1])] = json.load(f)
    return outcomes


def wait_for(directory, ranks, timeout):
    """Waits until each of `ranks` has recorded what it raised (or `timeout` seconds have passed): ranks whose exit
    stops the job call it before exiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(directory, "raised.%d" % r))
                                                   for r in ranks):
        time.sleep(0.01)
