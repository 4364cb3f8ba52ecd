/* SPDX-License-Identifier: Apache-2.0 */
/* Communicator life cycle: meet the other ranks of this host in a job segment, and leave it.
 *
 * Rank 0 creates the segment exclusively (mode 0600) under a name made from the job token, the others open it.
 * Once every rank has attached, rank 0 removes the name: the memory lives on in the mappings, and nothing can be
 * left behind in /dev/shm, whatever happens to the job afterwards. Only a crash during init can leave a name, and
 * the launcher removes every name carrying its job token. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "coll/comm.h"
#include "core/clock.h"
#include "core/error.h"
#include "shm/segment.h"

static size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }

static smc_result_t validate(const smc_config_t* cfg) {
  if (cfg == NULL) return smc_set_error(SMC_ERR_INVALID, "init: config is NULL");
  size_t len = cfg->token ? strlen(cfg->token) : 0;
  if (len < 8 || len > 64) return smc_set_error(SMC_ERR_INVALID, "init: job token must have 8 to 64 characters");
  for (size_t i = 0; i < len; i++) {
    char ch = cfg->token[i];
    if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_'))
      return smc_set_error(SMC_ERR_INVALID, "init: job token may hold only letters, digits and '_'");
  }
  if (cfg->size < 1 || cfg->size > SMC_MAX_RANKS)
    return smc_set_error(SMC_ERR_INVALID, "init: size %d is outside 1..%d", cfg->size, SMC_MAX_RANKS);
  if (cfg->rank < 0 || cfg->rank >= cfg->size)
    return smc_set_error(SMC_ERR_INVALID, "init: rank %d is outside 0..%d", cfg->rank, cfg->size - 1);
  if (cfg->slot_bytes < (size_t)2 * SMC_CACHE_LINE * (size_t)cfg->size || cfg->slot_bytes < 2 * SMC_PAGE)
    return smc_set_error(SMC_ERR_INVALID, "init: slot_bytes %zu is too small for %d ranks", cfg->slot_bytes,
                         cfg->size);
  if (cfg->slot_bytes > SMC_MAX_BYTES / (size_t)cfg->size || cfg->arena_bytes > SMC_MAX_BYTES ||
      cfg->small_bytes > SMC_MAX_BYTES)
    return smc_set_error(SMC_ERR_INVALID, "init: slot_bytes %zu, small_bytes %zu or arena_bytes %zu is too large",
                         cfg->slot_bytes, cfg->small_bytes, cfg->arena_bytes);
  if (!(cfg->timeout_s > 0) || !(cfg->start_timeout_s > 0) || !(cfg->liveness_s > 0) ||
      !smc_timeout_ok(cfg->timeout_s) || !smc_timeout_ok(cfg->start_timeout_s) || !smc_timeout_ok(cfg->liveness_s))
    return smc_set_error(SMC_ERR_INVALID, "init: timeouts must be positive and finite");
  for (int r = 0; cfg->job_ranks != NULL && r < cfg->size; r++)
    if (cfg->job_ranks[r] < 0) /* -1 means "no rank" in the failure data */
      return smc_set_error(SMC_ERR_INVALID, "init: job_ranks[%d] is %d; job ranks are not negative", r,
                           cfg->job_ranks[r]);
  return SMC_SUCCESS;
}

static smc_result_t init_shared_mutex(pthread_mutex_t* m, int recursive) {
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  if (recursive) pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
  int rc = pthread_mutex_init(m, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) return smc_set_error(SMC_ERR_SYSTEM, "pthread_mutex_init failed: %s", strerror(rc));
  return SMC_SUCCESS;
}

