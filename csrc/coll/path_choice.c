/* SPDX-License-Identifier: Apache-2.0 */
/* Whether a collective takes the kernel's copy where that copy proved slow at init: an allreduce or reduce-scatter
 * pulls, an allgather or alltoall moves by single copy, or each goes through the staging halves.
 *
 * Staged steps hand each piece from one core's cache to the other's; the kernel's copy reads it wherever it lies. On
 * a shared machine the first slows several times over for seconds at a time while the second holds (benchmarks/
 * RESULTS.md, "The machine's slow spells"), and which is cheaper differs from one machine and day to the next, so no
 * fixed choice is right there. Each rank keeps, per collective and power of two of the size, what each path cost per
 * byte: the path it takes by the median of its last few calls (a call that lost its core to another process says
 * nothing about the path, and a mean swung by one such call flipped the choice), the other as last tried. It offers
 * the cheaper and now and then the other, half as often each time that one loses, down to once in LAST_INTERVAL calls
 * times how many times dearer it was, so that trying a far dearer path costs little on average. The first call of
 * each path, and of each try of the other, only warms it (its pages, its caches) and teaches nothing. Every rank
 * learns from the path each call took, but rank 0's offer decides (coll/allreduce.c, coll/allgather.c,
 * coll/alltoall.c): ranks that tried the other path each on its own schedule would seldom try it together, and a
 * lone try takes the usual path and teaches nothing new. The others offer the cheaper as they learned it, which says
 * whether they stage their first piece before the ranks agree. */
#include <string.h>

#include "coll/comm.h"
#include "core/clock.h"

#define FIRST_INTERVAL 8
#define LAST_INTERVAL 64
#define MOST_DEARER 64 /* times: a loser dearer than this is still tried once in this many LAST_INTERVALs */
#define WARMING 4 /* calls, each path in turn: the first of each warms it, the second is learned */

/* The class of `bytes` among sizes from `base` on, a power of two each. */
static smc_choice_class_t* class_of(smc_choice_class_t* classes, uint64_t base, uint64_t bytes) {
  int k = 0;
  while (k < SMC_CHOICE_CLASSES - 1 && (bytes >> (k + 1)) >= base) k++;
  return &classes[k];
}

/* The median of the costs in `recent` (0: none), those of a few calls; of an even number, the lower middle one, so
 * that of two calls the slower alone never moves it. */
static double median(const double* recent) {
  double sorted[SMC_CHOICE_RECENT];
  int n = 0;
  for (; n < SMC_CHOICE_RECENT && recent[n] > 0; n++) {
    int at = n;
    for (; at > 0 && sorted[at - 1] > recent[n]; at--) sorted[at] = sorted[at - 1];
    sorted[at] = recent[n];
  }
  return sorted[(n - 1) / 2];
}

/* A path never learned (a buffer that overlaps its output cannot pull) never counts as the cheaper. */
static int kernel_cheaper(const smc_choice_class_t* k) { return k->cost[1] > 0 && k->cost[1] < k->cost[0]; }

int smc_choice_offer(smc_choice_class_t* classes, uint64_t base, uint64_t bytes, int leads) {
  const smc_choice_class_t* k = class_of(classes, base, bytes);
  if (k->warming < WARMING) return k->warming % 2 == 0; /* in step on every rank: all learn from the same calls */
  return leads && k->until_other == 0 ? !kernel_cheaper(k) : kernel_cheaper(k);
}

void smc_choice_learn(smc_choice_class_t* classes, uint64_t base, uint64_t bytes, int took, double seconds) {
  if (bytes == 0 || !(seconds > 0)) return;
  smc_choice_class_t* k = class_of(classes, base, bytes);
  const double cost = seconds / (double)bytes;
  if (k->warming < WARMING) {
    if (++k->warming > WARMING / 2) k->cost[took] = k->recent[took][0] = cost;
    if (k->warming == WARMING) k->until_other = k->interval = FIRST_INTERVAL;
    return;
  }
  const int tried = k->cost[took] == 0 || k->until_other == 0;
  if (tried && !k->trying) { /* the try's first call: the next takes the same path and is learned */
    k->trying = 1;
    return;
  }
  k->trying = 0;
  const int was_cheaper = kernel_cheaper(k);
  /* A path tried now and then starts afresh from what it cost now: its old figure may come from another spell. */
  double* recent = k->recent[took];
  if (tried) memset(recent, 0, sizeof(k->recent[took]));
  memmove(recent + 1, recent, sizeof(double) * (SMC_CHOICE_RECENT - 1));
  recent[0] = cost;
  k->cost[took] = median(recent);
  if (!tried) {
    k->until_other--;
    return;
  }
  if (kernel_cheaper(k) != was_cheaper) {
    k->interval = FIRST_INTERVAL; /* the other path won: try the loser soon */
  } else {
    const double dearer = took ? k->cost[1] / k->cost[0] : k->cost[0] / k->cost[1]; /* the loser's, >= 1 */
    const uint32_t last = dearer >= MOST_DEARER ? MOST_DEARER * LAST_INTERVAL
                                                : (uint32_t)((dearer > 1 ? dearer : 1) * LAST_INTERVAL);
    k->interval = 2 * k->interval < last ? 2 * k->interval : last;
  }
  k->until_other = k->interval;
}

int smc_pull_choose(smc_comm_t* c, uint64_t bytes) {
  return smc_pull_learned(c, bytes) ? smc_choice_offer(c->pull_classes, c->pull_bytes, bytes, c->rank == 0)
                                    : smc_pull(c, bytes);
}

void smc_pull_learn(smc_comm_t* c, uint64_t bytes, int pulled, double seconds) {
  if (smc_pull_learned(c, bytes)) smc_choice_learn(c->pull_classes, c->pull_bytes, bytes, pulled, seconds);
}

int smc_single_copy_offer(smc_comm_t* c, smc_choice_class_t* classes, uint64_t bytes) {
  c->learning.start = smc_now();
  c->learning.bytes = bytes;
  c->learning.windows = c->window_calls;
  return smc_choice_offer(classes, c->single_copy_bytes, bytes, c->rank == 0);
}

void smc_single_copy_taught(smc_comm_t* c, smc_choice_class_t* classes, int single) {
  if (c->learning.bytes > 0 && c->window_calls == c->learning.windows) /* shared buffers' calls teach nothing */
    smc_choice_learn(classes, c->single_copy_bytes, c->learning.bytes, single, smc_now() - c->learning.start);
  c->learning.bytes = 0;
}
