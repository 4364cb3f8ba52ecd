# SPDX-License-Identifier: Apache-2.0
"""Which array element types the core reduces, and how numpy and torch spell them."""
import zlib

import numpy as np

from shmcomm._native import lib

_NUMPY = {
    np.dtype(np.float16): lib.SMC_FLOAT16,
    np.dtype(np.float32): lib.SMC_FLOAT32,
    np.dtype(np.float64): lib.SMC_FLOAT64,
    np.dtype(np.int8): lib.SMC_INT8,
    np.dtype(np.uint8): lib.SMC_UINT8,
    np.dtype(np.int16): lib.SMC_INT16,
    np.dtype(np.int32): lib.SMC_INT32,
    np.dtype(np.int64): lib.SMC_INT64,
}
_bfloat16_looked_for = False


def _look_for_bfloat16():
    """numpy has no bfloat16 of its own; ml_dtypes (shipped with jax) provides one. Looked for on first need, not at
    import: importing ml_dtypes 0.7 takes 1.3-1.5 s of CPU (it registers dozens of types and every cast between
    them), which every rank paid at start, and an array of its bfloat16 exists only once its maker imported it."""
    global _bfloat16_looked_for
    if not _bfloat16_looked_for:
        _bfloat16_looked_for = True
        try:
            import ml_dtypes
        except ImportError:
            return
        _NUMPY[np.dtype(ml_dtypes.bfloat16)] = lib.SMC_BFLOAT16


NAMES = {
    lib.SMC_FLOAT16: "float16", lib.SMC_BFLOAT16: "bfloat16", lib.SMC_FLOAT32: "float32", lib.SMC_FLOAT64: "float64",
    lib.SMC_INT8: "int8", lib.SMC_UINT8: "uint8", lib.SMC_INT16: "int16", lib.SMC_INT32: "int32",
    lib.SMC_INT64: "int64",
}
INTEGER = {lib.SMC_INT8, lib.SMC_UINT8, lib.SMC_INT16, lib.SMC_INT32, lib.SMC_INT64}
BFLOAT16 = lib.SMC_BFLOAT16  # the code the quick calls are given for a bfloat16 tensor's int16 view
# A CUDA tensor's dtype key is its core code plus this: ranks that pass a CUDA tensor where others pass a CPU one
# disagree on the dtype (and every rank raises), and the engine never fuses CUDA tensors with CPU ones. Core codes
# are below it; the keys of types the core does not reduce are 1000 and above (Buffer.dtype_key).
DEVICE_KEY = 100


def foreign_key(name):
    """The dtype key of a type the core does not reduce, from its name: 1000 and above, and the same in every process
    (str hashes differ between processes; crc32 does not)."""
    return 1000 + zlib.crc32(name.encode())


def device_code(key):
    """The core code of a CUDA tensor's dtype key, or None if `key` is not one."""
    code = key - DEVICE_KEY
    return code if code in NAMES else None

_torch_map = None


def torch_codes():
    """torch dtype -> core code, built on first use so that importing shmcomm never imports torch."""
    global _torch_map
    if _torch_map is None:
        import torch

        _torch_map = {
            torch.float16: lib.SMC_FLOAT16, torch.bfloat16: lib.SMC_BFLOAT16, torch.float32: lib.SMC_FLOAT32,
            torch.float64: lib.SMC_FLOAT64, torch.int8: lib.SMC_INT8, torch.uint8: lib.SMC_UINT8,
            torch.int16: lib.SMC_INT16, torch.int32: lib.SMC_INT32, torch.int64: lib.SMC_INT64,
        }
    return _torch_map


def numpy_code(dtype):
    code = _NUMPY.get(dtype)
    if code is None and not _bfloat16_looked_for and getattr(dtype, "name", None) == "bfloat16":
        _look_for_bfloat16()
        code = _NUMPY.get(dtype)
    return code


def numpy_dtype(code):
    if code == lib.SMC_BFLOAT16:
        _look_for_bfloat16()
    for dt, c in _NUMPY.items():
        if c == code:
            return dt
    raise ValueError("no numpy dtype for %s" % NAMES.get(code, code))
