/* SPDX-License-Identifier: Apache-2.0 */
/* Allgather with a contribution of its own size from every rank. Each step, every rank puts the next half-sized
 * window of its input into its half, and copies every other rank's window to its place in the output.
 *
 * The first step also tells every rank what the others contribute: each publishes its row count in its descriptor
 * (`own`, not compared), so a caller that does not know the other ranks' sizes learns them from the same
 * synchronisation that carries the first window, instead of a step of its own before the data (smc_allgather_begin,
 * then smc_allgather_finish once the caller has a place for the result). By single copy into outputs that lie in shared
 * buffers every rank maps, each rank copies its input straight into every output, with no kernel copy. */
#include <stdio.h>

#include "coll/comm.h"
#include "core/copy.h"
#include "core/error.h"

/* Inputs from which single copy is taken where it would be learned: it proved the steadier there. */
static uint64_t learned_below(const smc_comm_t* c) { return 2 * c->cache_bytes; }

/* Step 0 up to its synchronisation: window 0 in this rank's half, `desc` (whose `own` is the row count) compared.
 * An input that this rank offers to move by single copy stays where it is (its owner pushes it later); where not
 * every rank offers, smc_allgather_finish stages it after all. */
static smc_result_t begin_step(smc_comm_t* c, const void* sendbuf, uint64_t send_bytes, smc_desc_t* desc) {
  uint64_t first = send_bytes < c->half_bytes ? send_bytes : c->half_bytes;
  c->learning.bytes = 0;
  desc->kernel_copy = smc_single_copy_learned(c, send_bytes, send_bytes, learned_below(c))
                          ? smc_single_copy_offer(c, c->allgather_classes, send_bytes)
                          : smc_single_copy(c, send_bytes);
  if (first > 0 && !desc->kernel_copy) smc_copy(smc_half(c, c->rank), sendbuf, (size_t)first);
  return smc_coll_begin(c, desc, "allgather");
}

/* Whether every rank published (in its half: output, window, offset) an output in this rank's shared buffer w; if so,
 * outs[j] is rank j's output as this process maps it. The same answer on every rank: all published the same window
 * or some rank's differs from every rank's own. */
static int outputs_shared(smc_comm_t* c, const smc_window_t* w, uint64_t window, uint64_t total, uint8_t** outs) {
  if (w == NULL) return 0;
  for (int j = 0; j < c->size; j++) {
    const uint64_t* theirs = (const uint64_t*)smc_half(c, j);
    if (theirs[1] != window || theirs[2] > smc_window_bytes(w) - total) return 0;
    outs[j] = smc_window_peer(w, j) + theirs[2];
  }
  return 1;
}

/* Single copy by pushing: each rank publishes its output's address in its half (0: it keeps nothing), then copies its
 * own input a cache-sized chunk at a time into its own output and, from the cache, into every peer's output
 * (process_vm_writev); a last synchronisation tells every rank its output is whole. Each input is read from memory
 * once, where reading the peers' inputs instead would read every input twice, once by its owner's own copy and once
 * by the reader's. A failed write still synchronises, so the peers go on, and is reported by this rank alone. */
static smc_result_t single_copy(smc_comm_t* c, const void* sendbuf, uint8_t* out, const uint64_t* displ,
                                const uint64_t* every_rows, uint64_t row_bytes) {
  const int me = c->rank;
  smc_result_t rc = SMC_SUCCESS;
  const uint64_t mine = every_rows[me] * row_bytes;
  const uint64_t total = displ[c->size - 1] + every_rows[c->size - 1] * row_bytes;
  const uint8_t* src = sendbuf;
  smc_desc_t named = {0}; /* the shared buffer holding the output, if any */
  smc_window_t* w = out != NULL ? smc_window_name(c, &named, out, total) : NULL;
  smc_huge_pages_offer(c, out, total); /* the peers write into it by the kernel's copy (unless it is shared) */
  uint64_t* published = (uint64_t*)smc_half(c, me);
  published[0] = (uint64_t)(uintptr_t)out;
  published[1] = named.window;
  published[2] = named.window_at;
  SMC_CHECK(smc_sync(c, "allgather"));
  /* An output of 16 L2s or more is written by the own copy with
   * streaming stores, which save the read of each destination line, in chunks of a quarter L2 that stay in cache
   * for the writes to the peers. A smaller output stays in the caches: cached stores, and chunks of a whole L2 (fewer
   * calls into the kernel). */
  const int large = total >= 16 * c->cache_bytes;
  uint64_t chunk = large ? c->cache_bytes / 4 : c->cache_bytes;
  chunk = chunk < (16u << 10) ? (16u << 10) : chunk > (2u << 20) ? (2u << 20) : chunk;
  /* Outputs that all lie in shared buffers are written with plain copies into the peers' mappings instead. */
  uint8_t* outs[SMC_MAX_RANKS];
  const int shared = outputs_shared(c, w, named.window, total, outs);
  for (uint64_t at = 0; at < mine; at += chunk) {
    uint64_t len = mine - at < chunk ? mine - at : chunk;
    if (out != NULL && out + displ[me] != src)
      (large ? smc_copy_bypassing : smc_copy)(out + displ[me] + at, src + at, (size_t)len);
    for (int k = 1; k < c->size && rc == SMC_SUCCESS; k++) {
      int j = (me + k) % c->size;
      uint64_t theirs = *(const uint64_t*)smc_half(c, j);
      if (shared)
        (large ? smc_copy_bypassing : smc_copy)(outs[j] + displ[me] + at, src + at, (size_t)len);
      else if (theirs != 0)
        rc = smc_cma_write(c, j, theirs + displ[me] + at, src + at, len, "allgather");
    }
  }
  smc_result_t synced = smc_sync(c, "allgather");
  smc_flip(c);
  c->window_calls += (uint64_t)shared;
  return synced != SMC_SUCCESS ? synced : rc;
}

