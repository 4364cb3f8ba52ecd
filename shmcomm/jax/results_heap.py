# SPDX-License-Identifier: Apache-2.0
"""Keeps the memory of jitted calls' results mapped between calls (glibc's malloc only).

XLA mallocs every result of a jitted call and frees it when the array goes; with glibc's default thresholds a large
result's pages go back to the system and are faulted in again on every call, by the collective's own writes. So the
first use of shmcomm.jax raises glibc's mmap and trim thresholds to SHMCOMM_JAX_HEAP_BYTES (default 1 GiB; 0 leaves
them as they are). It is a setting because the thresholds are the whole process's: numpy's and torch's large blocks
come from the heap too."""
import ctypes
import logging

log = logging.getLogger("shmcomm.jax")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>


def keep_results_mapped(nbytes):
    """Raises glibc's mmap and trim thresholds to `nbytes`; whether it did (not under another malloc, nor for 0).

    glibc maps a block above its mmap threshold afresh on every malloc and unmaps it on free (the threshold follows
    the blocks freed, but only up to 32 MiB), and gives freed memory at the top of its heap back to the system once
    more than its trim threshold is free. Both are raised, as one alone does not help: the mmap threshold keeps the
    block in the heap, the trim threshold keeps the heap's pages. Blocks up to `nbytes` then come from the heap, and
    up to that much freed memory stays with the process for the next result."""
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
