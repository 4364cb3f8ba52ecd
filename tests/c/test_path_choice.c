/* SPDX-License-Identifier: Apache-2.0 */
/* C unit tests of coll/path_choice.c: which path a rank offers where the kernel's copy proved slow, from the costs
 * its calls report. Built with that file alone. Prints "N passed, N failed". */
#include <stdlib.h>

#include "coll/comm.h"
#include "harness.h"

#define PULL_BYTES (128u << 10)
#define LAST 64 /* coll/path_choice.c's LAST_INTERVAL */

static smc_comm_t* learning_comm(void) {
  smc_comm_t* c = calloc(1, sizeof(*c));
  c->size = 2;
  c->cma = 1;
  c->pull_probed = 1;
  c->pull_bytes = PULL_BYTES;
  return c;
}

/* One call of `bytes`: the path this rank offers, taken, and its cost per byte (both ranks agree here). */
static int call(smc_comm_t* c, uint64_t bytes, double staged, double pulled) {
  int pull = smc_pull_choose(c, bytes);
  smc_pull_learn(c, bytes, pull, (double)bytes * (pull ? pulled : staged));
  return pull;
}

/* The calls, as a string of P (pulled) and s (staged). */
static void calls(smc_comm_t* c, uint64_t bytes, double staged, double pulled, int n, char* out) {
  for (int i = 0; i < n; i++) out[i] = call(c, bytes, staged, pulled) ? 'P' : 's';
  out[n] = 0;
}

static void test_fixed_where_the_kernels_copy_is_fast_or_the_threshold_set(void) {
  smc_comm_t* c = learning_comm();
  c->cma_fast = 1;
  EXPECT(!smc_pull_learned(c, 1u << 20) && smc_pull_choose(c, 1u << 20) && !smc_pull_choose(c, PULL_BYTES - 64),
         "a fast kernel copy pulls from the threshold on");
  c->cma_fast = 0;
  c->pull_probed = 0; /* SHMCOMM_PULL_BYTES set: forced */
  EXPECT(!smc_pull_learned(c, 1u << 20) && smc_pull_choose(c, 1u << 20), "a set threshold pulls");
  c->pull_probed = 1;
  c->cma = 0;
  EXPECT(!smc_pull_choose(c, 1u << 20), "no pulling where the peers' memory cannot be read");
  c->cma = 1;
  EXPECT(smc_pull_learned(c, PULL_BYTES) && !smc_pull_learned(c, PULL_BYTES - 1), "learned from the threshold on");
  free(c);
}

static void test_learns_the_cheaper_and_tries_the_other_less_often(void) {
  smc_comm_t* c = learning_comm();
  char got[1024];
  calls(c, 1u << 20, 1.0, 2.0, 4, got);
  EXPECT(strcmp(got, "PsPs") == 0, "warming: each path twice, in turn: %s", got);
  /* staged is cheaper, pulling twice as dear: pulled again after 8, 16, 32, 64, 128 and 128 staged calls, each try
   * two calls (the first warms the path) */
  calls(c, 1u << 20, 1.0, 2.0, 8 + 2 + 16 + 2 + 32 + 2 + 64 + 2 + 128 + 2 + 128 + 2, got);
  int tries[8], n = 0, lone = 0;
  for (int at = 0; got[at]; at++) {
    if (got[at] == 'P' && (at == 0 || got[at - 1] != 'P') && n < 8) tries[n++] = at;
    lone += got[at] == 'P' && got[at + 1] != 'P' && (at == 0 || got[at - 1] != 'P');
  }
  EXPECT(n == 6 && lone == 0 && tries[0] == 8 && tries[1] == 26 && tries[2] == 60 && tries[3] == 126 &&
             tries[4] == 256 && tries[5] == 386,
         "the loser is tried half as often each time it loses, down to once per its dearness times 64 calls: %s", got);
  free(c);
  /* A path twenty times as dear is tried once in 1280 calls at most, once its waits have grown. */
  c = learning_comm();
  for (int i = 0; i < 4000; i++) call(c, 1u << 20, 1.0, 20.0);
  int pulled = 0;
  for (int i = 0; i < 2560; i++) pulled += call(c, 1u << 20, 1.0, 20.0);
  EXPECT(pulled == 4, "a far dearer path is tried seldom: %d calls of 2560 (two tries of two calls)", pulled);
  free(c);
}

static void test_a_slow_spell_turns_it_to_pulling_and_back(void) {
  smc_comm_t* c = learning_comm();
  char got[256];
  calls(c, 1u << 20, 1.0, 2.0, 200, got); /* learned: staged */
  calls(c, 1u << 20, 4.0, 2.0, 150, got); /* a spell: staged costs twice pulling */
  EXPECT(strcmp(got + 140, "PPPPPPPPPP") == 0, "pulling within 140 calls of a spell: %s", got);
  calls(c, 1u << 20, 1.0, 2.0, 150, got); /* the spell is over */
  EXPECT(strcmp(got + 140, "ssssssssss") == 0, "staging again after it: %s", got);
  free(c);
}