/* A call that fails its own checks still takes the first step, as a refusal, so that the peers fail at once. */
static smc_result_t refuse(smc_comm_t* c, const char* why) {
  return smc_refuse_here(c, SMC_COLL_ALLGATHERV, smc_set_error(SMC_ERR_INVALID, "allgather: %s", why));
}

static smc_result_t check_args(smc_comm_t* c, const void* sendbuf, uint64_t send_bytes, const void* rows) {
  SMC_CHECK(smc_coll_enter(c, "allgather"));
  if (rows == NULL) return refuse(c, "the row counts are NULL");
  if (send_bytes > SMC_MAX_BYTES) return refuse(c, "too many bytes");
  if (send_bytes > 0 && sendbuf == NULL) return refuse(c, "NULL buffer");
  return SMC_SUCCESS;
}

smc_result_t smc_allgather_begin(smc_comm_t* c, const void* sendbuf, uint64_t send_rows, uint64_t row_bytes,
                                 uint64_t tag, uint64_t* every_rows) {
  uint64_t send_bytes = send_rows * row_bytes;
  if (row_bytes != 0 && send_bytes / row_bytes != send_rows) send_bytes = SMC_MAX_BYTES + 1; /* wrapped */
  SMC_CHECK(check_args(c, sendbuf, send_bytes, every_rows));
  if (c->size == 1) {
    every_rows[0] = send_rows;
    return SMC_SUCCESS;
  }
  smc_desc_t desc = {.prescale = 1, .postscale = 1, .tag = tag, .divisor = 1, .own = send_rows,
                     .coll = SMC_COLL_ALLGATHERV, .root = -1};
  SMC_CHECK(begin_step(c, sendbuf, send_bytes, &desc));
  for (int j = 0; j < c->size; j++) every_rows[j] = smc_peer_desc(c, j)->own;
  return SMC_SUCCESS;
}

