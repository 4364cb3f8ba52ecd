/* SPDX-License-Identifier: Apache-2.0 */
/* Steps, synchronisation and the descriptor check shared by every collective (see coll/comm.h). */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <string.h>

#include "coll/comm.h"
#include "core/clock.h"
#include "core/error.h"

#define MOST_WAITS_BETWEEN_MOVES 1024 /* a rank whose moves do not hold tries once in this many waits beside a peer */
#define MOVE_HELD 64                  /* waits apart after a move that show it held */

typedef struct {
  smc_comm_t* comm;
  int rank;
  const char* what;
} peer_ref_t;

static smc_result_t check_peer(void* arg) {
  peer_ref_t* p = arg;
  return smc_peer_check(p->comm, p->rank, p->what);
}

static smc_result_t mark_broken(smc_comm_t* c, smc_result_t rc) {
  c->broken = rc;
  snprintf(c->broken_msg, sizeof(c->broken_msg), "%s", smc_last_error());
  smc_last_failure(&c->broken_failure);
  return rc;
}

smc_result_t smc_comm_usable(smc_comm_t* c, const char* what) {
  if (c == NULL) return smc_set_error(SMC_ERR_INVALID, "%s: communicator is NULL", what);
  if (c->broken != SMC_SUCCESS)
    return smc_set_failure(SMC_ERR_BROKEN, &c->broken_failure,
                           "%s: the communicator is unusable after an earlier failure: %s", what, c->broken_msg);
  return SMC_SUCCESS;
}

/* Whether a peer among ranks 0 to below - 1 last posted from CPU `here`; a CPU not known (this rank's or the
 * peer's) counts as `unknown` says. */
static int posted_from(const smc_comm_t* c, int here, int below, int unknown) {
  for (int r = 0; r < below; r++) {
    const int32_t theirs = atomic_load_explicit(&c->ctl[r].cpu, memory_order_relaxed);
    if (r != c->rank && (here < 0 || theirs == 0 ? unknown : theirs - 1 == here)) return 1;
  }
  return 0;
}

/* Where each rank could have a CPU of its own, ranks packed on one CPU stay there: their waits hand the CPU only to
 * each other, so the scheduler sees one busy CPU and no reason to spread them. The higher of them moves itself to
 * another CPU by leaving its own out of its affinity for a moment; the affinity is then restored, so it stays free
 * to go wherever the scheduler sends it later. Also beside busy processes: two ranks on two CPUs then still beat two
 * taking turns on one (benchmarks/RESULTS.md). A move that does not hold is tried half as often each time, down to
 * once in MOST_WAITS_BETWEEN_MOVES waits. */
