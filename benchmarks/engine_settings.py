# SPDX-License-Identifier: Apache-2.0
"""What the engine's settings are worth: the time of a training step's gradient exchange (a model's tensors, each
allreduced asynchronously through the engine, then all waited for) with every setting at its default and with one
setting changed at a time.

    python -m benchmarks.engine_settings -np 2 --rounds 5 [--busy 1]

Every round runs each configuration as a job of its own, in a rotating order; a job times --steps steps after
--warmup and reports its median and 90th percentile. The table gives, per configuration, the median over rounds of
the jobs' medians and p90s, and the ratio to the defaults as the median of the rounds' ratios. --busy N runs N
CPU-bound processes beside the jobs, as a data loader or another job would."""
import argparse
import json
import os
import subprocess
import sys
from statistics import median_high

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A small convolutional network's gradients (elements): many small tensors (biases, norms) and a few large ones.
TENSORS = [64 * 3 * 9, 64, 64, 64] + [64 * 64 * 9, 64, 64] * 4 + [128 * 64 * 9, 128, 128, 128 * 128 * 9, 128, 128] * 2 \
    + [256 * 128 * 9, 256, 256, 256 * 256 * 9, 256, 256] * 2 + [512 * 10, 10]

CONFIGURATIONS = [
    ("defaults", {}),
    ("SHMCOMM_FUSION_THRESHOLD=0", {"SHMCOMM_FUSION_THRESHOLD": "0"}),
    ("SHMCOMM_CYCLE_TIME=5", {"SHMCOMM_CYCLE_TIME": "5"}),
    ("SHMCOMM_CACHE_CAPACITY=0", {"SHMCOMM_CACHE_CAPACITY": "0"}),
    ("SHMCOMM_BUCKET_BYTES=0", {"SHMCOMM_BUCKET_BYTES": "0"}),
]


def _worker(steps, warmup):
    import time

    import numpy as np

    import shmcomm

    shmcomm.init(engine=True)
    grads = [np.full(n, 1.0, np.float32) for n in TENSORS]
    times = []
    for step in range(warmup + steps):
        shmcomm.barrier()
        started = time.perf_counter()
        handles = [shmcomm.allreduce_async_(g, op=shmcomm.Average, name="g%d" % i) for i, g in enumerate(grads)]
        for h in handles:
            shmcomm.synchronize(h)
        if step >= warmup:
            times.append(time.perf_counter() - started)
    wrong = sum(int(np.count_nonzero(g != 1.0)) for g in grads)  # the average of ones, however often taken
    slowest = shmcomm.allgather(np.array([np.median(times), np.percentile(times, 90), wrong]).reshape(1, 3)).max(axis=0)
    if shmcomm.rank() == 0:
        print("RESULT " + json.dumps({"median": float(slowest[0]), "p90": float(slowest[1]), "wrong": int(slowest[2])}))
    shmcomm.shutdown()


def _job(np_, extra_env, steps, warmup):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env = {k: v for k, v in env.items() if not k.startswith(("SHMCOMM_", "HOROVOD_"))}
    env.update(extra_env)
    cmd = [sys.executable, "-m", "shmcomm.runner", "-np", str(np_), sys.executable, "-m", "benchmarks.engine_settings",
           "--worker", "--steps", str(steps), "--warmup", str(warmup)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if "RESULT " in line]
    result = json.loads(lines[0].split("RESULT ", 1)[1]) if lines else None
    if run.returncode != 0 or result is None or result["wrong"]:
        sys.stderr.write(run.stdout + run.stderr)
        raise SystemExit("benchmark job failed%s: %s" % (" (wrong results)" if result else "", " ".join(cmd)))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside the jobs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.steps, args.warmup)
    from shmcomm.testing import cpu_load

    measured = {label: [] for label, _ in CONFIGURATIONS}
    with cpu_load.spinning(args.busy):
        for round_ in range(args.rounds):
            shift = round_ % len(CONFIGURATIONS)
            for label, extra in CONFIGURATIONS[shift:] + CONFIGURATIONS[:shift]:
                measured[label].append(_job(args.np, extra, args.steps, args.warmup))
    print("%d ranks, %d CPU-bound processes beside, %d tensors (%.1f MiB) a step, %d rounds\n"
          % (args.np, args.busy, len(TENSORS), sum(TENSORS) * 4 / 2 ** 20, args.rounds))
    print("| configuration | step, median (ms) | step, p90 (ms) | against the defaults |")
    print("|---|---|---|---|")
    defaults = measured["defaults"]
    for label, _ in CONFIGURATIONS:
        runs = measured[label]
        ratio = median_high([r["median"] / d["median"] for r, d in zip(runs, defaults)])
        print("| %s | %.2f | %.2f | %.2f |" % (label, 1e3 * median_high([r["median"] for r in runs]),
                                              1e3 * median_high([r["p90"] for r in runs]), ratio))


if __name__ == "__main__":
    main()
