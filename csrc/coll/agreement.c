/* SPDX-License-Identifier: Apache-2.0 */
/* The agreement's rounds (shmcomm/algorithms/agreement.py says what they decide), over any exchange: MPI's in C
 * (csrc/mpi/crossing.c), or a Python transport's, called back (shmcomm/transport/crossing.py). The rules: statuses
 * combine to the worst, two OKs with different signatures or data sizes make a MISMATCH, the lowest failed rank
 * wins, and data is reduced only between two OKs, the lower rank's first on both sides so that both compute the same
 * bits.
 *
 * Data of SMC_AGREEMENT_HALVING_BYTES or more among 4 or more ranks (after the fold) takes the rounds by halving and
 * doubling instead: each exchange carries the header and the half of the data that the partner keeps; after the last
 * one every rank holds the verdict and its reduced share, and where the verdict is OK the shares are gathered back by
 * doubling, data alone. */
#include <string.h>

#include "core/clock.h"
#include "shmcomm.h"

enum { OK = SMC_AGREEMENT_OK, MISMATCH = SMC_AGREEMENT_MISMATCH, HEADER_BYTES = SMC_AGREEMENT_HEADER_BYTES };

int smc_agreement_combine(uint64_t* mine, const uint64_t* theirs) {
  int both_ok = mine[1] == OK && theirs[1] == OK && mine[0] == theirs[0];
  if (!both_ok || mine[3] != theirs[3] || mine[2] != 0 || theirs[2] != 0) {
    uint64_t worst = mine[1] > theirs[1] ? mine[1] : theirs[1];
    if (worst == OK && mine[0] != theirs[0]) worst = MISMATCH;
    uint64_t culprit = mine[2] == 0 ? theirs[2] : (theirs[2] == 0 || mine[2] < theirs[2] ? mine[2] : theirs[2]);
    if (both_ok && mine[3] != theirs[3]) { /* same arguments, different paths: settings that differ per host */
      both_ok = 0;
      worst = MISMATCH;
    }
    mine[1] = worst;
    mine[2] = culprit;
  }
  return both_ok;
}

/* Combines the partner's header into this rank's; while both are OK, reduces the partner's `count` elements
 * (`other`) into this rank's at `data`. Returns 0, or the core's code of a failed reduction. */
static int merge(uint64_t* mine, const uint64_t* theirs, uint8_t* data, const uint8_t* other, int me, int peer,
                 uint64_t nbytes, uint64_t count, int code, int op) {
  if (smc_agreement_combine(mine, theirs) && nbytes > 0 && count > 0) {
    const void* pair[2] = {me < peer ? data : other, me < peer ? other : data};
    return smc_reduce(data, pair, 2, (size_t)count, (smc_datatype_t)code, (smc_redop_t)op, 1.0, 1.0, 1);
  }
  return 0;
}

/* One round's exchange: the receive (if `into`) and the send of `out_len` bytes at `out` (if out_len >= 0), with
 * `header` in front of them as one message. Where `out` does not follow the header, the header is written over the
 * bytes just before `out` for the time of the exchange, and they are put back after a completed one (they are this
 * rank's own, and nothing else reads or writes them meanwhile; after a failed one the caller raises, and a late send
 * may still be reading them). */
static int round_trip(smc_exchange_fn exchange, void* context, int peer, void* into, int into_len, uint64_t* header,
                      uint8_t* out, int out_len, double deadline) {
  uint8_t* from = out;
  uint8_t saved[HEADER_BYTES];
  int moved = 0;
  if (header != NULL && out_len > 0 && out != (uint8_t*)header + HEADER_BYTES) {
    from = out - HEADER_BYTES;
    memcpy(saved, from, HEADER_BYTES);
    memcpy(from, header, HEADER_BYTES);
    moved = 1;
  } else if (header != NULL) {
    from = (uint8_t*)header;
  }
  const int length = out_len < 0 ? -1 : out_len + (header != NULL ? HEADER_BYTES : 0);
  int rc = exchange(context, peer, into, into_len, from, length, deadline);
  if (moved && rc == 0) memcpy(from, saved, HEADER_BYTES);
  return rc;
}

