# SPDX-License-Identifier: Apache-2.0
"""Heterogeneity: one rank slowed down, synchronous training against asynchronous and hybrid (ShmCaffe's point).

    python -m benchmarks.elastic [--hosts 2 --ranks-per-host 2] [--slow-rank 3 --slow-factor 3] [--rounds 2]

Runs examples/torch_elastic.py in each mode (sync: DistributedOptimizer; async and hybrid:
ElasticAveragingOptimizer) with and without the slow rank, modes interleaved round by round, across simulated
hosts (--hosts 0: on this host). Reports, medians over rounds: the wall time until rank 0 sees the centre (sync: its
model) reach the target accuracy, the slowed runs' time against sync's slowed run, and the fast ranks' step rate
with the slow rank against without it (fast: not the slow rank, nor, in hybrid, a rank of its host, which steps with
it by design); then that ratio round by round (slowed over the same round's unslowed run): over runs of 1-2 s on a
shared machine one round's ratio moves far more than the 10% the target allows."""
import argparse
import os
import re
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("sync", "async", "hybrid")


def _run(launcher, mode, slow, options):
    args = [sys.executable, "examples/torch_elastic.py", "--mode", mode, "--target", str(options.target)]
    if slow:
        args += ["--slow-rank", str(options.slow_rank), "--slow-factor", str(options.slow_factor)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHMCOMM_", "HOROVOD_"))}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run(launcher + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        sys.stderr.write(run.stdout[-3000:] + run.stderr[-3000:])
        raise SystemExit("benchmarks.elastic: %s failed" % " ".join(args))
    reached = re.search(r"time to \d+%: ([0-9.]+) s", run.stdout)
    rates = {int(m.group(1)): float(m.group(2))
             for m in re.finditer(r"rank (\d+): \d+ steps, [0-9.]+ steps/s while stepping, ([0-9.]+) steps/s overall",
                                  run.stdout)}
    return (float(reached.group(1)) if reached else float("inf")), rates


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2, help="simulated hosts (0: this host only)")
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--slow-rank", type=int, default=3)
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--rounds", type=int, default=2)
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
    times, rates = {}, {}
    try:
        for _ in range(options.rounds):
            for slow in (False, True):
                for mode in MODES:
                    t, r = _run(launcher, mode, slow, options)
                    times.setdefault((mode, slow), []).append(t)
                    for rank, rate in r.items():
                        rates.setdefault((mode, slow, rank), []).append(rate)
    finally:
        if sim is not None:
            sim.close()
    slow_host = options.slow_rank // per_host
    print("# python -m benchmarks.elastic %s | %s | %d ranks (%s), rank %d slowed %.1fx, target %.0f%%, medians of %d "
          "rounds" % (" ".join(sys.argv[1:]), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), size,
                      "%d simulated hosts x %d" % (options.hosts, per_host) if options.hosts else "one host",
                      options.slow_rank, options.slow_factor, 100 * options.target, options.rounds))
    print("%-7s %14s %14s %18s %24s" % ("mode", "to target (s)", "slowed (s)", "sync slowed / this",
                                         "fast ranks' rate slowed/not"))
    sync_slow = float(np.median(times[("sync", True)]))
    spread = []
    for mode in MODES:
        plain, slowed = float(np.median(times[(mode, False)])), float(np.median(times[(mode, True)]))
        fast = [rank for rank in range(size) if rank != options.slow_rank
                and not (mode == "hybrid" and rank // per_host == slow_host)]
        ratios = ["%d: %.2f" % (rank, np.median(rates[(mode, True, rank)]) / np.median(rates[(mode, False, rank)]))
                  for rank in fast]
        print("%-7s %14.2f %14.2f %18.2f   %s" % (mode, plain, slowed, sync_slow / slowed, ", ".join(ratios)))
        spread.append("%s: %s" % (mode, "; ".join(
            "%d: %s" % (rank, " ".join("%.2f" % (s / p) for s, p in zip(rates[(mode, True, rank)],
                                                                      rates[(mode, False, rank)])))
            for rank in fast)))
    print("fast ranks' rate slowed/not, round by round (how much one round's ratio moves):")
    for line in spread:
        print("  " + line)


if __name__ == "__main__":
    main()
