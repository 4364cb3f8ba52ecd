/* SPDX-License-Identifier: Apache-2.0 */
/* Broadcast: the root streams its buffer through its staging half, one half-sized window per step, and every other
 * rank copies each window out.
 *
 * By single copy (large buffers, see coll/comm.h) the root does not idle while the others read its buffer: it
 * writes the first 1/size of the data into every other rank's buffer itself (process_vm_writev; each published its
 * buffer's address), while each of them reads the rest. Every rank then moves (size-1)/size of the data, in
 * parallel, instead of the others moving all of it while the root waits.
 *
 * Where every rank's buffer lies in a shared buffer that every rank maps (coll/window.c), the same split runs with
 * plain copies between the mappings: no staging half, no kernel copy (split).
 *
 * A broadcast of one step waits for its root alone (smc_coll_begin_early): the root returns once its data is in its
 * half, each receiver once it has copied it out. With more ranks than cores, or a busy core, a full synchronisation
 * is what such a broadcast's time is made of; a mismatch still fails every rank, the root at its next collective. */
#include "coll/comm.h"
#include "core/copy.h"
#include "core/error.h"

/* The root writes the first 1/size of its data into every peer's buffer while each peer reads the rest: through the
 * peers' mappings where every rank's buffer lies in a shared buffer (bufs: rank j's buffer as this process maps it),
 * else by the kernel's copy (each rank published its buffer's address). The synchronisation at the end keeps every
 * buffer as it is until every rank is done: the root's is read, the others' written. A failed copy still
 * synchronises, so the peers go on, and is reported by this rank alone. */
static uint64_t root_share(const smc_comm_t* c, uint64_t bytes) { /* what the root writes into each peer's buffer */
  return (bytes / (uint64_t)c->size) & ~(uint64_t)(SMC_CACHE_LINE - 1);
}

static smc_result_t split(smc_comm_t* c, const void* sendbuf, void* recvbuf, uint64_t bytes, int root,
                          uint8_t* const* bufs) {
  const int me = c->rank;
  const uint64_t share = root_share(c, bytes);
  smc_result_t rc = SMC_SUCCESS;
  for (int k = 1; me == root && k < c->size && rc == SMC_SUCCESS; k++) {
    int j = (root + k) % c->size;
    if (bufs != NULL)
      smc_copy(bufs[j], sendbuf, share);
    else
      rc = smc_cma_write(c, j, smc_peer_desc(c, j)->addr, sendbuf, share, "broadcast");
  }
  if (me != root && bufs != NULL) smc_copy((uint8_t*)recvbuf + share, bufs[root] + share, bytes - share);
  if (me != root && bufs == NULL)
    rc = smc_cma_read(c, root, (uint8_t*)recvbuf + share, smc_peer_desc(c, root)->addr + share, bytes - share,
                      "broadcast");
  smc_result_t synced = smc_sync(c, "broadcast");
  smc_flip(c);
  c->window_calls += bufs != NULL;
  if (me == root && sendbuf != recvbuf) smc_copy(recvbuf, sendbuf, bytes);
  return synced != SMC_SUCCESS ? synced : rc;
}

smc_result_t smc_broadcast(smc_comm_t* c, const void* sendbuf, void* recvbuf, size_t bytes, int root, uint64_t tag) {
  SMC_CHECK(smc_coll_enter(c, "broadcast"));
  if (root < 0 || root >= c->size)
    return smc_refuse_here(c, SMC_COLL_BROADCAST,
                           smc_set_error(SMC_ERR_INVALID, "broadcast: root %d is outside 0..%d", root, c->size - 1));
  const int me = c->rank;
  if (bytes > SMC_MAX_BYTES)
    return smc_refuse_here(c, SMC_COLL_BROADCAST, smc_set_error(SMC_ERR_INVALID, "broadcast: %zu bytes", bytes));
  if (bytes > 0 && ((me == root && sendbuf == NULL) || recvbuf == NULL))
    return smc_refuse_here(c, SMC_COLL_BROADCAST, smc_set_error(SMC_ERR_INVALID, "broadcast: NULL buffer"));
  smc_desc_t desc = {.prescale = 1, .postscale = 1, .count = bytes, .tag = tag, .divisor = 1,
                     .addr = (uint64_t)(uintptr_t)(me == root ? sendbuf : recvbuf), .coll = SMC_COLL_BROADCAST,
                     .root = root};
  /* Shared buffers' path synchronises twice, as single copy and a staging path of several steps do. */
  const int single = c->size > 1 && smc_broadcast_single_copy(c, bytes);
  c->single_copy_calls += (uint64_t)single;
  if (c->size > 1 && !single && bytes <= c->half_bytes) {
    if (me == root && bytes > 0) smc_copy(smc_half(c, me), sendbuf, bytes);
    SMC_CHECK(smc_coll_begin_early(c, &desc, root, "broadcast"));
    if (me != root && bytes > 0) smc_copy(recvbuf, smc_half(c, root), bytes);
    if (me == root && bytes > 0 && sendbuf != recvbuf) smc_copy(recvbuf, sendbuf, bytes);
    smc_flip(c);
    return SMC_SUCCESS;
  }
  smc_window_t* w = c->size > 1 && (single || bytes > c->half_bytes)
                        ? smc_window_name(c, &desc, me == root ? sendbuf : recvbuf, bytes)
                        : NULL;
  uint8_t* bufs[SMC_MAX_RANKS];
  if (single) {
    /* The root's buffer is read by the kernel's copy, and the root's share of the others' written so */
    smc_huge_pages_offer(c, me == root ? sendbuf : recvbuf, me == root ? bytes : root_share(c, bytes));
    SMC_CHECK(smc_coll_begin(c, &desc, "broadcast"));
    return split(c, sendbuf, recvbuf, bytes, root, smc_windows_agreed(c, w, bytes, bufs) ? bufs : NULL);
  }
  size_t steps = bytes == 0 ? 1 : (bytes + c->half_bytes - 1) / c->half_bytes;
  for (size_t k = 0; c->size > 1 && k < steps; k++) {
    size_t at = k * c->half_bytes;
    size_t len = bytes - at < c->half_bytes ? bytes - at : c->half_bytes;
    /* A root whose buffer is shared leaves it out of the first step's half until it knows that not every rank's is. */
    if (me == root && len > 0 && (k > 0 || desc.window == 0))
      smc_copy(smc_half(c, me), (const uint8_t*)sendbuf + at, len);
    if (k > 0) {
      SMC_CHECK(smc_sync(c, "broadcast"));
    } else {
      SMC_CHECK(smc_coll_begin(c, &desc, "broadcast"));
      if (smc_windows_agreed(c, w, bytes, bufs)) return split(c, sendbuf, recvbuf, bytes, root, bufs);
      if (smc_any_window(c)) { /* the same on every rank: the root's first window goes out late, with a step more */
        if (me == root && desc.window != 0 && len > 0) smc_copy(smc_half(c, me), sendbuf, len);
        SMC_CHECK(smc_sync(c, "broadcast"));
      }
    }
    if (me != root && len > 0) smc_copy((uint8_t*)recvbuf + at, smc_half(c, root), len);
    smc_flip(c);
  }
  if (me == root && bytes > 0 && sendbuf != recvbuf) smc_copy(recvbuf, sendbuf, bytes);
  return SMC_SUCCESS;
}
