/* SPDX-License-Identifier: Apache-2.0 */
/* Single copy between the ranks of a host: Linux cross-memory attach (see coll/comm.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "coll/comm.h"
#include "core/clock.h"
#include "core/copy.h"
#include "core/error.h"

/* Probe states, in order: CAN_FAST is CAN where this rank's kernel copy also proved fast (kernel_copy_is_fast). */
enum { PUBLISHED = 1, CANNOT = 2, CAN = 3, CAN_FAST = 4 };
enum { PAGE = SMC_PAGE_BYTES };

typedef struct {
  smc_comm_t* comm;
  int rank;
} peer_t;

static smc_result_t peer_alive(void* arg) {
  peer_t* p = arg;
  return smc_peer_check(p->comm, p->rank, "init");
}

/* Waits until rank r's probe state reaches `state`; a dead rank is named at once, a slow one at the timeout, with
 * every other rank that has not got as far: each rank waits for the one before it, so the one waited for may itself
 * wait for the rank that is stuck. */
static smc_result_t wait_state(smc_comm_t* c, int r, uint32_t state, double timeout_s) {
  peer_t peer = {c, r};
  smc_wait_opts_t opts = {c->spin_us, timeout_s, c->liveness_s, peer_alive, &peer, 0};
  smc_result_t rc = smc_wait_reach(&c->ctl[r].cma_state, &c->ctl[r].cma_sleepers, state, &opts);
  if (rc != SMC_ERR_TIMEOUT) return rc;
  char others[384] = "";
  size_t used = 0;
  for (int o = 0; o < c->size && used < sizeof(others) - 1; o++)
    if (o != c->rank && o != r && atomic_load(&c->ctl[o].cma_state) < state)
      used += (size_t)snprintf(others + used, sizeof(others) - used, ", nor did rank %d (pid %d)", smc_job_rank(c, o),
                               (int)c->ctl[o].pid);
  return smc_set_peer_error(rc, smc_job_rank(c, r), SMC_FIELD_NONE,
                            "init: rank %d did not finish the single-copy probe within %.1f s%s", smc_job_rank(c, r),
                            timeout_s, others);
}

static int read_neighbour(smc_comm_t* c, int r) {
  uint64_t got = 0;
  struct iovec local = {&got, sizeof(got)};
  struct iovec remote = {(void*)(uintptr_t)c->ctl[r].cma_addr, sizeof(got)};
  ssize_t n = process_vm_readv((pid_t)c->ctl[r].pid, &local, 1, &remote, 1, 0);
  /* The value proves the read reached the neighbour's process, not another one with its pid number. */
  return n == (ssize_t)sizeof(got) && got == c->ctl[r].cma_value;
}

/* Whether the kernel's copy behind process_vm_readv costs less than 3.5 memcpys of 128 KiB in cache (best of 8
 * each, reading this process itself: the kernel pins and maps each page as it does a peer's). Where it is fast,
 * single copy pays from small pieces; where it is not, only once the data outgrows the L2 (benchmarks/RESULTS.md). */
static int kernel_copy_is_fast(void) {
  enum { BYTES = 128 << 10, TRIES = 8 };
  /* Both on a page: where malloc puts them varies with the process's history, and a destination a few bytes past its
   * source slows both copies on some CPUs (core/copy.h), by different amounts, so the verdict would vary by start. */
  uint8_t *from = NULL, *to = NULL;
  if (posix_memalign((void**)&from, PAGE, BYTES) != 0) from = NULL;
  if (posix_memalign((void**)&to, PAGE, BYTES) != 0) to = NULL;
  double kernel = 1e9, user = 1e9;
  int fast = 0;
  if (from != NULL && to != NULL) {
    memset(from, 1, BYTES);
    memset(to, 2, BYTES);
    for (int k = 0; k < TRIES; k++) {
      struct iovec local = {to, BYTES}, remote = {from, BYTES};
      double t = smc_now();
      ssize_t n = process_vm_readv(getpid(), &local, 1, &remote, 1, 0);
      double d = smc_now() - t;
      if (n != BYTES) break;
      kernel = d < kernel ? d : kernel;
      t = smc_now();
      memcpy(to, from, BYTES);
      __asm__ volatile("" : : "r"(to) : "memory"); /* the copy is used */
      d = smc_now() - t;
      user = d < user ? d : user;
    }
    fast = kernel < 3.5 * user;
  }
  free(from);
  free(to);
  return fast;
}

