/* SPDX-License-Identifier: Apache-2.0 */
/* C unit tests of segments, waits, steps and liveness, with ranks as forked processes. Prints "N passed, N failed". */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/clock.h"
#include "harness.h"
#include "shm/segment.h"
#include "shm/wait.h"
#include "shmcomm.h"

static int shm_exists(const char* name) {
  char path[256];
  snprintf(path, sizeof(path), "/dev/shm%s", name);
  return access(path, F_OK) == 0;
}

static void test_segment(void) {
  char name[128];
  snprintf(name, sizeof(name), "/shmcomm-segtest%d", (int)getpid());
  void* base = NULL;
  int fd = -1, other_fd = -1, again_fd = -1;
  EXPECT(smc_segment_create(name, 8192, 4096, &base, &fd) == SMC_SUCCESS, "create: %s", smc_last_error());
  char path[256];
  snprintf(path, sizeof(path), "/dev/shm%s", name);
  struct stat st;
  EXPECT(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600, "mode is %o", (unsigned)(st.st_mode & 0777));
  EXPECT(st.st_blocks * 512 >= 4096 && st.st_blocks * 512 < 8192, "the first 4096 bytes are reserved, not the rest "
         "(%lld bytes allocated)", (long long)st.st_blocks * 512);
  EXPECT(smc_segment_reserve(fd, 4096, 4096, "test") == SMC_SUCCESS, "reserve: %s", smc_last_error());
  EXPECT(stat(path, &st) == 0 && st.st_blocks * 512 >= 8192, "reserved on request");
  void* again = NULL;
  EXPECT(smc_segment_create(name, 8192, 0, &again, &again_fd) == SMC_ERR_SYSTEM && strstr(smc_last_error(), "exists"),
         "second create: %s", smc_last_error());
  void* other = NULL;
  EXPECT(smc_segment_open(name, 8192, 1, NULL, &other, &other_fd) == SMC_SUCCESS, "open: %s", smc_last_error());
  ((char*)base)[100] = 42;
  EXPECT(((char*)other)[100] == 42, "both mappings see the same bytes");
  EXPECT(smc_segment_open(name, 4096, 1, NULL, &again, &again_fd) == SMC_ERR_INVALID, "a size mismatch is refused");
  chmod(path, 0644);
  EXPECT(smc_segment_open(name, 8192, 1, NULL, &again, &again_fd) == SMC_ERR_SYSTEM && strstr(smc_last_error(), "refusing"),
         "a segment readable by others is refused: %s", smc_last_error());
  smc_segment_unmap(other, 8192);
  smc_segment_unmap(base, 8192);
  smc_segment_close(other_fd);
  smc_segment_close(fd);
  smc_segment_unlink(name);
  EXPECT(!shm_exists(name), "unlinked");
  double t0 = smc_now();
  EXPECT(smc_segment_open(name, 8192, 0.1, NULL, &again, &again_fd) == SMC_ERR_TIMEOUT, "absent segment times out");
  EXPECT(smc_now() - t0 < 1.0, "and promptly");
}

static void test_wait_timeout(void) {
  _Atomic uint32_t word = 0, sleepers = 0;
  smc_wait_opts_t opts = {5, 0.05, 0.01, NULL, NULL, 0};
  double t0 = smc_now();
  EXPECT(smc_wait_reach(&word, &sleepers, 1, &opts) == SMC_ERR_TIMEOUT, "nobody posts: timeout");
  double took = smc_now() - t0;
  EXPECT(took >= 0.05 && took < 0.5, "timeout took %.3f s", took);
  EXPECT(atomic_load(&sleepers) == 0, "sleeper count restored");
  smc_post(&word, &sleepers, 0xFFFFFFFFu);
  EXPECT(smc_wait_reach(&word, &sleepers, 0xFFFFFFF0u, &opts) == SMC_SUCCESS, "wrap-around compare");
  EXPECT(smc_reached(2, 0xFFFFFFFFu), "2 is after 0xFFFFFFFF");
  smc_wait_opts_t yielding = {5, 0.05, 0.01, NULL, NULL, 20000}; /* yields 20 ms, then sleeps to the timeout */
  t0 = smc_now();
  EXPECT(smc_wait_reach(&word, &sleepers, 0, &yielding) == SMC_ERR_TIMEOUT, "a yielding wait still times out");
  took = smc_now() - t0;
  EXPECT(took >= 0.05 && took < 0.5, "the yielding wait's timeout took %.3f s", took);
  EXPECT(smc_wait_reach(&word, &sleepers, 0xFFFFFFF0u, &yielding) == SMC_SUCCESS, "a yielding wait sees a post");
}

typedef struct {
  const char* token;
  int size, rounds, die_rank;
  int pull; /* allreduces pull (smc_config_t.pull_bytes), in place every other round */
} job_t;

/* Child body: create, run `rounds` barriers and allreduces, check the sums, leave. Exit code 0 = fine. */
static int rank_main(int rank, void* arg) {
  const job_t* job = arg;
  const int size = job->size, rounds = job->rounds, die_rank = job->die_rank;
  smc_config_t cfg = config(job->token, rank, size);
  cfg.yield_us = size >= 8 ? 2000 : 0; /* more ranks than cores on most machines: the default yields */
  cfg.pull_bytes = job->pull ? 1 : 0;
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
    int64_t* result = job->pull && i % 2 ? data : out;
    if (smc_allreduce(comm, data, result, count, SMC_INT64, SMC_SUM, 1, 1, 1, 0) != SMC_SUCCESS) return 12;
    for (size_t k = 0; k < count; k++)
      if (result[k] != (int64_t)size * (int64_t)k + (int64_t)size * (size - 1) / 2) return 13;
  }
  smc_comm_destroy(comm);
  return die_rank >= 0 ? 14 : 0;
}

static int run_ranks(int size, int rounds, int die_rank, const char* token) {
  job_t job = {token, size, rounds, die_rank, 0};
  return fork_ranks(size, rank_main, &job);
}

int main(void) {
  test_segment();
  test_wait_timeout();
  char token[64], name[128];
  make_token(token, sizeof(token), "");
  EXPECT(run_ranks(4, 3000, -1, token) == 0, "4 ranks, 3000 barriers and allreduces");
  snprintf(name, sizeof(name), "/shmcomm-%s-0", token);
  EXPECT(!shm_exists(name), "no segment left after a clean job");
  make_token(token, sizeof(token), "b");
  double t0 = smc_now();
  EXPECT(run_ranks(8, 300, -1, token) == 0, "8 ranks on this machine's cores");
  printf("8 ranks x 300 rounds: %.2f s\n", smc_now() - t0);
  for (int size = 2; size <= 3; size++) {
    make_token(token, sizeof(token), size == 2 ? "p" : "q");
    job_t pulling = {token, size, 2000, -1, 1};
    EXPECT(fork_ranks(size, rank_main, &pulling) == 0, "%d ranks pulling", size);
  }
  make_token(token, sizeof(token), "c");
  EXPECT(run_ranks(3, 100000, 2, token) == 0, "a vanished rank is named by the others");
  snprintf(name, sizeof(name), "/shmcomm-%s-0", token);
  EXPECT(!shm_exists(name), "no segment left after a crash");
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
