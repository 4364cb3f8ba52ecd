/* SPDX-License-Identifier: Apache-2.0 */
/* Whether an allreduce or reduce-scatter pulls where the kernel's copy proved slow at init.
 *
 * Staged steps hand each piece from one core's cache to the other's; pulling reads it by the kernel's copy wherever
 * it lies. On a shared machine the first slows several times over for seconds at a time while the second holds
 * (benchmarks/RESULTS.md, "The machine's slow spells"), so no fixed choice is right there. Each rank keeps, per power
 * of two of the size, what each path cost per byte: the path it takes by a running mean, the other as last tried.
 * It offers the cheaper and now and then the other, half as often each time that one loses, down to once in
 * LAST_INTERVAL calls times how many times dearer it was, so that trying a far dearer path costs little on average.
 * The first call of each path only warms it (its pages, its caches) and teaches nothing. The ranks choose apart: they
 * pull only where all offer to (coll/allreduce.c), and a call that did not pull teaches the staged cost. */
#include "coll/comm.h"

#define FIRST_INTERVAL 8
#define LAST_INTERVAL 64
#define MOST_DEARER 64 /* times: a loser dearer than this is still tried once in this many LAST_INTERVALs */
#define WARMING 4 /* calls, each path in turn: the first of each warms it, the second is learned */

static smc_pull_class_t* class_of(smc_comm_t* c, uint64_t bytes) {
  int k = 0;
  while (k < SMC_PULL_CLASSES - 1 && (bytes >> (k + 1)) >= c->pull_bytes) k++;
  return &c->pull_classes[k];
}

/* A path never learned (a buffer that overlaps its output cannot pull) never counts as the cheaper. */
static int pulling_cheaper(const smc_pull_class_t* k) { return k->cost[1] > 0 && k->cost[1] < k->cost[0]; }

int smc_pull_choose(smc_comm_t* c, uint64_t bytes) {
  if (!smc_pull_learned(c, bytes)) return smc_pull(c, bytes);
  const smc_pull_class_t* k = class_of(c, bytes);
  if (k->warming < WARMING) return k->warming % 2 == 0;
  return k->until_other == 0 ? !pulling_cheaper(k) : pulling_cheaper(k);
}

void smc_pull_learn(smc_comm_t* c, uint64_t bytes, int pulled, double seconds) {
  if (!smc_pull_learned(c, bytes) || bytes == 0 || seconds <= 0) return;
  smc_pull_class_t* k = class_of(c, bytes);
  const double cost = seconds / (double)bytes;
  if (k->warming < WARMING) {
    if (++k->warming > WARMING / 2) k->cost[pulled] = cost;
    if (k->warming == WARMING) k->until_other = k->interval = FIRST_INTERVAL;
    return;
  }
  const int tried = k->cost[pulled] == 0 || k->until_other == 0;
  const int was_cheaper = pulling_cheaper(k);
  /* A path tried now and then starts afresh from what it cost now: its old figure may come from another spell. */
  k->cost[pulled] = tried ? cost : 0.75 * k->cost[pulled] + 0.25 * cost;
  if (!tried) {
    k->until_other--;
    return;
  }
  if (pulling_cheaper(k) != was_cheaper) {
    k->interval = FIRST_INTERVAL; /* the other path won: try the loser soon */
  } else {
    const double dearer = pulled ? k->cost[1] / k->cost[0] : k->cost[0] / k->cost[1]; /* the loser's, >= 1 */
    const uint32_t last = dearer >= MOST_DEARER ? MOST_DEARER * LAST_INTERVAL
                                                : (uint32_t)((dearer > 1 ? dearer : 1) * LAST_INTERVAL);
    k->interval = 2 * k->interval < last ? 2 * k->interval : last;
  }
  k->until_other = k->interval;
}
