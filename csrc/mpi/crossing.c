/* SPDX-License-Identifier: Apache-2.0 */
/* The agreement's rounds in C: what agreement.py's Agreement._run does round by round, without a Python layer
 * between MPI's calls (the layers cost about as much as MPI's own exchange of a small message; benchmarks/RESULTS.md,
 * "Small collectives across hosts, taken apart"). The rules are agreement.py's, word for word: statuses combine to
 * the worst, two OKs with different signatures or paths make a MISMATCH, the lowest failed rank wins, and data is
 * reduced only between two OKs, the lower rank's first on both sides so that both compute the same bits.
 *
 * Data of SMC_AGREEMENT_HALVING_BYTES or more among 4 or more ranks (after the fold) takes the rounds by halving and
 * doubling instead (agreement.py says why): each exchange carries the header and the half of the data that the
 * partner keeps; after the last one every rank holds the verdict and its reduced share, and where the verdict is OK
 * the shares are gathered back by doubling, data alone. */
#include "crossing.h"

#include <mpi.h>
#include <sched.h>
#include <string.h>
#include <time.h>

enum { OK = SMC_AGREEMENT_OK, MISMATCH = SMC_AGREEMENT_MISMATCH, HEADER_BYTES = SMC_AGREEMENT_HEADER_BYTES };
#define CLOSE_WAIT_S 0.01   /* poll MPI, yielding the core, this long; then sleep between polls */
#define LONGEST_NAP_NS 1000000L
#define CANCEL_WAIT_S 1.0  /* how long a late receive's cancellation may take before it is left pending */

typedef int (*reduce_fn)(void* dst, const void* const* srcs, int nsrcs, size_t count, int dtype, int op,
                         double prescale, double postscale, int64_t divisor);

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Waits for both requests (MPI_REQUEST_NULL for none) until `deadline`: MPI's own progress, as its blocking wait
 * would drive it, yielding the core in between; after CLOSE_WAIT_S, naps of up to a millisecond, so that a rank
 * waiting for a slow peer leaves the core to the ranks that share it. */
static int wait_both(MPI_Request* requests, double deadline) {
  double start = now();
  long nap_ns = 50000;
  for (;;) {
    int done = 0, rc = MPI_Testall(2, requests, &done, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) return rc;
    if (done) return 0;
    double t = now();
    if (t > deadline) return -1;
    if (t - start < CLOSE_WAIT_S) {
      sched_yield();
    } else {
      struct timespec nap = {0, nap_ns};
      nanosleep(&nap, NULL);
      nap_ns = nap_ns * 2 > LONGEST_NAP_NS ? LONGEST_NAP_NS : nap_ns * 2;
    }
  }
}

/* Combines the partner's header into this rank's; while both are OK, reduces the partner's `count` elements
 * (`other`) into this rank's at `data`. */
static int merge(uint64_t* mine, const uint64_t* theirs, uint8_t* data, const uint8_t* other, int me, int peer,
                 uint64_t nbytes, uint64_t count, int code, int op, reduce_fn reduce) {
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
  if (both_ok && nbytes > 0 && count > 0) {
    const void* pair[2] = {me < peer ? data : other, me < peer ? other : data};
    return reduce(data, pair, 2, (size_t)count, code, op, 1.0, 1.0, 1);
  }
  return 0;
}

/* Posts the receive (if `into`) and the send (if `out_len` >= 0) of one round, and waits for both by `deadline`.
 * With `header`, the send is that header followed by `out_len` bytes at `out`, as one message: where `out` does not
 * follow the header, the header is written over the bytes just before `out` for the time of the send, and they are put
 * back after (they are this rank's own, and nothing else reads or writes them meanwhile). Returns 0, -1 after the
 * deadline (the late receive cancelled), or MPI's error. */
static int exchange(MPI_Comm comm, int peer, void* into, int into_len, uint64_t* header, uint8_t* out, int out_len,
                    double deadline) {
  MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  uint8_t* from = out;
  uint8_t saved[HEADER_BYTES];
  int rc = MPI_SUCCESS, moved = 0;
  if (header != NULL && out_len > 0 && out != (uint8_t*)header + HEADER_BYTES) {
    from = out - HEADER_BYTES;
    memcpy(saved, from, HEADER_BYTES);
    memcpy(from, header, HEADER_BYTES);
    moved = 1;
  } else if (header != NULL) {
    from = (uint8_t*)header;
  }
  const int length = out_len + (header != NULL ? HEADER_BYTES : 0);
  if (into != NULL) /* the receive first: a peer doing the same never waits for buffer space */
    rc = MPI_Irecv(into, into_len, MPI_BYTE, peer, 0x5AC, comm, &requests[0]);
  if (rc == MPI_SUCCESS && out_len >= 0) rc = MPI_Isend(from, length, MPI_BYTE, peer, 0x5AC, comm, &requests[1]);
  if (rc == MPI_SUCCESS) rc = wait_both(requests, deadline);
  if (rc == -1 && requests[0] != MPI_REQUEST_NULL) { /* cancel the late receive */
    MPI_Cancel(&requests[0]);
    /* A receive already matched to a message whose sender died mid-way cannot be cancelled, and a wait for it would
     * never end: it is left pending after CANCEL_WAIT_S, like a late send, in a buffer that outlives the rounds. */
    MPI_Request cancelled[2] = {requests[0], MPI_REQUEST_NULL};
    if (wait_both(cancelled, now() + CANCEL_WAIT_S) == 0) requests[0] = MPI_REQUEST_NULL;
  }
  if (moved && requests[1] == MPI_REQUEST_NULL) memcpy(from, saved, HEADER_BYTES);
  /* A late send stays pending (not every MPI can cancel one): its bytes are left as they are, since the transport is
   * refused from here on and the caller's next look at the data is its own error path. */
  return rc;
}

