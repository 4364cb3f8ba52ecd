# SPDX-License-Identifier: Apache-2.0
"""shmcomm's allreduce against DeepSpeed's shared-memory allreduce for CPUs, on ordinary torch tensors, in one job:

    shmcommrun -np 2 python -m benchmarks.deepspeed [--bytes 8,1K,64K,1M,4M,16M,64M] [--dtypes float32,bfloat16,float16]
        [--rounds 5] [--cpu-load N]

DeepSpeed is a peer, never a dependency: `pip install deepspeed torch==2.13.0` (its op compiles on first use, with
g++ and ninja). DeepSpeed's op (`torch.ops.deepspeed.inference_all_reduce_`, after `ShareMemCommBuilder().load()`
and `initialize(world size, rank)`) sums float32, bfloat16 and float16 tensors in place when every rank is on one
host (LOCAL_SIZE, which this benchmark sets, equal to the world size; MASTER_ADDR and MASTER_PORT, which shmcommrun
sets, name its segment). shmcomm's side is `shmcomm.allreduce_(tensor, op=shmcomm.Sum)` on the same tensor. The two
take turns call by call, each call after a barrier; the table gives, per dtype and size, the median over rounds of
the slowest rank's median and 90th percentile of --iters calls, and DeepSpeed's time over shmcomm's as the median of
the rounds' ratios (above 1: shmcomm is faster). Both results are checked against the exact sum once per dtype and
size."""
import glob
import os
import sys

import numpy as np
import torch

import shmcomm
from benchmarks.taking_turns import alternating, parse_options, size_text, slowest_rank
from shmcomm.testing import cpu_load

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load(size, rank):
    """DeepSpeed's allreduce op, ready on this rank, and the vector level its kernels may use here (2: AVX-512);
    exits with how to install it when it is missing."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["LOCAL_SIZE"] = str(size)  # its shared-memory path needs every rank on this host, and to be told so
    try:
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    except ImportError:
        raise SystemExit("benchmarks.deepspeed needs DeepSpeed: pip install deepspeed torch==2.13.0") from None
    module = ShareMemCommBuilder().load()
    module.initialize(size, rank)
    return torch.ops.deepspeed.inference_all_reduce_, module.vector_kernel_level()


def _checked(op, dtype, count, me, n):
    """Both libraries sum small integers exactly, in every dtype: a wrong element fails the benchmark."""
    def mine(r):
        return (torch.arange(count) % 7 + r + 1).to(dtype)
    expected = sum(mine(r).double() for r in range(n)).to(dtype)
    for name, call in (("shmcomm", lambda t: shmcomm.allreduce_(t, op=shmcomm.Sum)), ("DeepSpeed", op)):
        t = mine(me)
        call(t)
        if not torch.equal(t, expected):
            raise SystemExit("%s's allreduce of %d %s elements is wrong on rank %d" % (name, count, dtype, me))


def main(argv=None):
    options, sizes, dtypes = parse_options(argv, __doc__, "8,1K,64K,1M,4M,16M,64M", list(DTYPES), "dtypes")
    torch.set_num_threads(1)
    shmcomm.init()
    me, n = shmcomm.rank(), shmcomm.size()
    if shmcomm.local_size() != n:
        raise SystemExit("DeepSpeed's shared-memory allreduce needs every rank on one host")
    their_op, level = load(n, me)
    if level < 2 and set(dtypes) - {"float32"}:  # its 16-bit kernels are AVX-512 code: elsewhere they fault
        dtypes = [d for d in dtypes if d == "float32"]
        if me == 0:
            print("# DeepSpeed's bfloat16 and float16 kernels need AVX-512, which this CPU lacks: float32 only")
    rows = {}  # (dtype, size) -> {library: [(median, p90) per round]}
    with cpu_load.spinning(options.cpu_load if me == 0 else 0):
        for round_ in range(options.rounds):
            for name in dtypes:
                for nbytes in sizes:
                    dtype = DTYPES[name]
                    count = max(1, nbytes * 8 // torch.finfo(dtype).bits)
                    if round_ == 0:
                        _checked(their_op, dtype, count, me, n)
                    tensor = torch.ones(count, dtype=dtype)
                    times = alternating({"shmcomm": lambda: shmcomm.allreduce_(tensor, op=shmcomm.Sum),
                                          "DeepSpeed": lambda: their_op(tensor)}, options.iters)
                    for library, spent in times.items():
                        rows.setdefault((name, nbytes), {}).setdefault(library, []).append(slowest_rank(spent))
    if me == 0:
        print("# python -m benchmarks.deepspeed %s | np=%d%s | medians over %d rounds of the slowest rank's median and "
              "p90 of %d calls" % (" ".join(sys.argv[1:] if argv is None else argv), n,
                                   " beside %d CPU-bound processes" % options.cpu_load if options.cpu_load else "",
                                   options.rounds, options.iters))
        print("| dtype | size | shmcomm us (p90) | DeepSpeed us (p90) | DeepSpeed / shmcomm |")
        print("|---|---|---|---|---|")
        for (name, nbytes), by_library in rows.items():
            ours, theirs = (np.array(by_library[lib]) for lib in ("shmcomm", "DeepSpeed"))
            ratio = np.median(theirs[:, 0] / ours[:, 0])
            print("| %s | %s | %.1f (%.1f) | %.1f (%.1f) | %.2f |" % (
                name, size_text(nbytes), *(1e6 * np.median(ours, axis=0)), *(1e6 * np.median(theirs, axis=0)), ratio),
                flush=True)
    shmcomm.barrier()
    remove_segments(me)
    shmcomm.shutdown()


def remove_segments(rank):
    """DeepSpeed never removes its shared-memory segments (named after MASTER_ADDR, MASTER_PORT and the rank): once
    every rank is done with them, each removes its own."""
    pattern = "/dev/shm/deepspeed_*_%s_%s_%d" % (os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""),
                                                 rank)
    for path in glob.glob(pattern):
        os.unlink(path)


if __name__ == "__main__":
    main()