/* Creator only: fill in the header before anyone may look at it. */
static smc_result_t init_header(smc_comm_t* c, const smc_config_t* cfg, size_t ctl_off, size_t slots_off,
                                size_t arena_off) {
  smc_shm_header_t* h = c->hdr;
  h->magic = SMC_MAGIC;
  h->layout_version = SMC_LAYOUT_VERSION;
  h->size = cfg->size;
  h->total_bytes = c->total_bytes;
  h->slot_bytes = cfg->slot_bytes;
  h->ctl_offset = ctl_off;
  h->slots_offset = slots_off;
  h->arena_offset = arena_off;
  h->arena_bytes = c->total_bytes - arena_off;
  SMC_CHECK(init_shared_mutex(&h->registry_lock, 0));
  for (int r = 0; r < cfg->size; r++) SMC_CHECK(init_shared_mutex(&c->ctl[r].alive, 0));
  atomic_store(&h->ready, 1);
  smc_futex_wake_all(&h->ready);
  return SMC_SUCCESS;
}

/* The caller's abandon word (smc_config_t.abandon), set by another of its threads. */
static int abandoned(const uint32_t* abandon) {
  return abandon != NULL && __atomic_load_n(abandon, __ATOMIC_ACQUIRE) != 0;
}

static smc_result_t abandoned_error(smc_comm_t* c, const char* waiting_for) {
  return smc_set_error(SMC_ERR_ABANDONED, "init: gave up waiting for %s of segment %s: a newer world replaced this one",
                       waiting_for, c->name);
}

/* Rank 0 creates the segment: when it never appears, rank 0 is the one to name. */
static smc_result_t open_segment(smc_comm_t* c, double timeout_s, const uint32_t* abandon, void** base) {
  smc_result_t rc = smc_segment_open(c->name, c->total_bytes, timeout_s, abandon, base, &c->fd);
  if (rc == SMC_ERR_ABANDONED) return abandoned_error(c, "its creator");
  if (rc != SMC_ERR_TIMEOUT) return rc;
  return smc_set_peer_error(SMC_ERR_TIMEOUT, smc_job_rank(c, 0), SMC_FIELD_NONE,
                            "segment %s did not appear within %.1f s: did rank %d start?", c->name, timeout_s,
                            smc_job_rank(c, 0));
}

static smc_result_t wait_ready(smc_comm_t* c, double timeout_s, const uint32_t* abandon) {
  double deadline = smc_now() + timeout_s;
  while (atomic_load(&c->hdr->ready) == 0) {
    if (abandoned(abandon)) return abandoned_error(c, "its creator");
    if (smc_now() > deadline)
      return smc_set_peer_error(SMC_ERR_TIMEOUT, smc_job_rank(c, 0), SMC_FIELD_NONE,
                                "init: segment %s never became ready: rank %d, its creator, did not finish making it "
                                "within %.1f s",
                                c->name, smc_job_rank(c, 0), timeout_s);
    smc_futex_sleep(&c->hdr->ready, 0, 0.01);
  }
  if (c->hdr->magic != SMC_MAGIC || c->hdr->layout_version != SMC_LAYOUT_VERSION || c->hdr->size != c->size)
    return smc_set_error(SMC_ERR_INVALID, "init: segment %s was made by another shmcomm version or job size (%d ranks)",
                         c->name, (int)c->hdr->size);
  return SMC_SUCCESS;
}

typedef struct {
  smc_comm_t* comm;
  const uint32_t* abandon;
  int reported; /* the check's own timeout error, which wait_all_attached keeps */
} attach_check_t;

/* The ranks that have not attached, named: "init: <why>; missing ranks: 1, 3". */
static smc_result_t missing_error(smc_comm_t* c, smc_result_t code, const char* why) {
  char missing[256] = "";
  size_t used = 0;
  int first_missing = -1;
  for (int r = 0; r < c->size && used < sizeof(missing) - 16; r++) {
    if (c->ctl[r].pid != 0) continue;
    if (first_missing < 0) first_missing = smc_job_rank(c, r);
    used += (size_t)snprintf(missing + used, sizeof(missing) - used, "%s%d", used ? ", " : "", smc_job_rank(c, r));
  }
  return smc_set_peer_error(code, first_missing, SMC_FIELD_NONE, "init: %s; missing ranks: %s", why, missing);
}

