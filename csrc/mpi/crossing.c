/* SPDX-License-Identifier: Apache-2.0 */
/* The agreement's rounds in C: what agreement.py's Agreement._run does round by round, without a Python layer
 * between MPI's calls (the layers cost about as much as MPI's own exchange of a small message; benchmarks/RESULTS.md,
 * "Small collectives across hosts, taken apart"). The rules are agreement.py's, word for word: statuses combine to
 * the worst, two OKs with different signatures or paths make a MISMATCH, the lowest failed rank wins, and data is
 * reduced only between two OKs, the lower rank's first on both sides so that both compute the same bits. */
#include "crossing.h"

#include <mpi.h>
#include <sched.h>
#include <string.h>
#include <time.h>

enum { OK = 0, MISMATCH = 1, HEADER_BYTES = 32 };
#define CLOSE_WAIT_S 0.01   /* poll MPI, yielding the core, this long; then sleep between polls */
#define LONGEST_NAP_NS 1000000L

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
  if (both_ok && nbytes > 0) {
    const void* pair[2] = {me < peer ? data : other, me < peer ? other : data};
    return reduce(data, pair, 2, (size_t)count, code, op, 1.0, 1.0, 1);
  }
  return 0;
}

int smc_crossing_rounds(uintptr_t comm_address, const int* peers, const int* kinds, int rounds, int my_rank,
                        void* message, void* incoming, uint64_t capacity, uint64_t nbytes, uint64_t count, int code,
                        int op, uintptr_t reduce, double timeout_s, int* late_round) {
  MPI_Comm comm = *(MPI_Comm*)comm_address;
  uint64_t* mine = message;
  const uint64_t* theirs = incoming;
  uint8_t* data = (uint8_t*)message + HEADER_BYTES;
  const uint8_t* other = (const uint8_t*)incoming + HEADER_BYTES;
  double deadline = now() + timeout_s;
  for (int k = 0; k < rounds; k++) {
    const int peer = peers[k], kind = kinds[k];
    MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    int rc = MPI_SUCCESS;
    *late_round = k;
    if (kind != SMC_ROUND_GIVE_BACK) /* the receive first: a peer doing the same never waits for buffer space */
      rc = MPI_Irecv(incoming, (int)(HEADER_BYTES + capacity), MPI_BYTE, peer, 0x5AC, comm, &requests[0]);
    if (rc == MPI_SUCCESS && kind != SMC_ROUND_TAKE) {
      int length = (int)(HEADER_BYTES + (mine[1] == OK ? mine[3] : 0));
      rc = MPI_Isend(message, length, MPI_BYTE, peer, 0x5AC, comm, &requests[1]);
    }
    if (rc != MPI_SUCCESS) return rc;
    rc = wait_both(requests, deadline);
    if (rc == -1) {
      if (requests[0] != MPI_REQUEST_NULL) { /* cancel the late receive; a late send stays pending */
        MPI_Cancel(&requests[0]);
        MPI_Wait(&requests[0], MPI_STATUS_IGNORE);
      }
      return -1;
    }
    if (rc != MPI_SUCCESS) return rc;
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
