# SPDX-License-Identifier: Apache-2.0
"""Soft Memory Box microbenchmark: write, read and accumulate bandwidth, and ping-pong latency next to MPI's.

    python -m benchmarks.smb -np 2 -b 8 -e 64M -f 4
    python -m benchmarks.smb --hosts 2 -b 4K -e 64M -f 4     # across simulated hosts: benchmarks/smb_hosts.py

Run plainly, this module is the driver: it starts the box measurements under shmcommrun and the MPI ping-pong
under mpiexec, each rank running this module again with --worker, and prints one line per size. Per size:

    write       rank 0 writes the first `size` bytes of a box (bytes per second)
    read        rank 1 reads them back into its own array
    accumulate  every rank accumulates into the same box at once; bytes accumulated per second, all ranks together
    ping-pong   rank 0 writes, rank 1 waits for the new version, reads, writes back, rank 0 waits and reads:
                half a round trip. The MPI line does the same with Send/Recv of a numpy array."""
import argparse
import json
import os
import shlex
import sys
import tempfile
import time

import numpy as np

from benchmarks import backends
from benchmarks.collectives import parse_size, sweep
from benchmarks.operations import ramp

BUDGET_S = 1.0  # timed iterations of one measurement are cut to fit about this long
MIN_ITERS = 3
MIN_PINGPONG_ITERS = 100  # a round trip takes microseconds: more of them for a stable median
WAIT_TIMEOUT_S = 10
DTYPE = np.float32


def iteration_count(estimate_s, cap):
    return cap if estimate_s <= 0 else min(cap, max(MIN_ITERS, int(BUDGET_S / estimate_s)))


def measure(agree, active, run, warmup, cap, before_each=None, timed=None):
    """Times of `run` (each iteration's slowest over the `timed` ranks, by default the active ones); the other
    ranks only join the agreements. The warm-up estimates one call's time so that big sizes run fewer iterations;
    all ranks derive the counts from agreed values, so they loop alike. Also returns the calls made per rank."""
    timed = active if timed is None else timed
    elapsed = 0.0
    if active:
        t0 = time.perf_counter()
        for _ in range(max(1, warmup)):
            run()
        elapsed = (time.perf_counter() - t0) / max(1, warmup)
    count = iteration_count(agree([elapsed])[0], cap)
    times = np.zeros(count)
    for k in range(count):
        if before_each is not None:
            before_each()
        if active:
            t0 = time.perf_counter()
            run()
            if timed:
                times[k] = time.perf_counter() - t0
    return agree(times), max(1, warmup) + count


# --- the Soft Memory Box ranks --------------------------------------------------------------------------------------