/* While waiting for the others to attach, fail fast if one that already attached has died. One that has left
 * (departed) gave up waiting for the same missing ranks, a moment sooner: the missing ranks are the ones to name. */
static smc_result_t check_attached_peers(void* arg) {
  attach_check_t* check = arg;
  smc_comm_t* c = check->comm;
  if (abandoned(check->abandon)) {
    check->reported = 1;
    return missing_error(c, SMC_ERR_ABANDONED,
                         "gave up waiting for every rank to attach: a newer world replaced this one");
  }
  int left = -1;
  for (int r = 0; r < c->size; r++) {
    if (r == c->rank || c->ctl[r].pid == 0) continue;
    if (!atomic_load(&c->ctl[r].departed)) {
      smc_result_t rc = smc_peer_check(c, r, "init"); /* a death is named first */
      /* A rank that departs between the two looks gave up as surely as one found departed: name the missing. */
      if (rc == SMC_SUCCESS || !atomic_load(&c->ctl[r].departed)) {
        SMC_CHECK(rc);
        continue;
      }
    }
    if (left < 0) left = r;
  }
  if (left < 0) return SMC_SUCCESS;
  char why[96];
  snprintf(why, sizeof(why), "rank %d gave up waiting for every rank to attach", smc_job_rank(c, left));
  check->reported = 1;
  return missing_error(c, SMC_ERR_TIMEOUT, why);
}

static smc_result_t wait_all_attached(smc_comm_t* c, double timeout_s, const uint32_t* abandon) {
  attach_check_t arg = {c, abandon, 0};
  smc_wait_opts_t opts = {c->spin_us, timeout_s, c->liveness_s, check_attached_peers, &arg, 0};
  smc_result_t rc = smc_wait_reach(&c->hdr->attached, &c->hdr->attach_sleepers, (uint32_t)c->size, &opts);
  if (rc != SMC_ERR_TIMEOUT || arg.reported) return rc;
  char why[96];
  snprintf(why, sizeof(why), "only %u of %d ranks attached within %.1f s", atomic_load(&c->hdr->attached), c->size,
           timeout_s);
  return missing_error(c, SMC_ERR_TIMEOUT, why);
}

