/* SPDX-License-Identifier: Apache-2.0 */
/* What the quick cross-host allreduce (csrc/py/quick_crossing.c) needs to run the agreement's rounds: the exchange
 * over MPI of csrc/mpi/crossing.c, by address (this module stays free of MPI), and the arguments the rounds take,
 * which the agreement keeps for every call (shmcomm/transport/crossing.py fills it). cffi reads this declaration
 * too. */
#ifndef SMC_PY_QUICK_CROSSING_H_
#define SMC_PY_QUICK_CROSSING_H_
#include <stdint.h>

typedef struct {
  uintptr_t exchange;      /* smc_crossing_exchange (csrc/mpi/crossing.h), an smc_exchange_fn */
  uintptr_t context;       /* its context: the address of the MPI_Comm */
  const int* peers;
  const int* kinds;
  int count;               /* rounds */
  int rank;
  void* message;           /* the agreement's header and data, where the result is left */
  void* incoming;
  uint64_t capacity;       /* bytes of data the messages hold */
  double timeout_s;
  int late_round;          /* set by the rounds when a wait ran out or MPI failed */
  int world_size;          /* an Average's divisor */
  uintptr_t row;           /* this host's shared-memory communicator (smc_comm_t*); its first rank crosses */
  int row_rank;
  int row_size;
  int world_rank;          /* the culprit a failure of this rank's rounds names (+ 1) */
  uint64_t min_bytes;      /* inputs from min_bytes to max_bytes take this path; others the full one */
  uint64_t max_bytes;
  const int* usable[2];    /* both transports' flags (transport/mpi.py): 0 once a failure left one out of step */
} smc_crossing_call_t;
#endif
