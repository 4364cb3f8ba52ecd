/* SPDX-License-Identifier: Apache-2.0 */
/* Allgather with a contribution of its own size from every rank. Each step, every rank puts the next half-sized
 * window of its input into its half, and copies every other rank's window to its place in the output. */
#include <stdio.h>

#include "coll/comm.h"
#include "core/error.h"

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
  SMC_CHECK(smc_comm_usable(c, "allgather"));
  if (recv_bytes == NULL)
    return smc_refuse_here(c, SMC_COLL_ALLGATHERV, smc_set_error(SMC_ERR_INVALID, "allgather: recv_bytes is NULL"));
  uint64_t displ[SMC_MAX_RANKS], total = 0, longest = 0;
  for (int j = 0; j < c->size; j++) {
    displ[j] = total;
    total = smc_add_bytes(total, recv_bytes[j]);
    longest = recv_bytes[j] > longest ? recv_bytes[j] : longest;
  }
  if (total > SMC_MAX_BYTES || send_bytes > SMC_MAX_BYTES)
    return smc_refuse_here(c, SMC_COLL_ALLGATHERV, smc_set_error(SMC_ERR_INVALID, "allgather: too many bytes"));
  if ((send_bytes > 0 && sendbuf == NULL) || (total > 0 && recvbuf == NULL))
    return smc_refuse_here(c, SMC_COLL_ALLGATHERV, smc_set_error(SMC_ERR_INVALID, "allgather: NULL buffer"));
  const int me = c->rank;
  uint8_t* out = recvbuf;
  if (c->size == 1) {
    if (send_bytes != recv_bytes[0])
      return smc_set_error(SMC_ERR_INVALID, "allgather: sends %zu bytes but expects %llu", send_bytes,
                           (unsigned long long)recv_bytes[0]);
    if (send_bytes > 0 && sendbuf != recvbuf) memmove(recvbuf, sendbuf, send_bytes);
    return SMC_SUCCESS;
  }
  smc_desc_t desc = {1, 1, 0, smc_digest(recv_bytes, c->size, tag), 1, send_bytes, SMC_COLL_ALLGATHERV, 0, 0, -1, 0};
  size_t half = c->half_bytes;
  size_t steps = longest == 0 ? 1 : (size_t)((longest + half - 1) / half);
  for (size_t k = 0; k < steps; k++) {
    size_t at = k * half;
    if (at < send_bytes) memcpy(smc_half(c, me), (const uint8_t*)sendbuf + at, send_bytes - at < half ? send_bytes - at : half);
    if (k == 0) {
      SMC_CHECK(smc_coll_begin(c, &desc, "allgather"));
      smc_result_t rc = check_contributions(c, recv_bytes);
      if (rc != SMC_SUCCESS) {
        smc_flip(c);
        return rc;
      }
    } else {
      SMC_CHECK(smc_sync(c, "allgather"));
    }
    for (int j = 0; j < c->size; j++) {
      if (at >= recv_bytes[j]) continue;
      size_t len = recv_bytes[j] - at < half ? (size_t)(recv_bytes[j] - at) : half;
      const uint8_t* from = j == me ? (const uint8_t*)sendbuf + at : smc_half(c, j);
      if (from != out + displ[j] + at) memmove(out + displ[j] + at, from, len);
    }
    smc_flip(c);
  }
  return SMC_SUCCESS;
}
