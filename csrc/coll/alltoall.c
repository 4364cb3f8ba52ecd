/* SPDX-License-Identifier: Apache-2.0 */
/* Alltoall with explicit per-destination byte counts.
 *
 * Step 0 publishes every rank's send and receive counts, so every rank can check the whole matrix (rank i sends
 * rank j exactly what rank j expects) and reach the same verdict. Then the data moves through the staging halves
 * (staged, below) or by single copy.
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

/* Routes into this rank from the counts in every half, and the largest part any rank sends a peer (`widest`). */
static smc_result_t plan_routes(smc_comm_t* c, route_t* routes, uint64_t* widest) {
  const int n = c->size, me = c->rank;
  *widest = 0;
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
      if (m != j && sent_by_j[m] > *widest) *widest = sent_by_j[m];
    }
    r->len = sent_by_j[me];
    r->to = to;
    to += r->len;
  }
  return SMC_SUCCESS;
}

/* ---- The staged path ----
 * Each window, every sender puts into its half, for each other rank d, the next `cap` bytes of its part for d, at
 * d's place among the sender's peers (place * cap); after the window's synchronisation every rank copies its chunk
 * out of each peer's half. The own part is copied once, straight. Only bytes bound for a peer pass through a half,
 * one copy in and one out; the windows' number is set by the largest part in the matrix, the same on every rank.
 * (Streaming the whole send buffer through the half instead copied the own part in for nothing and took more
 * windows.) Window 0 may start `skip` bytes in,
 * after the counts that smc_alltoall_begin sends with it. */
typedef struct {
  uint64_t from; /* where this rank's part for rank d starts in its send buffer */
  uint64_t len;
} part_t;

/* Bytes per peer in a window whose data has `room` bytes: cache-line multiples where that leaves a page or more. */
static uint64_t chunk_bytes(uint64_t room, int n) {
  uint64_t cap = room / (uint64_t)(n - 1);
  return cap >= 4096 ? cap & ~(uint64_t)63 : cap;
}

/* This rank's parts, from its row of counts (in rows of row_bytes). */
static void plan_parts(part_t* parts, const uint64_t* sends, uint64_t row_bytes, int n) {
  for (int d = 0; d < n; d++) {
    parts[d].len = sends[d] * row_bytes;
    parts[d].from = d == 0 ? 0 : parts[d - 1].from + parts[d - 1].len;
  }
}

static int place(int sender, int d) { return d < sender ? d : d - 1; } /* d's among the sender's peers */

/* Window k's [start, start + cap) of every part. */
static void window_span(uint64_t k, uint64_t cap0, uint64_t cap, uint64_t* start, uint64_t* len) {
  *start = k == 0 ? 0 : cap0 + (k - 1) * cap;
  *len = k == 0 ? cap0 : cap;
}

/* Copies this rank's window-k chunks into its half (after `skip` bytes). */
static void stage_in(smc_comm_t* c, const uint8_t* sendbuf, const part_t* parts, uint64_t k, uint64_t cap0,
                     uint64_t cap, uint64_t skip) {
  const int n = c->size, me = c->rank;
  uint64_t start, len;
  window_span(k, cap0, cap, &start, &len);
  uint8_t* half = smc_half(c, me) + skip;
  for (int d = 0; d < n; d++) {
    if (d == me || parts[d].len <= start) continue;
    uint64_t bytes = parts[d].len - start < len ? parts[d].len - start : len;
    smc_copy(half + (uint64_t)place(me, d) * len, sendbuf + parts[d].from + start, (size_t)bytes);
  }
}

/* Copies this rank's window-k chunks out of every peer's half into `out` (NULL: keeps nothing). */
static void stage_out(smc_comm_t* c, uint8_t* out, const route_t* routes, uint64_t k, uint64_t cap0, uint64_t cap,
                      uint64_t skip) {
  const int n = c->size, me = c->rank;
  uint64_t start, len;
  window_span(k, cap0, cap, &start, &len);
  for (int i = 1; out != NULL && i < n; i++) {
    int j = (me + i) % n; /* each rank starts at another peer's half */
    const route_t* r = &routes[j];
    if (r->len <= start) continue;
    uint64_t bytes = r->len - start < len ? r->len - start : len;
    smc_copy(out + r->to + start, smc_half(c, j) + skip + (uint64_t)place(j, me) * len, (size_t)bytes);
  }
}

/* Every window until every part of the matrix, the largest `widest` bytes, has moved; the own part in the first.
 * Window 0 is in the halves and synchronised already where `synced` (it went out with the counts). */
