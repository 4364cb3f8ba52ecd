# SPDX-License-Identifier: Apache-2.0
"""Where the scheduler runs a job's ranks, call by call, and what each placement costs:

    mpiexec -n 2 python -m benchmarks.placement [--op allgather] [--bytes 256K] [--calls 2000] [--cpu-load K]
    shmcommrun -np 2 python -m benchmarks.placement ...

Every call follows shmcomm's own barrier, and each rank notes the CPU it ran the call on. The report gives, per
tenth of the run, how many calls had two or more ranks on one CPU and the median time (the slowest rank's) of the
calls in each placement, then the run's median and p90. Launchers differ in where they start the ranks
(benchmarks/RESULTS.md); --cpu-load runs K CPU-bound processes beside the job."""
import argparse
import ctypes
import time

import numpy as np

OPS = ("allreduce", "allgather", "alltoall")


def main(argv=None):
    from benchmarks.collectives import parse_size
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=OPS, default="allgather")
    parser.add_argument("--bytes", default="256K", help="the output's size (e.g. 256K, 1M)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--cpu-load", type=int, default=0, help="CPU-bound processes beside the job (default 0)")
    args = parser.parse_args(argv)
    if args.calls < 10 or args.cpu_load < 0:
        parser.error("--calls must be at least 10 and --cpu-load at least 0")
    import shmcomm
    from shmcomm.testing import cpu_load
    shmcomm.init()
    with cpu_load.spinning(args.cpu_load if shmcomm.rank() == 0 else 0):
        _measure(args, shmcomm, parse_size(args.bytes))
    shmcomm.shutdown()


def _measure(args, shmcomm, nbytes):
    """Times the calls, checks the last result and prints the report (rank 0)."""
    me, size = shmcomm.rank(), shmcomm.size()
    count = max(size, nbytes // 4 // size * size)
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
    packed = np.array([len(set(every[:, k])) < size for k in range(args.calls)])
    if me == 0:
        _report(args, count * 4, size, slowest, packed)


def _report(args, nbytes, size, slowest, packed):
    beside = ", beside %d CPU-bound process%s" % (args.cpu_load, "es" * (args.cpu_load > 1)) if args.cpu_load else ""
    print("# %s of %d bytes, %d ranks, %d calls each after shmcomm's barrier%s; us, slowest rank"
          % (args.op, nbytes, size, args.calls, beside))
    print("#  calls         packed  median packed  median apart")
    median = lambda x: "%14.1f" % np.median(x) if len(x) else "%14s" % "-"  # noqa: E731
    tenth = args.calls // 10
    for lo in range(0, tenth * 10, tenth):
        part, here = slowest[lo:lo + tenth], packed[lo:lo + tenth]
        print("%6d-%-6d %10d %s %s" % (lo, lo + tenth, here.sum(), median(part[here]), median(part[~here])))
    print("# all: %d of %d calls packed; median %.1f us, p90 %.1f us" % (packed.sum(), args.calls,
          np.median(slowest), np.percentile(slowest, 90)))


if __name__ == "__main__":
    main()
