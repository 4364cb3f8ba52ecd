# SPDX-License-Identifier: Apache-2.0
"""Heterogeneity: one rank slowed down, synchronous training against asynchronous and hybrid (ShmCaffe's point).

    python -m benchmarks.elastic [--hosts 2 --ranks-per-host 2] [--slow-rank 3 --slow-factor 3] [--rounds 2]

Runs examples/torch_elastic.py in each mode (sync: DistributedOptimizer; async and hybrid:
ElasticAveragingOptimizer) with and without the slow rank, modes interleaved round by round, across simulated
hosts (--hosts 0: on this host), and reports, medians over rounds, the wall time until rank 0 sees the centre (sync:
its model) reach the target accuracy, and the slowed runs' time against sync's slowed run.

The fast ranks' step rate with the slow rank against without it comes from separate jobs of each mode
(--rate-seconds, default 24): in each, the slow rank is slowed only in every other phase of --phase-seconds, so
both rates come from one job, interleaved in time. Separate jobs on a shared machine differ by more than the 10%
the target allows (runs of 1-3 s to the target gave one rank's ratio anywhere from 0.32 to 2.79). Fast: not the slow
rank, nor, in hybrid, a rank of its host, which steps with it by design.

The same jobs' unslowed phases give each mode's communication time per step, as ShmCaffe's SMB paper compares
training's communication time with SMB and with MPI: 1/(steps/s) less the same for --mode local (each rank trains
alone, no communication), medians over ranks; "sync-mpi" is sync with MPI's own allreduce across hosts
(shmcommrun --allreduce-algo mpi), the MPI-based training of the comparison."""
import argparse
import os
import re
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("sync", "async", "hybrid")
PHASED = ("local", "sync-mpi") + MODES  # local first: the others' communication is measured against it


def _launch(launcher, args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHMCOMM_", "HOROVOD_"))}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run(launcher + [sys.executable, "examples/torch_elastic.py"] + args, cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        sys.stderr.write(run.stdout[-3000:] + run.stderr[-3000:])
        raise SystemExit("benchmarks.elastic: examples/torch_elastic.py %s failed" % " ".join(args))
    return run.stdout


def _time_to_target(launcher, mode, slow, options):
    args = ["--mode", mode, "--target", str(options.target)]
    if slow:
        args += ["--slow-rank", str(options.slow_rank), "--slow-factor", str(options.slow_factor)]
    reached = re.search(r"time to \d+%: ([0-9.]+) s", _launch(launcher, args))
    return float(reached.group(1)) if reached else float("inf")


def _phased_rates(launcher, mode, options):
    """{rank: (steps/s in unslowed phases, steps/s in slowed phases)} from one job."""
    if mode == "sync-mpi":
        launcher, mode = launcher + ["--allreduce-algo", "mpi"], "sync"
    out = _launch(launcher, ["--mode", mode, "--slow-rank", str(options.slow_rank),
                             "--slow-factor", str(options.slow_factor), "--duration", str(options.rate_seconds),
                             "--phase-seconds", str(options.phase_seconds)])
    return {int(m.group(1)): (float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"rank (\d+) phases: ([0-9.]+) steps/s unslowed, ([0-9.]+) steps/s with", out)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2, help="simulated hosts (0: this host only)")
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--slow-rank", type=int, default=3)
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate-seconds", type=float, default=24.0, help="length of each step-rate job")
    parser.add_argument("--phase-seconds", type=float, default=2.0, help="the slow rank's phases in a step-rate job")
    options = parser.parse_args()
    per_host = options.ranks_per_host
    sim = None
    if options.hosts:
        from shmcomm.testing.simhosts import SimulatedHosts
        sim = SimulatedHosts(options.hosts).__enter__()
        launcher = [sys.executable, "-m", "shmcomm.runner", *sim.shmcommrun_args(per_host)]
    else:
        launcher = [sys.executable, "-m", "shmcomm.runner", "-np", str(per_host)]
    size = max(1, options.hosts) * per_host
    times, phased = {}, {}
    try:
        for _ in range(options.rounds):
            for mode in MODES:
                for slow in (False, True):
                    times.setdefault((mode, slow), []).append(_time_to_target(launcher, mode, slow, options))
            for mode in PHASED:
                for rank, rates in _phased_rates(launcher, mode, options).items():
                    phased.setdefault((mode, rank), []).append(rates)
    finally:
        if sim is not None:
            sim.close()
    slow_host = options.slow_rank // per_host
    print("# python -m benchmarks.elastic %s | %s | %d ranks (%s), rank %d slowed %.1fx, target %.0f%%, medians of %d "
          "rounds" % (" ".join(sys.argv[1:]), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), size,
                      "%d simulated hosts x %d" % (options.hosts, per_host) if options.hosts else "one host",
                      options.slow_rank, options.slow_factor, 100 * options.target, options.rounds))
    print("%-7s %14s %14s %18s   %s" % ("mode", "to target (s)", "slowed (s)", "sync slowed / this",
                                       "fast ranks' rate, slowed phases / unslowed"))
    sync_slow = float(np.median(times[("sync", True)]))
    ratios = {}
    for mode in PHASED:
        fast = [rank for rank in range(size) if rank != options.slow_rank
                and not (mode == "hybrid" and rank // per_host == slow_host)]
        ratios[mode] = {rank: [s / p if p else 0.0 for p, s in phased[(mode, rank)]] for rank in fast}
    for mode in MODES:
        plain, slowed = float(np.median(times[(mode, False)])), float(np.median(times[(mode, True)]))
        print("%-7s %14.2f %14.2f %18.2f   %s" % (mode, plain, slowed, sync_slow / slowed, ", ".join(
            "%d: %.3f" % (r, np.median(v)) for r, v in ratios[mode].items())))
    # local is the control: its ranks communicate with nobody, so its ratio is what the machine does to a rank
    # whose neighbour sleeps, whatever the library
    print("fast ranks' rate, slowed phases / unslowed, job by job (%.0f s jobs, %.1f s phases; local: no "
          "communication at all):" % (options.rate_seconds, options.phase_seconds))
    for mode in PHASED:
        print("  %s: %s" % (mode, "; ".join("%d: %s" % (r, " ".join("%.3f" % x for x in v))
                                           for r, v in ratios[mode].items())))
    local = [float(np.median([1 / p for p, _ in phased[("local", r)]])) for r in range(size)]
    print("communication per step in unslowed phases, ms (1/rate less local's 1/rate; median of jobs, then of ranks):")
    comm = {}
    for mode in PHASED[1:]:
        per_rank = [float(np.median([1 / p for p, _ in phased[(mode, r)]])) - local[r] for r in range(size)]
        comm[mode] = float(np.median(per_rank))
        print("  %-9s %7.3f" % (mode, 1e3 * comm[mode]))
    print("  sync-mpi / async %.2f, sync-mpi / hybrid %.2f, sync / async %.2f (local step %.3f ms)"
          % (comm["sync-mpi"] / comm["async"], comm["sync-mpi"] / comm["hybrid"], comm["sync"] / comm["async"],
             1e3 * float(np.median(local))))
    print("steps/s, unslowed / slowed phases, job by job:")
    for mode in PHASED:
        print("  %s: %s" % (mode, "; ".join("%d: %s" % (r, " ".join("%.0f/%.0f" % pair for pair in phased[(mode, r)]))
                                           for r in range(size))))


if __name__ == "__main__":
    main()
