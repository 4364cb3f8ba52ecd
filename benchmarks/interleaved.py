# SPDX-License-Identifier: Apache-2.0
"""shmcomm against the MPI it runs beside, call by call in one job:

    mpiexec -n 2 python -m benchmarks.interleaved --bytes 1M,4M,16M [--ops allreduce,allgather] [--rounds 5]

Why a second benchmark beside benchmarks.collectives: there each backend runs in jobs of its own, one after the other,
and on a shared machine separate jobs differ by up to 3x (benchmarks/RESULTS.md, "this machine's slow jobs": moving
cache lines between the cores gets slower for a while, whoever runs). Here both libraries run in the same processes:
each round times every op and size with shmcomm, then with MPI, a median and 90th percentile of --iters calls each,
the slowest rank's; the ratio of medians is taken per round, so both sides of a ratio saw the same machine. Sizes
follow nccl-tests: the buffer of allreduce, alltoall and broadcast (in place, from rank 0 or --root), allgather's
output and reducescatter's input. Both libraries' results are checked against each other once per op and size.
--inplace makes allreduce reduce its buffer in place (MPI_IN_PLACE), as a training step's fusion buffer is; --shared
makes shmcomm's buffer a shmcomm.shared_empty array, as the engine's fusion buffer is (MPI's stays an ordinary one,
in place), and reducescatter's and alltoall's inputs, allgather's output and broadcast's buffer too. The op `fused`
(not in the default list) is DistributedOptimizer's path: 8 tensors of the size in all, each allreduce_async_ in
the engine, which fuses them into one allreduce of its fusion buffer, and synchronize(); MPI allreduces the same bytes
in place in one call, as if they were packed already. The engine starts with the first such call, so each round then
ends with a shutdown.

--setting VAR=v1,v2,... compares settings of shmcomm's in the same way: each round re-initialises shmcomm once per
value (`unset` leaves VAR out) and times every op and size with it, MPI once per round; the table then has a column
per value, each with its own ratio to MPI's time of the same round. That is how a change of a default is measured.
--cpu-load N times it all beside N CPU-bound processes (rank 0 starts and stops them), as on a training machine,
which is never idle.

Each call is timed alone, after an MPI barrier: the time a rank waits for the others in every call counts (a
collective that checks every rank's arguments before it returns waits a barrier's worth; a small broadcast, shmcomm's
as MPI's, waits for its root alone). --loop times --iters calls back to back after one barrier instead, as nccl-tests
and the OSU benchmarks do: the rate of a loop of calls, where each call's wait overlaps the previous one's. Both MPIs'
barriers let rank 0 out first (np=4: 1999 times of 2000, the last rank 2.7 us later under Open MPI, 11.8 us under
MPICH), so an MPI broadcast from rank 0 finds its readers after the barrier with the data already posted; --root -1
broadcasts from the rank let out last instead.

--torch-memory takes every buffer of both libraries from torch's allocator, as a training job's tensors are. numpy asks
the kernel for transparent huge pages for arrays from 4 MiB and torch does not, and the kernel's copy (single copy, in
shmcomm and in MPI) pins the pages it reaches one by one: where huge pages are only given on request, the two kinds of
memory are different benchmarks from 4 MiB.

Without --setting, each row ends with a verdict on the medians and one on the p90s, MPI's over shmcomm's per round: `met` where the
median of the rounds' ratios is at least 1, `spread` where it is not but some round's is (shmcomm level with MPI
within the spread of the rounds), `BEHIND` where every round's is below 1 (with one round, every cell below 1). The last line lists the cells
behind."""
import argparse
import os
import sys
import time

import numpy as np

from shmcomm.testing import cpu_load

OPS = ("allreduce", "allgather", "alltoall", "reducescatter", "broadcast")  # the default
EXTRA_OPS = ("fused",)
FUSED_TENSORS = 8


def torch_empty(count):
    """float32 memory from torch's allocator, as a training job's tensors are: unlike numpy, which asks for huge pages
    from 4 MiB, it leaves them to the system (4 KiB pages where transparent huge pages are madvise-only)."""
    import torch
    return torch.empty(count, dtype=torch.float32).numpy()  # the array keeps the tensor alive


