# SPDX-License-Identifier: Apache-2.0
"""torch.distributed on the "shmcomm" backend against gloo and against shmcomm's own numpy-level API, in one job:

    shmcommrun -np 2 python -m benchmarks.torch_distributed [--bytes 4K,64K,1M,16M,64M] [--rounds 5] [--cpu-load N]

The job's default group runs on the shmcomm backend and a second group of every rank on gloo; the numpy-level calls
work on numpy views of the same tensors. Each round times every op and size twice: the backend, the numpy API and
the numpy API followed by the same torch call on a group that does nothing (benchmarks/torch_layer.py: the least any
backend written in Python can cost) taking turns call by call, then the backend and gloo the same way; each call
alone after a barrier. The table gives
the median over rounds of the slowest rank's median and 90th percentile of --iters calls (the backend's from the
first pair), and each ratio as the median of the rounds' ratios within its pair, so both sides of a ratio saw the
same machine. Sizes follow nccl-tests: the buffer of all_reduce, broadcast and all_to_all_single, the output of
all_gather_into_tensor and the input of reduce_scatter_tensor. --cpu-load N runs it all beside N CPU-bound
processes (rank 0 starts and stops them)."""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import shmcomm
import shmcomm.torch  # noqa: F401  (registers the backend)
from benchmarks import torch_layer
from benchmarks.taking_turns import alternating, parse_options, size_text, slowest_rank
from shmcomm.testing import cpu_load

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast")


def _cases(op, nbytes, n, gloo, layer):
    """{library: a function that runs `op` once} on float32 buffers of `nbytes` (rounded to n elements); "torch's
    layer" runs it on the group `layer`, which does nothing."""
    count = max(n, nbytes // 4 // n * n)
    whole = torch.ones(count)
    part = torch.ones(count // n)
    a_whole, a_part = whole.numpy(), part.numpy()
    out = torch.empty(count)
    a_out = out.numpy()
    if op == "all_reduce":
        calls = {"numpy API": lambda: shmcomm.allreduce_(a_whole, op=shmcomm.Sum),
                 "torch": lambda group=None: dist.all_reduce(whole, group=group)}
    elif op == "all_gather_into_tensor":
        calls = {"numpy API": lambda: shmcomm.allgather(a_part, output=a_out),
                 "torch": lambda group=None: dist.all_gather_into_tensor(out, part, group=group)}
    elif op == "reduce_scatter_tensor":
        calls = {"numpy API": lambda: shmcomm.reducescatter(a_whole.reshape(n, -1), op=shmcomm.Sum,
                                                            output=a_part.reshape(1, -1)),
                 "torch": lambda group=None: dist.reduce_scatter_tensor(part, whole, group=group)}
    elif op == "all_to_all_single":
        calls = {"numpy API": lambda: shmcomm.alltoall(a_whole, output=a_out),
                 "torch": lambda group=None: dist.all_to_all_single(out, whole, group=group)}
    else:
        calls = {"numpy API": lambda: shmcomm.broadcast_(a_whole, 0),
                 "torch": lambda group=None: dist.broadcast(whole, 0, group=group)}
    numpy_api, torch_call = calls["numpy API"], calls["torch"]
    return {"gloo": lambda: torch_call(gloo), "backend": torch_call, "numpy API": numpy_api,
            "numpy API + torch's layer": lambda: (numpy_api(), torch_call(layer))}





def main(argv=None):
    options, sizes, ops = parse_options(argv, __doc__, "4K,64K,1M,16M,64M", OPS, "ops")
    torch.set_num_threads(1)
    dist.init_process_group("shmcomm")
    gloo = dist.new_group(backend="gloo")
    layer = torch_layer.group()
    n, me = dist.get_world_size(), dist.get_rank()
    rows = {}  # (op, size) -> {library: [(median, p90) per round]}; "backend beside gloo" for the ratio to gloo
    with cpu_load.spinning(options.cpu_load if me == 0 else 0):
        for _ in range(options.rounds):
            for op in ops:
                for nbytes in sizes:
                    calls = _cases(op, nbytes, n, gloo, layer)
                    row = rows.setdefault((op, nbytes), {})
                    # each ratio from calls that took turns with each other
                    mine = alternating({k: calls[k] for k in ("backend", "numpy API", "numpy API + torch's layer")},
                                       options.iters)
                    theirs = alternating({"backend beside gloo": calls["backend"], "gloo": calls["gloo"]},
                                          options.iters)
                    for library, times in list(mine.items()) + list(theirs.items()):
                        row.setdefault(library, []).append(slowest_rank(times))
    if me == 0:
        _report(rows, options, n, argv)
    dist.destroy_process_group()


def _report(rows, options, n, argv):
    print("# python -m benchmarks.torch_distributed %s | np=%d%s | medians over %d rounds of the slowest rank's "
          "median and p90 of %d calls" % (" ".join(sys.argv[1:] if argv is None else argv), n,
                                          " beside %d CPU-bound processes" % options.cpu_load if options.cpu_load
                                          else "", options.rounds, options.iters))
    print("| op | size | gloo us (p90) | backend us (p90) | numpy API us (p90) | backend speed / gloo's "
          "| backend time / numpy API's | the same for torch's layer alone |")
    print("|---|---|---|---|---|---|---|---|")
    for (op, nbytes), by_library in rows.items():
        cells = ["%.1f (%.1f)" % tuple(1e6 * np.median(np.array(by_library[lib]), axis=0))
                 for lib in ("gloo", "backend", "numpy API")]
        over_gloo = np.median([g[0] / b[0] for g, b in zip(by_library["gloo"], by_library["backend beside gloo"])])
        over_numpy, floor = (np.median([b[0] / a[0] for b, a in zip(by_library[lib], by_library["numpy API"])])
                             for lib in ("backend", "numpy API + torch's layer"))
        print("| %s | %s | %s | %.2fx | %.2f | %.2f |" % (op, size_text(nbytes), " | ".join(cells), over_gloo,
                                                          over_numpy, floor), flush=True)



if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