static smc_result_t staged(smc_comm_t* c, const uint8_t* sendbuf, uint8_t* out, const part_t* parts,
                           const route_t* routes, uint64_t widest, uint64_t skip, int synced, const char* what) {
  const uint64_t cap0 = chunk_bytes(c->half_bytes - skip, c->size), cap = chunk_bytes(c->half_bytes, c->size);
  const route_t* own = &routes[c->rank];
  uint64_t start = 0, len = 0;
  for (uint64_t k = 0; k == 0 || (window_span(k, cap0, cap, &start, &len), start < widest); k++) {
    const uint64_t at = k == 0 ? skip : 0;
    if (k > 0 || !synced) stage_in(c, sendbuf, parts, k, cap0, cap, at);
    if (k == 0 && out != NULL && own->len > 0) /* while the peers stage theirs */
      smc_copy(out + own->to, sendbuf + parts[c->rank].from, (size_t)own->len);
    if (k > 0 || !synced) SMC_CHECK(smc_sync(c, what));
    stage_out(c, out, routes, k, cap0, cap, at);
    smc_flip(c);
  }
  return SMC_SUCCESS;
}

smc_result_t smc_alltoallv(smc_comm_t* c, const void* sendbuf, const uint64_t* send_bytes, void* recvbuf,
                           const uint64_t* recv_bytes, uint64_t tag) {
  SMC_CHECK(smc_coll_enter(c, "alltoall"));
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
  const uint64_t counts_bytes = 2 * sizeof(uint64_t) * (uint64_t)n;
  if (counts_bytes + (uint64_t)n > c->half_bytes) /* the same on every rank: all fail alike, no step taken */
    return smc_set_error(SMC_ERR_INVALID, "alltoall: %d ranks' counts need %llu bytes, more than a staging half (%zu)",
                         n, (unsigned long long)counts_bytes, c->half_bytes);
  route_t* routes = malloc(sizeof(route_t) * (size_t)n);
  part_t* parts = malloc(sizeof(part_t) * (size_t)n);
  if (routes == NULL || parts == NULL) {
    free(routes);
    free(parts);
    return smc_refuse_here(c, SMC_COLL_ALLTOALLV, smc_set_error(SMC_ERR_NOMEM, "alltoall: out of memory"));
  }
  plan_parts(parts, send_bytes, 1, n);
  smc_result_t rc = SMC_SUCCESS;
  uint64_t widest = 0;
  uint64_t* counts = (uint64_t*)smc_half(c, me);
  memcpy(counts, send_bytes, sizeof(uint64_t) * (size_t)n);
  memcpy(counts + n, recv_bytes, sizeof(uint64_t) * (size_t)n);
  /* Window 0 goes out with the counts; where they disagree, nobody reads it. */
  const uint64_t cap0 = chunk_bytes(c->half_bytes - counts_bytes, n), cap = chunk_bytes(c->half_bytes, n);
  stage_in(c, sendbuf, parts, 0, cap0, cap, counts_bytes);
  smc_desc_t desc = {.prescale = 1, .postscale = 1, .tag = tag, .divisor = 1, .coll = SMC_COLL_ALLTOALLV, .root = -1};
  SMC_CHECK_GOTO(smc_coll_begin(c, &desc, "alltoall"), rc, out);
  rc = plan_routes(c, routes, &widest);
  if (rc != SMC_SUCCESS) {
    smc_flip(c);
    goto out;
  }
  rc = staged(c, sendbuf, recvbuf, parts, routes, widest, counts_bytes, 1, "alltoall");
out:
  free(routes);
  free(parts);
  return rc;
}

/* ---- Alltoall whose receive counts come with the data ----
 * Step 0 carries, in each rank's half, its row counts to every rank followed by the first window of its data, so
 * every rank learns the whole matrix of counts from the synchronisation that also brings the first data: a small
 * alltoall is one synchronisation. Nothing can disagree on counts (each receiver takes what is sent to it); the
 * descriptor still compares the tag (dtype and row shape). */

/* Whole inputs from which single copy is taken where it would be learned: it proved the steadier there. */
static uint64_t learned_below(const smc_comm_t* c) { return 8 * c->cache_bytes; }

