# SPDX-License-Identifier: Apache-2.0
"""The core's reduction kernel alone (smc_reduce, what every allreduce and reduce-scatter step runs), in one process:

    python -m benchmarks.reduction [--elements 16K,1M] [--dtypes float32,bfloat16,float16] [--sources 2,4] [--tries 7]

Sums `--sources` inputs into an output apart from them, without a scale and averaged (postscale 1/2), and prints
nanoseconds per element, the best of --tries runs of enough calls for a few milliseconds each. Two sources are two
ranks' inputs: an allreduce at two ranks reduces them in one call per piece. Nothing else runs: a change to a kernel
is measured here first, then in the collectives."""
import argparse
import time

import numpy as np

from benchmarks.collectives import parse_size
from shmcomm._C import ffi, lib

# the core's code of each dtype, and the numpy type its elements are stored as (bfloat16 as its 16 bits)
DTYPES = {"float32": ("SMC_FLOAT32", np.float32), "float64": ("SMC_FLOAT64", np.float64),
          "bfloat16": ("SMC_BFLOAT16", np.uint16), "float16": ("SMC_FLOAT16", np.float16),
          "int32": ("SMC_INT32", np.int32)}


def per_element(dtype, elements, sources, postscale, tries):
    """Best nanoseconds per element of smc_reduce over `tries` runs."""
    code, kind = DTYPES[dtype]
    inputs = [np.full(elements, 0x3f80 if dtype == "bfloat16" else 1, kind) for _ in range(sources)]
    out = np.empty(elements, kind)
    srcs = ffi.new("void*[]", [ffi.cast("void*", x.ctypes.data) for x in inputs])
    dst = ffi.cast("void*", out.ctypes.data)
    calls = max(1, int(4e6 // elements))  # a few milliseconds a run
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        for _ in range(calls):
            if lib.smc_reduce(dst, srcs, sources, elements, getattr(lib, code), lib.SMC_SUM, 1.0, postscale, 1):
                raise SystemExit("smc_reduce failed: %s" % ffi.string(lib.smc_last_error()).decode())
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e9 / elements


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", default="16K,1M", help="comma-separated element counts, e.g. 16K,1M")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--sources", default="2,4")
    parser.add_argument("--tries", type=int, default=7)
    options = parser.parse_args(argv)
    print("# ns per element, best of %d runs: sum | average (postscale 1/2)" % options.tries)
    print("# %-9s %10s %8s %8s %8s" % ("dtype", "elements", "sources", "sum", "average"))
    for dtype in options.dtypes.split(","):
        for elements in [parse_size(s) for s in options.elements.split(",")]:
            for sources in [int(s) for s in options.sources.split(",")]:
                print("  %-9s %10d %8d %8.3f %8.3f" % (dtype, elements, sources,
                                                      per_element(dtype, elements, sources, 1.0, options.tries),
                                                      per_element(dtype, elements, sources, 0.5, options.tries)))


if __name__ == "__main__":
    main()
