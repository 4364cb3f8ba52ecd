# SPDX-License-Identifier: Apache-2.0
"""The autotuner on the synthetic benchmark: img/s with the default settings and with the settings the autotuner
chose (pinned with the flags it prints), the samples it took, and which prior converges sooner.

    python -m benchmarks.autotune -np 2 --model mlp_deep --image-size 16
    python -m benchmarks.autotune -np 4 --model resnet_tiny --image-size 32 --rounds 3

Every round runs, in a rotating order: the defaults; an autotuning run with the cost-model prior and one without
(HOROVOD_AUTOTUNE_PRIOR=model / none); then the choice of each, pinned. Each img/s figure is the median over rounds
of the median over iterations; a ratio is the median of the rounds' ratios. Convergence: the samples until a run's
best score so far first reaches 95% of its final best (its CSV log)."""
import argparse
import csv
import os
import re
import shlex
import sys
import tempfile

from benchmarks.training import EXAMPLE, _img_per_sec, _launch, _median

CHOSEN = re.compile(r"autotune: (?:done after (\d+) samples.*?chosen|stopped before the end after (\d+) samples; "
                    r"best so far): (--fusion-threshold-mb \S+ --cycle-time-ms \S+) SHMCOMM_BUCKET_BYTES=(\d+)")


DEFAULT_CHOICE = (["--fusion-threshold-mb", "64", "--cycle-time-ms", "1"], 25 << 20)  # as the tuner prints them


def _example(args, iters):
    return [sys.executable, EXAMPLE, "--model", args.model, "--batch-size", str(args.batch_size), "--image-size",
            str(args.image_size), "--num-warmup-batches", "10", "--num-batches-per-iter",
            str(args.num_batches_per_iter), "--num-iters", str(iters)]


def _samples_to_converge(log_file):
    """Samples (after warm-up) until the best score so far reaches 95% of the run's best; the log's last row is
    the best, not a sample."""
    with open(log_file) as file:
        scores = [float(row["score"]) for row in csv.DictReader(file)][:-1]
    best, running = max(scores), 0.0
    for index, score in enumerate(scores, 1):
        running = max(running, score)
        if running >= 0.95 * best:
            return index
    return len(scores)


def _autotune(args, prior, log_file):
    os.environ["HOROVOD_AUTOTUNE_PRIOR"] = prior
    try:
        output = _launch(args.np, ["--autotune", "--autotune-log-file", log_file] + _example(args, args.tune_iters),
                         args.timeout, with_stderr=True)  # the autotuner reports on stderr
    finally:
        del os.environ["HOROVOD_AUTOTUNE_PRIOR"]
    match = CHOSEN.search(output)
    if match is None:
        raise SystemExit("no autotune choice in the output:\n" + output)
    samples = int(match.group(1) or match.group(2))
    return samples, shlex.split(match.group(3)), int(match.group(4)), _samples_to_converge(log_file)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", type=int, default=2)
    parser.add_argument("--model", default="mlp_deep")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=10, help="iterations of the default and pinned runs")
    parser.add_argument("--tune-iters", type=int, default=40, help="iterations of the autotuning runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=900)
    args = parser.parse_args()

    figures = {name: [] for name in ("default", "tuned model", "tuned none")}
    ratios = {"tuned model": [], "tuned none": []}
    samples = {"model": [], "none": []}
    converge = {"model": [], "none": []}
    chosen = {"model": [], "none": []}
    workdir = tempfile.mkdtemp(prefix="shmcomm-autotune-bench-")
    for round_ in range(args.rounds):
        priors = ["model", "none"] if round_ % 2 == 0 else ["none", "model"]
        for prior in priors:
            taken, flags, bucket, converged = _autotune(args, prior, os.path.join(workdir, f"{prior}{round_}.csv"))
            samples[prior].append(taken)
            converge[prior].append(converged)
            chosen[prior].append((flags, bucket))
        runs = [("default", [], {})] + [(f"tuned {p}", chosen[p][-1][0], {"SHMCOMM_BUCKET_BYTES": chosen[p][-1][1]})
                                         for p in priors]
        runs = runs[round_ % len(runs):] + runs[:round_ % len(runs)]
        this_round = {}
        for name, flags, env in runs:
            os.environ.update({k: str(v) for k, v in env.items()})
            try:
                this_round[name] = args.np * _img_per_sec(_launch(args.np, flags + _example(args, args.num_iters),
                                                                  args.timeout))
            finally:
                for key in env:
                    del os.environ[key]
            figures[name].append(this_round[name])
        for name in ratios:
            ratios[name].append(this_round[name] / this_round["default"])
        print("round %d: %s" % (round_ + 1, ", ".join("%s %.0f img/s" % kv for kv in this_round.items())),
              file=sys.stderr, flush=True)

    print(f"np={args.np} {args.model} (image {args.image_size}, batch {args.batch_size}), {args.rounds} rounds:")
    print(f"  default settings: {_median(figures['default']):.0f} img/s")
    for prior in ("model", "none"):
        name = f"tuned {prior}"
        print(f"  autotuned, prior {prior}: {_median(figures[name]):.0f} img/s = {_median(ratios[name]):.2f}x default "
              f"(rounds {', '.join('%.2f' % r for r in ratios[name])}); samples taken {samples[prior]}, "
              f"to 95% of the best {converge[prior]}; kept the default settings in "
              f"{sum(choice == DEFAULT_CHOICE for choice in chosen[prior])} of {args.rounds} runs; chose "
              f"{[' '.join(f) + ' bucket=%d' % b for f, b in chosen[prior]]}")


if __name__ == "__main__":
    main()
