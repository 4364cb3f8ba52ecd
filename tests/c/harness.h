/* SPDX-License-Identifier: Apache-2.0 */
/* What the C unit tests share: counting checks, a job token, a test config, and ranks as forked processes. Each test
 * is one translation unit, so everything here is static. */
#ifndef SMC_TESTS_HARNESS_H_
#define SMC_TESTS_HARNESS_H_

#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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

/* A token no other test run uses; `suffix` tells apart the jobs of one run. */
static inline void make_token(char* out, size_t len, const char* suffix) {
  snprintf(out, len, "ctest%d%ld%s", (int)getpid(), (long)time(NULL), suffix);
}

static inline smc_config_t config(const char* token, int rank, int size) {
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

/* Runs body(rank, arg) in `size` forked processes; returns how many did not exit with 0. A child's EXPECTs print
 * there, so a body returns non-zero when any of them failed. */
static inline int fork_ranks(int size, int (*body)(int rank, void* arg), void* arg) {
  pid_t pids[16];
  for (int r = 0; r < size; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      alarm(60); /* a hang fails the test instead of stalling it */
      passed = failed = 0; /* the child's own checks only */
      _exit(body(r, arg));
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

#endif
