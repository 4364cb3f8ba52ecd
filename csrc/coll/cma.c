/* SPDX-License-Identifier: Apache-2.0 */
/* Single copy between the ranks of a host: Linux cross-memory attach (see coll/comm.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "coll/comm.h"
#include "core/error.h"

enum { PUBLISHED = 1, CANNOT = 2, CAN = 3 };

typedef struct {
  smc_comm_t* comm;
  int rank;
} peer_t;

static smc_result_t peer_alive(void* arg) {
  peer_t* p = arg;
  return smc_peer_check(p->comm, p->rank, "init");
}

/* Waits until rank r's probe state reaches `state`; a dead rank is named at once, a slow one at the timeout. */
static smc_result_t wait_state(smc_comm_t* c, int r, uint32_t state, double timeout_s) {
  peer_t peer = {c, r};
  smc_wait_opts_t opts = {c->spin_us, timeout_s, c->liveness_s, peer_alive, &peer};
  smc_result_t rc = smc_wait_reach(&c->ctl[r].cma_state, &c->ctl[r].cma_sleepers, state, &opts);
  if (rc == SMC_ERR_TIMEOUT)
    return smc_set_peer_error(rc, smc_job_rank(c, r), SMC_FIELD_NONE,
                              "init: rank %d did not finish the single-copy probe within %.1f s", smc_job_rank(c, r),
                              timeout_s);
  return rc;
}

static int read_neighbour(smc_comm_t* c, int r) {
  uint64_t got = 0;
  struct iovec local = {&got, sizeof(got)};
  struct iovec remote = {(void*)(uintptr_t)c->ctl[r].cma_addr, sizeof(got)};
  ssize_t n = process_vm_readv((pid_t)c->ctl[r].pid, &local, 1, &remote, 1, 0);
  /* The value proves the read reached the neighbour's process, not another one with its pid number. */
  return n == (ssize_t)sizeof(got) && got == c->ctl[r].cma_value;
}

smc_result_t smc_cma_probe(smc_comm_t* c, double timeout_s) {
  c->cma = 0;
  if (c->size == 1 || c->single_copy_bytes == 0) return SMC_SUCCESS; /* every rank has the same setting */
  smc_rank_ctl_t* me = &c->ctl[c->rank];
  c->cma_probe = ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)c ^ 0x9e3779b97f4a7c15ULL;
  me->cma_addr = (uint64_t)(uintptr_t)&c->cma_probe;
  me->cma_value = c->cma_probe;
  smc_post(&me->cma_state, &me->cma_sleepers, PUBLISHED);
  int next = (c->rank + 1) % c->size;
  SMC_CHECK(wait_state(c, next, PUBLISHED, timeout_s));
  smc_post(&me->cma_state, &me->cma_sleepers, read_neighbour(c, next) ? CAN : CANNOT);
  int all = 1;
  for (int r = 0; r < c->size; r++) {
    SMC_CHECK(wait_state(c, r, CANNOT, timeout_s));
    all &= atomic_load(&c->ctl[r].cma_state) == CAN;
  }
  c->cma = all;
  return SMC_SUCCESS;
}

smc_result_t smc_cma_read(smc_comm_t* c, int r, void* local, uint64_t remote, uint64_t bytes, const char* what) {
  uint8_t* to = local;
  while (bytes > 0) { /* the kernel may move less than asked */
    struct iovec l = {to, (size_t)bytes};
    struct iovec rm = {(void*)(uintptr_t)remote, (size_t)bytes};
    ssize_t n = process_vm_readv((pid_t)c->ctl[r].pid, &l, 1, &rm, 1, 0);
    if (n <= 0)
      return smc_set_peer_error(n < 0 && errno == ESRCH ? SMC_ERR_RANK_FAILED : SMC_ERR_SYSTEM, smc_job_rank(c, r),
                                SMC_FIELD_NONE, "%s: reading rank %d's buffer failed: %s", what, smc_job_rank(c, r),
                                n < 0 ? strerror(errno) : "no progress");
    to += n;
    remote += (uint64_t)n;
    bytes -= (uint64_t)n;
  }
  return SMC_SUCCESS;
}
