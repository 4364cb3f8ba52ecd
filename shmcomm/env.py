# SPDX-License-Identifier: Apache-2.0
"""The one reader of the environment: the launcher's rank contract and the tuning knobs.

Every SHMCOMM_* name is also read under its HOROVOD_* spelling, so a job started the Horovod way finds its ranks."""
import os
import secrets
from dataclasses import dataclass


def _get(name, default=None):
    for prefix in ("SHMCOMM_", "HOROVOD_"):
        value = os.environ.get(prefix + name)
        if value not in (None, ""):
            return value
    return default


def _number(name, default, kind=float):
    value = _get(name)
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        raise ValueError("environment variable SHMCOMM_%s=%r is not a valid %s" % (name, value, kind.__name__))


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    token: str
    launched: bool  # False: a world of one started without a launcher


def topology():
    """Where this process sits in the job, from the launcher's variables; a world of one without them."""
    if _get("RANK") is None:
        return Topology(0, 1, 0, 1, 0, 1, secrets.token_hex(16), False)
    size = _number("SIZE", 1, int)
    rank = _number("RANK", 0, int)
    local_size = _number("LOCAL_SIZE", size, int)
    local_rank = _number("LOCAL_RANK", rank, int)
    token = _get("JOB_TOKEN")
    if token is None:
        raise ValueError(
            "SHMCOMM_RANK is set but SHMCOMM_JOB_TOKEN is not: start the job with shmcommrun, or set a job token "
            "(a random string of 8 to 64 letters and digits shared by all ranks)"
        )
    if not (0 <= rank < size and 0 <= local_rank < local_size <= size):
        raise ValueError("inconsistent launch variables: rank %d of %d, local rank %d of %d"
                         % (rank, size, local_rank, local_size))
    return Topology(rank, size, local_rank, local_size, _number("CROSS_RANK", 0, int),
                    _number("CROSS_SIZE", 1, int), token, True)


def engine_requested():
    return _get("ENGINE", "0") not in ("0", "false", "False", "")


@dataclass(frozen=True)
class Tuning:
    timeout_s: float       # any collective wait while peers are alive
    start_timeout_s: float # init waiting for every rank
    liveness_s: float      # how often a sleeping waiter checks its peer is alive
    slot_bytes: int        # per-rank staging buffer
    small_bytes: int       # one-step allreduce up to this size
    arena_bytes: int       # Soft Memory Box arena
    spin_us: int           # microseconds of polling before sleeping


def tuning(local_size):
    # With more ranks than cores, a spinning waiter steals the core its peer needs: sleep almost at once.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # With a core each, polling for up to a millisecond rides out the scheduling hiccups of a shared machine, which
    # otherwise turn a 70 us allreduce into a futex wake-up chain ten times slower.
    default_spin_us = 1000 if local_size <= cores else 2
    return Tuning(
        timeout_s=_number("TIMEOUT", 300.0),
        start_timeout_s=_number("START_TIMEOUT", 60.0),
        liveness_s=_number("LIVENESS_INTERVAL", 0.1),
        # More ranks than cores: every synchronisation costs context switches, so take fewer, larger steps.
        slot_bytes=_number("SLOT_BYTES", (4 << 20) if local_size <= cores else (8 << 20), int),
        small_bytes=_number("SMALL_BYTES", 64 << 10, int),
        arena_bytes=_number("SMB_BYTES", 256 << 20, int),
        spin_us=_number("SPIN_US", default_spin_us, int),
    )
