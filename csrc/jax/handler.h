/* SPDX-License-Identifier: Apache-2.0
 *
 * handler.h: what shmcomm.jax's XLA FFI handler (handler.c) and Python share. shmcomm/jax/native.py feeds every line
 * of it that is not a preprocessor directive to cffi's cdef, so it stays C99 and free of macros in declarations.
 *
 * The handler is built apart from the core (shmcomm._C) because it needs jaxlib's header, which the core's build
 * never sees; it reaches the core's collectives through the function pointers of smc_jax_core_t, which the shared-
 * memory transport hands out (shmcomm/transport/shm.py), so both modules run the same code on the same segment.
 */
#ifndef SHMCOMM_JAX_HANDLER_H_
#define SHMCOMM_JAX_HANDLER_H_

#include <stddef.h>
#include <stdint.h>

#include "shmcomm.h"

typedef struct {
  smc_result_t (*allreduce)(smc_comm_t*, const void*, void*, size_t, smc_datatype_t, smc_redop_t, double, double,
                            int64_t, uint64_t);
  smc_result_t (*reducescatter)(smc_comm_t*, const void*, void*, const uint64_t*, smc_datatype_t, smc_redop_t,
                                double, double, int64_t, uint64_t);
  smc_result_t (*broadcast)(smc_comm_t*, const void*, void*, size_t, int, uint64_t);
  smc_result_t (*allgatherv)(smc_comm_t*, const void*, size_t, void*, const uint64_t*, uint64_t);
  smc_result_t (*alltoallv)(smc_comm_t*, const void*, const uint64_t*, void*, const uint64_t*, uint64_t);
  smc_result_t (*barrier)(smc_comm_t*);
  const char* (*last_error)(void);
} smc_jax_core_t;

/* One per process, made and kept by Python (never freed, so that an executable compiled before a shutdown finds
 * it still there); executables carry its address and pid as attributes. */
typedef struct {
  int64_t pid;        /* the process it lives in: an executable from another process's cache is refused */
  smc_comm_t* comm;   /* the host's segment while the handler may call the core itself; NULL otherwise */
  smc_jax_core_t core;
  int max_ranks;      /* the longest per-rank list a call may carry */
  uint64_t huge_page; /* the kernel's transparent huge page size in bytes; 0: none to ask for */
} smc_jax_context_t;

/* One collective as the handler decoded it, for Python: to run it (comm is NULL: across hosts, or the engine runs)
 * or, after the core failed (rc != 0), to explain the failure. Sizes are in bytes. */
typedef struct {
  int kind;                 /* smc_coll_kind_t */
  int dtype;                /* smc_datatype_t */
  int op;                   /* shmcomm.vocabulary.ops.ReduceOp */
  int root;                 /* index in the communicator */
  double prescale;
  double postscale;
  uint64_t tag;
  const void* src;
  size_t src_bytes;
  const int64_t* src_dims;
  int64_t src_ndim;
  void* dst;
  size_t dst_bytes;
  const int64_t* rows;      /* allgather, alltoall: rows from each rank; reducescatter: rows to each */
  const int64_t* sends;     /* alltoall: rows to each rank */
  size_t nranks;            /* entries of rows and sends */
  const char* name;
  size_t name_len;
  int rc;                   /* the core's result, if it failed */
  char error[2048];         /* Python's message on failure */
} smc_jax_call_t;

/* The handler, for jax.ffi.register_ffi_target (as a function pointer); not a function of the core. */
void* shmcomm_jax_handler_address(void);

#endif
