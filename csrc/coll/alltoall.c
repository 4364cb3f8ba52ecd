/* SPDX-License-Identifier: Apache-2.0 */
/* Alltoall with explicit per-destination byte counts.
 *
 * Step 0 publishes every rank's send and receive counts, so every rank can check the whole matrix (rank i sends
 * rank j exactly what rank j expects) and reach the same verdict. Then each rank streams its whole send buffer
 * through its half, a window per step, and every rank picks out of each window the bytes addressed to it. */
#include <stdlib.h>

#include "coll/comm.h"
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
    if (my_total > 0 && sendbuf != recvbuf) memmove(recvbuf, sendbuf, my_total);
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
  smc_desc_t desc = {1, 1, 0, tag, 1, 0, SMC_COLL_ALLTOALLV, 0, 0, -1, 0};
  SMC_CHECK_GOTO(smc_coll_begin(c, &desc, "alltoall"), rc, out);
  rc = plan_routes(c, routes, &longest);
  smc_flip(c);
  if (rc != SMC_SUCCESS) goto out;

  const size_t half = c->half_bytes;
  for (uint64_t at = 0; at < longest; at += half) {
    if (at < my_total) memcpy(smc_half(c, me), (const uint8_t*)sendbuf + at, my_total - at < half ? my_total - at : half);
    SMC_CHECK_GOTO(smc_sync(c, "alltoall"), rc, out);
    for (int j = 0; j < n; j++) {
      const route_t* r = &routes[j];
      uint64_t lo = r->from > at ? r->from : at;
      uint64_t hi = r->from + r->len < at + half ? r->from + r->len : at + half;
      if (lo >= hi) continue;
      const uint8_t* from = j == me ? (const uint8_t*)sendbuf + lo : smc_half(c, j) + (lo - at);
      memmove((uint8_t*)recvbuf + r->to + (lo - r->from), from, hi - lo);
    }
    smc_flip(c);
  }
out:
  free(routes);
  return rc;
}
