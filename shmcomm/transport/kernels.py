# SPDX-License-Identifier: Apache-2.0
"""The core's reduction kernels on this process's own memory (csrc/reduce/): what a transport that moves bytes only
(MPI) needs to reduce what it received, with the same rules and the same bits as the shared-memory steps."""
from shmcomm._native import error_for, ffi, lib


def itemsize(dtype):
    return int(lib.smc_dtype_size(dtype))


def reduce_pair(dst, first, second, count, dtype, op, what):
    """dst = op(first, second), element-wise over `count` elements; dst may be either source. Every rank that
    reduces the same pair in the same order gets the same bits."""
    rc = lib.smc_reduce(dst, ffi.new("void *[2]", [first, second]), 2, count, dtype, op, 1.0, 1.0, 1)
    if rc != 0:
        raise error_for(rc, what)


def scale(ptr, count, dtype, factor, divisor=1):
    """x = factor * x / divisor in place, with the reductions' rules (integers truncate)."""
    if factor != 1.0 or divisor != 1:
        rc = lib.smc_reduce(ptr, ffi.new("void *[1]", [ptr]), 1, count, dtype, lib.SMC_SUM, 1.0, factor, divisor)
        if rc != 0:
            raise error_for(rc, "scale")
