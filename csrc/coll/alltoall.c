/* SPDX-License-Identifier: Apache-2.0 */
/* Alltoall with explicit per-destination byte counts.
 *
 * Step 0 publishes every rank's send and receive counts, so every rank can check the whole matrix (rank i sends
 * rank j exactly what rank j expects) and reach the same verdict. Then each rank streams its whole send buffer
 * through its half, a window per step, and every rank picks out of each window the bytes addressed to it.
 *
 * By single copy (smc_alltoall_finish) each rank reads its part of every peer's input: with plain copies where the
 * input lies in a shared buffer that this rank maps (coll/window.c), else by the kernel's copy. */
#include <stdlib.h>

#include "coll/comm.h"
#include "core/copy.h"
#include "core/error.h"

typedef struct {
  uint64_t from;  /* where my part starts in rank j's send buffer */
  uint64_t len;   /* how long it is */
  uint64_t total; /* rank j's whole send buffer */
  uint64_t to;    /* where it lands in my receive buffer */
} route_t;

static smc_result_t plan_routes(smc_comm_t* c, route_t* routes, uint64_t* longest) {
  const int n = c->size, me = c->rank;
  *longest = 0;
  uint64_t to = 0;
  for (int j = 0; j < n; j++) {
    const uint64_t* sent_by_j = (const uint64_t*)smc_half(c, j);
    const uint64_t* expected_by_j = sent_by_j + n;
    for (int i = 0; i < n; i++) {
      uint64_t sent_to_j = ((const uint64_t*)smc_half(c, i))[j];
      if (sent_to_j != expected_by_j[i]) /* the sender is named as the rank that differs */
        return smc_set_peer_error(SMC_ERR_MISMATCH, smc_job_rank(c, i), SMC_FIELD_COUNT,
                                  "alltoall: ranks disagree: rank %d sends %llu bytes to rank %d, which expects %llu",
                                  smc_job_rank(c, i), (unsigned long long)sent_to_j, smc_job_rank(c, j),
                                  (unsigned long long)expected_by_j[i]);
    }
    route_t* r = &routes[j];
    r->from = 0;
    r->total = 0;
    for (int m = 0; m < n; m++) {
      if (m < me) r->from += sent_by_j[m];
      r->total += sent_by_j[m];
    }
    r->len = sent_by_j[me];
    r->to = to;
    to += r->len;
    *longest = r->total > *longest ? r->total : *longest;
  }
  return SMC_SUCCESS;
}

smc_result_t smc_alltoallv(smc_comm_t* c, const void* sendbuf, const uint64_t* send_bytes, void* recvbuf,
                           const uint64_t* recv_bytes, uint64_t tag) {
  SMC_CHECK(smc_comm_usable(c, "alltoall"));
  if (send_bytes == NULL || recv_bytes == NULL)
    return smc_refuse_here(c, SMC_COLL_ALLTOALLV, smc_set_error(SMC_ERR_INVALID, "alltoall: NULL counts"));
  const int n = c->size, me = c->rank;
  uint64_t my_total = 0, my_recv = 0;
  for (int j = 0; j < n; j++) {
    my_total = smc_add_bytes(my_total, send_bytes[j]);
    my_recv = smc_add_bytes(my_recv, recv_bytes[j]);
  }
  if (my_total > SMC_MAX_BYTES || my_recv > SMC_MAX_BYTES)
    return smc_refuse_here(c, SMC_COLL_ALLTOALLV, smc_set_error(SMC_ERR_INVALID, "alltoall: too many bytes"));
  if ((my_total > 0 && sendbuf == NULL) || (my_recv > 0 && recvbuf == NULL))
    return smc_refuse_here(c, SMC_COLL_ALLTOALLV,
                           smc_set_error(SMC_ERR_INVALID, "alltoall: NULL buffer"));
  if (n == 1) {
    if (send_bytes[0] != recv_bytes[0]) return smc_set_error(SMC_ERR_INVALID, "alltoall: send and receive counts differ");
    if (my_total > 0 && sendbuf != recvbuf) smc_copy(recvbuf, sendbuf, my_total);
    return SMC_SUCCESS;
  }
  route_t* routes = malloc(sizeof(route_t) * (size_t)n);
  if (routes == NULL)
    return smc_refuse_here(c, SMC_COLL_ALLTOALLV, smc_set_error(SMC_ERR_NOMEM, "alltoall: out of memory"));
  smc_result_t rc = SMC_SUCCESS;
  uint64_t longest = 0;
  uint64_t* counts = (uint64_t*)smc_half(c, me);
  memcpy(counts, send_bytes, sizeof(uint64_t) * (size_t)n);
  memcpy(counts + n, recv_bytes, sizeof(uint64_t) * (size_t)n);
  smc_desc_t desc = {.prescale = 1, .postscale = 1, .tag = tag, .divisor = 1, .coll = SMC_COLL_ALLTOALLV, .root = -1};
  SMC_CHECK_GOTO(smc_coll_begin(c, &desc, "alltoall"), rc, out);
  rc = plan_routes(c, routes, &longest);
  smc_flip(c);
  if (rc != SMC_SUCCESS) goto out;

  const size_t half = c->half_bytes;
  for (uint64_t at = 0; at < longest; at += half) {
    if (at < my_total) smc_copy(smc_half(c, me), (const uint8_t*)sendbuf + at, my_total - at < half ? my_total - at : half);
    SMC_CHECK_GOTO(smc_sync(c, "alltoall"), rc, out);
    for (int j = 0; j < n; j++) {
      const route_t* r = &routes[j];
      uint64_t lo = r->from > at ? r->from : at;
      uint64_t hi = r->from + r->len < at + half ? r->from + r->len : at + half;
      if (lo >= hi) continue;
      const uint8_t* from = j == me ? (const uint8_t*)sendbuf + lo : smc_half(c, j) + (lo - at);
      smc_copy((uint8_t*)recvbuf + r->to + (lo - r->from), from, hi - lo);
    }
    smc_flip(c);
  }
out:
  free(routes);
  return rc;
}

