/* SPDX-License-Identifier: Apache-2.0 */
/* The agreement's exchanges over MPI, for the core's rounds (csrc/coll/agreement.c): without a Python layer between
 * MPI's calls, which would cost about as much as MPI's own exchange of a small message. */
#include "crossing.h"

#include <mpi.h>
#include <sched.h>
#include <string.h>
#include <time.h>

#define CLOSE_WAIT_S 0.01   /* poll MPI, yielding the core, this long; then sleep between polls */
#define LONGEST_NAP_NS 1000000L
#define CANCEL_WAIT_S 1.0  /* how long a late receive's cancellation may take before it is left pending */

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
    if (t > deadline) return SMC_EXCHANGE_LATE;
    if (t - start < CLOSE_WAIT_S) {
      sched_yield();
    } else {
      struct timespec nap = {0, nap_ns};
      nanosleep(&nap, NULL);
      nap_ns = nap_ns * 2 > LONGEST_NAP_NS ? LONGEST_NAP_NS : nap_ns * 2;
    }
  }
}

int smc_crossing_exchange(void* context, int peer, void* into, int into_len, const void* out, int out_len,
                          double deadline) {
  MPI_Comm comm = *(MPI_Comm*)context;
  MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  int rc = MPI_SUCCESS;
  if (into != NULL) /* the receive first: a peer doing the same never waits for buffer space */
    rc = MPI_Irecv(into, into_len, MPI_BYTE, peer, SMC_AGREEMENT_TAG, comm, &requests[0]);
  if (rc == MPI_SUCCESS && out_len >= 0)
    rc = MPI_Isend((void*)out, out_len, MPI_BYTE, peer, SMC_AGREEMENT_TAG, comm, &requests[1]);
  if (rc == MPI_SUCCESS) rc = wait_both(requests, deadline);
  if (rc == SMC_EXCHANGE_LATE && requests[0] != MPI_REQUEST_NULL) { /* cancel the late receive */
    MPI_Cancel(&requests[0]);
    /* A receive already matched to a message whose sender died mid-way cannot be cancelled, and a wait for it would
     * never end: it is left pending after CANCEL_WAIT_S, like a late send, in a buffer that outlives the rounds. */
    MPI_Request cancelled[2] = {requests[0], MPI_REQUEST_NULL};
    wait_both(cancelled, now() + CANCEL_WAIT_S);
  }
  /* A late send stays pending (not every MPI can cancel one): the transport is refused from here on. */
  return rc;
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