smc_result_t smc_comm_create(const smc_config_t* cfg, smc_comm_t** out) {
  smc_result_t res = SMC_SUCCESS;
  SMC_CHECK(validate(cfg));
  if (out == NULL) return smc_set_error(SMC_ERR_INVALID, "init: output pointer is NULL");
  smc_comm_t* c = calloc(1, sizeof(*c));
  if (c == NULL) return smc_set_error(SMC_ERR_NOMEM, "init: out of memory");
  c->fd = -1;
  c->rank = cfg->rank;
  c->size = cfg->size;
  c->slot_bytes = round_up(cfg->slot_bytes, 2 * SMC_PAGE);
  c->half_bytes = c->slot_bytes / 2;
  c->small_bytes = cfg->small_bytes < c->half_bytes ? cfg->small_bytes : c->half_bytes;
  c->timeout_s = cfg->timeout_s;
  c->liveness_s = cfg->liveness_s;
  c->spin_us = cfg->spin_us < 0 ? 0 : cfg->spin_us;
  c->yield_us = c->yield_now_us = cfg->yield_us < 0 ? 0 : cfg->yield_us;
  cpu_set_t cpus;
  c->cpu_each = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 && c->size <= CPU_COUNT(&cpus);
  c->move_in = c->move_every = 1;
  c->single_copy_bytes = cfg->single_copy_bytes;
  c->broadcast_single_copy_bytes = cfg->broadcast_single_copy_bytes;
  c->cache_bytes = cfg->cache_bytes > 0 ? cfg->cache_bytes : (1u << 20);
  c->shared_cache_bytes = cfg->shared_cache_bytes > 0 ? cfg->shared_cache_bytes : 8 * c->cache_bytes;
  c->single_copy_probed = cfg->single_copy_probed;
  c->piece_bytes = cfg->piece_bytes;
  c->piece_probed = cfg->piece_probed;
  c->pull_bytes = cfg->pull_bytes;
  c->pull_probed = cfg->pull_probed;
  c->race_pause_us = cfg->race_pause_us > 0 ? cfg->race_pause_us : 0;
  c->shared_from_bytes = cfg->shared_from_bytes;
  smc_huge_pages_init(c, cfg->huge_pages);
  for (int r = 0; r < c->size; r++) c->job_ranks[r] = cfg->job_ranks != NULL ? cfg->job_ranks[r] : r;
  snprintf(c->name, sizeof(c->name), "/shmcomm-%s-%d", cfg->token, cfg->generation);

  size_t ctl_off = round_up(sizeof(smc_shm_header_t), SMC_PAGE);
  size_t slots_off = ctl_off + round_up(sizeof(smc_rank_ctl_t) * (size_t)c->size, SMC_PAGE);
  size_t arena_off = slots_off + c->slot_bytes * (size_t)c->size;
  c->total_bytes = arena_off + round_up(cfg->arena_bytes, SMC_PAGE);

  void* base = NULL;
  if (c->rank == 0)  /* the header, the ranks' control blocks and slots are touched at once; boxes when created */
    SMC_CHECK_GOTO(smc_segment_create(c->name, c->total_bytes, arena_off, &base, &c->fd), res, fail);
  else
    SMC_CHECK_GOTO(open_segment(c, cfg->start_timeout_s, cfg->abandon, &base), res, fail);
  c->base = base;
  c->hdr = base;
  c->ctl = (smc_rank_ctl_t*)(c->base + ctl_off);
  c->slots = c->base + slots_off;
  if (c->rank == 0)
    SMC_CHECK_GOTO(init_header(c, cfg, ctl_off, slots_off, arena_off), res, fail_unmap);
  else
    SMC_CHECK_GOTO(wait_ready(c, cfg->start_timeout_s, cfg->abandon), res, fail_unmap);

  smc_rank_ctl_t* me = &c->ctl[c->rank];
  if (me->pid != 0) {
    res = smc_set_error(SMC_ERR_INVALID, "init: rank %d is taken by pid %d: two processes were given the same rank",
                        smc_job_rank(c, c->rank), (int)me->pid);
    goto fail_unmap;
  }
  int lrc = pthread_mutex_lock(&me->alive);
  if (lrc != 0) {
    res = smc_set_error(SMC_ERR_SYSTEM, "init: taking the liveness lock failed: %s", strerror(lrc));
    goto fail_unmap;
  }
  c->holds_alive = 1;
  me->pid = (int32_t)getpid();
  atomic_fetch_add(&c->hdr->refcount, 1);
  atomic_fetch_add(&c->hdr->attached, 1);
  smc_futex_wake_all(&c->hdr->attached);
  SMC_CHECK_GOTO(wait_all_attached(c, cfg->start_timeout_s, cfg->abandon), res, fail_leave);
  SMC_CHECK_GOTO(smc_cma_probe(c, cfg->start_timeout_s), res, fail_leave);
  if (c->rank == 0) {
    smc_segment_unlink(c->name);
    atomic_store(&c->hdr->unlinked, 1);
  }
  *out = c;
  return SMC_SUCCESS;

fail_leave:
  smc_comm_destroy(c);
  return res;
fail_unmap:
  if (c->rank == 0) smc_segment_unlink(c->name);
  smc_segment_unmap(c->base, c->total_bytes);
fail:
  smc_segment_close(c->fd);
  free(c);
  return res;
}

void smc_comm_destroy(smc_comm_t* c) {
  if (c == NULL) return;
  if (c->holds_alive) {
    atomic_store(&c->ctl[c->rank].departed, 1);
    pthread_mutex_unlock(&c->ctl[c->rank].alive);
  }
  if (atomic_fetch_sub(&c->hdr->refcount, 1) == 1 && !atomic_load(&c->hdr->unlinked)) smc_segment_unlink(c->name);
  smc_windows_close(c);
  smc_segment_unmap(c->base, c->total_bytes);
  smc_segment_close(c->fd);
  free(c->bounce);
  free(c);
}

