/* SPDX-License-Identifier: Apache-2.0 */
/* The agreement's rounds across hosts (shmcomm/algorithms/agreement.py), driven from C over the job's MPI.
 *
 * Built on first use with the MPI wheel's mpicc (shmcomm/transport/crossing.py), never part of the core: the core
 * stays free of MPI. cffi reads the declarations below. */
#include <stdint.h>

#include "shmcomm.h" /* the agreement's statuses, header, rounds */

/* Runs the rounds. `message` and `incoming` are a header (SMC_AGREEMENT_HEADER_BYTES) then room for `capacity` bytes
 * of data; `message` holds this rank's header and data, and holds the combined verdict and data afterwards. `nbytes` of data (`count` elements of the core's type `code`) are
 * reduced with `op` by `reduce` (the core's smc_reduce, by address). Every wait ends by `timeout_s` from the call.
 * Returns 0; or -1 after a wait ran out (*late_round: the round whose peer did not come; the late receive is
 * cancelled, a late send stays pending); or MPI's error code (> 0, *late_round: the round); or
 * SMC_CROSSING_REDUCE_FAILED - the core's error code when the reduction failed. */
int smc_crossing_rounds(uintptr_t comm_address, const int* peers, const int* kinds, int rounds, int my_rank,
                        void* message, void* incoming, uint64_t capacity, uint64_t nbytes, uint64_t count, int code,
                        int op, uintptr_t reduce, double timeout_s, int* late_round);

/* The MPI library this module was built against (MPI_Get_library_version), to compare with mpi4py's. */
int smc_crossing_library(char* text, int cap);
