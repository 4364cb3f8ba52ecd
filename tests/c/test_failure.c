/* SPDX-License-Identifier: Apache-2.0 */
/* C unit tests of the failure data (smc_last_failure) and of job rank numbers (smc_config_t.job_ranks): the peer a
 * failure names, by its job rank, in the data and in the text; the field of a mismatch; a reset on other errors.
 * The communicators here number their ranks 20, 21, 22 in the job, so a local index in a message would show.
 * Prints "N passed, N failed". */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "harness.h"
#include "shmcomm.h"

static const int JOB_RANKS[3] = {20, 21, 22};

static smc_failure_t last_failure(void) {
  smc_failure_t f;
  smc_last_failure(&f);
  return f;
}

/* The last failure is exactly {code, rank, field}. */
#define EXPECT_FAILURE(code_, rank_, field_, ...)                                                             \
  do {                                                                                                        \
    smc_failure_t f_ = last_failure();                                                                        \
    EXPECT(f_.code == (code_) && f_.rank == (rank_) && f_.field == (field_), "got {%d, %d, %d}: %s: %s",      \
           (int)f_.code, f_.rank, (int)f_.field, smc_last_error(), __VA_ARGS__);                              \
  } while (0)

/* Creates rank `rank` of `size` with job ranks 20.. from a copy that is overwritten right after, so a communicator
 * that kept a pointer to it would name rank -1. */
static smc_comm_t* join(const char* token, int rank, int size, double timeout_s) {
  int job_ranks[3];
  memcpy(job_ranks, JOB_RANKS, sizeof(job_ranks));
  smc_config_t cfg = config(token, rank, size);
  cfg.job_ranks = job_ranks;
  cfg.timeout_s = timeout_s;
  smc_comm_t* comm = NULL;
  smc_result_t rc = smc_comm_create(&cfg, &comm);
  memset(job_ranks, 0xff, sizeof(job_ranks));
  if (rc != SMC_SUCCESS) fprintf(stderr, "rank %d: create: %s\n", rank, smc_last_error());
  return comm;
}

/* A call that fails for no peer's sake resets the failure data. */
static void expect_reset(smc_comm_t* comm) {
  double x = 0;
  EXPECT(smc_allreduce(comm, &x, &x, 1, (smc_datatype_t)99, SMC_SUM, 1, 1, 1, 0) == SMC_ERR_INVALID, "bad dtype");
  EXPECT_FAILURE(SMC_ERR_INVALID, -1, SMC_FIELD_NONE, "an invalid argument names no peer");
}

/* ---- mismatches: every rank gets the same data, naming the first rank that differs from rank 0 ---- */

static void expect_mismatch(smc_result_t rc, int rank, smc_field_t field, const char* text, const char* what) {
  EXPECT(rc == SMC_ERR_MISMATCH, "%s: rc %d: %s", what, (int)rc, smc_last_error());
  EXPECT_FAILURE(SMC_ERR_MISMATCH, rank, field, what);
  EXPECT(text == NULL || strstr(smc_last_error(), text) != NULL, "%s: text %s", what, smc_last_error());
}

