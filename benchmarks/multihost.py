# SPDX-License-Identifier: Apache-2.0
"""Allreduce across simulated hosts: the 2D torus, the flat ring and the MPI library's own allreduce, in one job,
then the cost model (shmcomm.sim) calibrated on these measurements, predicted against measured.

    python -m benchmarks.multihost --hosts 2 --ranks-per-host 2 [--rate 1gbit] [--bytes 4K,256K,4M,64M]
                                   [--shared | --fused]

Each time is the median over iterations of the slowest rank's time; the algorithms take turns within each
iteration. Needs root (network namespaces); see shmcomm/testing/simhosts.py for how the hosts are made. Each
simulated host runs on its own share of this machine's CPUs, as separate machines would (--shared-cpus lets the
scheduler mix the hosts' ranks on the cores instead). MPI's own allreduce runs under the best progress settings found
for MPICH on this machine (MPIR_CVAR_CH4_PROGRESS_THROTTLE); --mpi-env adds or overrides settings."""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = "MULTIHOST "
BREAKDOWN = "MULTIHOST-BREAKDOWN "
BEST_MPI_SETTINGS = {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "16"}
# With --shared-cpus the ranks of all simulated hosts share the cores, which a rank cannot tell from its local size
# and CPU set: shmcomm's waits must yield the core at once, as they do on an oversubscribed host. (A host with its own
# CPUs sees it has fewer than ranks, and does so by itself.)
SHARED_CORES = {"SHMCOMM_SPIN_US": "2"}
SMALL_SIZE, SMALL_ITERS = 1 << 20, 200  # below SMALL_SIZE bytes, at least SMALL_ITERS iterations


FUSED_TENSORS = 8