smc_result_t smc_alltoall_begin(smc_comm_t* c, const void* sendbuf, const uint64_t* send_rows, uint64_t row_bytes,
                                uint64_t tag, uint64_t* matrix) {
  SMC_CHECK(smc_coll_enter(c, "alltoall"));
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
  if (counts_bytes + (uint64_t)n > c->half_bytes) /* the same on every rank: all fail alike, no step taken */
    return smc_set_error(SMC_ERR_INVALID, "alltoall: %d ranks' counts need %llu bytes, more than a staging half (%zu)",
                         n, (unsigned long long)counts_bytes, c->half_bytes);
  memcpy(smc_half(c, c->rank), send_rows, (size_t)counts_bytes);
  c->learning.bytes = 0;
  const int single = smc_single_copy_learned(c, my_total / (uint64_t)n, my_total, learned_below(c))
                         ? smc_single_copy_offer(c, c->alltoall_classes, my_total)
                         : smc_alltoall_single_copy(c, my_total);
  /* An input offered for single copy stays where it is; where not every rank offers, smc_alltoall_finish stages it
   * after all. */
  if (my_total > 0 && !single) {
    part_t* parts = malloc(sizeof(part_t) * (size_t)n);
    if (parts == NULL)
      return smc_refuse_here(c, SMC_COLL_ALLTOALLV, smc_set_error(SMC_ERR_NOMEM, "alltoall: out of memory"));
    plan_parts(parts, send_rows, row_bytes, n);
    stage_in(c, sendbuf, parts, 0, chunk_bytes(c->half_bytes - counts_bytes, n), chunk_bytes(c->half_bytes, n),
             counts_bytes);
    free(parts);
  }
  smc_desc_t desc = {.prescale = 1, .postscale = 1, .tag = tag, .divisor = 1, .own = my_total,
                     .addr = (uint64_t)(uintptr_t)sendbuf, .coll = SMC_COLL_ALLTOALLV, .root = -1,
                     .kernel_copy = single};
  if (my_total > 0) smc_window_name(c, &desc, sendbuf, my_total); /* a shared input: the peers read it mapped */
  if (my_total > 0 && single) /* else by the kernel's copy */
    smc_huge_pages_offer(c, sendbuf, my_total);
  SMC_CHECK(smc_coll_begin(c, &desc, "alltoall"));
  for (int j = 0; j < n; j++) memcpy(matrix + (size_t)j * n, smc_half(c, j), (size_t)counts_bytes);
  return SMC_SUCCESS;
}

smc_result_t smc_alltoall_finish(smc_comm_t* c, const void* sendbuf, void* recvbuf, uint64_t row_bytes,
                                 const uint64_t* matrix) {
  SMC_CHECK(smc_coll_enter(c, "alltoall"));
  if (matrix == NULL) return smc_set_error(SMC_ERR_INVALID, "alltoall: NULL counts");
  const int n = c->size, me = c->rank;
  uint8_t* out = recvbuf; /* NULL: take part in every step, keep nothing */
  if (n == 1) {
    uint64_t bytes = matrix[0] * row_bytes;
    if (out != NULL && bytes > 0 && sendbuf != recvbuf) smc_copy(out, sendbuf, (size_t)bytes);
    return SMC_SUCCESS;
  }
  route_t* routes = malloc(sizeof(route_t) * (size_t)n);
  part_t* parts = malloc(sizeof(part_t) * (size_t)n);
  if (routes == NULL || parts == NULL) {
    free(routes);
    free(parts);
    return smc_set_error(SMC_ERR_NOMEM, "alltoall: out of memory");
  }
  uint64_t longest = 0, to = 0, widest = 0;
  for (int j = 0; j < n; j++) { /* each sender's total passed its own check: no sum within a row wraps */
    const uint64_t* sent_by_j = matrix + (size_t)j * n;
    route_t* r = &routes[j];
    r->from = r->total = 0;
    for (int m = 0; m < n; m++) {
      if (m < me) r->from += sent_by_j[m] * row_bytes;
      r->total += sent_by_j[m] * row_bytes;
      if (m != j && sent_by_j[m] * row_bytes > widest) widest = sent_by_j[m] * row_bytes;
    }
    r->len = sent_by_j[me] * row_bytes;
    r->to = to;
    to = smc_add_bytes(to, r->len);
    longest = r->total > longest ? r->total : longest;
  }
  smc_result_t rc = SMC_SUCCESS;
  /* learned: rank 0's offer decides (coll/path_choice.c); else the largest input */
  const int learned = c->single_copy_learned && longest < learned_below(c);
  if (learned ? smc_peer_desc(c, 0)->kernel_copy : smc_alltoall_single_copy(c, longest)) {
    c->single_copy_calls++;
    /* Into an output of 16 L2s or more, this rank's copies bypass the cache, as allgather's (coll/allgather.c).
     * A smaller output stays in the caches. */
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
    free(parts);
    rc = synced != SMC_SUCCESS ? synced : rc;
    if (rc == SMC_SUCCESS) smc_single_copy_taught(c, c->alltoall_classes, 1);
    return rc;
  }
  plan_parts(parts, matrix + (size_t)me * n, row_bytes, n);
  /* where some rank offered single copy, its window 0 is not in its half: every rank stages window 0 again */
  rc = staged(c, sendbuf, out, parts, routes, widest, sizeof(uint64_t) * (uint64_t)n, !smc_kernel_copy_offered(c),
              "alltoall");
  free(routes);
  free(parts);
  if (rc == SMC_SUCCESS) smc_single_copy_taught(c, c->alltoall_classes, 0);
  return rc;
}
