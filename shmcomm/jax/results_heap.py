# SPDX-License-Identifier: Apache-2.0
"""Keeps the memory of jitted calls' results mapped between calls (glibc's malloc only).

XLA mallocs every result of a jitted call and frees it when the array goes. glibc maps a block above its mmap
threshold afresh on every malloc and unmaps it on free (the threshold follows the blocks freed, but only up to 32
MiB), and it gives freed memory at the top of its heap back to the system once more than its trim threshold is free.
Either way a result's pages are faulted in again on every call, by the collective's own writes: at 2 ranks, within
the handler, a 1 MiB allreduce took 250-300 us with 80-100 faults a call, against 157 us with 3.5 once both thresholds
were raised; 16 MiB 4.8 ms against 2.9, 64 MiB 23.0 ms against 15.4 (the numpy API's own: 150 us, 2.9 ms, 22.4 ms).
Raising one threshold alone did not help: the mmap threshold keeps the block in the heap, the trim threshold keeps
the heap's pages.

So the first use of shmcomm.jax raises both to SHMCOMM_JAX_HEAP_BYTES (default 1 GiB; 0 leaves them as they are):
blocks up to that size come from the heap, and up to that much freed memory stays with the process for the next
result instead of going back to the system. The thresholds are the process's (numpy's and torch's large blocks come
from the heap too), hence the setting."""
import ctypes
import logging

log = logging.getLogger("shmcomm.jax")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>


def keep_results_mapped(nbytes):
    """Raises glibc's mmap and trim thresholds to `nbytes`; whether it did (not under another malloc, nor for 0)."""
    if nbytes <= 0:
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # present in glibc only: another malloc may lack mallopt or ignore it
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("not glibc: results' memory left to the malloc in use")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, nbytes) == 1 and mallopt(M_TRIM_THRESHOLD, nbytes) == 1
    log.debug("glibc's mmap and trim thresholds %s %d bytes", "raised to" if done else "could not be raised to", nbytes)
    return done