/* Whether the data goes by halving and doubling: the same answer on every rank that called with the same data. */
static int halving(const int* kinds, int rounds, uint64_t nbytes, uint64_t count) {
  int swaps = 0;
  for (int k = 0; k < rounds; k++) swaps += kinds[k] == SMC_ROUND_SWAP;
  return swaps >= 2 && nbytes >= SMC_AGREEMENT_HALVING_BYTES && count > 0 &&
         (count >> swaps) * (nbytes / count) >= HEADER_BYTES;
}

int smc_agreement_rounds(smc_exchange_fn exchange, void* context, const int* peers, const int* kinds, int rounds,
                         int my_rank, void* message, void* incoming, uint64_t capacity, uint64_t nbytes,
                         uint64_t count, int code, int op, double timeout_s, int* late_round) {
  uint64_t* mine = message;
  const uint64_t* theirs = incoming;
  uint8_t* data = (uint8_t*)message + HEADER_BYTES;
  const uint8_t* other = (const uint8_t*)incoming + HEADER_BYTES;
  const int halve = halving(kinds, rounds, nbytes, count), room = (int)(HEADER_BYTES + capacity);
  const uint64_t esize = count ? nbytes / count : 1;
  uint64_t lo = 0, hi = count;   /* while halving: the elements this rank still reduces */
  uint64_t below[64], above[64]; /* each halving round's range, for the gathering back */
  int halved = 0;
  const double deadline = smc_now() + timeout_s;
  for (int k = 0; k < rounds; k++) {
    const int peer = peers[k], kind = kinds[k];
    *late_round = k;
    int rc;
    if (halve && kind == SMC_ROUND_SWAP) {
      uint64_t mid = lo + (hi - lo) / 2, keep = my_rank < peer ? lo : mid, give = my_rank < peer ? mid : lo;
      uint64_t kept = my_rank < peer ? mid - lo : hi - mid, given = hi - lo - kept;
      below[halved] = lo;
      above[halved++] = hi;
      rc = round_trip(exchange, context, peer, incoming, room, mine, data + give * esize,
                      mine[1] == OK ? (int)(given * esize) : 0, deadline);
      if (rc != 0) return rc;
      int failed = merge(mine, theirs, data + keep * esize, other, my_rank, peer, nbytes, kept, code, op);
      if (failed != 0) return SMC_CROSSING_REDUCE_FAILED - failed;
      lo = keep;
      hi = keep + kept;
      if (k + 1 < rounds && kinds[k + 1] == SMC_ROUND_SWAP) continue;
      /* The last halving round: every rank of the group now holds the same verdict. */
      for (int j = k; mine[1] == OK && halved > 0; j--) {
        halved--;
        uint64_t from = lo == below[halved] ? hi : below[halved], to = lo == below[halved] ? above[halved] : lo;
        *late_round = j;
        rc = round_trip(exchange, context, peers[j], data + from * esize, (int)((to - from) * esize), NULL,
                        data + lo * esize, (int)((hi - lo) * esize), deadline);
        if (rc != 0) return rc;
        lo = below[halved];
        hi = above[halved];
      }
      continue;
    }
    void* into = kind != SMC_ROUND_GIVE_BACK ? incoming : NULL;
    int out_len = kind == SMC_ROUND_TAKE ? -1 : (int)(mine[1] == OK ? mine[3] : 0);
    rc = round_trip(exchange, context, peer, into, room, mine, data, out_len, deadline);
    if (rc != 0) return rc;
    if (kind == SMC_ROUND_HAND_OVER) { /* the partner's next message is the verdict, and the data with it */
      memcpy(mine, theirs, HEADER_BYTES);
      if (theirs[1] == OK && nbytes > 0) memcpy(data, other, (size_t)nbytes);
    } else if (kind != SMC_ROUND_GIVE_BACK) {
      int failed = merge(mine, theirs, data, other, my_rank, peer, nbytes, count, code, op);
      if (failed != 0) return SMC_CROSSING_REDUCE_FAILED - failed;
    }
  }
  return 0;
}