def calls(op, nbytes, comm, shmcomm, MPI, inplace=False, shared=False, empty=None, root=0):
    """(shmcomm's call, MPI's call, shmcomm's output, MPI's output) on preallocated buffers from `empty` (a count of
    float32 elements; numpy's by default); broadcast's from `root`."""
    n = comm.size
    count = max(nbytes // 4 // n * n, n)  # float32 elements, a multiple of the ranks
    empty = empty or (lambda size: np.empty(size, np.float32))
    x = empty(count)
    x[:] = np.arange(count, dtype=np.float32) % 251 + comm.rank
    ours, theirs = empty(count), empty(count)
    if op == "fused":
        ours[:], theirs[:] = x, x
        parts = np.array_split(ours, FUSED_TENSORS)

        def fused():
            handles = [shmcomm.allreduce_async_(t, op=shmcomm.Sum, name="fused.%d" % i) for i, t in enumerate(parts)]
            for h in handles:
                shmcomm.synchronize(h)

        return fused, lambda: comm.Allreduce(MPI.IN_PLACE, theirs, MPI.SUM), ours, theirs
    if op == "allreduce" and (inplace or shared):  # each call doubles the values: float32 overflows after 120
        if shared:
            ours = shmcomm.shared_empty(count, np.float32)
        ours[:], theirs[:] = x, x
        return (lambda: shmcomm.allreduce_(ours, op=shmcomm.Sum), lambda: comm.Allreduce(MPI.IN_PLACE, theirs, MPI.SUM),
                ours, theirs)
    if op == "allreduce":
        return (lambda: shmcomm.allreduce(x, op=shmcomm.Sum, output=ours), lambda: comm.Allreduce(x, theirs, MPI.SUM),
                ours, theirs)
    if op == "allgather":
        part = x[:count // n]
        if shared:  # into a shared output, which every rank's input is copied straight into
            ours = shmcomm.shared_empty(count, np.float32)
        return lambda: shmcomm.allgather(part, output=ours), lambda: comm.Allgather(part, theirs), ours, theirs
    if op == "alltoall":
        mine = x
        if shared:  # the input in a shared array, each rank's part read straight from there
            mine = shmcomm.shared_empty(count, np.float32)
            mine[:] = x
        return lambda: shmcomm.alltoall(mine, output=ours), lambda: comm.Alltoall(x, theirs), ours, theirs
    if op == "broadcast":  # in place, as MPI_Bcast is
        if shared:
            ours = shmcomm.shared_empty(count, np.float32)
        ours[:], theirs[:] = x, x
        return lambda: shmcomm.broadcast_(ours, root), lambda: comm.Bcast(theirs, root), ours, theirs
    ours, theirs = ours[:count // n], theirs[:count // n]
    mine = x
    if shared:  # the input in a shared array, read straight from there by every rank
        mine = shmcomm.shared_empty(count, np.float32)
        mine[:] = x
    return (lambda: shmcomm.reducescatter(mine, op=shmcomm.Sum, output=ours),
            lambda: comm.Reduce_scatter_block(x, theirs, MPI.SUM), ours, theirs)


def timed(fn, comm, iters, loop=False):
    """Seconds per call, (median, 90th percentile) of `iters` calls each timed alone after a barrier, or with `loop`
    the mean of `iters` calls back to back after one barrier (twice: a loop has no spread of its own)."""
    for _ in range(2):
        fn()
    if loop:
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        mean = (time.perf_counter() - start) / iters
        return mean, mean
    times = []
    for _ in range(iters):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(np.percentile(times, 90))


def main(argv=None):
    from benchmarks.collectives import parse_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", default="1M,4M,16M", help="comma-separated sizes, e.g. 64K,1M,16M")
    parser.add_argument("--ops", default=",".join(OPS),
                        help="comma-separated, default all but fused: " + ",".join(OPS + EXTRA_OPS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=11, help="calls timed per library, op, size and round")
    parser.add_argument("--inplace", action="store_true", help="allreduce in place (MPI_IN_PLACE)")
    parser.add_argument("--shared", action="store_true",
                        help="allreduce in place, shmcomm's on a shmcomm.shared_empty array; reducescatter's and "
                             "alltoall's inputs, allgather's output and broadcast's buffer in one too")
    parser.add_argument("--setting", help="VAR=v1,v2,...: time shmcomm with each value of VAR (unset: without it)")
    parser.add_argument("--cpu-load", type=int, default=0, metavar="N",
                        help="N CPU-bound processes beside the job (started by rank 0) while it times")
    parser.add_argument("--loop", action="store_true",
                        help="time --iters calls back to back after one barrier (as nccl-tests and OSU do), not each "
                             "call after a barrier of its own")
    parser.add_argument("--torch-memory", action="store_true",
                        help="both libraries' buffers from torch's allocator (4 KiB pages where numpy's would be huge)")
    parser.add_argument("--root", type=int, default=0,
                        help="broadcast's root; negative counts from the last rank (-1: the last, which MPI's barriers "
                             "let out last)")
    options = parser.parse_args(argv)
    variable, values = None, [None]
    if options.setting:
        variable, _, listed = options.setting.partition("=")
        values = [v.strip() for v in listed.split(",") if v.strip()]
        if not variable or not values:
            parser.error("--setting takes VAR=v1,v2,...")
    sizes = [parse_size(s.strip()) for s in options.bytes.split(",") if s.strip()]
    ops = [o.strip() for o in options.ops.split(",") if o.strip()]
    unknown = sorted(set(ops) - set(OPS + EXTRA_OPS))
    if unknown:
        parser.error("unknown ops %s; choose from %s" % (unknown, ", ".join(OPS + EXTRA_OPS)))

    from mpi4py import MPI

    import shmcomm

    comm = MPI.COMM_WORLD
    if not -comm.size <= options.root < comm.size:
        parser.error("--root %d: the job has %d ranks" % (options.root, comm.size))
    root = options.root % comm.size
    if options.cpu_load < 0:
        parser.error("--cpu-load must be at least 0")
    cases = [(op, nbytes) for op in ops for nbytes in sizes]
    with cpu_load.spinning(options.cpu_load if comm.rank == 0 else 0):
        times = _rounds(options, comm, shmcomm, MPI, cases, variable, values, root)
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, MPI.MAX)
    if comm.rank == 0:
        _report(options, argv, comm, MPI, cases, variable, values, slowest)


def _rounds(options, comm, shmcomm, MPI, cases, variable, values, root):
    """Seconds per call: [round, case, each value of the setting, then MPI, (median, p90)]."""
    times = np.zeros((options.rounds, len(cases), len(values) + 1, 2))  # shmcomm with each value, then MPI
    for r in range(options.rounds):
        for v, value in enumerate(values):
            _configure(variable, value)
            shmcomm.init()
            if shmcomm.size() != comm.size:
                raise SystemExit("shmcomm has %d ranks and MPI %d: start both from one mpiexec"
                                 % (shmcomm.size(), comm.size))
            for i, (op, nbytes) in enumerate(cases):
                ours, theirs, our_out, their_out = calls(op, nbytes, comm, shmcomm, MPI, options.inplace,
                                                         options.shared, torch_empty if options.torch_memory else None,
                                                         root)
                if r == 0:  # the same answer from both, once per setting
                    ours()
                    theirs()
                    np.testing.assert_array_equal(our_out, their_out, err_msg="%s of %d bytes%s" % (
                        op, nbytes, "" if variable is None else ", %s=%s" % (variable, value)))
                times[r, i, v] = timed(ours, comm, options.iters, options.loop)
                if v == 0:
                    times[r, i, -1] = timed(theirs, comm, options.iters, options.loop)
            if variable is not None or r == options.rounds - 1 or any(op == "fused" for op, _ in cases):
                shmcomm.shutdown()
    return times


def _report(options, argv, comm, MPI, cases, variable, values, slowest):
    library = MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()
    print("# mpiexec -n %d python -m benchmarks.interleaved %s | %s UTC | %s" % (
        comm.size, " ".join(sys.argv[1:] if argv is None else argv),
        time.strftime("%Y-%m-%d %H:%M", time.gmtime()), library))
    print("# slowest rank's %s per round; MPI/shmcomm above 1: shmcomm is faster. Median of the rounds." % (
        "mean of --iters calls back to back" if options.loop else "median of calls each after a barrier"))
    if variable is None:
        print("#  op                 bytes  shmcomm us   (p90)      MPI us   (p90)  MPI/shmcomm  median p90  per round")
    else:
        print("# %s = %s: shmcomm us and MPI/shmcomm for each, then MPI us" % (variable, ", ".join(values)))
    medians, p90s = slowest[..., 0], slowest[..., 1]
    behind = []
    for i, (op, nbytes) in enumerate(cases):
        mpi = medians[:, i, -1]
        if variable is None:
            ratios = mpi / medians[:, i, 0]
            verdicts = verdict(ratios), verdict(p90s[:, i, -1] / p90s[:, i, 0])
            behind += ["%s %d (%s)" % (op, nbytes, what) for what, v in zip(("median", "p90"), verdicts) if v == BEHIND]
            print("   %-13s %12d %11.1f %7.1f %11.1f %7.1f %12.2f  %6s %6s  %s" % (
                op, nbytes, np.median(medians[:, i, 0]) * 1e6, np.median(p90s[:, i, 0]) * 1e6, np.median(mpi) * 1e6,
                np.median(p90s[:, i, -1]) * 1e6, np.median(ratios), verdicts[0], verdicts[1],
                " ".join("%.2f" % v for v in ratios)))
        else:
            print("   %-13s %12d  %s  MPI %.1f" % (op, nbytes, "  ".join(
                "%s: %.1f %.2fx" % (value, np.median(medians[:, i, v]) * 1e6, np.median(mpi / medians[:, i, v]))
                for v, value in enumerate(values)), np.median(mpi) * 1e6))
    if variable is None:
        print("# behind MPI in every round: %s" % (", ".join(behind) or "none"))


BEHIND = "BEHIND"


def verdict(ratios):
    """`met`, `spread` or BEHIND for the rounds' ratios of MPI's time over shmcomm's (see the module's docstring)."""
    ratios = np.asarray(ratios, dtype=float)
    if np.median(ratios) >= 1:
        return "met"
    return "spread" if ratios.max() >= 1 else BEHIND


def _configure(variable, value):
    """Sets (or, for `unset`, removes) the setting that the next shmcomm.init() reads."""
    if variable is None:
        return
    if value == "unset":
        os.environ.pop(variable, None)
    else:
        os.environ[variable] = value


if __name__ == "__main__":
    main()
