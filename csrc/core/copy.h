/* SPDX-License-Identifier: Apache-2.0 */
/* Bulk copies of collective data, between callers' buffers and staging memory.
 *
 * From 2 KiB up to the size where it switches to non-temporal stores, glibc's memcpy uses `rep movsb`, and so does
 * the kernel's copy behind process_vm_readv. On AMD Zen that instruction slows down sharply when the destination
 * lies 1-31 bytes past the source modulo 4 KiB. That is the usual case here, not a corner: staging halves start on a
 * page, and numpy's large arrays start 16 bytes past one (malloc's header), so every copy out of a half into such an
 * array hits it. Intel's cores do not slow down there, and this file's own loop would cost them more than memmove:
 * the CPU's vendor, as it reports it, decides. */
#ifndef SMC_CORE_COPY_H_
#define SMC_CORE_COPY_H_

#include <stddef.h>
#include <stdint.h>

enum { SMC_PAGE_BYTES = 4096 };

/* Whether dst is a few bytes past src within a page's span, on a CPU whose `rep movsb` handles that placement slowly
 * (AMD's). (A margin up to a cache line: a little past 31 bytes is still slow.) */
static inline int smc_short_distance(const void* dst, const void* src) {
  uintptr_t d = ((uintptr_t)dst - (uintptr_t)src) & (SMC_PAGE_BYTES - 1);
#if defined(SMC_SLOW_SHORT_MOVES) /* set by tests/test_c_core.py, so that the loop is tested on every CPU */
  return d != 0 && d < 64 && SMC_SLOW_SHORT_MOVES;
#elif defined(__x86_64__) && defined(__GNUC__)
  return d != 0 && d < 64 && __builtin_cpu_is("amd");
#else
  return d != 0 && d < 64;
#endif
}

/* memmove, that copies such placements with a vector loop that runs backwards instead. */
void smc_copy(void* dst, const void* src, size_t bytes);

/* memcpy (no overlap) with stores that bypass the cache where the CPU has them: for data that will not be read
 * again soon, it saves the read of each destination line that a cached store costs first. */
void smc_copy_streaming(void* dst, const void* src, size_t bytes);

/* smc_copy_streaming where the buffers do not overlap, smc_copy (which allows any overlap) where they do. */
void smc_copy_bypassing(void* dst, const void* src, size_t bytes);

#endif
