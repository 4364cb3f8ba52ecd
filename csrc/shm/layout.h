/* SPDX-License-Identifier: Apache-2.0 */
/* The layout of a job segment. Every rank maps the same bytes, so these structs are the wire format between the
 * processes of one host: change them only together with SMC_LAYOUT_VERSION.
 *
 *   [header + box registry][rank control blocks][staging slots: size x slot_bytes][box arena]
 *
 * Words that one rank writes and others poll sit alone on their cache line, so a poller never steals the line a
 * writer is filling. */
#ifndef SMC_SHM_LAYOUT_H_
#define SMC_SHM_LAYOUT_H_

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define SMC_CACHE_LINE 64
#define SMC_PAGE 4096
#define SMC_MAGIC 0x31474553434d53ULL /* "SMCSEG1" */
#define SMC_LAYOUT_VERSION 8
#define SMC_MAX_RANKS 1024
#define SMC_MAX_BOXES 256
#define SMC_BOX_NAME_MAX 64

enum { BOX_FREE = 0, BOX_LIVE = 1, BOX_DOOMED = 2 /* destroyed, space held until the last handle closes */ };

typedef struct {
  char name[SMC_BOX_NAME_MAX]; /* NUL-terminated */
  uint32_t state;              /* BOX_* ; guarded by the registry lock, like every field up to `handles` */
  uint32_t dtype;              /* smc_datatype_t */
  uint64_t count;              /* elements */
  uint64_t offset;             /* data position from the segment start; 0 = never allocated */
  uint64_t capacity_bytes;     /* space owned by this entry, kept when freed so it can be reused */
  uint32_t handles;            /* open handles across all ranks */
  _Atomic uint32_t sleepers;   /* waiters on version_word */
  _Atomic uint64_t version;    /* bumped on every write and accumulate */
  _Atomic uint32_t version_word; /* low 32 bits of version: the futex word waiters sleep on */
  int32_t holder;              /* the rank (index in the communicator) holding the lock, -1: none; for messages */
  int32_t holder_tid;          /* the holding thread */
  uint32_t depth;              /* how many times the holder holds it (the lock is recursive) */
  pthread_mutex_t lock;        /* pshared, robust, recursive: the box lock */
} __attribute__((aligned(SMC_CACHE_LINE))) smc_box_entry_t;

/* What a rank is about to do, published at the first step of every collective and compared by every rank. */
typedef struct {
  double prescale;
  double postscale;
  uint64_t count; /* elements, or bytes for byte-oriented collectives */
  uint64_t tag;   /* caller's digest (shapes) mixed with a digest of per-rank count arrays */
  int64_t divisor;
  uint64_t own;  /* a per-rank value that is not compared (what this rank contributes to an allgatherv, where an
                  * allreduce's or reduce-scatter's peers may read its input by single copy) */
  uint64_t addr; /* not compared: where peers may read this rank's input by single copy (coll/cma.c), or write
                  * into its output (allgather, a pulled allreduce), or 0 */
  uint64_t window;    /* not compared: 1 + the serial of the shared buffer holding this rank's data (coll/window.c), */
  uint64_t window_at; /* or 0; and the data's offset in it */
  uint32_t coll; /* smc_coll_kind_t */
  uint32_t dtype;
  uint32_t op;
  int32_t root;
  int32_t refused; /* non-zero: this rank's call failed its own checks; its half holds the reason (smc_coll_refuse) */
  int32_t early;   /* not compared: non-zero where this rank waits for the root alone (smc_coll_begin_early) */
  int32_t kernel_copy; /* not compared: non-zero where this rank offers to take the kernel's copy (an allreduce's or
                        * reduce-scatter's pull, an allgather's or alltoall's single copy), leaving its first piece or
                        * window unstaged; where that choice is learned, rank 0's offer decides (coll/path_choice.c) */
} smc_desc_t;

typedef struct {
  /* Line 1, written by the owner on every step, polled by everyone: the owner's progress counter. */
  _Atomic uint32_t seq __attribute__((aligned(SMC_CACHE_LINE)));
  _Atomic uint32_t sleepers; /* peers asleep on seq; the owner wakes them only when non-zero */
  _Atomic int32_t cpu;       /* 1 + the CPU the owner ran on when it last posted seq; 0 before */
  /* Line 2, liveness: the owner holds `alive` while attached; the kernel releases it as "owner died" if the
   * process dies, which peers observe with a trylock. */
  int32_t pid __attribute__((aligned(SMC_CACHE_LINE)));
  _Atomic uint32_t dead;     /* set by the first peer that saw the owner die */
  _Atomic uint32_t departed; /* set by the owner on a clean shutdown */
  _Atomic uint32_t failed;   /* set by the owner that leaves because of an error of its own */
  _Atomic int32_t blamed;    /* set by the owner: 1 + the rank its last failed wait was for (smc_comm_blame), or 0 */
  pthread_mutex_t alive;
  /* Line 3: the owner's doorbell: its engine sleeps on it between cycles; rung by itself or by any rank. */
  _Atomic uint32_t bell __attribute__((aligned(SMC_CACHE_LINE)));
  _Atomic uint32_t bell_sleepers;
  /* Line 4+: the descriptor of the collective in flight, one per staging half. */
  smc_desc_t desc[2] __attribute__((aligned(SMC_CACHE_LINE)));
  /* Written once at init (coll/cma.c): where a peer can read this rank's probe value with process_vm_readv, and
   * this rank's verdict on reading its neighbour's (1 published, 2 could not, 3 could). */
  uint64_t cma_addr __attribute__((aligned(SMC_CACHE_LINE)));
  uint64_t cma_value;
  _Atomic uint32_t cma_state;
  _Atomic uint32_t cma_sleepers;
} smc_rank_ctl_t;

typedef struct {
  uint64_t magic;
  uint32_t layout_version;
  int32_t size;
  uint64_t total_bytes;
  uint64_t slot_bytes;
  uint64_t ctl_offset;
  uint64_t slots_offset;
  uint64_t arena_offset;
  uint64_t arena_bytes;
  _Atomic uint32_t ready __attribute__((aligned(SMC_CACHE_LINE))); /* creator sets 1 when the header is valid */
  _Atomic uint32_t attached;                                       /* ranks attached so far (futex word) */
  _Atomic uint32_t attach_sleepers;
  _Atomic uint32_t refcount; /* mappings alive; the last to leave unlinks the name if nobody did */
  _Atomic uint32_t unlinked;
  pthread_mutex_t registry_lock __attribute__((aligned(SMC_CACHE_LINE))); /* pshared, robust: box registry */
  uint64_t arena_used;
  smc_box_entry_t boxes[SMC_MAX_BOXES];
} smc_shm_header_t;

#endif
