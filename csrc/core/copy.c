/* SPDX-License-Identifier: Apache-2.0 */
/* See copy.h. */
#include "core/copy.h"

#include <string.h>

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
