# SPDX-License-Identifier: Apache-2.0
"""Allreduce of CUDA tensors: shmcomm.torch against torch.distributed, in nccl-tests' units.

Each rank of a job started by shmcommrun runs one backend over sizes from -b to -e bytes (float32, in place) and rank
0 prints one JSON line per size: bytes, the median time of the timed iterations, algbw (bytes / time) and busbw
(algbw * 2 (n - 1) / n, nccl-tests' allreduce bus bandwidth, which is 0 for one rank: algbw is the figure there).
Each rank takes the GPU local_rank % device_count, so more ranks than GPUs share one.

    shmcommrun -np 2 python -m benchmarks.gpu_allreduce run shmcomm -b 4K -e 1G --out shmcomm.jsonl
    shmcommrun -np 2 python -m benchmarks.gpu_allreduce run torch-gloo -b 4K -e 1G --out gloo.jsonl
    python -m benchmarks.gpu_allreduce table "np=2" shmcomm.jsonl gloo.jsonl

Backends: `shmcomm` (NCCL when every rank has a GPU, the host path when ranks share one), `torch-nccl` and
`torch-gloo` (torch.distributed; NCCL needs a GPU per rank, gloo stages CUDA tensors through host memory as
shmcomm's host path does). Iterations: -n timed (default 20) and -w warm-up (default 3), fewer for big sizes so
that each size takes about -t seconds at most (default 2)."""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.collectives import parse_size, sweep

class Shmcomm:
    def __init__(self):
        import shmcomm.torch as hvd

        hvd.init()
        self.hvd, self.rank, self.size, self.local_rank = hvd, hvd.rank(), hvd.size(), hvd.local_rank()

    def allreduce(self, x):
        self.hvd.allreduce_(x, op=self.hvd.Sum, name="bench.%d" % x.numel())

    def barrier(self):
        self.hvd.barrier()


class TorchDistributed:
    def __init__(self, backend):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.size = int(os.environ["SHMCOMM_RANK"]), int(os.environ["SHMCOMM_SIZE"])
        self.local_rank = int(os.environ.get("SHMCOMM_LOCAL_RANK", self.rank))
        store = os.environ.get("BENCH_STORE") or os.path.join(tempfile.gettempdir(), "gpu_allreduce.%s.store"
                                                              % os.environ.get("SHMCOMM_JOB_TOKEN", "job"))
        self.backend = backend
        self._init = lambda: dist.init_process_group(backend, init_method="file://" + store, rank=self.rank,
                                                     world_size=self.size)

    def start(self):
        self._init()  # after the device is chosen: NCCL binds the current device

    def allreduce(self, x):
        self.dist.all_reduce(x)

    def barrier(self):
        self.dist.barrier()


def run(args):
    import torch

    backend = Shmcomm() if args.backend == "shmcomm" else TorchDistributed(args.backend.split("-")[1])
    torch.cuda.set_device(backend.local_rank % torch.cuda.device_count())
    if hasattr(backend, "start"):
        backend.start()
    stream = torch.cuda.current_stream()
    for nbytes in sweep(args.b, args.e, args.f):
        x = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device="cuda")
        times = []
        warmup, timed = args.w, args.n
        for i in range(warmup + timed):
            backend.barrier()
            started = time.perf_counter()
            backend.allreduce(x)
            stream.synchronize()
            elapsed = time.perf_counter() - started
            if i >= warmup:
                times.append(elapsed)
            if elapsed * (len(times) + 1) > args.t and len(times) >= 2:
                break
            if i == 0 and elapsed > args.t:
                warmup = 0  # a size this large: one warm-up is all the time allows
        median = statistics.median(times) if times else elapsed
        algbw = nbytes / median / 1e9
        if backend.rank == 0:
            row = json.dumps({"backend": args.backend, "np": backend.size, "bytes": nbytes, "time_us": median * 1e6,
                              "algbw": algbw, "busbw": algbw * 2 * (backend.size - 1) / backend.size,
                              "iterations": len(times)})
            print(row, flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(row + "\n")
        del x


def _rows(path):
    rows = {}
    with open(path) as lines:
        for line in lines:
            line = line.split(">: ", 1)[-1].strip()  # shmcommrun's rank prefix, if the output kept it
            if line.startswith("{"):
                row = json.loads(line)
                rows[row["bytes"]] = row
    return rows


def table(args):
    """A Markdown table: one row per size, time and bandwidths of each file's backend, and the first backend's
    time over each other's (above 1: the first is faster)."""
    every = [_rows(path) for path in args.files]
    names = [next(iter(r.values()))["backend"] if r else os.path.basename(p) for r, p in zip(every, args.files)]
    figure = "busbw" if any(r and next(iter(r.values()))["np"] > 1 for r in every) else "algbw"
    head = ["bytes"] + ["%s us" % n for n in names] + ["%s %s GB/s" % (n, figure) for n in names]
    head += ["%s / %s time" % (names[j], names[0]) for j in range(1, len(names))]
    print("### allreduce of CUDA tensors, %s (float32, in place)\n" % args.title)
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for nbytes in sorted(set().union(*every)):
        got = [r.get(nbytes) for r in every]
        cells = [str(nbytes)] + ["%.1f" % g["time_us"] if g else "-" for g in got]
        cells += ["%.2f" % g[figure] if g else "-" for g in got]
        cells += ["%.2f" % (g["time_us"] / got[0]["time_us"]) if g and got[0] else "-" for g in got[1:]]
        print("| " + " | ".join(cells) + " |")
    print()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="run one backend on every rank of this job")
    one.add_argument("backend", choices=["shmcomm", "torch-nccl", "torch-gloo"])
    one.add_argument("-b", type=parse_size, default="4K")
    one.add_argument("-e", type=parse_size, default="1G")
    one.add_argument("-f", type=int, default=4)
    one.add_argument("-n", type=int, default=20)
    one.add_argument("-w", type=int, default=3)
    one.add_argument("-t", type=float, default=2.0)
    one.add_argument("--out", help="also append the rows to this file (rank 0)")
    both = sub.add_parser("table", help="Markdown table of result files (JSON lines)")
    both.add_argument("title")
    both.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    run(args) if args.command == "run" else table(args)


if __name__ == "__main__":
    sys.exit(main())
