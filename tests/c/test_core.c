/* SPDX-License-Identifier: Apache-2.0 */
/* C unit tests of segments, waits, steps and liveness, with ranks as forked processes. Prints "N passed, N failed". */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/clock.h"
#include "shm/segment.h"
#include "shm/wait.h"
#include "shmcomm.h"

static int passed, failed;

#define EXPECT(cond, ...)                                 \
  do {                                                    \
    if (cond) {                                           \
      passed++;                                           \
    } else {                                              \
      failed++;                                           \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                       \
      fprintf(stderr, "\n");                              \
    }                                                     \
  } while (0)

static void make_token(char* out, size_t len) {
  snprintf(out, len, "ctest%d%ld", (int)getpid(), (long)time(NULL));
}

static smc_config_t config(const char* token, int rank, int size) {
  smc_config_t c = {0};
  c.token = token;
  c.rank = rank;
  c.size = size;
  c.start_timeout_s = 20;
  c.timeout_s = 20;
  c.liveness_s = 0.05;
  c.slot_bytes = 1 << 16;
  c.small_bytes = 4096;
  c.arena_bytes = 1 << 16;
  c.spin_us = 5;
  return c;
}

static int shm_exists(const char* name) {
  char path[256];
  snprintf(path, sizeof(path), "/dev/shm%s", name);
  return access(path, F_OK) == 0;
}

static void test_segment(void) {
  char name[128];
  snprintf(name, sizeof(name), "/shmcomm-segtest%d", (int)getpid());
  void* base = NULL;
  EXPECT(smc_segment_create(name, 8192, &base) == SMC_SUCCESS, "create: %s", smc_last_error());
  char path[256];
  snprintf(path, sizeof(path), "/dev/shm%s", name);
  struct stat st;
  EXPECT(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600, "mode is %o", (unsigned)(st.st_mode & 0777));
  void* again = NULL;
  EXPECT(smc_segment_create(name, 8192, &again) == SMC_ERR_SYSTEM && strstr(smc_last_error(), "exists"),
         "second create: %s", smc_last_error());
  void* other = NULL;
  EXPECT(smc_segment_open(name, 8192, 1, &other) == SMC_SUCCESS, "open: %s", smc_last_error());
  ((char*)base)[100] = 42;
  EXPECT(((char*)other)[100] == 42, "both mappings see the same bytes");
  EXPECT(smc_segment_open(name, 4096, 1, &again) == SMC_ERR_INVALID, "a size mismatch is refused");
  chmod(path, 0644);
  EXPECT(smc_segment_open(name, 8192, 1, &again) == SMC_ERR_SYSTEM && strstr(smc_last_error(), "refusing"),
         "a segment readable by others is refused: %s", smc_last_error());
  smc_segment_unmap(other, 8192);
  smc_segment_unmap(base, 8192);
  smc_segment_unlink(name);
  EXPECT(!shm_exists(name), "unlinked");
  double t0 = smc_now();
  EXPECT(smc_segment_open(name, 8192, 0.1, &again) == SMC_ERR_TIMEOUT, "absent segment times out");
  EXPECT(smc_now() - t0 < 1.0, "and promptly");
}

static void test_wait_timeout(void) {
  _Atomic uint32_t word = 0, sleepers = 0;
  smc_wait_opts_t opts = {5, 0.05, 0.01, NULL, NULL};
  double t0 = smc_now();
  EXPECT(smc_wait_reach(&word, &sleepers, 1, &opts) == SMC_ERR_TIMEOUT, "nobody posts: timeout");
  double took = smc_now() - t0;
  EXPECT(took >= 0.05 && took < 0.5, "timeout took %.3f s", took);
  EXPECT(atomic_load(&sleepers) == 0, "sleeper count restored");
  smc_post(&word, &sleepers, 0xFFFFFFFFu);
  EXPECT(smc_wait_reach(&word, &sleepers, 0xFFFFFFF0u, &opts) == SMC_SUCCESS, "wrap-around compare");
  EXPECT(smc_reached(2, 0xFFFFFFFFu), "2 is after 0xFFFFFFFF");
}

/* Child body: create, run `rounds` barriers and allreduces, check the sums, leave. Exit code 0 = fine. */
static int rank_main(const char* token, int rank, int size, int rounds, int die_rank) {
  smc_config_t cfg = config(token, rank, size);
  smc_comm_t* comm = NULL;
  if (smc_comm_create(&cfg, &comm) != SMC_SUCCESS) {
    fprintf(stderr, "rank %d: create: %s\n", rank, smc_last_error());
    return 10;
  }
  if (rank == die_rank) _exit(0); /* vanish without leaving: the others must notice */
  int64_t data[1000], out[1000];
  for (int i = 0; i < rounds; i++) {
    smc_result_t rc = smc_barrier(comm);
    if (rc != SMC_SUCCESS) {
      if (die_rank >= 0 && rc == SMC_ERR_RANK_FAILED && strstr(smc_last_error(), "rank 2 (pid")) return 0;
      fprintf(stderr, "rank %d: barrier %d: %s\n", rank, i, smc_last_error());
      return 11;
    }
    size_t count = (size_t)(i % 7 == 0 ? 1000 : i % 97 + 1);
    for (size_t k = 0; k < count; k++) data[k] = rank + (int64_t)k;
    if (smc_allreduce(comm, data, out, count, SMC_INT64, SMC_SUM, 1, 1, 1, 0) != SMC_SUCCESS) return 12;
    for (size_t k = 0; k < count; k++)
      if (out[k] != (int64_t)size * (int64_t)k + (int64_t)size * (size - 1) / 2) return 13;
  }
  smc_comm_destroy(comm);
  return die_rank >= 0 ? 14 : 0;
}

static int run_ranks(int size, int rounds, int die_rank, const char* token) {
  pid_t pids[16];
  for (int r = 0; r < size; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      alarm(60); /* a hang fails the test instead of stalling it */
      _exit(rank_main(token, r, size, rounds, die_rank));
    }
  }
  int bad = 0;
  for (int r = 0; r < size; r++) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      fprintf(stderr, "rank %d ended with status %d\n", r, status);
      bad++;
    }
  }
  return bad;
}

int main(void) {
  test_segment();
  test_wait_timeout();
  char token[64], name[128];
  make_token(token, sizeof(token));
  EXPECT(run_ranks(4, 3000, -1, token) == 0, "4 ranks, 3000 barriers and allreduces");
  snprintf(name, sizeof(name), "/shmcomm-%s-0", token);
  EXPECT(!shm_exists(name), "no segment left after a clean job");
  make_token(token, sizeof(token));
  strcat(token, "b");
  double t0 = smc_now();
  EXPECT(run_ranks(8, 300, -1, token) == 0, "8 ranks on this machine's cores");
  printf("8 ranks x 300 rounds: %.2f s\n", smc_now() - t0);
  make_token(token, sizeof(token));
  strcat(token, "c");
  EXPECT(run_ranks(3, 100000, 2, token) == 0, "a vanished rank is named by the others");
  snprintf(name, sizeof(name), "/shmcomm-%s-0", token);
  EXPECT(!shm_exists(name), "no segment left after a crash");
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
