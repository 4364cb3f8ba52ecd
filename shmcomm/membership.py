# SPDX-License-Identifier: Apache-2.0
"""Who is in an elastic job now: the membership the elastic launcher (runner/elastic.py) writes, and how a worker
takes its place in it.

The launcher keeps one JSON file, replaced atomically (written aside, then renamed) whenever the job changes:

    {"generation": 3, "token": "<job token>g3", "members": [0, 2, 3, 4], "abort": null}

`members` are worker ids in rank order (survivors keep their order, newcomers come last, so rank 0 is the oldest
worker: the one whose state the others receive). Each generation has a job token of its own, so a re-formed world
meets in new segments. `abort` holds the reason when the job cannot go on (fewer workers than --min-np). Workers
learn their identity here at every init; nothing else in shmcomm knows the job is elastic."""
import json
import os
import time

from shmcomm import env
from shmcomm.exceptions import ShmCommError

FILE = "membership.json"


class MembershipError(ShmCommError):
    """The elastic job cannot go on: the launcher stopped it, or no membership came in time."""
_POLL_S = 0.02


def write(directory, generation, token, members, abort=None):
    record = {"generation": generation, "token": "%sg%d" % (token, generation), "members": list(members),
              "abort": abort}
    path = os.path.join(directory, FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    return record


def read(directory):
    try:
        with open(os.path.join(directory, FILE)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


class _Joined:
    generation = -1  # the generation this process last joined


def joined_generation():
    return _Joined.generation


def current_generation():
    """The newest generation the launcher has written (cheap enough for every commit)."""
    record = read(env.elastic_dir())
    return -1 if record is None else record["generation"]


def join(timeout_s=None):
    """Waits for a generation newer than the last one joined that includes this worker, then sets the launcher's
    variables of that world (rank, size, token) for init to read. Raises ShmCommError when the launcher gave up
    (abort) or after `timeout_s` (SHMCOMM_ELASTIC_TIMEOUT) without one: never waits forever."""
    directory, me = env.elastic_dir(), env.elastic_worker()
    timeout_s = env.elastic_timeout() if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    ready = os.path.join(directory, "ready.%d" % me)
    if not os.path.exists(ready):  # the launcher adds a new worker to the membership once it is this far
        open(ready, "w").close()
    while True:
        record = read(directory)
        if record is not None and record["abort"]:
            raise MembershipError("elastic job stopped: %s" % record["abort"])
        if record is not None and record["generation"] > _Joined.generation and me in record["members"]:
            break
        if time.monotonic() > deadline:
            raise MembershipError("elastic worker %d: no new membership that includes it within %.0f s "
                               "(SHMCOMM_ELASTIC_TIMEOUT)" % (me, timeout_s))
        time.sleep(_POLL_S)
    rank, size = record["members"].index(me), len(record["members"])
    identity = {"RANK": rank, "SIZE": size, "LOCAL_RANK": rank, "LOCAL_SIZE": size, "CROSS_RANK": 0,
                "CROSS_SIZE": 1, "JOB_TOKEN": record["token"]}
    for key, value in identity.items():
        os.environ["SHMCOMM_" + key] = os.environ["HOROVOD_" + key] = str(value)
    _Joined.generation = record["generation"]
    return record