def box_worker(options):
    import shmcomm

    shmcomm.init()
    rank, n = shmcomm.rank(), shmcomm.size()

    def agree(values):
        return shmcomm.allreduce(np.asarray(values, dtype=np.float64), op=shmcomm.Max)

    def total(value):
        return int(shmcomm.allreduce(np.array([value], dtype=np.int64), op=shmcomm.Sum)[0])

    largest = max(1, options.max_bytes // np.dtype(DTYPE).itemsize)
    # One box per purpose at the largest size; each size uses its first elements.
    bw_box = shmcomm.SoftMemoryBox("bench-smb-bandwidth", shape=(largest,), dtype=DTYPE)
    pp_box = shmcomm.SoftMemoryBox("bench-smb-pingpong", shape=(largest,), dtype=DTYPE)
    rows = []
    for nominal in sweep(options.min_bytes, options.max_bytes, options.factor):
        count = max(1, nominal // np.dtype(DTYPE).itemsize)
        if rows and rows[-1]["count"] == count:
            continue
        nbytes = count * np.dtype(DTYPE).itemsize
        data = ramp(count, DTYPE) + 1
        mine = np.empty(count, DTYPE)
        row = {"size": nbytes, "count": count}

        shmcomm.barrier()
        times, _ = measure(agree, rank == 0, lambda: bw_box.write(data), options.warmup, options.iters)
        row["write"] = _bandwidth(nbytes, times)
        shmcomm.barrier()
        times, _ = measure(agree, rank == 1, lambda: bw_box.read(out=mine, count=count), options.warmup,
                           options.iters)
        row["read"] = _bandwidth(nbytes, times)
        wrong = int(np.count_nonzero(mine != data)) if rank == 1 else 0

        delta = np.full(count, rank + 1, DTYPE)
        shmcomm.barrier()
        times, calls = measure(agree, True, lambda: bw_box.accumulate(delta), options.warmup, options.iters,
                               before_each=shmcomm.barrier)
        row["accumulate"] = _bandwidth(n * nbytes, times)
        shmcomm.barrier()
        if rank == 0:  # every rank added (its rank + 1) once per call: exact in float32 at these sizes
            wrong += int(np.count_nonzero(bw_box.read(count=count) != data + calls * (n * (n + 1) // 2)))

        shmcomm.barrier()
        first = pp_box.version
        shmcomm.barrier()  # every rank has read the version before rank 0's first write changes it
        trips = _box_pingpong(pp_box, rank, data, mine, first)
        times, _ = measure(agree, rank in (0, 1), trips, options.warmup, max(options.iters, MIN_PINGPONG_ITERS),
                           timed=rank == 0)  # only rank 0 sees whole round trips
        row["pingpong_us"] = float(np.median(times)) / 2 * 1e6
        row["pingpong_p99_us"] = float(np.percentile(times, 99)) / 2 * 1e6
        if rank == 1:
            wrong += int(np.count_nonzero(mine != data))
        row["wrong"] = total(wrong)
        rows.append(row)
    bw_box.close()
    pp_box.close()
    if rank == 0:
        _write(options.result, {"nranks": n, "library": "shmcomm %s" % shmcomm.__version__, "rows": rows})
    shmcomm.shutdown()
    return 0


def _box_pingpong(box, rank, data, mine, first):
    """One round trip per call. Versions say whose turn it is: rank 0's k-th write makes first + 2k + 1, rank 1's
    answer first + 2k + 2."""
    state = {"next": first + 1}
    count = data.size

    def rank0():
        version = box.write(data)
        box.wait_version(version + 1, timeout=WAIT_TIMEOUT_S)
        box.read(out=mine, count=count)

    def rank1():
        box.wait_version(state["next"], timeout=WAIT_TIMEOUT_S)
        box.read(out=mine, count=count)
        state["next"] = box.write(mine) + 1

    return {0: rank0, 1: rank1}.get(rank, lambda: None)


def _bandwidth(nbytes, times):
    median = float(np.median(times))
    return nbytes / median / 1e9 if median > 0 else 0.0


# --- the MPI ranks --------------------------------------------------------------------------------------------------

def mpi_worker(options):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()

    def agree(values):
        out = np.array(values, dtype=np.float64)
        comm.Allreduce(MPI.IN_PLACE, out, MPI.MAX)
        return out

    rows = []
    for nominal in sweep(options.min_bytes, options.max_bytes, options.factor):
        count = max(1, nominal // np.dtype(DTYPE).itemsize)
        if rows and rows[-1]["count"] == count:
            continue
        data, mine = ramp(count, DTYPE) + 1, np.empty(count, DTYPE)

        def trip():
            if rank == 0:
                comm.Send(data, dest=1)
                comm.Recv(mine, source=1)
            elif rank == 1:
                comm.Recv(mine, source=0)
                comm.Send(mine, dest=0)

        comm.Barrier()
        times, _ = measure(agree, rank in (0, 1), trip, options.warmup, max(options.iters, MIN_PINGPONG_ITERS),
                           timed=rank == 0)
        rows.append({"size": count * np.dtype(DTYPE).itemsize, "count": count,
                     "pingpong_us": float(np.median(times)) / 2 * 1e6,
                     "pingpong_p99_us": float(np.percentile(times, 99)) / 2 * 1e6})
    if rank == 0:
        library = " ".join(MPI.Get_library_version().splitlines()[0].split())
        _write(options.result, {"nranks": comm.Get_size(), "library": library, "rows": rows})
    return 0


def _write(path, result):
    with open(path, "w") as out:
        json.dump(result, out)


# --- driver ---------------------------------------------------------------------------------------------------------

def table_lines(boxes, mpi, verbose=False):
    by_size = {row["size"]: row for row in (mpi or {}).get("rows", [])}
    lines = ["#",
             "# Soft Memory Box: %d ranks, %s boxes (%s); bandwidths in GB/s and half round trips in us, medians "
             "over iterations" % (boxes["nranks"], np.dtype(DTYPE).name, boxes["library"]),
             "# mpi ping-pong: %s" % (mpi["library"] if mpi else "not measured"),
             "#",
             "# %10s  %12s  %8s  %8s  %10s  %10s  %10s  %8s  %6s" % (
                 "size", "count", "write", "read", "accumulate", "ping-pong", "mpi", "mpi/smb", "#wrong")
             + ("  %8s  %8s" % ("smb p99", "mpi p99") if verbose else ""),
             "# %10s  %12s  %8s  %8s  %10s  %10s  %10s  %8s  %6s" % (
                 "(B)", "(elements)", "(GB/s)", "(GB/s)", "(GB/s)", "(us)", "(us)", "", "")
             + ("  %8s  %8s" % ("(us)", "(us)") if verbose else "")]
    wrong = 0
    for row in boxes["rows"]:
        theirs = by_size.get(row["size"])
        mpi_us = "%10.2f" % theirs["pingpong_us"] if theirs else "%10s" % "N/A"
        ratio = "%8.2f" % (theirs["pingpong_us"] / row["pingpong_us"]) if theirs and row["pingpong_us"] else \
            "%8s" % "-"
        line = "%12d  %12d  %8.2f  %8.2f  %10.2f  %10.2f  %s  %s  %6d" % (
            row["size"], row["count"], row["write"], row["read"], row["accumulate"], row["pingpong_us"], mpi_us,
            ratio, row["wrong"])
        if verbose:
            line += "  %8.2f  %8s" % (row["pingpong_p99_us"],
                                      "%.2f" % theirs["pingpong_p99_us"] if theirs else "N/A")
        lines.append(line)
        wrong += row["wrong"]
    lines.append("# mpi/smb: MPI's ping-pong time over the box's (above 1.00 the box is faster)")
    lines.append("# Wrong elements: %d %s" % (wrong, "OK" if wrong == 0 else "FAILED"))
    return lines


def _job(launcher, options, worker, workdir, env):
    result = os.path.join(workdir, worker + ".json")
    args = ["--worker", worker, "--result", result, "-b", options.min_bytes, "-e", options.max_bytes,
            "-f", options.factor, "-n", options.iters, "-w", options.warmup]
    command = backends.launch_command(launcher, options.nranks, "benchmarks.smb", args)
    print("# running %s: %d ranks" % (worker, options.nranks), file=sys.stderr, flush=True)
    sizes = len(sweep(options.min_bytes, options.max_bytes, options.factor))
    rc, out, err = backends.run_job(command, env, options.timeout or 60 + 10.0 * sizes)
    if rc != 0 or not os.path.exists(result):
        sys.stderr.write("benchmarks.smb: the %s job failed (exit code %s): %s\n" % (worker, rc, shlex.join(command)))
        sys.stderr.write(out[-4000:] if out else "")
        sys.stderr.write(err or "(no output on stderr)\n")
        sys.exit(rc or 1)
    with open(result) as data:
        return json.load(data)


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.smb", allow_abbrev=False,
                                     description="Soft Memory Box bandwidth and ping-pong latency, next to MPI's.")
    parser.add_argument("-np", dest="nranks", type=int, default=2, metavar="N", help="ranks (default 2, at least 2)")
    parser.add_argument("-b", "--minbytes", dest="min_bytes", type=parse_size, default=8, metavar="SIZE")
    parser.add_argument("-e", "--maxbytes", dest="max_bytes", type=parse_size, default=parse_size("64M"),
                        metavar="SIZE")
    parser.add_argument("-f", "--stepfactor", dest="factor", type=int, default=4, metavar="F")
    parser.add_argument("-n", "--iters", dest="iters", type=int, default=20,
                        help="timed iterations (default 20; ping-pong at least %d)" % MIN_PINGPONG_ITERS)
    parser.add_argument("-w", "--warmup_iters", dest="warmup", type=int, default=5)
    parser.add_argument("-v", "--verbose", action="store_true", help="add p99 ping-pong columns")
    parser.add_argument("--json", metavar="FILE", help="write the rows of both jobs to FILE")
    parser.add_argument("--timeout", type=float, metavar="S", help="seconds each job may take")
    parser.add_argument("--hosts", type=int, default=0, metavar="H",
                        help="across H simulated hosts instead (benchmarks/smb_hosts.py; needs root)")
    parser.add_argument("--ranks-per-host", type=int, default=1, metavar="R", help="with --hosts (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="with --hosts: interleaved rounds (default 3)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="with --hosts: compute step (default 20 ms)")
    parser.add_argument("--worker", choices=("smb", "mpi"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    options = parser.parse_args(argv)
    if options.hosts:
        if options.hosts < 2 or options.ranks_per_host < 1 or options.rounds < 1:
            parser.error("need --hosts >= 2, --ranks-per-host >= 1 and --rounds >= 1")
        from benchmarks import smb_hosts
        return smb_hosts.main(options, argv)
    if options.nranks < 2:
        parser.error("the ping-pong needs -np 2 or more")
    if options.min_bytes < 1 or options.max_bytes < options.min_bytes or options.factor < 2:
        parser.error("need 1 <= -b <= -e and -f >= 2")
    if options.iters < 1 or options.warmup < 0:
        parser.error("need -n >= 1 and -w >= 0")
    if options.worker == "smb":
        return box_worker(options)
    if options.worker == "mpi":
        return mpi_worker(options)

    env = backends.job_environment()
    # Both boxes must fit the arena; its pages are used only when touched.
    env.setdefault("SHMCOMM_SMB_BYTES", str(max(256 << 20, 2 * options.max_bytes + (4 << 20))))
    notes = []
    with tempfile.TemporaryDirectory(prefix="shmcomm-smb-") as workdir:
        boxes = _job("shmcomm", options, "smb", workdir, env)
        why = backends.unavailable("mpi")
        mpi = None if why else _job("mpi", options, "mpi", workdir, env)
    if why:
        notes.append("mpi skipped: %s" % why)
    lines = table_lines(boxes, mpi, options.verbose) + ["# %s" % note for note in notes]
    print("\n".join(lines), flush=True)
    if options.json:
        with open(options.json, "w") as out:
            json.dump({"command": "python -m benchmarks.smb " + shlex.join(argv), "smb": boxes, "mpi": mpi,
                       "notes": notes}, out, indent=1)
            out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
