# SPDX-License-Identifier: Apache-2.0
"""Addresses as the transports take them: made here from arrays, viewed and copied here. Above the transports an
address is an opaque value handed down (at most offset by a byte count), so only this package, the Soft Memory Box
and the loader of the core use the core's cffi (tests/test_architecture.py)."""
import functools

import numpy as np

from shmcomm._native import ffi

NULL = ffi.NULL
address = ffi.from_buffer  # of a contiguous array or bytes-like object; refuses anything else (BufferError)
copy = ffi.memmove  # copy(dst, src, nbytes): addresses or buffers


# at(integer): the address of the memory at `integer` (numpy's ctypes.data, torch's data_ptr()); a partial, not a
# function of our own, because wrapping every torch tensor pays for each Python frame on the way down.
at = functools.partial(ffi.cast, "void *")


def view(addr, nbytes):
    """The `nbytes` bytes at `addr` as a uint8 numpy array, without a copy."""
    return np.frombuffer(ffi.buffer(addr, nbytes), dtype=np.uint8) if nbytes else np.empty(0, np.uint8)


def counts(values):
    """A C array of uint64 counts (`values`, or that many zeros), for calls that take one per rank."""
    return ffi.new("uint64_t[]", values)


def scratch(nbytes):
    """`nbytes` bytes of fresh memory, freed with the returned value."""
    return ffi.new("char[]", nbytes)
