/* SPDX-License-Identifier: Apache-2.0 */
/* The agreement's rounds across hosts (shmcomm/algorithms/agreement.py), driven from C over the job's MPI.
 *
 * Built on first use with the MPI wheel's mpicc (shmcomm/transport/crossing.py), never part of the core: the core
 * stays free of MPI. cffi reads the declarations below. */
#include <stdint.h>

/* What a round does with its peer (agreement._schedule's plan, in order). */
enum {
  SMC_ROUND_HAND_OVER = 0, /* send everything, receive the verdict and adopt it (a folded rank) */
  SMC_ROUND_TAKE = 1,      /* receive a folded rank's message and merge it */
  SMC_ROUND_SWAP = 2,      /* send and receive at once, merge (recursive doubling) */
  SMC_ROUND_GIVE_BACK = 3  /* send the verdict back to a folded rank */
};

/* Runs the rounds. `message` and `incoming` are HEADER_BYTES of header (uint64 words: signature, status, lowest failed
 * rank + 1, data bytes) then room for `capacity` bytes of data; `message` holds this rank's header and data, and
 * holds the combined verdict and data afterwards. `nbytes` of data (`count` elements of the core's type `code`) are
 * reduced with `op` by `reduce` (the core's smc_reduce, by address). Every wait ends by `timeout_s` from the call.
 * Returns 0; or -1 after a wait ran out (*late_round: the round whose peer did not come; the late receive is
 * cancelled, a late send stays pending); or MPI's error code (> 0, *late_round: the round); or
 * SMC_CROSSING_REDUCE_FAILED - the core's error code when the reduction failed. */
#define SMC_CROSSING_REDUCE_FAILED -1000
/* Data of at least this many bytes, among 4 or more ranks after the fold, is reduced by halving and gathered by
 * doubling (agreement.py: HALVING_BYTES, the same number). */
#define SMC_CROSSING_HALVING_BYTES (64 << 10)
int smc_crossing_rounds(uintptr_t comm_address, const int* peers, const int* kinds, int rounds, int my_rank,
                        void* message, void* incoming, uint64_t capacity, uint64_t nbytes, uint64_t count, int code,
                        int op, uintptr_t reduce, double timeout_s, int* late_round);

/* The MPI library this module was built against (MPI_Get_library_version), to compare with mpi4py's. */
int smc_crossing_library(char* text, int cap);
