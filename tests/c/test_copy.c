/* SPDX-License-Identifier: Apache-2.0 */
/* smc_copy (core/copy.h) against memmove: every short distance, both directions of overlap, sizes on both sides of
 * where it switches to its backward loop and of that loop's 128-byte blocks; smc_copy_streaming against memcpy at
 * every offset of its 16-byte stores and around its 64-byte blocks. Prints "N passed, N failed". */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/copy.h"
#include "harness.h"

enum { ROOM = 20 * 4096 }; /* a multiple of the page, as aligned_alloc wants */

static void fill(uint8_t* p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(i * 131u + seed * 7u + (i >> 8));
}

/* Copies `bytes` from src_at to dst_at within one buffer (so they may overlap) with both functions and compares
 * the whole buffer, which also catches a write outside the destination. */
static int same_as_memmove(uint8_t* a, uint8_t* b, size_t src_at, size_t dst_at, size_t bytes) {
  fill(a, ROOM, (unsigned)(src_at + dst_at + bytes));
  memcpy(b, a, ROOM);
  memmove(b + dst_at, b + src_at, bytes);
  smc_copy(a + dst_at, a + src_at, bytes);
  return memcmp(a, b, ROOM) == 0;
}

int main(void) {
  uint8_t* a = aligned_alloc(4096, ROOM);
  uint8_t* b = aligned_alloc(4096, ROOM);
  const size_t sizes[] = {0, 1, 127, 2048, 2049, 2050, 2176, 4095, 4096, 4097, 8191, 65536 + 77};
  const size_t nsizes = sizeof(sizes) / sizeof(sizes[0]);
  int bad = 0, short_cases = 0;
  for (size_t s = 0; s < nsizes; s++) {
    size_t n = sizes[s];
    for (size_t d = 0; d < 80; d++) {
      /* Apart, with dst d bytes past src modulo a page: the placement that takes the backward loop when d < 64. */
      size_t src_at = 5, dst_at = 5 + 4096 * ((n + 4095) / 4096 + 1) + d;
      if (dst_at + n > ROOM) continue;
      short_cases += smc_short_distance(a + dst_at, a + src_at);
      bad += !same_as_memmove(a, b, src_at, dst_at, n);
      /* Overlapping, dst above src and below it: memmove's semantics either way. */
      bad += !same_as_memmove(a, b, 100, 100 + d, n);
      bad += !same_as_memmove(a, b, 100 + d, 100, n);
      /* Overlapping with dst a page and d bytes below src: a short distance modulo a page, that must go forwards. */
      if (n > 4096 + d) bad += !same_as_memmove(a, b, 100 + 4096 + d, 100 + d + d, n);
    }
  }
  EXPECT(bad == 0, "%d copies differ from memmove", bad);
  int streamed_bad = 0;
  const size_t streamed[] = {0, 1, 15, 16, 63, 64, 79, 80, 127, 128, 1000, 4096 + 33, 65536 + 5};
  for (size_t s = 0; s < sizeof(streamed) / sizeof(streamed[0]); s++) {
    for (size_t dst_at = 0; dst_at < 40; dst_at++) {
      size_t n = streamed[s], src_at = 3 + (dst_at * 7) % 64;
      fill(a, ROOM, (unsigned)(n + dst_at));
      fill(b, ROOM, (unsigned)(n + dst_at + 1));
      uint8_t* want = malloc(ROOM);
      memcpy(want, b, ROOM);
      memcpy(want + 8192 + dst_at, a + src_at, n);
      smc_copy_streaming(b + 8192 + dst_at, a + src_at, n);
      streamed_bad += memcmp(want, b, ROOM) != 0; /* the whole buffer: nothing written outside the destination */
      free(want);
    }
  }
  EXPECT(streamed_bad == 0, "%d streamed copies differ from memcpy", streamed_bad);
  EXPECT(short_cases > 0, "no case had a short distance");
  EXPECT(smc_short_distance(a + 16, a) && smc_short_distance(a + 4096 + 8, a) && !smc_short_distance(a, a) &&
             !smc_short_distance(a + 64, a) && !smc_short_distance(a, a + 16),
         "short distances: 1-63 bytes past the source modulo a page");
  free(a);
  free(b);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