smc_result_t smc_cma_probe(smc_comm_t* c, double timeout_s) {
  c->cma = c->cma_fast = 0;
  if (c->size == 1 || (c->single_copy_bytes == 0 && c->broadcast_single_copy_bytes == 0 && c->pull_bytes == 0))
    return SMC_SUCCESS; /* every rank has the same settings */
  smc_rank_ctl_t* me = &c->ctl[c->rank];
  c->cma_probe = ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)c ^ 0x9e3779b97f4a7c15ULL;
  me->cma_addr = (uint64_t)(uintptr_t)&c->cma_probe;
  me->cma_value = c->cma_probe;
  smc_post(&me->cma_state, &me->cma_sleepers, PUBLISHED);
  int next = (c->rank + 1) % c->size;
  SMC_CHECK(wait_state(c, next, PUBLISHED, timeout_s));
  int can = read_neighbour(c, next);
  /* One rank at a time times its copies: ranks timing at once share the cores and slow the kernel's copy more than
   * the user's, so a job's verdict would flip from one start to the next. */
  if (c->rank > 0) SMC_CHECK(wait_state(c, c->rank - 1, CANNOT, timeout_s));
  smc_post(&me->cma_state, &me->cma_sleepers, !can ? CANNOT : kernel_copy_is_fast() ? CAN_FAST : CAN);
  int all = 1, all_fast = 1;
  for (int r = 0; r < c->size; r++) {
    SMC_CHECK(wait_state(c, r, CANNOT, timeout_s));
    uint32_t state = atomic_load(&c->ctl[r].cma_state);
    all &= state >= CAN;
    all_fast &= state == CAN_FAST;
  }
  c->cma = all;
  c->cma_fast = all && all_fast;
  /* Where the kernel's copy proved slow, two copies through the staging halves beat it at some sizes on some
   * machines and days, and lose to it several times over on others (benchmarks/RESULTS.md): allgathers and alltoalls
   * learn which pays as they go (coll/path_choice.c), up to the sizes from which single copy is the steadier
   * (smc_single_copy_learned). Not broadcast's: its readers copy from a buffer the root did not just write. */
  c->single_copy_learned = c->single_copy_probed && !all_fast; /* the same on every rank: each read every state */
  return SMC_SUCCESS;
}

static smc_result_t move_failed(smc_comm_t* c, int r, ssize_t n, int write, const char* what) {
  return smc_set_peer_error(n < 0 && errno == ESRCH ? SMC_ERR_RANK_FAILED : SMC_ERR_SYSTEM, smc_job_rank(c, r),
                            SMC_FIELD_NONE, "%s: %s rank %d's buffer failed: %s", what, write ? "writing into" : "reading",
                            smc_job_rank(c, r), n < 0 ? strerror(errno) : "no progress");
}

/* Between `local` and rank r's `remote`, in the direction `write` says; the kernel may move less than asked. */
static smc_result_t move_direct(smc_comm_t* c, int r, uint8_t* local, uint64_t remote, uint64_t bytes, int write,
                                const char* what) {
  while (bytes > 0) {
    struct iovec l = {local, (size_t)bytes};
    struct iovec rm = {(void*)(uintptr_t)remote, (size_t)bytes};
    pid_t pid = (pid_t)c->ctl[r].pid;
    ssize_t n = write ? process_vm_writev(pid, &l, 1, &rm, 1, 0) : process_vm_readv(pid, &l, 1, &rm, 1, 0);
    if (n <= 0) return move_failed(c, r, n, write, what);
    local += n;
    remote += (uint64_t)n;
    bytes -= (uint64_t)n;
  }
  return SMC_SUCCESS;
}

/* The kernel's copy is `rep movsb`, with the slow placement core/copy.h describes. Such moves go through a
 * cache-sized bounce buffer at the remote buffer's offset in a cache line, and memcpy moves each chunk between it and
 * the local buffer while it is in cache. The chunk is a quarter of the L2 (smc_config_t.cache_bytes): the bounce and
 * the lines being written share that cache. */

static smc_result_t move_bounced(smc_comm_t* c, int r, uint8_t* local, uint64_t remote, uint64_t bytes, int write,
                                 const char* what) {
  if (c->bounce == NULL) {
    size_t want = (size_t)(c->cache_bytes / 4);
    want = want < (16u << 10) ? (16u << 10) : want > (1u << 20) ? (1u << 20) : want;
    if (posix_memalign((void**)&c->bounce, PAGE, want + PAGE) != 0) {
      c->bounce = NULL;
      return move_direct(c, r, local, remote, bytes, write, what); /* slower, still right */
    }
    c->bounce_bytes = want;
  }
  /* At the remote buffer's offset in a cache line (the kernel's copy then meets no short distance), and half a page
   * from the local buffer's offset in a page (nor does memcpy's). */
  uintptr_t in_page = (((uintptr_t)local + PAGE / 2) & (PAGE - 1) & ~(uintptr_t)(SMC_CACHE_LINE - 1)) |
                      (uintptr_t)(remote & (SMC_CACHE_LINE - 1));
  uint8_t* at = c->bounce + in_page;
  while (bytes > 0) {
    size_t len = bytes < c->bounce_bytes ? (size_t)bytes : c->bounce_bytes;
    if (write) memcpy(at, local, len);
    SMC_CHECK(move_direct(c, r, at, remote, len, write, what));
    if (!write) memcpy(local, at, len);
    local += len;
    remote += len;
    bytes -= len;
  }
  return SMC_SUCCESS;
}

static smc_result_t move(smc_comm_t* c, int r, uint8_t* local, uint64_t remote, uint64_t bytes, int write,
                         const char* what) {
  const void* far = (const void*)(uintptr_t)remote;
  /* Large reads go straight too: a bounce with streaming stores, to save the kernel's copy reading each destination
   * line first, cost more than that copy saved, with a rank per core and more (benchmarks/RESULTS.md). */
  if (bytes > 2048 && (write ? smc_short_distance(far, local) : smc_short_distance(local, far)))
    return move_bounced(c, r, local, remote, bytes, write, what);
  return move_direct(c, r, local, remote, bytes, write, what);
}

smc_result_t smc_cma_read(smc_comm_t* c, int r, void* local, uint64_t remote, uint64_t bytes, const char* what) {
  return move(c, r, local, remote, bytes, 0, what);
}

smc_result_t smc_cma_write(smc_comm_t* c, int r, uint64_t remote, const void* local, uint64_t bytes,
                           const char* what) {
  return move(c, r, (uint8_t*)(uintptr_t)local, remote, bytes, 1, what); /* only read from, when writing */
}