static int move_apart(smc_comm_t* c, int here) {
  if (c->waits_apart - c->apart_at_move >= MOVE_HELD) c->move_every = c->move_in = 1; /* the last move held */
  if (--c->move_in > 0) return 0;
  c->move_every = c->move_every < MOST_WAITS_BETWEEN_MOVES ? 2 * c->move_every : c->move_every;
  c->move_in = c->move_every;
  c->apart_at_move = c->waits_apart;
  cpu_set_t allowed, others;
  if (here < 0 || sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return 0;
  others = allowed;
  CPU_CLR(here, &others);
  if (CPU_COUNT(&others) == 0 || sched_setaffinity(0, sizeof(others), &others) != 0) return 0;
  c->moves++;
  sched_setaffinity(0, sizeof(allowed), &allowed);
  return 1;
}

/* Waits for rank r to have posted `target`; a timeout names every rank that has not. */
static smc_result_t wait_peer(smc_comm_t* c, int r, uint32_t target, const char* what) {
  peer_ref_t ref = {c, r, what};
  /* A waiter yields its core only where a peer last ran on it: there the yield lets that peer (likely the one
   * waited for) run at once. Where every peer runs on another CPU, a yield could only hand the core to an unrelated
   * busy process for a whole scheduler slice, so the waiter polls for the same budget instead, then sleeps. */
  const int here = sched_getcpu();
  int shared = c->yield_us > 0 && posted_from(c, here, c->size, 1);
  /* Of two ranks packed on one CPU, the higher moves, so that both do not move onto the same other CPU. */
  if (shared && c->cpu_each && posted_from(c, here, c->rank, 0) && move_apart(c, here))
    shared = posted_from(c, sched_getcpu(), c->size, 1);
  if (c->yield_us > 0) ++*(shared ? &c->waits_beside_peer : &c->waits_apart);
  /* Polled for at most a liveness interval, as the yield is (shm/wait.c), so that a dead peer is still seen soon. */
  const double most_us = 1e6 * c->liveness_s;
  const int poll_us = c->yield_now_us < most_us ? c->yield_now_us : (int)most_us;
  smc_wait_opts_t opts = {c->yield_us > 0 ? (shared ? 0 : poll_us) : c->spin_us, c->timeout_s, c->liveness_s,
                          check_peer, &ref, shared ? c->yield_now_us : 0};
  double waiting_since = c->yield_us > 0 ? smc_now() : 0;
  smc_result_t rc = smc_wait_reach(&c->ctl[r].seq, &c->ctl[r].sleepers, target, &opts);
  if (c->yield_us > 0) {
    /* A wait that outlasted the whole yield (or poll) slept in the end: the peer was computing, and yielding or
     * polling meanwhile took part of the core from whoever shares it. Each such wait halves the next budget; a wait
     * short enough for the whole budget to catch it restores it. */
    double waited_us = 1e6 * (smc_now() - waiting_since);
    c->yield_now_us = waited_us > c->yield_us ? c->yield_now_us / 2 : c->yield_us;
  }
  if (rc == SMC_ERR_TIMEOUT) {
    /* Every peer that has not arrived is named: the one waited for may itself wait for another that is stuck. */
    char others[384] = "";
    size_t used = 0;
    for (int o = r + 1; o < c->size && used < sizeof(others) - 1; o++)
      if (o != c->rank && (int32_t)(atomic_load(&c->ctl[o].seq) - target) < 0)
        used += (size_t)snprintf(others + used, sizeof(others) - used, " and rank %d (pid %d)", smc_job_rank(c, o),
                                 (int)c->ctl[o].pid);
    smc_comm_blame(c, r);
    rc = smc_set_peer_error(SMC_ERR_TIMEOUT, smc_job_rank(c, r), SMC_FIELD_NONE,
                            "%s: timed out after %.0f s waiting for rank %d (pid %d, alive)%s: it is stuck, or it "
                            "called a different collective (SHMCOMM_TIMEOUT sets the limit)",
                            what, c->timeout_s, smc_job_rank(c, r), (int)c->ctl[r].pid, others);
  }
  if (rc != SMC_SUCCESS) return mark_broken(c, rc);
  return SMC_SUCCESS;
}

/* Posts this rank's next step, saying from which CPU. */
static void post_step(smc_comm_t* c, uint32_t target) {
  atomic_store_explicit(&c->ctl[c->rank].cpu, sched_getcpu() + 1, memory_order_relaxed);
  smc_post(&c->ctl[c->rank].seq, &c->ctl[c->rank].sleepers, target);
}

smc_result_t smc_sync(smc_comm_t* c, const char* what) {
  uint32_t target = ++c->seq;
  post_step(c, target);
  for (int r = 0; r < c->size; r++)
    if (r != c->rank) SMC_CHECK(wait_peer(c, r, target, what));
  return SMC_SUCCESS;
}

static const char* coll_name(uint32_t kind) {
  static const char* names[] = {"?", "barrier", "allreduce", "reducescatter", "broadcast", "allgather", "alltoall",
                                "shared buffer"};
  return kind < sizeof(names) / sizeof(names[0]) ? names[kind] : "?";
}

static const char* dtype_name(uint32_t dtype) {
  static const char* names[] = {"float16", "bfloat16", "float32", "float64", "int8",
                                "uint8",   "int16",    "int32",   "int64"};
  return dtype < SMC_NUM_DTYPES ? names[dtype] : "?";
}

static const char* op_name(uint32_t op) {
  static const char* names[] = {"sum", "min", "max", "product"};
  return op < SMC_NUM_OPS ? names[op] : "?";
}

/* Names the first field in which descriptor b (of job rank `other`) differs from a (of job rank `first`, the
 * communicator's rank 0), in the order a user would look for it. Returns that field, SMC_FIELD_NONE if they agree. */
static smc_field_t describe_difference(char* out, size_t len, int first, int other, const smc_desc_t* a,
                                       const smc_desc_t* b) {
  if (a->coll != b->coll) {
    snprintf(out, len, "rank %d called %s, rank %d called %s", first, coll_name(a->coll), other, coll_name(b->coll));
    return SMC_FIELD_COLL;
  }
  if (a->dtype != b->dtype) {
    snprintf(out, len, "rank %d has dtype %s, rank %d has %s", first, dtype_name(a->dtype), other,
             dtype_name(b->dtype));
    return SMC_FIELD_DTYPE;
  }
  if (a->count != b->count) {
    snprintf(out, len, "rank %d has count %llu, rank %d has %llu", first, (unsigned long long)a->count, other,
             (unsigned long long)b->count);
    return SMC_FIELD_COUNT;
  }
  if (a->op != b->op) {
    snprintf(out, len, "rank %d has op %s, rank %d has %s", first, op_name(a->op), other, op_name(b->op));
    return SMC_FIELD_OP;
  }
  if (a->root != b->root) {
    snprintf(out, len, "rank %d has root %d, rank %d has %d", first, a->root, other, b->root);
    return SMC_FIELD_ROOT;
  }
  if (a->prescale != b->prescale || a->postscale != b->postscale || a->divisor != b->divisor) {
    snprintf(out, len, "rank %d scales by (pre %g, post %g, /%lld), rank %d by (pre %g, post %g, /%lld)", first,
             a->prescale, a->postscale, (long long)a->divisor, other, b->prescale, b->postscale,
             (long long)b->divisor);
    return SMC_FIELD_SCALE;
  }
  if (a->tag != b->tag) {
    snprintf(out, len, "rank %d and rank %d passed different shapes or per-rank counts", first, other);
    return SMC_FIELD_TAG;
  }
  return SMC_FIELD_NONE;
}

/* The reasons of the ranks whose call failed its own checks (smc_coll_refuse), read from their halves: every rank
 * returns SMC_ERR_REFUSED naming the first of them, except the refusing ranks, whose own error stands. `only`: that
 * rank's alone (a rank that waited for it alone), or -1. */
static smc_result_t refusals(smc_comm_t* c, const char* what, int only) {
  char msg[1024] = "";
  size_t used = 0;
  int first = -1, count = 0;
  for (int r = 0; r < c->size; r++) {
    if (!smc_peer_desc(c, r)->refused || (only >= 0 && r != only)) continue;
    count++;
    if (first < 0) first = r;
    if (used < sizeof(msg) - 1) {
      size_t room = c->half_bytes < SMC_REASON_MAX ? c->half_bytes : SMC_REASON_MAX;
      used += (size_t)snprintf(msg + used, sizeof(msg) - used, "%srank %d: %.*s", used ? "; " : "",
                               smc_job_rank(c, r), (int)strnlen((const char*)smc_half(c, r), room - 1),
                               (const char*)smc_half(c, r));
    }
  }
  if (first < 0) return SMC_SUCCESS;
  return smc_set_peer_error(SMC_ERR_REFUSED, smc_job_rank(c, first), SMC_FIELD_NONE,
                            "%s: rank %d's call failed its own checks%s, so no rank ran it; %s", what,
                            smc_job_rank(c, first), count > 1 ? " (and other ranks' too)" : "", msg);
}

/* What the descriptors of the current step say: SMC_SUCCESS, the first refusal, or how ranks differ from rank 0. */
static smc_result_t verdict(smc_comm_t* c, const char* what) {
  smc_result_t refused = refusals(c, what, -1);
  if (refused != SMC_SUCCESS) return refused;
  const smc_desc_t* first = smc_peer_desc(c, 0);
  char msg[768] = "";
  size_t used = 0;
  int culprit = -1; /* the first rank that differs from rank 0, and how */
  smc_field_t field = SMC_FIELD_NONE;
  for (int r = 1; r < c->size && used < sizeof(msg) - 1; r++) {
    char part[256];
    smc_field_t differs =
        describe_difference(part, sizeof(part), smc_job_rank(c, 0), smc_job_rank(c, r), first, smc_peer_desc(c, r));
    if (differs == SMC_FIELD_NONE) continue;
    if (culprit < 0) {
      culprit = smc_job_rank(c, r);
      field = differs;
    }
    used += (size_t)snprintf(msg + used, sizeof(msg) - used, "%s%s", used ? "; " : "", part);
  }
  if (culprit < 0) return SMC_SUCCESS;
  return smc_set_peer_error(SMC_ERR_MISMATCH, culprit, field, "%s: ranks disagree: %s", what, msg);
}

smc_result_t smc_coll_begin(smc_comm_t* c, smc_desc_t* desc, const char* what) {
  c->ctl[c->rank].desc[c->parity] = *desc;
  SMC_CHECK(smc_sync(c, what));
  smc_result_t rc = verdict(c, what);
  if (rc == SMC_SUCCESS) return SMC_SUCCESS;
  /* Ranks that took this step early may not have heard of its failure: the next collective checks it again. */
  for (int r = 0; r < c->size; r++)
    if (smc_peer_desc(c, r)->early) c->unsettled = 1;
  smc_flip(c);
  return rc == SMC_ERR_REFUSED && desc->refused ? SMC_SUCCESS : rc;
}

smc_result_t smc_coll_begin_early(smc_comm_t* c, smc_desc_t* desc, int root, const char* what) {
  const int me = c->rank;
  desc->early = 1;
  c->ctl[me].desc[c->parity] = *desc;
  const uint32_t target = ++c->seq;
  post_step(c, target);
  c->unsettled = 1;
  if (me == root) return SMC_SUCCESS;
  SMC_CHECK(wait_peer(c, root, target, what));
  const smc_desc_t* theirs = smc_peer_desc(c, root);
  char part[256];
  smc_field_t differs = SMC_FIELD_NONE;
  smc_result_t rc = SMC_SUCCESS;
  if (theirs->refused) {
    rc = refusals(c, what, root);
  } else if ((differs = describe_difference(part, sizeof(part), smc_job_rank(c, root), smc_job_rank(c, me), theirs,
                                            desc)) != SMC_FIELD_NONE) {
    rc = smc_set_peer_error(SMC_ERR_MISMATCH, smc_job_rank(c, me), differs, "%s: ranks disagree: %s", what, part);
  }
  if (rc != SMC_SUCCESS) {
    smc_failure_mark_earlier();
    smc_flip(c);
  }
  return rc;
}

/* Whether every rank already failed the early step whose descriptors are current: each rank that took it with a
 * full synchronisation saw every descriptor; a root that returned early saw none; a receiver saw its root's. */
static int every_rank_heard(smc_comm_t* c) {
  char unused[256];
  for (int r = 0; r < c->size; r++) {
    const smc_desc_t* d = smc_peer_desc(c, r);
    if (!d->early) continue;
    if (d->root == r || d->root < 0 || d->root >= c->size) return 0;
    const smc_desc_t* root = smc_peer_desc(c, d->root);
    if (!root->refused && describe_difference(unused, sizeof(unused), 0, 0, root, d) == SMC_FIELD_NONE) return 0;
  }
  return 1;
}

smc_result_t smc_coll_enter(smc_comm_t* c, const char* what) {
  SMC_CHECK(smc_comm_usable(c, what));
  if (!c->unsettled) return SMC_SUCCESS;
  const uint32_t target = c->seq; /* no step since that one */
  c->unsettled = 0;
  for (int r = 0; r < c->size; r++)
    if (r != c->rank) SMC_CHECK(wait_peer(c, r, target, what));
  /* Every rank has taken that step, and none can take another before this rank does: its descriptors stand. */
  char earlier[160];
  smc_flip(c);
  int early = 0;
  while (early < c->size - 1 && !smc_peer_desc(c, early)->early) early++;
  snprintf(earlier, sizeof(earlier), "the %s before this %s (which no rank ran)",
           coll_name(smc_peer_desc(c, early)->coll), what);
  smc_result_t rc = verdict(c, earlier);
  int heard = rc == SMC_SUCCESS || every_rank_heard(c);
  smc_flip(c);
  if (heard) return SMC_SUCCESS;
  smc_failure_mark_earlier();
  return rc;
}

const smc_desc_t* smc_peer_desc(smc_comm_t* c, int r) { return &c->ctl[r].desc[c->parity]; }

/* FNV-1a over 64-bit words: a cheap fingerprint of per-rank count arrays for the descriptor check. */
uint64_t smc_digest(const uint64_t* values, int n, uint64_t seed) {
  uint64_t h = 1469598103934665603ULL ^ seed;
  for (int i = 0; i < n; i++) {
    h ^= values[i];
    h *= 1099511628211ULL;
  }
  return h;
}

smc_result_t smc_barrier(smc_comm_t* c) {
  SMC_CHECK(smc_coll_enter(c, "barrier"));
  smc_desc_t desc = {.prescale = 1, .postscale = 1, .divisor = 1, .coll = SMC_COLL_BARRIER, .root = -1};
  SMC_CHECK(smc_coll_begin(c, &desc, "barrier"));
  smc_flip(c);
  return SMC_SUCCESS;
}

smc_result_t smc_coll_refuse(smc_comm_t* c, smc_coll_kind_t kind, const char* reason) {
  SMC_CHECK(smc_coll_enter(c, "refused collective"));
  if (c->size == 1) return SMC_SUCCESS;
  size_t room = c->half_bytes < SMC_REASON_MAX ? c->half_bytes : SMC_REASON_MAX;
  snprintf((char*)smc_half(c, c->rank), room, "%s", reason != NULL ? reason : "(no reason given)");
  smc_desc_t desc = {.prescale = 1, .postscale = 1, .divisor = 1, .coll = (uint32_t)kind, .root = -1, .refused = 1};
  return smc_coll_begin(c, &desc, coll_name((uint32_t)kind));
}

smc_result_t smc_refuse_here(smc_comm_t* c, smc_coll_kind_t kind, smc_result_t rc) {
  if ((rc != SMC_ERR_INVALID && rc != SMC_ERR_NOMEM) || c == NULL || c->broken != SMC_SUCCESS || c->size == 1)
    return rc;
  char text[SMC_REASON_MAX];
  smc_failure_t failure;
  snprintf(text, sizeof(text), "%s", smc_last_error());
  smc_last_failure(&failure);
  smc_coll_refuse(c, kind, text); /* if that fails too, the communicator says so from now on; the error is ours */
  return smc_set_failure(rc, &failure, "%s", text);
}
