/* SPDX-License-Identifier: Apache-2.0 */
/* Steps, synchronisation and the descriptor check shared by every collective (see coll/comm.h). */
#include <stdio.h>

#include "coll/comm.h"
#include "core/error.h"

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
  return rc;
}

smc_result_t smc_comm_usable(smc_comm_t* c, const char* what) {
  if (c == NULL) return smc_set_error(SMC_ERR_INVALID, "%s: communicator is NULL", what);
  if (c->broken != SMC_SUCCESS)
    return smc_set_error(SMC_ERR_BROKEN, "%s: the communicator is unusable after an earlier failure: %s", what,
                         c->broken_msg);
  return SMC_SUCCESS;
}

smc_result_t smc_sync(smc_comm_t* c, const char* what) {
  uint32_t target = ++c->seq;
  smc_post(&c->ctl[c->rank].seq, &c->ctl[c->rank].sleepers, target);
  for (int r = 0; r < c->size; r++) {
    if (r == c->rank) continue;
    peer_ref_t ref = {c, r, what};
    smc_wait_opts_t opts = {c->spin_us, c->timeout_s, c->liveness_s, check_peer, &ref};
    smc_result_t rc = smc_wait_reach(&c->ctl[r].seq, &c->ctl[r].sleepers, target, &opts);
    if (rc == SMC_ERR_TIMEOUT)
      rc = smc_set_error(SMC_ERR_TIMEOUT,
                         "%s: timed out after %.0f s waiting for rank %d (pid %d, alive): it is stuck, or it called "
                         "a different collective (SHMCOMM_TIMEOUT sets the limit)",
                         what, c->timeout_s, r, (int)c->ctl[r].pid);
    if (rc != SMC_SUCCESS) return mark_broken(c, rc);
  }
  return SMC_SUCCESS;
}

static const char* coll_name(uint32_t kind) {
  static const char* names[] = {"?", "barrier", "allreduce", "reducescatter", "broadcast", "allgather", "alltoall"};
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

/* Names the first field in which rank r differs from rank 0, in the order a user would look for it. */
static int describe_difference(char* out, size_t len, int r, const smc_desc_t* a, const smc_desc_t* b) {
  if (a->coll != b->coll)
    return snprintf(out, len, "rank 0 called %s, rank %d called %s", coll_name(a->coll), r, coll_name(b->coll));
  if (a->dtype != b->dtype)
    return snprintf(out, len, "rank 0 has dtype %s, rank %d has %s", dtype_name(a->dtype), r, dtype_name(b->dtype));
  if (a->count != b->count)
    return snprintf(out, len, "rank 0 has count %llu, rank %d has %llu", (unsigned long long)a->count, r,
                    (unsigned long long)b->count);
  if (a->op != b->op)
    return snprintf(out, len, "rank 0 has op %s, rank %d has %s", op_name(a->op), r, op_name(b->op));
  if (a->root != b->root) return snprintf(out, len, "rank 0 has root %d, rank %d has %d", a->root, r, b->root);
  if (a->prescale != b->prescale || a->postscale != b->postscale || a->divisor != b->divisor)
    return snprintf(out, len, "rank 0 scales by (pre %g, post %g, /%lld), rank %d by (pre %g, post %g, /%lld)",
                    a->prescale, a->postscale, (long long)a->divisor, r, b->prescale, b->postscale,
                    (long long)b->divisor);
  if (a->tag != b->tag)
    return snprintf(out, len, "rank 0 and rank %d passed different shapes or per-rank counts", r);
  return 0;
}

smc_result_t smc_coll_begin(smc_comm_t* c, smc_desc_t* desc, const char* what) {
  c->ctl[c->rank].desc[c->parity] = *desc;
  SMC_CHECK(smc_sync(c, what));
  const smc_desc_t* first = smc_peer_desc(c, 0);
  char msg[768] = "";
  size_t used = 0;
  for (int r = 1; r < c->size && used < sizeof(msg) - 1; r++) {
    char part[256];
    if (describe_difference(part, sizeof(part), r, first, smc_peer_desc(c, r)) > 0)
      used += (size_t)snprintf(msg + used, sizeof(msg) - used, "%s%s", used ? "; " : "", part);
  }
  if (used == 0) return SMC_SUCCESS;
  smc_flip(c);
  return smc_set_error(SMC_ERR_MISMATCH, "%s: ranks disagree: %s", what, msg);
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
  SMC_CHECK(smc_comm_usable(c, "barrier"));
  smc_desc_t desc = {.prescale = 1, .postscale = 1, .divisor = 1, .coll = SMC_COLL_BARRIER, .root = -1};
  SMC_CHECK(smc_coll_begin(c, &desc, "barrier"));
  smc_flip(c);
  return SMC_SUCCESS;
}