smc_result_t smc_allgather_finish(smc_comm_t* c, const void* sendbuf, void* recvbuf, uint64_t row_bytes,
                                  const uint64_t* every_rows) {
  SMC_CHECK(smc_coll_enter(c, "allgather"));
  if (every_rows == NULL) return smc_set_error(SMC_ERR_INVALID, "allgather: the row counts are NULL");
  const int me = c->rank;
  uint64_t displ[SMC_MAX_RANKS], total = 0, longest = 0;
  for (int j = 0; j < c->size; j++) {
    uint64_t bytes = every_rows[j] * row_bytes; /* each passed its rank's check_args: no product wraps */
    displ[j] = total;
    total = smc_add_bytes(total, bytes);
    longest = bytes > longest ? bytes : longest;
  }
  if (total > SMC_MAX_BYTES) { /* every rank sees the same counts and stops here alike */
    smc_flip(c);
    return smc_set_error(SMC_ERR_INVALID, "allgather: the ranks' contributions add up to more than %llu bytes",
                         (unsigned long long)SMC_MAX_BYTES);
  }
  const uint64_t send_bytes = every_rows[me] * row_bytes;
  uint8_t* out = recvbuf; /* NULL: take part in every step, keep nothing (the caller had no place for the result) */
  if (c->size == 1) {
    if (out != NULL && send_bytes > 0 && sendbuf != recvbuf) smc_copy(out, sendbuf, (size_t)send_bytes);
    return SMC_SUCCESS;
  }
  /* Learned: rank 0's offer decides (coll/path_choice.c). Else the largest input, which a rank offers only if its
   * own would. */
  const int learned = c->single_copy_learned && longest < learned_below(c);
  if (learned ? smc_peer_desc(c, 0)->kernel_copy : smc_single_copy(c, longest)) {
    c->single_copy_calls++;
    smc_result_t rc = single_copy(c, sendbuf, out, displ, every_rows, row_bytes);
    if (rc == SMC_SUCCESS) smc_single_copy_taught(c, c->allgather_classes, 1);
    return rc;
  }
  if (smc_kernel_copy_offered(c)) { /* window 0 of the ranks that offered single copy is not staged: a second phase */
    uint64_t first = send_bytes < c->half_bytes ? send_bytes : c->half_bytes;
    if (first > 0 && smc_peer_desc(c, me)->kernel_copy) smc_copy(smc_half(c, me), sendbuf, (size_t)first);
    SMC_CHECK(smc_sync(c, "allgather"));
  }
  const uint64_t half = c->half_bytes;
  uint64_t steps = longest == 0 ? 1 : (longest + half - 1) / half;
  for (uint64_t k = 0; k < steps; k++) {
    uint64_t at = k * half;
    if (k > 0) { /* window 0 went out with smc_allgather_begin */
      if (at < send_bytes)
        smc_copy(smc_half(c, me), (const uint8_t*)sendbuf + at, (size_t)(send_bytes - at < half ? send_bytes - at : half));
      SMC_CHECK(smc_sync(c, "allgather"));
    }
    for (int j = 0; out != NULL && j < c->size; j++) {
      uint64_t bytes = every_rows[j] * row_bytes;
      if (at >= bytes) continue;
      size_t len = (size_t)(bytes - at < half ? bytes - at : half);
      const uint8_t* from = j == me ? (const uint8_t*)sendbuf + at : smc_half(c, j);
      if (from != out + displ[j] + at) smc_copy(out + displ[j] + at, from, len);
    }
    smc_flip(c);
  }
  smc_single_copy_taught(c, c->allgather_classes, 0);
  return SMC_SUCCESS;
}

/* recv_bytes is the same on every rank (its digest is in the descriptor), so every rank reaches the same verdict. */
static smc_result_t check_contributions(smc_comm_t* c, const uint64_t* recv_bytes) {
  for (int j = 0; j < c->size; j++) {
    uint64_t sent = smc_peer_desc(c, j)->own;
    if (sent != recv_bytes[j])
      return smc_set_peer_error(SMC_ERR_MISMATCH, smc_job_rank(c, j), SMC_FIELD_COUNT,
                                "allgather: ranks disagree: rank %d contributes %llu bytes, the ranks expected %llu",
                                smc_job_rank(c, j), (unsigned long long)sent, (unsigned long long)recv_bytes[j]);
  }
  return SMC_SUCCESS;
}

smc_result_t smc_allgatherv(smc_comm_t* c, const void* sendbuf, size_t send_bytes, void* recvbuf,
                            const uint64_t* recv_bytes, uint64_t tag) {
  SMC_CHECK(check_args(c, sendbuf, send_bytes, recv_bytes));
  uint64_t total = 0;
  for (int j = 0; j < c->size; j++) total = smc_add_bytes(total, recv_bytes[j]);
  if (total > SMC_MAX_BYTES) return refuse(c, "too many bytes");
  if (total > 0 && recvbuf == NULL) return refuse(c, "NULL buffer");
  if (c->size == 1 && send_bytes != recv_bytes[0])
    return smc_set_error(SMC_ERR_INVALID, "allgather: sends %zu bytes but expects %llu", send_bytes,
                         (unsigned long long)recv_bytes[0]);
  if (c->size > 1) {
    smc_desc_t desc = {.prescale = 1, .postscale = 1, .tag = smc_digest(recv_bytes, c->size, tag), .divisor = 1,
                       .own = send_bytes, .coll = SMC_COLL_ALLGATHERV, .root = -1};
    SMC_CHECK(begin_step(c, sendbuf, send_bytes, &desc));
    smc_result_t rc = check_contributions(c, recv_bytes);
    if (rc != SMC_SUCCESS) {
      smc_flip(c);
      return rc;
    }
  }
  return smc_allgather_finish(c, sendbuf, recvbuf, 1, recv_bytes);
}