static int mismatches(int rank, void* arg) {
  smc_comm_t* comm = join(arg, rank, 3, 20);
  if (comm == NULL) return 10;
  double in[4] = {1, 2, 3, 4}, out[4];
  float in32[4] = {1, 2, 3, 4}, out32[4];
  const int odd = rank == 2; /* rank 2 (job rank 22) differs in each case */

  smc_result_t rc = odd ? smc_broadcast(comm, in, out, sizeof(in), 0, 0)
                        : smc_allreduce(comm, in, out, 4, SMC_FLOAT64, SMC_SUM, 1, 1, 1, 0);
  expect_mismatch(rc, 22, SMC_FIELD_COLL, "rank 20 called allreduce, rank 22 called broadcast", "collective");
  expect_reset(comm);

  rc = odd ? smc_allreduce(comm, in32, out32, 4, SMC_FLOAT32, SMC_SUM, 1, 1, 1, 0)
           : smc_allreduce(comm, in, out, 4, SMC_FLOAT64, SMC_SUM, 1, 1, 1, 0);
  expect_mismatch(rc, 22, SMC_FIELD_DTYPE, "rank 20 has dtype float64, rank 22 has float32", "dtype");
  rc = smc_allreduce(comm, in, out, odd ? 3 : 4, SMC_FLOAT64, SMC_SUM, 1, 1, 1, 0);
  expect_mismatch(rc, 22, SMC_FIELD_COUNT, "rank 20 has count 4, rank 22 has 3", "count");
  rc = smc_allreduce(comm, in, out, 4, SMC_FLOAT64, odd ? SMC_MAX : SMC_SUM, 1, 1, 1, 0);
  expect_mismatch(rc, 22, SMC_FIELD_OP, "rank 20 has op sum, rank 22 has max", "op");
  /* A small broadcast waits for its root alone: a receiver that disagrees with its root fails at once, naming itself;
   * the root and the receivers that agreed hear of it at their next collective, which fails on every rank unrun. */
  rc = smc_broadcast(comm, in, out, sizeof(in), odd ? 1 : 0, 0);
  if (odd)
    expect_mismatch(rc, 22, SMC_FIELD_ROOT, "broadcast: ranks disagree: rank 21 has root 0, rank 22 has 1", "root");
  else
    EXPECT(rc == SMC_SUCCESS, "root: the root and rank 21 hear of it later: %s", smc_last_error());
  expect_mismatch(smc_barrier(comm), 22, SMC_FIELD_ROOT,
                  "the broadcast before this barrier (which no rank ran): ranks disagree: rank 20 has root 0, rank 22 "
                  "has 1", "root, at the next collective");
  /* Every rank its own root: each returns at once, and the next collective fails on every rank. */
  EXPECT(smc_broadcast(comm, in, out, sizeof(in), rank, 0) == SMC_SUCCESS, "roots: %s", smc_last_error());
  expect_mismatch(smc_barrier(comm), 21, SMC_FIELD_ROOT, "rank 20 has root 0, rank 21 has 1; rank 20 has root 0",
                  "roots, at the next collective");
  /* Where every rank heard of the failure at the broadcast itself (its root called something else), the next
   * collective runs. */
  rc = rank == 0 ? smc_allreduce(comm, in, out, 4, SMC_FLOAT64, SMC_SUM, 1, 1, 1, 0)
                 : smc_broadcast(comm, in, out, 8, 0, 0);
  EXPECT(rc == SMC_ERR_MISMATCH, "rank 20 called allreduce: %s", smc_last_error());
  EXPECT(smc_barrier(comm) == SMC_SUCCESS, "all heard: %s", smc_last_error());
  rc = smc_allreduce(comm, in, out, 4, SMC_FLOAT64, SMC_SUM, odd ? 2 : 1, 1, 1, 0);
  expect_mismatch(rc, 22, SMC_FIELD_SCALE, "rank 22 by (pre 2", "scale");
  rc = smc_allreduce(comm, in, out, 4, SMC_FLOAT64, SMC_SUM, 1, 1, 1, odd ? 7 : 0);
  expect_mismatch(rc, 22, SMC_FIELD_TAG, "rank 20 and rank 22 passed different shapes", "tag");

  /* Two ranks differ: the data names the first one, with its own first difference. */
  rc = smc_allreduce(comm, rank == 2 ? (const void*)in32 : in, rank == 2 ? (void*)out32 : out, 4,
                     rank == 2 ? SMC_FLOAT32 : SMC_FLOAT64, rank == 1 ? SMC_MAX : SMC_SUM, 1, 1, 1, 0);
  expect_mismatch(rc, 21, SMC_FIELD_OP, "rank 20 has op sum, rank 21 has max; rank 20 has dtype float64", "two");

  /* Per-rank counts: rank 2 contributes less to an allgather than every rank expects of it. */
  uint64_t expect_bytes[3] = {8, 8, 8};
  double every[3];
  rc = smc_allgatherv(comm, in, odd ? 4 : 8, every, expect_bytes, 0);
  expect_mismatch(rc, 22, SMC_FIELD_COUNT, "rank 22 contributes 4 bytes", "allgather share");
  /* ... and to an alltoall: rank 2 (job rank 22) sends rank 0 (job rank 20) 16 bytes, where 8 are expected. */
  uint64_t sends[3] = {odd ? 16 : 8, 8, 8}, recvs[3] = {8, 8, 8};
  double to_all[4] = {0}, from_all[3];
  rc = smc_alltoallv(comm, to_all, sends, from_all, recvs, 0);
  expect_mismatch(rc, 22, SMC_FIELD_COUNT, "rank 22 sends 16 bytes to rank 20, which expects 8", "alltoall share");
  expect_reset(comm);

  EXPECT(smc_barrier(comm) == SMC_SUCCESS, "a mismatch leaves the communicator usable: %s", smc_last_error());
  smc_comm_destroy(comm);
  return failed ? 1 : 0;
}

/* ---- a peer that dies or leaves: named now, and again by every later refusal of the broken communicator ---- */

