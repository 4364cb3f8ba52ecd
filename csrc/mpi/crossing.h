/* SPDX-License-Identifier: Apache-2.0 */
/* The agreement's exchanges across hosts over the job's MPI, for the core's rounds (smc_agreement_rounds).
 *
 * Built on first use with the MPI wheel's mpicc (shmcomm/transport/crossing.py), never part of the core: the core
 * stays free of MPI. cffi reads the declarations below. */
#include <stdint.h>

#include "shmcomm.h" /* the exchange's contract (smc_exchange_fn) and its codes */

/* An smc_exchange_fn over MPI: `context` is the address of an MPI_Comm (mpi4py's MPI._addressof), `peer` a rank in
 * it. MPI's error codes are positive. */
int smc_crossing_exchange(void* context, int peer, void* into, int into_len, const void* out, int out_len,
                          double deadline);

/* The MPI library this module was built against (MPI_Get_library_version), to compare with mpi4py's. */
int smc_crossing_library(char* text, int cap);
