# SPDX-License-Identifier: Apache-2.0
"""End-to-end training speed: the synthetic benchmark single-process, under shmcomm's DistributedOptimizer, under DDP
(over gloo, with shmcomm's hook, and on torch.distributed's "shmcomm" backend) and under FSDP2 (over gloo and on the
"shmcomm" backend), in one run, one math thread per rank; then the engine's steady-state overhead with 100 small
gradients per step.

    python -m benchmarks.training -np 2
    python -m benchmarks.training -np 2 --model resnet18 --image-size 64 --num-iters 10

Scaling efficiency = total img/s at np=N / (N x img/s at np=1). Each figure is the median over --rounds interleaved
runs of the median over iterations."""
import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "torch_synthetic_benchmark.py")


def _launch(np_, args, timeout, with_stderr=False):
    """The job's stdout (and stderr after it, with_stderr); a failed job ends the benchmark with its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "shmcomm.runner", "-np", str(np_)] + args
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        sys.stderr.write(run.stdout + run.stderr)
        raise SystemExit("benchmark job failed: %s" % " ".join(cmd))
    return run.stdout + (run.stderr if with_stderr else "")


def _img_per_sec(output):
    """Median of the per-iteration img/sec lines of rank 0, per rank."""
    values = sorted(float(v) for v in re.findall(r"Iter #\d+: ([\d.]+) img/sec per CPU", output))
    if not values:
        raise SystemExit("no img/sec in the benchmark output:\n" + output)
    return values[len(values) // 2]


def _median(values):
    values = sorted(values)
    return values[len(values) // 2]


def synthetic(args):
    """Runs every configuration once per round, rotating their order, so that the machine's drift over a few
    minutes falls on all of them alike; reports medians over rounds, and the ratio as the median of the rounds'."""
    common = [sys.executable, EXAMPLE, "--model", args.model, "--batch-size", str(args.batch_size), "--image-size",
              str(args.image_size), "--num-warmup-batches", str(args.num_warmup_batches), "--num-batches-per-iter",
              str(args.num_batches_per_iter), "--num-iters", str(args.num_iters)]
    runs = [("single process", 1, "shmcomm"), ("shmcomm", args.np, "shmcomm"), ("DDP + gloo", args.np, "ddp-gloo"),
            ("DDP + shmcomm hook", args.np, "ddp-shmcomm"), ("DDP on shmcomm", args.np, "ddp-backend"),
            ("FSDP2 + gloo", args.np, "fsdp-gloo"), ("FSDP2 on shmcomm", args.np, "fsdp-backend")]
    measured = {label: [] for label, _, _ in runs}
    for round_ in range(args.rounds):
        shift = round_ % len(runs)
        for label, np_, backend in runs[shift:] + runs[:shift]:
            measured[label].append(_img_per_sec(_launch(np_, common + ["--backend", backend], args.timeout)))
    rows = {}
    for label, np_, _ in runs:
        per_rank = rows[label] = _median(measured[label])
        print("  %-20s np=%d  %8.1f img/s per rank  %8.1f img/s total   (rounds: %s)"
              % (label, np_, per_rank, per_rank * np_, " ".join("%.1f" % v for v in measured[label])), flush=True)
    single = rows["single process"]
    print("scaling efficiency at np=%d (total / (np x single)):" % args.np)
    for label, _, _ in runs[1:]:
        print("  %-20s %.3f" % (label, rows[label] / single))
    for mine, theirs in (("shmcomm", "DDP + gloo"), ("DDP on shmcomm", "DDP + gloo"),
                         ("DDP on shmcomm", "DDP + shmcomm hook"), ("FSDP2 on shmcomm", "FSDP2 + gloo")):
        ratios = [a / b for a, b in zip(measured[mine], measured[theirs])]
        print("%s / %s throughput, median of the rounds: %.3f   (rounds: %s)"
              % (mine, theirs, _median(ratios), " ".join("%.3f" % r for r in ratios)))
    return rows


def overhead_worker(steps):
    """Runs under the launcher: 100 small parameters; the time from the last gradient to step() returning, minus
    the optimizer's own update time, is what the engine adds."""
    import torch

    import shmcomm.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(50)])  # 100 tensors
    params = list(model.parameters())
    base = torch.optim.SGD(model.parameters(), lr=1e-3)
    last_grad = [0.0]
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: last_grad.__setitem__(0, time.perf_counter()))
    x = torch.randn(8, 16)

    def local_update_time():
        t = time.perf_counter()
        base.step()
        return time.perf_counter() - t

    local = sorted(local_update_time() for _ in range(50))[25]
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    samples = []
    for step in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        samples.append(time.perf_counter() - last_grad[0] - local)
    tail = sorted(samples[steps // 5:])  # the first steps fill the response cache
    median = torch.tensor([tail[len(tail) // 2]], dtype=torch.float64)
    worst = hvd.allreduce(median, op=hvd.Max, name="overhead").item()
    if hvd.rank() == 0:
        print("engine overhead, last gradient to step() returning, 100 tensors: median %.3f ms (slowest rank)"
              % (worst * 1e3), flush=True)
    hvd.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", type=int, default=2)
    parser.add_argument("--model", default="resnet18_half")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every configuration, interleaved")
    parser.add_argument("--overhead-steps", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--overhead-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.overhead_worker:
        overhead_worker(args.overhead_steps)
        return
    print("# %s | %s | %d cores" % (" ".join(["python -m benchmarks.training"] + sys.argv[1:]),
                                    time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), len(os.sched_getaffinity(0))))
    print("synthetic benchmark (%s, batch %d per rank, %dx%d images), median img/s:"
          % (args.model, args.batch_size, args.image_size, args.image_size), flush=True)
    synthetic(args)
    overheads = []
    for _ in range(args.rounds):
        out = _launch(args.np, [sys.executable, "-m", "benchmarks.training", "--overhead-worker", "--overhead-steps",
                                str(args.overhead_steps)], args.timeout)
        overheads.append(float(re.search(r"median ([\d.]+) ms", out).group(1)))
    print("engine overhead, last gradient to step() returning, 100 tensors: median %.3f ms (slowest rank; rounds: %s)"
          % (_median(overheads), " ".join("%.3f" % v for v in overheads)))


if __name__ == "__main__":
    main()