static int dead_peer(int rank, void* arg) {
  smc_comm_t* comm = join(arg, rank, 3, 20);
  if (comm == NULL) return 10;
  if (rank == 2) _exit(0); /* vanish without leaving */
  smc_result_t rc;
  while ((rc = smc_barrier(comm)) == SMC_SUCCESS) {
  }
  EXPECT(rc == SMC_ERR_RANK_FAILED, "rc %d: %s", (int)rc, smc_last_error());
  EXPECT_FAILURE(SMC_ERR_RANK_FAILED, 22, SMC_FIELD_NONE, "the dead rank");
  EXPECT(strstr(smc_last_error(), "rank 22 (pid") != NULL, "text: %s", smc_last_error());
  EXPECT(smc_barrier(comm) == SMC_ERR_BROKEN, "then broken: %s", smc_last_error());
  EXPECT_FAILURE(SMC_ERR_RANK_FAILED, 22, SMC_FIELD_NONE, "a broken communicator repeats the failure that broke it");
  EXPECT(strstr(smc_last_error(), "rank 22 (pid") != NULL, "text: %s", smc_last_error());
  EXPECT(smc_comm_failed_ranks(comm) == 1u << 2, "failed ranks are communicator indices: %llx",
         (unsigned long long)smc_comm_failed_ranks(comm));
  smc_comm_destroy(comm);
  return failed ? 1 : 0;
}

static int departed_peer(int rank, void* arg) {
  smc_comm_t* comm = join(arg, rank, 2, 20);
  if (comm == NULL) return 10;
  if (rank == 1) {
    smc_comm_destroy(comm);
    return 0;
  }
  smc_result_t rc;
  while ((rc = smc_barrier(comm)) == SMC_SUCCESS) {
  }
  EXPECT(rc == SMC_ERR_RANK_FAILED && strstr(smc_last_error(), "rank 21 (pid") && strstr(smc_last_error(), "shut down"),
         "rc %d: %s", (int)rc, smc_last_error());
  EXPECT_FAILURE(SMC_ERR_RANK_FAILED, 21, SMC_FIELD_NONE, "the departed rank");
  EXPECT(smc_comm_failed_ranks(comm) == 0, "a rank that left is not a failed one");
  smc_comm_destroy(comm);
  return failed ? 1 : 0;
}

/* ---- a late peer: the timeout names it, and so does the broken communicator afterwards ---- */

static int late_peer(int rank, void* arg) {
  smc_comm_t* comm = join(arg, rank, 2, 0.2);
  if (comm == NULL) return 10;
  if (rank == 1) {
    smc_sleep(1.0);
    smc_comm_destroy(comm);
    return 0;
  }
  EXPECT(smc_barrier(comm) == SMC_ERR_TIMEOUT, "timeout: %s", smc_last_error());
  EXPECT_FAILURE(SMC_ERR_TIMEOUT, 21, SMC_FIELD_NONE, "the late rank");
  EXPECT(strstr(smc_last_error(), "waiting for rank 21 (pid") != NULL, "text: %s", smc_last_error());
  EXPECT(smc_barrier(comm) == SMC_ERR_BROKEN, "then broken: %s", smc_last_error());
  EXPECT_FAILURE(SMC_ERR_TIMEOUT, 21, SMC_FIELD_NONE, "a broken communicator repeats the timeout");
  smc_comm_destroy(comm);
  return failed ? 1 : 0;
}

/* ---- init: ranks that never come, and bad job ranks ---- */

static void test_init(void) {
  char token[64];
  make_token(token, sizeof(token), "init");
  smc_config_t cfg = config(token, 0, 3);
  cfg.job_ranks = JOB_RANKS;
  cfg.start_timeout_s = 0.2;
  smc_comm_t* comm = NULL;
  EXPECT(smc_comm_create(&cfg, &comm) == SMC_ERR_TIMEOUT, "alone: %s", smc_last_error());
  EXPECT_FAILURE(SMC_ERR_TIMEOUT, 21, SMC_FIELD_NONE, "the first rank that never came");
  EXPECT(strstr(smc_last_error(), "missing ranks: 21, 22") != NULL, "text: %s", smc_last_error());

  cfg.rank = 1; /* nobody creates the segment rank 1 waits for */
  EXPECT(smc_comm_create(&cfg, &comm) == SMC_ERR_TIMEOUT, "no creator: %s", smc_last_error());
  EXPECT_FAILURE(SMC_ERR_TIMEOUT, 20, SMC_FIELD_NONE, "the rank that creates the segment");
  EXPECT(strstr(smc_last_error(), "did rank 20 start?") != NULL, "text: %s", smc_last_error());

  int negative[3] = {0, -1, 2};
  cfg.rank = 0;
  cfg.job_ranks = negative;
  EXPECT(smc_comm_create(&cfg, &comm) == SMC_ERR_INVALID, "a negative job rank is refused: %s", smc_last_error());
  EXPECT_FAILURE(SMC_ERR_INVALID, -1, SMC_FIELD_NONE, "a bad config names no peer");
}