/* A call that lost its core for a scheduler slice costs many times the path's worth; alone, it moves nothing. */
static void test_one_call_slowed_by_the_machine_keeps_the_choice(void) {
  smc_comm_t* c = learning_comm();
  char got[256];
  calls(c, 1u << 20, 1.0, 1.5, 200, got); /* learned: staged, pulling a little dearer */
  int flips = 0;
  for (int i = 0; i < 20; i++) {
    calls(c, 1u << 20, 20.0, 30.0, 1, got); /* whichever path the call takes, it waits a slice */
    calls(c, 1u << 20, 1.0, 1.5, 9, got);
    int pulled = 0;
    for (int j = 0; got[j]; j++) pulled += got[j] == 'P';
    flips += pulled > 2; /* two are a scheduled try */
  }
  EXPECT(flips == 0, "%d of 20 slowed calls turned the choice to pulling", flips);
  calls(c, 1u << 20, 20.0, 10.0, 150, got); /* a spell in which staging truly costs more */
  int staged = 0;
  for (int j = 100; got[j]; j++) staged += got[j] == 's';
  EXPECT(staged <= 2, "pulling within 100 calls of a spell, staging only tried: %s", got);
  free(c);
}

static void test_sizes_learn_apart_and_a_refused_pull_teaches_staging(void) {
  smc_comm_t* c = learning_comm();
  char got[256];
  calls(c, 1u << 20, 1.0, 2.0, 40, got);
  calls(c, 64u << 20, 2.0, 1.0, 40, got);
  const char* tried = strchr(got + 20, 's'); /* at most one try of staging, two calls */
  EXPECT(tried == NULL || (tried[1] == 's' && strchr(tried + 2, 's') == NULL),
         "64 MiB learns pulling while 1 MiB stages: %s", got);
  calls(c, (1u << 20) + 4096, 1.0, 2.0, 1, got);
  EXPECT(got[0] == 's', "the same power of two shares what was learned");
  smc_comm_t* d = learning_comm();
  for (int i = 0; i < 20; i++) { /* offers to pull, but the call stages (an output overlapping the input) */
    smc_pull_choose(d, 1u << 20);
    smc_pull_learn(d, 1u << 20, 0, (double)(1u << 20));
  }
  EXPECT(d->pull_classes[3].cost[1] == 0 && !smc_pull_choose(d, 1u << 20), "never pulled: staged is the cheaper");
  free(c);
  free(d);
}

/* Two ranks whose costs differ a little, as on any machine: the path each call takes is rank 0's offer (as the core
 * decides where it is learned). The dearer path is still tried on both ranks at the pace rank 0 learned, and rank 1,
 * which only predicts, never offers against what it learned. */
static void test_rank_0_leads_so_the_dearer_path_is_still_tried_together(void) {
  smc_comm_t* r[2] = {learning_comm(), learning_comm()};
  r[1]->rank = 1;
  const double staged[2] = {1.0, 1.1}, pulled[2] = {2.0, 2.3};
  int tries = 0, last_try = 0, against = 0, widest = 0;
  for (int i = 0; i < 6000; i++) {
    int offers[2];
    for (int j = 0; j < 2; j++) offers[j] = smc_pull_choose(r[j], 1u << 20);
    const int took = offers[0];
    for (int j = 0; j < 2; j++)
      smc_pull_learn(r[j], 1u << 20, took, (double)(1u << 20) * (took ? pulled[j] : staged[j]));
    if (i >= 4 && took) {
      tries++;
      widest = i - last_try > widest ? i - last_try : widest;
      last_try = i;
    }
    against += i >= 4 && offers[1] != (r[1]->pull_classes[3].cost[1] < r[1]->pull_classes[3].cost[0]);
  }
  EXPECT(tries >= 6000 / (3 * LAST) && widest <= 3 * LAST && 6000 - last_try <= 3 * LAST,
         "pulled %d times in 6000 calls, at most %d apart, the last at %d", tries, widest, last_try);
  EXPECT(against == 0, "rank 1 offered against what it learned %d times", against);
  free(r[0]);
  free(r[1]);
}

/* The single-copy choice of an allgather or alltoall learns apart from pulling, per collective. */
static void test_single_copy_learns_in_its_own_classes(void) {
  smc_comm_t* c = learning_comm();
  c->single_copy_learned = 1;
  c->single_copy_bytes = 16u << 10;
  char got[64];
  for (int i = 0; i < 40; i++) {
    int single = smc_single_copy_offer(c, c->alltoall_classes, 1u << 20);
    c->learning.start -= (double)(1u << 20) * (single ? 1.0 : 3.0) * 1e-9; /* the call's cost, single copy cheaper */
    smc_single_copy_taught(c, c->alltoall_classes, single);
    got[i] = single ? 'S' : 's';
  }
  got[40] = 0;
  int staged = 0;
  for (int i = 4; i < 40; i++) staged += got[i] == 's';
  EXPECT(strncmp(got, "SsSsSSSSSSSS", 12) == 0 && staged <= 4 && got[39] == 'S',
         "single copy learned as the cheaper, staging tried now and then: %s", got);
  EXPECT(c->allgather_classes[6].warming == 0 && c->pull_classes[3].warming == 0, "the other choices untouched");
  EXPECT(smc_single_copy_learned(c, 16u << 10, 16u << 10, 1u << 20) &&
             !smc_single_copy_learned(c, (16u << 10) - 1, 16u << 10, 1u << 20) &&
             !smc_single_copy_learned(c, 16u << 10, 1u << 20, 1u << 20),
         "learned from the single-copy size on, below the size where single copy is steadier");
  free(c);
}

int main(void) {
  test_rank_0_leads_so_the_dearer_path_is_still_tried_together();
  test_single_copy_learns_in_its_own_classes();
  test_fixed_where_the_kernels_copy_is_fast_or_the_threshold_set();
  test_learns_the_cheaper_and_tries_the_other_less_often();
  test_a_slow_spell_turns_it_to_pulling_and_back();
  test_one_call_slowed_by_the_machine_keeps_the_choice();
  test_sizes_learn_apart_and_a_refused_pull_teaches_staging();
  printf("%d passed, %d failed\n", passed, failed);
  return failed != 0;
}