/* ---- Alltoall whose receive counts come with the data ----
 * Step 0 carries, in each rank's half, its row counts to every rank followed by the first window of its data, so
 * every rank learns the whole matrix of counts from the synchronisation that also brings the first data: a small
 * alltoall is one synchronisation. Nothing can disagree on counts (each receiver takes what is sent to it); the
 * descriptor still compares the tag (dtype and row shape). Later windows are whole halves. */

/* Where window k of a sender's data starts in its buffer, and how much of its half it fills. */
static uint64_t window_start(uint64_t k, uint64_t first, uint64_t half) { return k == 0 ? 0 : first + (k - 1) * half; }

smc_result_t smc_alltoall_begin(smc_comm_t* c, const void* sendbuf, const uint64_t* send_rows, uint64_t row_bytes,
                                uint64_t tag, uint64_t* matrix) {
  SMC_CHECK(smc_comm_usable(c, "alltoall"));
  if (send_rows == NULL || matrix == NULL)
    return smc_refuse_here(c, SMC_COLL_ALLTOALLV, smc_set_error(SMC_ERR_INVALID, "alltoall: NULL counts"));
  const int n = c->size;
  uint64_t my_total = 0;
  for (int j = 0; j < n; j++) {
    uint64_t bytes = send_rows[j] * row_bytes;
    my_total = smc_add_bytes(my_total, row_bytes != 0 && bytes / row_bytes != send_rows[j] ? SMC_MAX_BYTES + 1 : bytes);
  }
  if (my_total > SMC_MAX_BYTES)
    return smc_refuse_here(c, SMC_COLL_ALLTOALLV, smc_set_error(SMC_ERR_INVALID, "alltoall: too many bytes"));
  if (my_total > 0 && sendbuf == NULL)
    return smc_refuse_here(c, SMC_COLL_ALLTOALLV, smc_set_error(SMC_ERR_INVALID, "alltoall: NULL buffer"));
  if (n == 1) {
    matrix[0] = send_rows[0];
    return SMC_SUCCESS;
  }
  const uint64_t counts_bytes = sizeof(uint64_t) * (uint64_t)n;
  if (counts_bytes >= c->half_bytes) /* the same on every rank: all fail alike, no step taken */
    return smc_set_error(SMC_ERR_INVALID, "alltoall: %d ranks' counts need %llu bytes, more than a staging half (%zu)",
                         n, (unsigned long long)counts_bytes, c->half_bytes);
  uint8_t* mine = smc_half(c, c->rank);
  memcpy(mine, send_rows, (size_t)counts_bytes);
  uint64_t first = c->half_bytes - counts_bytes;
  /* An input that will move by single copy stays where it is: the largest input is at least this one. Single copy
   * moves a part per peer, one system call each: the parts' mean size is what it is decided on. */
  if (my_total > 0 && !smc_single_copy(c, c->single_copy_whole ? my_total : my_total / (uint64_t)n))
    memcpy(mine + counts_bytes, sendbuf, (size_t)(my_total < first ? my_total : first));
  smc_desc_t desc = {.prescale = 1, .postscale = 1, .tag = tag, .divisor = 1, .own = my_total,
                     .addr = (uint64_t)(uintptr_t)sendbuf, .coll = SMC_COLL_ALLTOALLV, .root = -1};
  if (my_total > 0) smc_window_name(c, &desc, sendbuf, my_total); /* a shared input: the peers read it mapped */
  SMC_CHECK(smc_coll_begin(c, &desc, "alltoall"));
  for (int j = 0; j < n; j++) memcpy(matrix + (size_t)j * n, smc_half(c, j), (size_t)counts_bytes);
  return SMC_SUCCESS;
}

