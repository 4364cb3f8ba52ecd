/* SPDX-License-Identifier: Apache-2.0 */
/* See copy.h. */
#include "core/copy.h"

#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

typedef uint8_t smc_vec32_t __attribute__((vector_size(32)));

/* Backwards, each load reads below every store still in flight, so no load waits for an older store whose address
 * matches it in the low 12 bits (the false dependency a forward copy with dst just past src meets at every line).
 * Also memmove's order when dst is above src, so overlapping buffers stay right. */
static void copy_backwards(uint8_t* d, const uint8_t* s, size_t n) {
  while (n >= 128) {
    n -= 128;
    smc_vec32_t a, b, c, e;
    memcpy(&e, s + n + 96, 32); /* fixed-size memcpy: unaligned vector moves, no call */
    memcpy(&c, s + n + 64, 32);
    memcpy(&b, s + n + 32, 32);
    memcpy(&a, s + n, 32);
    memcpy(d + n + 96, &e, 32);
    memcpy(d + n + 64, &c, 32);
    memcpy(d + n + 32, &b, 32);
    memcpy(d + n, &a, 32);
  }
  if (n > 0) memmove(d, s, n); /* under 2 KiB: no rep movsb */
}

void smc_copy(void* dst, const void* src, size_t bytes) {
  uint8_t* d = dst;
  const uint8_t* s = src;
  /* Buffers that overlap with dst below src must be copied forwards. */
  if (bytes > 2048 && smc_short_distance(d, s) && !(d < s && d + bytes > s))
    copy_backwards(d, s, bytes);
  else if (d != s)
    memmove(d, s, bytes);
}

void smc_copy_bypassing(void* dst, const void* src, size_t bytes) {
  const uint8_t *d = dst, *s = src;
  if (d + bytes <= s || s + bytes <= d)
    smc_copy_streaming(dst, src, bytes);
  else
    smc_copy(dst, src, bytes);
}

void smc_copy_streaming(void* dst, const void* src, size_t bytes) {
#if defined(__x86_64__)
  uint8_t* d = dst;
  const uint8_t* s = src;
  size_t head = (size_t)(-(uintptr_t)d & 15);
  if (bytes < head + 64) {
    memcpy(d, s, bytes);
    return;
  }
  memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  while (bytes >= 64) {
    __m128i a = _mm_loadu_si128((const __m128i*)s), b = _mm_loadu_si128((const __m128i*)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i*)(s + 32)), e = _mm_loadu_si128((const __m128i*)(s + 48));
    _mm_stream_si128((__m128i*)d, a);
    _mm_stream_si128((__m128i*)(d + 16), b);
    _mm_stream_si128((__m128i*)(d + 32), c);
    _mm_stream_si128((__m128i*)(d + 48), e);
    d += 64;
    s += 64;
    bytes -= 64;
  }
  _mm_sfence(); /* the streamed lines are ordered before what follows (the step's synchronisation) */
  memcpy(d, s, bytes);
#else
  memcpy(dst, src, bytes);
#endif
}
