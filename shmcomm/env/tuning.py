# SPDX-License-Identifier: Apache-2.0
"""The performance settings: the core's waits, buffers and path thresholds (Tuning), the engine's cycle and fusion,
and the autotuner's search. Defaults follow what the machine reports at run time (cores, L2 size)."""
import os
from dataclasses import dataclass

from shmcomm.env import machine
from shmcomm.env.values import MAX_BYTES, MAX_SECONDS, flag as _flag, get as _get, is_set, number as _number, switch


@dataclass(frozen=True)
class Tuning:
    timeout_s: float       # any collective wait while peers are alive
    start_timeout_s: float # init waiting for every rank
    liveness_s: float      # how often a sleeping waiter checks its peer is alive
    slot_bytes: int        # per-rank staging buffer
    small_bytes: int       # one-step allreduce up to this size (16-bit floats: a quarter)
    arena_bytes: int       # Soft Memory Box arena
    spin_us: int           # microseconds of polling before sleeping
    yield_us: int          # then microseconds of a collective's waiter yielding its core before sleeping
    single_copy_bytes: int  # allgather inputs and alltoall parts per peer from this size read peers' memory; 0: never
    broadcast_single_copy_bytes: int  # broadcast's, which differs with more ranks than cores
    piece_bytes: int       # allreduce/reducescatter bytes of each rank's range per step; 0: a staging half's share
    pull_bytes: int        # allreduces and reduce-scatters from this size read the peers' inputs; 0: never
    cache_bytes: int       # one core's L2: single copy's chunks, and from which sizes its copies bypass the caches
    shared_cache_bytes: int  # the last-level cache: reductions whose data outgrow it write their results past it
    single_copy_probed: bool  # the thresholds are defaults: learned per size where the kernel's copy is slow
    shared_buffers: bool   # the engine's fusion buffer and shmcomm.shared_empty are mapped by every rank of the host
    shared_from_bytes: int  # collectives on shared buffers from this size read and write the peers' directly
    huge_pages: bool       # buffers that peers reach by the kernel's copy are collapsed into huge pages when reused
    pull_probed: bool      # PULL_BYTES is its default: pull where init found the kernel's copy fast, else learn
    piece_probed: bool     # PIECE_BYTES is its default: it sizes pulled steps only, staged ones take a half's share
    race_pause_us: int     # tests only: a pause inside a box update's locked section, so that a lost lock shows


def timeout_s(environ=None):
    """SHMCOMM_TIMEOUT, the bound of every wait on another rank (of `environ`: the launcher reads the ranks')."""
    # Horovod's Gloo timeout bounds its collectives as SHMCOMM_TIMEOUT bounds these.
    return _number("TIMEOUT", _number("GLOO_TIMEOUT_SECONDS", 300.0, environ=environ, positive=True, high=MAX_SECONDS),
                   environ=environ, positive=True, high=MAX_SECONDS)


def start_timeout_s():
    """SHMCOMM_START_TIMEOUT, the bound of the waits for every rank to attach to a world or process set."""
    return _number("START_TIMEOUT", 60.0, positive=True, high=MAX_SECONDS)