smc_result_t smc_alltoall_finish(smc_comm_t* c, const void* sendbuf, void* recvbuf, uint64_t row_bytes,
                                 const uint64_t* matrix) {
  SMC_CHECK(smc_comm_usable(c, "alltoall"));
  if (matrix == NULL) return smc_set_error(SMC_ERR_INVALID, "alltoall: NULL counts");
  const int n = c->size, me = c->rank;
  uint8_t* out = recvbuf; /* NULL: take part in every step, keep nothing */
  if (n == 1) {
    uint64_t bytes = matrix[0] * row_bytes;
    if (out != NULL && bytes > 0 && sendbuf != recvbuf) smc_copy(out, sendbuf, (size_t)bytes);
    return SMC_SUCCESS;
  }
  route_t* routes = malloc(sizeof(route_t) * (size_t)n);
  if (routes == NULL) return smc_set_error(SMC_ERR_NOMEM, "alltoall: out of memory");
  uint64_t longest = 0, to = 0, my_total = 0;
  for (int j = 0; j < n; j++) { /* each sender's total passed its own check: no sum within a row wraps */
    const uint64_t* sent_by_j = matrix + (size_t)j * n;
    route_t* r = &routes[j];
    r->from = r->total = 0;
    for (int m = 0; m < n; m++) {
      if (m < me) r->from += sent_by_j[m] * row_bytes;
      r->total += sent_by_j[m] * row_bytes;
    }
    r->len = sent_by_j[me] * row_bytes;
    r->to = to;
    to = smc_add_bytes(to, r->len);
    longest = r->total > longest ? r->total : longest;
    if (j == me) my_total = r->total;
  }
  smc_result_t rc = SMC_SUCCESS;
  if (smc_single_copy(c, c->single_copy_whole ? longest : longest / (uint64_t)n)) { /* reads of parts (comm.h) */
    /* Into an output of 16 L2s or more, this rank's copies bypass the cache, as allgather's (coll/allgather.c).
     * Against MPICH's alltoall in the same job, 2 ranks, the own part: 8 and 16 MiB per rank 1.00x and 1.19x that
     * way against 0.86x and 0.98x through the cache; 2 MiB 0.96x through the cache against 0.84x; 1 and 4 MiB the
     * same either way. */
    const uint64_t to_total = routes[n - 1].to + routes[n - 1].len;
    void (*copy)(void*, const void*, size_t) = to_total >= 16 * c->cache_bytes ? smc_copy_bypassing : smc_copy;
    int mapped = 0;
    for (int k = 1; k < n && out != NULL; k++) {
      int j = (me + k) % n;
      const route_t* r = &routes[j];
      if (r->len == 0 || rc != SMC_SUCCESS) continue;
      /* A part in a shared buffer this rank maps is a plain copy; it is the peer's choice, so each part is decided
       * alone, and every rank still synchronises once at the end. */
      const uint8_t* theirs = smc_window_peer_data(c, j, r->total);
      if (theirs != NULL)
        copy(out + r->to, theirs + r->from, (size_t)r->len);
      else
        rc = smc_cma_read(c, j, out + r->to, smc_peer_desc(c, j)->addr + r->from, r->len, "alltoall");
      mapped |= theirs != NULL;
    }
    const route_t* own = &routes[me];
    if (out != NULL && own->len > 0) copy(out + own->to, (const uint8_t*)sendbuf + own->from, (size_t)own->len);
    smc_result_t synced = smc_sync(c, "alltoall");
    smc_flip(c);
    c->window_calls += (uint64_t)mapped;
    free(routes);
    return synced != SMC_SUCCESS ? synced : rc;
  }
  const uint64_t half = c->half_bytes, counts_bytes = sizeof(uint64_t) * (uint64_t)n, first = half - counts_bytes;
  for (uint64_t k = 0; k == 0 || window_start(k, first, half) < longest; k++) {
    uint64_t at = window_start(k, first, half), len = k == 0 ? first : half, skip = k == 0 ? counts_bytes : 0;
    if (k > 0) { /* window 0 went out with smc_alltoall_begin */
      if (at < my_total) smc_copy(smc_half(c, me), (const uint8_t*)sendbuf + at, (size_t)(my_total - at < len ? my_total - at : len));
      SMC_CHECK_GOTO(smc_sync(c, "alltoall"), rc, done);
    }
    for (int j = 0; out != NULL && j < n; j++) {
      const route_t* r = &routes[j];
      uint64_t lo = r->from > at ? r->from : at;
      uint64_t hi = r->from + r->len < at + len ? r->from + r->len : at + len;
      if (lo >= hi) continue;
      const uint8_t* from = j == me ? (const uint8_t*)sendbuf + lo : smc_half(c, j) + skip + (lo - at);
      smc_copy(out + r->to + (lo - r->from), from, (size_t)(hi - lo));
    }
    smc_flip(c);
  }
done:
  free(routes);
  return rc;
}
