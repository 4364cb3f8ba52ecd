# SPDX-License-Identifier: Apache-2.0
"""The core's computations on this process's own memory: its reduction kernels (csrc/reduce/), which a transport that
moves bytes only (MPI) needs to reduce what it received with the same rules and bits as the shared-memory steps; and
the digests ranks compare (csrc/core/digest.c), which the quick calls in C compute alike."""
import numpy as np

from shmcomm._native import error_for, ffi, lib

HALF = (lib.SMC_FLOAT16, lib.SMC_BFLOAT16)  # reduced in float32 and rounded once, wherever they travel


def itemsize(dtype):
    return int(lib.smc_dtype_size(dtype))


def reduce_pair(dst, first, second, count, dtype, op, what, pair=None):
    """dst = op(first, second), element-wise over `count` elements; dst may be either source. Every rank that
    reduces the same pair in the same order gets the same bits. `pair`: a reusable ffi "void *[2]" (a caller that
    reduces many pairs allocates it once)."""
    if pair is None:
        pair = ffi.new("void *[2]")
    pair[0], pair[1] = first, second
    rc = lib.smc_reduce(dst, pair, 2, count, dtype, op, 1.0, 1.0, 1)
    if rc != 0:
        raise error_for(rc, what)


def shape_tag(dtype, shape):
    """The core's tag of a dtype key and a shape (smc_shape_tag)."""
    return int(lib.smc_shape_tag(dtype, ffi.new("int64_t[]", shape), len(shape)))


def signature(kind, dtype, shape, op, prescale, postscale, root, extra):
    """The core's signature of a whole description and `extra` numbers (smc_signature)."""
    return int(lib.smc_signature(kind, dtype, ffi.new("int64_t[]", shape), len(shape), op, prescale, postscale, root,
                                 ffi.new("int64_t[]", [int(e) for e in extra]), len(extra)))


def combine_headers(headers):
    """Combines the agreement's headers (a uint64 array of rows of four words: signature, status, culprit, data
    bytes) into the first row, by the rules of its rounds (the core's smc_agreement_combine)."""
    rows = ffi.from_buffer("uint64_t[]", headers)
    for r in range(1, len(headers)):
        lib.smc_agreement_combine(rows, rows + 4 * r)


def scale(ptr, count, dtype, factor, divisor=1):
    """x = factor * x / divisor in place, with the reductions' rules (integers truncate)."""
    if factor != 1.0 or divisor != 1:
        rc = lib.smc_reduce(ptr, ffi.new("void *[1]", [ptr]), 1, count, dtype, lib.SMC_SUM, 1.0, factor, divisor)
        if rc != 0:
            raise error_for(rc, "scale")


def widened(raw, dtype):
    """A float32 copy of the 16-bit floats (float16 or bfloat16) held in the uint8 array `raw`."""
    wide = np.empty(raw.nbytes // 2, dtype=np.float32)
    if dtype == lib.SMC_FLOAT16:
        wide[:] = raw.view(np.float16)
    else:  # bfloat16: the top half of a float32
        wide.view(np.uint32)[:] = raw.view(np.uint16).astype(np.uint32) << 16
    return wide


def narrow_into(raw, wide, dtype):
    """Rounds the float32 array `wide` to nearest even, as the core does, into the 16-bit floats of `raw`."""
    if dtype == lib.SMC_FLOAT16:
        raw.view(np.float16)[:] = wide
    else:
        bits = wide.view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = np.isnan(wide)
        raw.view(np.uint16)[:] = np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)