def tuning(local_size):
    # With more ranks than cores, a spinning waiter steals the core its peer needs: sleep almost at once.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # Where the waits poll without yielding (SHMCOMM_YIELD_US=0) and the ranks have a core each, polling for up to a
    # millisecond rides out the scheduling hiccups that would otherwise make a small allreduce a chain of wake-ups.
    default_spin_us = 1000 if local_size <= cores else 2
    # A waiter yields its core before sleeping, for about a scheduler slice per rank sharing a core, where a peer
    # last ran on that core: the peer it waits for then runs first. Not only with more ranks than cores: any other
    # busy process (a data loader, another job) can put a rank's peer behind it on one core at any moment. Where
    # every peer runs elsewhere it polls for as long instead, since a yield there could only give the core to that
    # busy process for a whole slice (csrc/coll/step.c; figures in benchmarks/RESULTS.md).
    default_yield_us = 1000 * -(-local_size // cores)
    l2_bytes = machine.cache_bytes(2) or (1 << 20)
    # Single copy costs a system call per peer and saves a copy: it pays from pieces of about 16 KiB, where one copy
    # in cache takes as long as the call, and with more ranks than cores from pieces as many times larger as ranks
    # share a core (each call may wait for the core). Where the kernel's copy proves slow at init, allgathers and
    # alltoalls learn per size whether it pays, up to a few L2s (csrc/coll/cma.c, single_copy_probed); broadcast's
    # stays.
    single_copy_bytes = _number("SINGLE_COPY_BYTES", (16 << 10) * -(-local_size // cores), int, low=0, high=MAX_BYTES)
    return Tuning(
        timeout_s=timeout_s(),
        start_timeout_s=start_timeout_s(),
        liveness_s=_number("LIVENESS_INTERVAL", 0.1, positive=True, high=MAX_SECONDS),
        # More ranks than cores: every synchronisation costs context switches, so take fewer, larger steps. The
        # core needs two pages, and a cache line per rank in each half.
        slot_bytes=_number("SLOT_BYTES", (4 << 20) if local_size <= cores else (8 << 20), int,
                           low=max(8192, 128 * local_size), high=MAX_BYTES // max(local_size, 1)),
        small_bytes=_number("SMALL_BYTES", 64 << 10, int, low=0, high=MAX_BYTES),
        arena_bytes=_number("SMB_BYTES", 256 << 20, int, low=0, high=MAX_BYTES),
        spin_us=_number("SPIN_US", default_spin_us, int, low=0, high=(1 << 31) - 1),
        yield_us=_number("YIELD_US", default_yield_us, int, low=0, high=(1 << 31) - 1),
        single_copy_bytes=single_copy_bytes,
        # Broadcast's is the same but with more ranks than cores, unless set: its root waits for every reader of its
        # buffer then, which with the cores shared costs more than the copy saves below the L2's size.
        broadcast_single_copy_bytes=single_copy_bytes if local_size <= cores or is_set("SINGLE_COPY_BYTES") else max(
            single_copy_bytes, l2_bytes),
        # An eighth of the L2 per pulled step keeps its copies in it, with room: a rank reads its peer's piece by the
        # kernel's copy, reduces it and writes it out. Staged steps take as much as a half holds unless this is set
        # (piece_probed): each costs a synchronisation, which a busy machine makes dear, and their copies gained
        # nothing from staying in the L2. With more ranks than cores every step costs context switches, so the same.
        piece_bytes=_number("PIECE_BYTES", max(l2_bytes // 8, 128 << 10) if local_size <= cores else 0, int, low=0,
                            high=MAX_BYTES),
        # Pulling (csrc/coll/allreduce.c): two kernel copies per element and no synchronisation between pieces, for
        # the staging steps' three copies and one per step. It pays at two ranks with a core each; with more ranks the
        # kernel copies outnumber what they save (benchmarks/RESULTS.md). Always where every rank's kernel copy
        # proved fast at init; elsewhere each rank learns whether it pays (csrc/coll/path_choice.c).
        pull_bytes=_number("PULL_BYTES", 128 << 10 if local_size == 2 <= cores else 0, int, low=0, high=MAX_BYTES),
        cache_bytes=_number("CACHE_BYTES", l2_bytes, int, low=4096, high=MAX_BYTES),
        shared_cache_bytes=_number("SHARED_CACHE_BYTES", machine.cache_bytes(3) or 8 * l2_bytes, int, low=4096,
                                   high=MAX_BYTES),
        single_copy_probed=not is_set("SINGLE_COPY_BYTES"),
        # An in-place allreduce of memory every rank maps reads and writes the peers' buffers directly
        # (csrc/coll/window.c). It synchronises twice where the small path does once, which costs more the more ranks
        # share a core: so it starts from 4 KiB times the ranks sharing a core (benchmarks/RESULTS.md).
        shared_buffers=_flag("SHARED_BUFFERS", True),
        shared_from_bytes=(4 << 10) * -(-local_size // cores),
        huge_pages=_flag("HUGE_PAGES", True),  # why: csrc/coll/huge_pages.c
        # Set, the pull threshold holds whatever init's speed probe found: tests force the path so.
        pull_probed=not is_set("PULL_BYTES"),
        piece_probed=not is_set("PIECE_BYTES"),
        race_pause_us=_number("TEST_RACE_PAUSE_US", 0, int, low=0, high=10 ** 6),
    )


@dataclass(frozen=True)
class EngineSettings:
    cycle_s: float                 # cycle while a caller waits
    fusion_threshold: int          # largest fused allreduce, bytes
    bucket_bytes: int              # queued requests wait until a caller waits or this many bytes gathered
    cache_capacity: int            # response-cache entries
    stall_check_s: float           # report requests some ranks wait for this long
    stall_shutdown_s: float        # then fail them (0: never)
    stall_check: bool


def engine():
    return EngineSettings(
        cycle_s=_number("CYCLE_TIME", 1.0, positive=True, high=MAX_SECONDS) / 1000.0,
        fusion_threshold=_number("FUSION_THRESHOLD", 64 << 20, int, low=0, high=MAX_BYTES),
        bucket_bytes=_number("BUCKET_BYTES", 25 << 20, int, low=0, high=MAX_BYTES),
        cache_capacity=_number("CACHE_CAPACITY", 1024, int, low=0),
        stall_check_s=_number("STALL_CHECK_TIME_SECONDS", 60.0, low=0, high=MAX_SECONDS),
        stall_shutdown_s=_number("STALL_SHUTDOWN_TIME_SECONDS", 0.0, low=0, high=MAX_SECONDS),
        stall_check=not _flag("STALL_CHECK_DISABLE"),
    )


def thread_affinity(local_rank):
    """The core the engine thread of this local rank is pinned to (HOROVOD_THREAD_AFFINITY: one core, or a
    comma-separated core per local rank), or None."""
    text = _get("THREAD_AFFINITY")
    if text is None:
        return None
    try:
        cores = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError("SHMCOMM_THREAD_AFFINITY=%r: expected a core, or one core per local rank: 0,1,2,3"
                         % text) from None
    if any(core < 0 for core in cores):
        raise ValueError("SHMCOMM_THREAD_AFFINITY=%r: cores are numbered from 0" % text)
    return cores[local_rank % len(cores)]


@dataclass(frozen=True)
class AutotuneSettings:
    enabled: bool
    log_file: object        # CSV of the samples, or None
    warmup_samples: int     # samples discarded first
    steps_per_sample: int   # training steps (a tensor reduced this many times) per sample
    max_samples: int        # samples of the Bayesian search
    noise: float            # Gaussian-process noise, in [0, 1], relative to the scores' spread
    prior: str              # "model": the cost model's prediction is the search's prior mean; "none": constant
    pinned: frozenset       # settings the user set, held constant: fusion, cycle, bucket, algorithm


def autotune():
    settings = AutotuneSettings(
        enabled=bool(switch("AUTOTUNE")), log_file=_get("AUTOTUNE_LOG"),
        warmup_samples=_number("AUTOTUNE_WARMUP_SAMPLES", 3, int),
        steps_per_sample=_number("AUTOTUNE_STEPS_PER_SAMPLE", 10, int),
        max_samples=_number("AUTOTUNE_BAYES_OPT_MAX_SAMPLES", 20, int),
        noise=_number("AUTOTUNE_GAUSSIAN_PROCESS_NOISE", 0.8), prior=(_get("AUTOTUNE_PRIOR", "model")).lower(),
        pinned=frozenset(key for key, names in (("fusion", ("FUSION_THRESHOLD",)), ("cycle", ("CYCLE_TIME",)),
                                                ("bucket", ("BUCKET_BYTES",)),
                                                ("algorithm", ("ALLREDUCE_ALGO", "HIERARCHICAL_ALLREDUCE",
                                                               "TORUS_ALLREDUCE")))
                         if any(is_set(name) for name in names)))
    if settings.warmup_samples < 0 or settings.steps_per_sample < 1 or settings.max_samples < 1:
        raise ValueError("SHMCOMM_AUTOTUNE_WARMUP_SAMPLES must be >= 0, ..._STEPS_PER_SAMPLE and "
                         "..._BAYES_OPT_MAX_SAMPLES >= 1")
    if not 0 <= settings.noise <= 1:
        raise ValueError("SHMCOMM_AUTOTUNE_GAUSSIAN_PROCESS_NOISE=%r must be in [0, 1]" % settings.noise)
    if settings.prior not in ("model", "none"):
        raise ValueError("SHMCOMM_AUTOTUNE_PRIOR=%r: choose model or none" % settings.prior)
    return settings
