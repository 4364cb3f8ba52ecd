# SPDX-License-Identifier: Apache-2.0
"""Soak: OPS mixed operations on each of 4 ranks (every collective, sizes 0 B to 16 MiB, asynchronous handles through
the engine, Soft Memory Boxes created, used and destroyed), sampling every rank's resident memory, open descriptors,
threads and the job's /dev/shm usage as it goes. After warm-up (the first tenth) they must stay flat: a leak of a
few bytes per operation shows over 100,000 operations.

    python tests/soak.py OUT_DIR [OPS]

writes OUT_DIR/soak.csv (rank, ops done, rss_anon_kib, fds, threads, rss_shmem_kib, shm_files) and OUT_DIR/soak.md (a
table: each rank's values after warm-up and at the end, and the largest after warm-up), prints the table, and exits
non-zero if anything grew past its allowance (private memory, per quarter both from the first quarter after warm-up
to the third and from the third to the last, by the lower quartiles of their samples: 8 MiB; shared memory touched:
1 MiB; descriptors, threads, files in /dev/shm: none
above their first value after warm-up)."""
import ctypes
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

RANKS = 4
SAMPLES = 50
SIZES = [0, 4, 64, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 16 << 20]  # bytes
WEIGHTS = [3, 20, 30, 20, 15, 8, 3, 0.2]  # mostly small, as a training step's tensors are
ALLOWANCE = {"rss_anon_kib": 8 << 10, "fds": 0, "threads": 0, "rss_shmem_kib": 1 << 10, "shm_files": 0}


def _sample(token):
    """(private resident KiB, descriptors, threads, resident shared-memory KiB, the job's files in /dev/shm). The job's
    segment leaves /dev/shm once every rank has attached, so its use shows as the rank's resident shared memory."""
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.split()[0] if value.split() else "0"
    files = sum(1 for n in os.listdir("/dev/shm") if token in n)
    return (int(status["RssAnon"]), len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")),
            int(status["RssShmem"]), files)


def _allocator_returns_what_is_freed():
    """Fixes glibc's thresholds, so that resident memory follows what the process holds: left to itself, glibc raises
    its mmap threshold after the first large free and then keeps freed 16 MiB buffers in the heap, so a rank's
    resident memory steps up by a buffer's size at a moment that differs from rank to rank, which reads as growth."""
    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 128 << 10)
    libc.mallopt(m_trim_threshold, 128 << 10)