/* Ranks 20 and 21 of 3 start; 22 never does. 21 gives up first (a shorter start timeout) and leaves: 20 still
 * names the rank that never came, not the one that left. */
static int one_never_comes(int rank, void* arg) {
  smc_config_t cfg = config(arg, rank, 3);
  cfg.job_ranks = JOB_RANKS;
  cfg.start_timeout_s = rank == 0 ? 2.0 : 0.3; /* rank 0 outwaits rank 1, even when rank 1 starts late */
  smc_comm_t* comm = NULL;
  EXPECT(smc_comm_create(&cfg, &comm) == SMC_ERR_TIMEOUT, "rank %d: %s", rank, smc_last_error());
  EXPECT_FAILURE(SMC_ERR_TIMEOUT, 22, SMC_FIELD_NONE, "the rank that never came");
  EXPECT(strstr(smc_last_error(), "missing ranks: 22") != NULL, "text: %s", smc_last_error());
  EXPECT(rank == 1 || strstr(smc_last_error(), "rank 21 gave up waiting") != NULL, "text: %s", smc_last_error());
  return failed ? 1 : 0;
}

static void* abandon_soon(void* word) {
  smc_sleep(0.2);
  __atomic_store_n((uint32_t*)word, 1, __ATOMIC_RELEASE);
  return NULL;
}

/* Rank `rank` of 3 starts alone, with a start timeout of 20 s; another thread sets the abandon word after 0.2 s.
 * Rank 1 waits for rank 0's segment to appear, rank 0 for the others to attach: both stop within a second with
 * SMC_ERR_ABANDONED, and leave nothing behind (the segment's name is free for the next try). */
static void abandoned_world(const char* token, int rank) {
  uint32_t word = 0;
  smc_config_t cfg = config(token, rank, 3);
  cfg.job_ranks = JOB_RANKS;
  cfg.abandon = &word;
  pthread_t setter;
  pthread_create(&setter, NULL, abandon_soon, &word);
  smc_comm_t* comm = NULL;
  double started = smc_now();
  smc_result_t rc = smc_comm_create(&cfg, &comm);
  double took = smc_now() - started;
  pthread_join(setter, NULL);
  EXPECT(rc == SMC_ERR_ABANDONED && comm == NULL, "rank %d: got %d: %s", rank, (int)rc, smc_last_error());
  EXPECT(took < 1.5, "rank %d gave up after %.2f s", rank, took);
  EXPECT(strstr(smc_last_error(), "a newer world replaced this one") != NULL, "text: %s", smc_last_error());
  EXPECT(rank != 0 || strstr(smc_last_error(), "missing ranks: 21, 22") != NULL, "text: %s", smc_last_error());
  cfg.abandon = NULL; /* the name is free again: a lone world of one forms under it */
  cfg.rank = 0;
  cfg.size = 1;
  EXPECT(smc_comm_create(&cfg, &comm) == SMC_SUCCESS, "after abandoning: %s", smc_last_error());
  smc_comm_destroy(comm);
}

int main(void) {
  char token[64];
  test_init();
  make_token(token, sizeof(token), "abandon0");
  abandoned_world(token, 0);
  make_token(token, sizeof(token), "abandon1");
  abandoned_world(token, 1);
  make_token(token, sizeof(token), "never");
  EXPECT(fork_ranks(2, one_never_comes, token) == 0, "a rank that left init early is not blamed for one missing");
  make_token(token, sizeof(token), "mismatch");
  EXPECT(fork_ranks(3, mismatches, token) == 0, "mismatches name the first differing rank and field");
  make_token(token, sizeof(token), "dead");
  EXPECT(fork_ranks(3, dead_peer, token) == 0, "a dead rank is named by its job rank");
  make_token(token, sizeof(token), "left");
  EXPECT(fork_ranks(2, departed_peer, token) == 0, "a departed rank is named by its job rank");
  make_token(token, sizeof(token), "late");
  EXPECT(fork_ranks(2, late_peer, token) == 0, "a late rank is named by its job rank");
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