void smc_comm_mark_failed(smc_comm_t* c) {
  if (c != NULL && c->holds_alive) atomic_store(&c->ctl[c->rank].failed, 1);
}

static void ring_one(smc_rank_ctl_t* r) {
  atomic_fetch_add(&r->bell, 1);
  if (atomic_load(&r->bell_sleepers) != 0) smc_futex_wake_all(&r->bell);
}

/* The doorbell and status calls below are safe on NULL (they do nothing, and read 0). */
void smc_comm_doorbell_ring(smc_comm_t* c, int rank) {
  if (c == NULL) return;
  if (rank >= 0 && rank < c->size) {
    ring_one(&c->ctl[rank]);
    return;
  }
  for (int r = 0; r < c->size; r++) ring_one(&c->ctl[r]);
}

uint32_t smc_comm_doorbell_value(smc_comm_t* c) { return c != NULL ? atomic_load(&c->ctl[c->rank].bell) : 0; }

uint32_t smc_comm_doorbell_wait(smc_comm_t* c, uint32_t seen, double timeout_s) {
  if (c == NULL) return seen;
  if (!smc_timeout_ok(timeout_s)) timeout_s = timeout_s > 0 ? 1e9 : 0; /* NaN and negatives: do not sleep */
  smc_rank_ctl_t* me = &c->ctl[c->rank];
  atomic_fetch_add(&me->bell_sleepers, 1);
  if (atomic_load(&me->bell) == seen) smc_futex_sleep(&me->bell, seen, timeout_s);
  atomic_fetch_sub(&me->bell_sleepers, 1);
  return atomic_load(&me->bell);
}

void smc_comm_set_spin(smc_comm_t* c, int spin_us, int yield_us) {
  if (c == NULL) return;
  c->spin_us = spin_us < 0 ? 0 : spin_us;
  yield_us = yield_us < 0 ? 0 : yield_us;
  if (yield_us != c->yield_us) c->yield_us = c->yield_now_us = yield_us; /* else keep what the waits learnt (step.c) */
}

int smc_comm_single_copy(smc_comm_t* c) { return c->cma; }

uint64_t smc_comm_single_copy_from(smc_comm_t* c, int broadcast) {
  return !c->cma ? 0 : broadcast ? c->broadcast_single_copy_bytes : c->single_copy_bytes;
}

int smc_comm_single_copy_learned(smc_comm_t* c) { return c->cma && c->single_copy_bytes > 0 && c->single_copy_learned; }

uint64_t smc_comm_shared_calls(smc_comm_t* c) { return c != NULL ? c->window_calls : 0; }

uint64_t smc_comm_pull_from(smc_comm_t* c) {
  return smc_pull(c, UINT64_MAX) || smc_pull_learned(c, UINT64_MAX) ? c->pull_bytes : 0;
}

uint64_t smc_comm_pulled_calls(smc_comm_t* c) { return c != NULL ? c->pulled_calls : 0; }

uint64_t smc_comm_pieces(smc_comm_t* c) { return c != NULL ? c->pieces : 0; }
void smc_comm_waits(smc_comm_t* c, uint64_t* yielded, uint64_t* polled, uint64_t* moved) {
  if (yielded != NULL) *yielded = c != NULL ? c->waits_beside_peer : 0;
  if (polled != NULL) *polled = c != NULL ? c->waits_apart : 0;
  if (moved != NULL) *moved = c != NULL ? c->moves : 0;
}

uint64_t smc_comm_single_copy_calls(smc_comm_t* c) { return c != NULL ? c->single_copy_calls : 0; }

uint64_t smc_comm_failed_ranks(smc_comm_t* c) {
  uint64_t mask = 0;
  if (c == NULL) return 0;
  for (int r = 0; r < c->size && r < 64; r++)
    if (r != c->rank && smc_peer_check(c, r, "status") == SMC_ERR_RANK_FAILED && !atomic_load(&c->ctl[r].departed))
      mask |= 1ULL << r;
  return mask;
}
