# SPDX-License-Identifier: Apache-2.0
"""Where the scheduler runs a job's ranks, call by call, and what each placement costs:

    mpiexec -n 2 python -m benchmarks.placement [--op allgather] [--bytes 256K] [--calls 2000]
    shmcommrun -np 2 python -m benchmarks.placement ...

Every call follows shmcomm's own barrier, and each rank notes the CPU it ran the call on. The report gives, per
tenth of the run, how many calls had two or more ranks on one CPU and the median time (the slowest rank's) of the
calls in each placement. Launchers differ in where they start the ranks (benchmarks/RESULTS.md)."""
import argparse
import ctypes

import numpy as np

OPS = ("allreduce", "allgather", "alltoall")


def main(argv=None):
    from benchmarks.collectives import parse_size
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=OPS, default="allgather")
    parser.add_argument("--bytes", default="256K", help="the output's size (e.g. 256K, 1M)")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.calls < 10:
        parser.error("--calls must be at least 10")
    import time

    import shmcomm
    shmcomm.init()
    me, size = shmcomm.rank(), shmcomm.size()
    count = max(size, parse_size(args.bytes) // 4 // size * size)
    full = np.full(count, me + 1, np.float32)
    out = np.empty(count, np.float32)
    mine = full[:count // size]
    run = {"allreduce": lambda: shmcomm.allreduce(full, op=shmcomm.Sum, output=out),
           "allgather": lambda: shmcomm.allgather(mine, output=out),
           "alltoall": lambda: shmcomm.alltoall(full, output=out)}[args.op]
    cpu_of = ctypes.CDLL(None).sched_getcpu
    seconds, cpus = np.empty(args.calls), np.empty(args.calls)
    for k in range(args.calls):
        shmcomm.barrier()
        t0 = time.perf_counter()
        run()
        seconds[k] = time.perf_counter() - t0
        cpus[k] = cpu_of()
    expected = (np.full(count, size * (size + 1) / 2, np.float32) if args.op == "allreduce"
                else np.repeat(np.arange(1, size + 1, dtype=np.float32), count // size))
    if not np.array_equal(out, expected):
        raise SystemExit("rank %d: %s gave a wrong result" % (me, args.op))
    slowest = shmcomm.allreduce(seconds * 1e6, op=shmcomm.Max)
    every = shmcomm.allgather(cpus[None, :])  # [rank, call]
    shared = np.array([len(set(every[:, k])) < size for k in range(args.calls)])
    if me == 0:
        print("# %s of %d bytes, %d ranks, %d calls each after shmcomm's barrier; us, slowest rank"
              % (args.op, count * 4, size, args.calls))
        print("#  calls         packed  median packed  median apart")
        tenth = args.calls // 10
        for lo in range(0, tenth * 10, tenth):
            part, packed = slowest[lo:lo + tenth], shared[lo:lo + tenth]
            median = lambda x: "%14.1f" % np.median(x) if len(x) else "%14s" % "-"  # noqa: E731
            print("%6d-%-6d %10d %s %s" % (lo, lo + tenth, packed.sum(), median(part[packed]), median(part[~packed])))
        print("# all: %d of %d calls packed; median %.1f us" % (shared.sum(), args.calls, np.median(slowest)))
    shmcomm.shutdown()


if __name__ == "__main__":
    main()