def worker(sizes, iters, warmup, breakdown=False, shared=False, fused=False):
    """Every rank: time each algorithm on each size; rank 0 prints one JSON line per (algorithm, size)."""
    import numpy as np
    from mpi4py import MPI

    import shmcomm
    from shmcomm import basics

    shmcomm.init()
    world, mpi = basics.communicator(), MPI.COMM_WORLD
    names = ("torus", "ring", "auto", "mpi library")  # auto: what shmcomm picks by default for the size
    for size in sizes:
        x = np.ones(max(1, size // 4), dtype=np.float32)
        theirs = x.copy()  # MPI's, an ordinary array in any case
        if shared:  # memory every rank of the host maps, as the engine's fusion buffer is: the row steps use it
            x = shmcomm.shared_empty(x.size, np.float32)
            x[:] = 1
        parts = np.array_split(x, FUSED_TENSORS)

        def call(name):
            if name == "mpi library":
                mpi.Allreduce(MPI.IN_PLACE, theirs, MPI.SUM)
            elif fused:  # DistributedOptimizer's path: the engine fuses the tensors into one allreduce by `name`
                world.algorithm = name
                handles = [shmcomm.allreduce_async_(t, op=shmcomm.Sum, name="fused.%d" % i) for i, t in
                           enumerate(parts)]
                for handle in handles:
                    shmcomm.synchronize(handle)
            else:
                world.algorithm = name
                shmcomm.allreduce_(x, op=shmcomm.Sum)
        for name in names:
            for _ in range(warmup):
                call(name)
        # Small sizes are latency, which this shared machine makes noisy: more iterations, and the algorithms take
        # turns, in a rotating order, so that a slow patch of the machine falls on all of them alike.
        count = iters if size >= SMALL_SIZE else max(iters, SMALL_ITERS)
        times = {name: [] for name in names}
        for i in range(count):
            for name in names[i % len(names):] + names[:i % len(names)]:
                mpi.Barrier()
                t = time.perf_counter()
                call(name)
                times[name].append(time.perf_counter() - t)
        for name in names:
            slowest = np.empty(count)
            mpi.Allreduce(np.array(times[name]), slowest, MPI.MAX)
            if mpi.rank == 0:
                print(TAG + json.dumps({"algorithm": name, "bytes": size, "median_s": float(np.median(slowest))}),
                      flush=True)
    if breakdown:
        _breakdown(world, mpi, [s for s in sizes if s <= world.torus.small_bytes], max(iters, SMALL_ITERS))
    shmcomm.shutdown()


PHASES = ("row step", "across hosts", "row broadcast")  # one after the other; "exchanges" is part of "across hosts"


def _breakdown(world, mpi, sizes, count):
    """Where the torus's small path spends a call, on every rank (--breakdown): its row step, the first column's
    allreduce across hosts (the agreement's exchange carrying the data; "exchange": its rounds in C where they are
    compiled, transport/crossing.py, else the MPI transport's exchanges), the row broadcast of the result, and the rest
    (Python between them, the output's copy). Beside it, a bare MPI_Sendrecv of the same message between the same
    ranks: what the exchange costs MPI itself. Each phase is timed by a clock around the transport's call, per call,
    medians over calls, printed by each rank. The phases are those of the full path: the numpy API's quick call
    (csrc/py/quick_crossing.c, the same steps in one C call) is closed meanwhile, and timed on its own ("one C
    call")."""
    import numpy as np

    import shmcomm
    from shmcomm import quick_path
    from shmcomm.algorithms.agreement import HEADER_BYTES

    torus, clocks = world.torus, {}
    leader = torus.row.rank == 0  # the rank of its host that crosses

    def clocked(owner, method, phase):
        call = getattr(owner, method)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                clocks[phase] = clocks.get(phase, 0.0) + time.perf_counter() - started
        setattr(owner, method, timed)  # on this instance only, for the rest of the job
    clocked(torus.row, "allreduce", PHASES[0])
    clocked(torus.column, "allreduce", PHASES[1])
    clocked(torus.row, "broadcast", PHASES[2])
    if leader:  # the exchanges: the agreement's rounds (MPI's calls, in C where compiled, and the merges)
        clocked(torus.column._rounds, "run", "exchanges")
    world.algorithm = "torus"
    for size in sizes:
        x = np.ones(max(1, size // 4), dtype=np.float32)
        message, echo = np.zeros(HEADER_BYTES + x.nbytes, np.uint8), np.zeros(HEADER_BYTES + x.nbytes, np.uint8)
        column = torus.column.transport.comm if leader else None
        partner = column.rank ^ 1 if leader and (column.rank ^ 1) < column.size else None
        rows = {name: [] for name in ("call",) + PHASES + ("exchanges", "MPI_Sendrecv", "one C call")}
        quick = quick_path.world.crossing_allreduce
        for _ in range(count):
            if quick:
                mpi.Barrier()
                started = time.perf_counter()
                shmcomm.allreduce_(x, op=shmcomm.Sum)
                rows["one C call"].append(time.perf_counter() - started)
            quick_path.world.crossing_allreduce = None  # the full path, whose phases the clocks see
            mpi.Barrier()
            clocks.clear()
            started = time.perf_counter()
            shmcomm.allreduce_(x, op=shmcomm.Sum)
            rows["call"].append(time.perf_counter() - started)
            quick_path.world.crossing_allreduce = quick
            for phase in PHASES + ("exchanges",):
                rows[phase].append(clocks.get(phase, 0.0))
            mpi.Barrier()
            started = time.perf_counter()
            if partner is not None:
                column.Sendrecv(message, partner, 0x5AD, echo, partner, 0x5AD)
            rows["MPI_Sendrecv"].append(time.perf_counter() - started)
        medians = {name: float(np.median(values)) if values else None for name, values in rows.items()}
        every = mpi.gather(dict(medians, rank=mpi.rank, leader=leader, bytes=size), root=0)
        for row in every or []:
            print(BREAKDOWN + json.dumps(row), flush=True)


def _print_breakdown(rows):
    print("where the torus's small path spends a call, medians in us (a clock around each phase, per call):")
    print("%8s %5s %7s %9s %9s %13s %10s %14s %8s %13s %11s" % ("bytes", "rank", "leader", "call", "row step",
                                                                "across hosts", "(exchange)", "row broadcast", "rest",
                                                                "MPI_Sendrecv", "one C call"))
    for r in rows:
        rest = r["call"] - sum(r[p] for p in PHASES)
        print("%8d %5d %7s %9.1f %9.1f %13.1f %10.1f %14.1f %8.1f %13s %11s" % (
            r["bytes"], r["rank"], "yes" if r["leader"] else "no", r["call"] * 1e6, r["row step"] * 1e6,
            r["across hosts"] * 1e6, r["exchanges"] * 1e6, r["row broadcast"] * 1e6, rest * 1e6,
            "%.1f" % (r["MPI_Sendrecv"] * 1e6) if r["leader"] else "-",
            "%.1f" % (r["one C call"] * 1e6) if r["one C call"] is not None else "-"))


def _samples(results, hosts, local, small_bytes):
    """(model label, bytes, seconds): the torus took its small-message path up to small_bytes."""
    def label(algorithm, nbytes):
        if algorithm == "torus":
            return "torus-small" if nbytes <= small_bytes else "torus %dx%d" % (local, hosts)
        return algorithm
    return [(label(r["algorithm"], r["bytes"]), r["bytes"], r["median_s"]) for r in results
            if r["algorithm"] in ("torus", "ring")]


def _machine(hosts, local, fit=None):
    from shmcomm.sim import LinkModel, Machine

    if fit is not None:
        return Machine(ranks=hosts * local, local=local, intra=fit.intra, inter=fit.inter,
                       gamma_s_per_byte=fit.gamma_s_per_byte)
    return Machine(ranks=hosts * local, local=local, intra=LinkModel.from_bandwidth(1e-6, 5e9),
                   inter=LinkModel.from_bandwidth(50e-6, 1e9), gamma_s_per_byte=0.1e-9)


def calibrated(results, hosts, local, small_bytes, fit_from=None):
    """Fits the model on `fit_from` (an earlier run's saved results and shape) or on these results, then predicts
    these results with it. Gamma stays at its given value: allreduce times alone do not separate it from beta."""
    from shmcomm.sim import calibrate, cost_terms

    source = fit_from or {"results": results, "hosts": hosts, "local": local, "torus_small_bytes": small_bytes}
    fit = calibrate(_samples(source["results"], source["hosts"], source["local"],
                             source.get("torus_small_bytes", small_bytes)),
                    _machine(source["hosts"], source["local"]), fit_gamma=False)
    machine = _machine(hosts, local, fit)
    rows = []
    for algorithm, nbytes, measured in _samples(results, hosts, local, small_bytes):
        predicted = float(cost_terms(algorithm, machine, nbytes)[0] @ machine.parameters)
        rows.append((algorithm, nbytes, measured, predicted))
    return fit, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--rate", help="cap each host's link, tc syntax (1gbit)")
    parser.add_argument("--shared-cpus", action="store_true",
                        help="let every simulated host run on every CPU (by default each has its own)")
    parser.add_argument("--bytes", default="4K,256K,4M,64M")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--mpi-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", help="save the measurements here")
    parser.add_argument("--fit-from", help="calibrate the model on this earlier --json file, predict this run")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the phases of the torus's small path on every rank (sizes it takes)")
    parser.add_argument("--shared", action="store_true",
                        help="shmcomm's buffer a shmcomm.shared_empty array, as the engine's fusion buffer is "
                             "(MPI's an ordinary one)")
    parser.add_argument("--fused", action="store_true",
                        help="shmcomm's calls through the engine: %d tensors of the size in all, each "
                             "allreduce_async_, fused into one allreduce (DistributedOptimizer's path); MPI's one call "
                             "as before"
                        % FUSED_TENSORS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fused and (args.shared or args.breakdown):
        parser.error("--fused takes neither --shared (the engine packs the tensors into its own fusion buffer, shared "
                     "by default) nor --breakdown")
    from benchmarks.collectives import parse_size

    sizes = [parse_size(s) for s in args.bytes.split(",")]
    if args.worker:
        worker(sizes, args.iters, args.warmup, args.breakdown, args.shared, args.fused)
        return
    from shmcomm.testing.simhosts import SimulatedHosts

    env = dict(BEST_MPI_SETTINGS, **(SHARED_CORES if args.shared_cpus else {}))
    env.update(item.split("=", 1) for item in args.mpi_env)
    with SimulatedHosts(args.hosts, rate=args.rate, own_cpus=not args.shared_cpus) as sim:
        cpus = "shared" if args.shared_cpus else " ".join("%s:%s" % hc for hc in zip(sim.hosts, sim.cpus))
        cmd = [sys.executable, "-m", "shmcomm.runner", *sim.shmcommrun_args(args.ranks_per_host, extra_env=env),
               sys.executable, "-m", "benchmarks.multihost", "--worker", "--bytes", args.bytes, "--iters",
               str(args.iters), "--warmup", str(args.warmup)] + (["--breakdown"] if args.breakdown else []) + (
                   ["--shared"] if args.shared else []) + (["--fused"] if args.fused else [])
        run_env = {k: v for k, v in os.environ.items() if not k.startswith(("SHMCOMM_", "HOROVOD_"))}
        run_env["PYTHONPATH"] = ROOT
        run = subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=args.timeout)
    if run.returncode != 0:
        sys.stderr.write(run.stdout + run.stderr)
        raise SystemExit("the job failed")
    results = [json.loads(line.split(TAG, 1)[1]) for line in run.stdout.splitlines() if TAG in line]
    phases = [json.loads(line.split(BREAKDOWN, 1)[1]) for line in run.stdout.splitlines() if BREAKDOWN in line]
    from shmcomm.env import torus_small_bytes

    small_bytes = torus_small_bytes(env)
    print("# %s | %s | %d hosts x %d ranks, links %s, CPUs %s, MPI settings %s" % (
        " ".join(["python -m benchmarks.multihost"] + sys.argv[1:]), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        args.hosts, args.ranks_per_host, args.rate or "unshaped", cpus, " ".join("%s=%s" % kv for kv in env.items())))
    by = {(r["algorithm"], r["bytes"]): r["median_s"] for r in results}
    print("%12s %12s %12s %12s %12s %10s %10s %10s" % ("bytes", "torus (ms)", "ring (ms)", "auto (ms)", "MPI (ms)",
                                                       "MPI/torus", "ring/torus", "MPI/auto"))
    for size in sizes:
        t, r, a, m = (by[(name, size)] for name in ("torus", "ring", "auto", "mpi library"))
        print("%12d %12.3f %12.3f %12.3f %12.3f %10.2f %10.2f %10.2f" % (size, t * 1e3, r * 1e3, a * 1e3, m * 1e3,
                                                                     m / t, r / t, m / a))
    if phases:
        _print_breakdown(phases)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hosts": args.hosts, "local": args.ranks_per_host, "rate": args.rate, "results": results,
                       "torus_small_bytes": small_bytes}, f)
    if args.shared or args.fused:  # the model describes one allreduce through the staging copies, not these
        print("cost model not calibrated: it models allreduces of ordinary arrays (no --shared, no --fused)")
        return
    fit_from = None
    if args.fit_from:
        with open(args.fit_from) as f:
            fit_from = json.load(f)
    try:
        fit, rows = calibrated(results, args.hosts, args.ranks_per_host, small_bytes, fit_from)
    except ValueError as error:  # too few sizes to fit both links' latency and bandwidth: the table stands alone
        print("cost model not calibrated: %s" % error)
        return
    print("cost model calibrated on %s: intra %.2f us + %.2f GB/s, inter %.2f us + %.2f GB/s, gamma %.3f ns/B"
          % (args.fit_from or "these runs", fit.intra.latency * 1e6, fit.intra.bandwidth / 1e9,
             fit.inter.latency * 1e6, fit.inter.bandwidth / 1e9,
             fit.gamma_s_per_byte * 1e9))
    for algorithm, nbytes, measured, predicted in rows:
        print("  %-12s %12d B  measured %10.3f ms  predicted %10.3f ms  (%+.0f%%)"
              % (algorithm, nbytes, measured * 1e3, predicted * 1e3, 100 * (predicted / measured - 1)))


if __name__ == "__main__":
    main()