/* Whether the data goes by halving and doubling: the same answer on every rank that called with the same data. */
static int halving(const int* kinds, int rounds, uint64_t nbytes, uint64_t count) {
  int swaps = 0;
  for (int k = 0; k < rounds; k++) swaps += kinds[k] == SMC_ROUND_SWAP;
  return swaps >= 2 && nbytes >= SMC_AGREEMENT_HALVING_BYTES && count > 0 &&
         (count >> swaps) * (nbytes / count) >= HEADER_BYTES;
}

int smc_crossing_rounds(uintptr_t comm_address, const int* peers, const int* kinds, int rounds, int my_rank,
                        void* message, void* incoming, uint64_t capacity, uint64_t nbytes, uint64_t count, int code,
                        int op, uintptr_t reduce, double timeout_s, int* late_round) {
  MPI_Comm comm = *(MPI_Comm*)comm_address;
  uint64_t* mine = message;
  const uint64_t* theirs = incoming;
  uint8_t* data = (uint8_t*)message + HEADER_BYTES;
  const uint8_t* other = (const uint8_t*)incoming + HEADER_BYTES;
  const int halve = halving(kinds, rounds, nbytes, count);
  const uint64_t esize = count ? nbytes / count : 1;
  uint64_t lo = 0, hi = count; /* while halving: the elements this rank still reduces */
  uint64_t below[64], above[64]; /* each halving round's range, for the gathering back */
  int halved = 0;
  double deadline = now() + timeout_s;
  for (int k = 0; k < rounds; k++) {
    const int peer = peers[k], kind = kinds[k];
    *late_round = k;
    int rc;
    if (halve && kind == SMC_ROUND_SWAP) {
      uint64_t mid = lo + (hi - lo) / 2, keep = my_rank < peer ? lo : mid, give = my_rank < peer ? mid : lo;
      uint64_t kept = my_rank < peer ? mid - lo : hi - mid, given = hi - lo - kept;
      below[halved] = lo;
      above[halved++] = hi;
      rc = exchange(comm, peer, incoming, (int)(HEADER_BYTES + capacity), mine, data + give * esize,
                    mine[1] == OK ? (int)(given * esize) : 0, deadline);
      if (rc != 0) return rc;
      int failed = merge(mine, theirs, data + keep * esize, other, my_rank, peer, nbytes, kept, code, op,
                         (reduce_fn)reduce);
      if (failed != 0) return SMC_CROSSING_REDUCE_FAILED - failed;
      lo = keep;
      hi = keep + kept;
      if (k + 1 < rounds && kinds[k + 1] == SMC_ROUND_SWAP) continue;
      /* The last halving round: every rank of the group now holds the same verdict. */
      for (int j = k; mine[1] == OK && halved > 0; j--) {
        halved--;
        uint64_t from = lo == below[halved] ? hi : below[halved], to = lo == below[halved] ? above[halved] : lo;
        *late_round = j;
        rc = exchange(comm, peers[j], data + from * esize, (int)((to - from) * esize), NULL, data + lo * esize,
                      (int)((hi - lo) * esize), deadline);
        if (rc != 0) return rc;
        lo = below[halved];
        hi = above[halved];
      }
      continue;
    }
    void* into = kind != SMC_ROUND_GIVE_BACK ? incoming : NULL;
    int out_len = kind == SMC_ROUND_TAKE ? -1 : (int)(mine[1] == OK ? mine[3] : 0);
    rc = exchange(comm, peer, into, (int)(HEADER_BYTES + capacity), mine, data, out_len, deadline);
    if (rc != 0) return rc;
    if (kind == SMC_ROUND_HAND_OVER) { /* the partner's next message is the verdict, and the data with it */
      memcpy(mine, theirs, HEADER_BYTES);
      if (theirs[1] == OK && nbytes > 0) memcpy(data, other, (size_t)nbytes);
    } else if (kind != SMC_ROUND_GIVE_BACK) {
      int failed = merge(mine, theirs, data, other, my_rank, peer, nbytes, count, code, op, (reduce_fn)reduce);
      if (failed != 0) return SMC_CROSSING_REDUCE_FAILED - failed;
    }
  }
  return 0;
}

int smc_crossing_library(char* text, int cap) {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(version, &len);
  if (cap <= 0) return len;
  int n = len < cap - 1 ? len : cap - 1;
  memcpy(text, version, (size_t)n);
  text[n] = '\0';
  return len;
}
