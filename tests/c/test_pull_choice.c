/* SPDX-License-Identifier: Apache-2.0 */
/* C unit tests of coll/pull_choice.c: which path a rank offers where the kernel's copy proved slow, from the costs
 * its calls report. Built with that file alone. Prints "N passed, N failed". */
#include <stdlib.h>

#include "coll/comm.h"
#include "harness.h"

#define PULL_BYTES (128u << 10)

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
  /* staged is cheaper, pulling twice as dear: pulled again after 8, 16, 32, 64, 128 and 128 staged calls */
  calls(c, 1u << 20, 1.0, 2.0, 8 + 1 + 16 + 1 + 32 + 1 + 64 + 1 + 128 + 1 + 128 + 1, got);
  int tries[8], n = 0;
  for (int at = 0; got[at]; at++)
    if (got[at] == 'P' && n < 8) tries[n++] = at;
  EXPECT(n == 6 && tries[0] == 8 && tries[1] == 25 && tries[2] == 58 && tries[3] == 123 && tries[4] == 252 &&
             tries[5] == 381,
         "the loser is tried half as often each time it loses, down to once per its dearness times 64 calls: %s", got);
  free(c);
  /* A path twenty times as dear is tried once in 1280 calls at most, once its waits have grown. */
  c = learning_comm();
  for (int i = 0; i < 4000; i++) call(c, 1u << 20, 1.0, 20.0);
  int pulled = 0;
  for (int i = 0; i < 2560; i++) pulled += call(c, 1u << 20, 1.0, 20.0);
  EXPECT(pulled == 2, "a far dearer path is tried seldom: %d times in 2560 calls", pulled);
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

static void test_sizes_learn_apart_and_a_refused_pull_teaches_staging(void) {
  smc_comm_t* c = learning_comm();
  char got[256];
  calls(c, 1u << 20, 1.0, 2.0, 40, got);
  calls(c, 64u << 20, 2.0, 1.0, 40, got);
  EXPECT(strcmp(got + 20, "PPPPPPPPPPPPPPPPPPPP") == 0 || strchr(got + 20, 's') == strrchr(got + 20, 's'),
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

int main(void) {
  test_fixed_where_the_kernels_copy_is_fast_or_the_threshold_set();
  test_learns_the_cheaper_and_tries_the_other_less_often();
  test_a_slow_spell_turns_it_to_pulling_and_back();
  test_sizes_learn_apart_and_a_refused_pull_teaches_staging();
  printf("%d passed, %d failed\n", passed, failed);
  return failed != 0;
}
