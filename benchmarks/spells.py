# SPDX-License-Identifier: Apache-2.0
"""shmcomm and MPI inside and outside the machine's slow spells, in one job:

    mpiexec -n 2 python -m benchmarks.spells --seconds 60 [--bytes 1M,16M] [--ops allreduce,allgather] [--inplace]
        [--setting VAR=v1,v2]

A shared machine's cross-core traffic slows for seconds at a time, for every library (benchmarks/RESULTS.md). This
runs short rounds for --seconds: each times MPI's 1 MiB allreduce (the probe), then MPI's and shmcomm's calls of
each op (once per value of --setting, re-initialised as benchmarks.interleaved does) at every size. A round whose
probe took more than twice the fastest probe of the run is in a spell. With a single value (or none), shmcomm is
initialised once for the whole run, so that what it learns from its calls carries over from round to round, as in a
training job. The table gives, in and out of spells, the median and 90th percentile of the rounds' medians (the slowest
rank's) of each library and size. Each value's results are checked against MPI's first, out of place."""
import argparse
import sys
import time

import numpy as np

from benchmarks.interleaved import _configure, calls, timed


def main(argv=None):
    from benchmarks.collectives import parse_size
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--bytes", default="1M,16M", help="comma-separated sizes, as benchmarks.interleaved's")
    parser.add_argument("--ops", default="allreduce", help="comma-separated, of benchmarks.interleaved's")
    parser.add_argument("--iters", type=int, default=5, help="calls timed per library, size and round")
    parser.add_argument("--inplace", action="store_true", help="allreduce in place, both libraries")
    parser.add_argument("--setting", help="VAR=v1,v2,...: time shmcomm with each value of VAR (unset: without it)")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    import shmcomm
    comm = MPI.COMM_WORLD
    cases = [(op, parse_size(s)) for op in args.ops.split(",") for s in args.bytes.split(",")]
    variable, _, listed = (args.setting or "").partition("=")
    variable, values = (variable, listed.split(",")) if args.setting else (None, ["default"])
    slowest = lambda fn: comm.allreduce(timed(fn, comm, args.iters)[0], op=MPI.MAX)  # noqa: E731
    for value in values:
        _configure(variable, value)
        shmcomm.init()
        for op, n in cases:
            ours, theirs, got, expected = calls(op, n, comm, shmcomm, MPI)
            ours(), theirs()
            np.testing.assert_array_equal(got, expected)
        shmcomm.shutdown()
    probe = calls("allreduce", 1 << 20, comm, None, MPI)[1]
    timed_calls = [calls(op, n, comm, shmcomm, MPI, inplace=args.inplace)[:2] for op, n in cases]  # buffers kept
    once = len(values) == 1
    if once:
        _configure(variable, values[0])
        shmcomm.init()
    rounds, start = [], time.time()
    while comm.bcast(time.time() - start < args.seconds):
        row = [slowest(probe)]
        for value in values:
            if not once:
                _configure(variable, value)
                shmcomm.init()
            row += [slowest(ours) for ours, _ in timed_calls]
            if not once:
                shmcomm.shutdown()
        row += [slowest(theirs) for _, theirs in timed_calls]
        rounds.append(row)
    if once:
        shmcomm.shutdown()
    if comm.rank != 0:
        return
    times = np.array(rounds) * 1e6
    spell = times[:, 0] > 2 * times[:, 0].min()
    names = ["%s %s" % (variable, v) if variable else "shmcomm" for v in values] + ["MPI"]
    print("# mpiexec -n %d python -m benchmarks.spells %s | %s | %s" % (
        comm.size, " ".join(argv if argv is not None else sys.argv[1:]),
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), MPI.Get_library_version().splitlines()[0]))
    print("# %s%s, us: median (p90) of the rounds; %d rounds, %d in spells (MPI's 1 MiB allreduce probe over twice "
          "its fastest, %.0f us)" % (args.ops, " (allreduce in place)" if args.inplace else "", len(times), spell.sum(),
                                    times[:, 0].min()))
    for label, chosen in (("outside spells", ~spell), ("in spells", spell)):
        if not chosen.any():
            continue
        part = times[chosen]
        print("  %s: MPI 1 MiB probe %.1f us" % (label, np.median(part[:, 0])))
        for i, (op, n) in enumerate(cases):
            print("    %-13s %10d  %s" % (op, n, "  ".join(
                "%s %.1f (%.1f)" % (name, np.median(column), np.percentile(column, 90))
                for name, column in zip(names, (part[:, 1 + k * len(cases) + i] for k in range(len(names)))))))


if __name__ == "__main__":
    main()