def _rank(ops):
    import shmcomm

    _allocator_returns_what_is_freed()
    shmcomm.init(engine=True)
    me, n = shmcomm.rank(), shmcomm.size()
    token = os.environ["SHMCOMM_JOB_TOKEN"]
    rng = np.random.default_rng(1234)  # the same on every rank: every rank runs the same sequence
    rows = []
    every = max(ops // SAMPLES, 1)
    probabilities = np.array(WEIGHTS) / sum(WEIGHTS)
    pending = []
    box = None
    for i in range(ops):
        nbytes = int(rng.choice(SIZES, p=probabilities))
        kind = int(rng.integers(0, 9))
        count = nbytes // 4
        x = np.full(count, me + 1, np.float32)
        if kind == 0:
            got = shmcomm.allreduce(x, op=shmcomm.Sum)
            assert count == 0 or got[0] == n * (n + 1) / 2
        elif kind == 1:
            pending.append(shmcomm.allreduce_async(x, op=shmcomm.Sum, name="a%d" % i))
        elif kind == 2:
            shmcomm.broadcast(x, root_rank=i % n)
        elif kind == 3:
            shmcomm.allgather(x[:max(count // n, 1)] if count else x)
        elif kind == 4:
            shmcomm.reducescatter(np.ones((n, max(count // n, 1)), np.float32), op=shmcomm.Sum)
        elif kind == 5:
            shmcomm.alltoall(np.ones((n, max(count // n, 1)), np.float32))
        elif kind == 6:
            pending.append(shmcomm.broadcast_async(x, root_rank=0, name="b%d" % i))
        elif kind == 7:
            shmcomm.barrier()
        else:  # a box's life: created, written, accumulated into, read, destroyed
            if box is None:
                box = shmcomm.SoftMemoryBox("soak%d" % i, shape=(max(count, 1) if nbytes <= 1 << 20 else 1024,))
                if me == 0:
                    box.write(np.ones(box.shape, np.float32))
            else:
                box.accumulate(np.ones(box.shape, np.float32))
                box.read()
                shmcomm.barrier()
                if me == 0:
                    box.destroy()
                else:
                    box.close()
                box = None
        if len(pending) >= 16 or (pending and i % 7 == 0):
            for h in pending:
                shmcomm.synchronize(h)
            pending = []
        if i % every == 0 or i == ops - 1:
            rows.append((me, i + 1) + _sample(token))
    for h in pending:
        shmcomm.synchronize(h)
    shmcomm.barrier()
    return rows


def soak(out_dir, ops):
    import multiproc

    os.makedirs(out_dir, exist_ok=True)
    started = time.monotonic()
    results = multiproc.run(RANKS, _rank, ops, timeout=7200, env={"SHMCOMM_TIMEOUT": "120"})
    seconds = time.monotonic() - started
    rows = [row for rank_rows in results for row in rank_rows]
    fields = ("rss_anon_kib", "fds", "threads", "rss_shmem_kib", "shm_files")
    with open(os.path.join(out_dir, "soak.csv"), "w") as f:
        f.write("rank,ops,%s\n" % ",".join(fields))
        for row in rows:
            f.write(",".join(map(str, row)) + "\n")
    table, grew = judge(rows, ops, fields, "%d operations per rank on %d ranks in %.0f s" % (ops, RANKS, seconds))
    with open(os.path.join(out_dir, "soak.md"), "w") as f:
        f.write(table)
    return table, grew


def judge(rows, ops, fields, title):
    """The table, and what grew. Memory is judged by its lower quartiles in the first, third and last quarter after
    warm-up: a leak grows at the same rate in the half from the first quarter to the third and in the quarter after,
    while a buffer kept for reuse that reaches its largest size late (the engine's fusion buffer, the allocator's
    pools) steps up once, in one of them, hence the smaller of the two rates per quarter. A sample taken while a 16
    MiB operation's buffers are alive is a peak, not a trend, and a leak raises the floor, hence lower quartiles.
    Counts are judged by every sample."""
    lines = [title + "; each cell: the lower quartiles of the first, third and last quarter after warm-up (%d ops), and "
             "(smallest..largest after warm-up)" % (ops // 10), "",
             "| rank | " + " | ".join(fields) + " |", "|" + "---|" * (len(fields) + 1)]
    grew = []
    for rank in sorted({r[0] for r in rows}):
        warm = [r for r in rows if r[0] == rank and r[1] > ops // 10]
        quarter = max(len(warm) // 4, 1)
        cells = []
        for k, field in enumerate(fields):
            values = [r[2 + k] for r in warm]
            first, third, last = (_lower_quartile(values[:quarter]), _lower_quartile(values[-2 * quarter:-quarter]),
                                  _lower_quartile(values[-quarter:]))
            cells.append("%d, %d, %d (%d..%d)" % (first, third, last, min(values), max(values)))
            growth = min(last - third, (third - first) / 2) if field.startswith("rss") else max(values) - values[0]
            if growth > ALLOWANCE[field]:
                grew.append("rank %d: %s grew from %d to %d" % (rank, field, third, last))
        lines.append("| %d | %s |" % (rank, " | ".join(cells)))
    return "\n".join(lines) + "\n", grew


def _lower_quartile(values):
    ordered = sorted(values)
    return ordered[len(ordered) // 4]


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "soak-results"
    ops = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
    table, grew = soak(out_dir, ops)
    print(table)
    if grew:
        print("GREW: " + "; ".join(grew))
    sys.exit(1 if grew else 0)


if __name__ == "__main__":
    main()
