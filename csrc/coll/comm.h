/* SPDX-License-Identifier: Apache-2.0 */
/* The communicator: everything a rank knows about its job segment. No state lives outside it. */
#ifndef SMC_COLL_COMM_H_
#define SMC_COLL_COMM_H_

#include <stddef.h>
#include <stdint.h>

#include "shm/layout.h"
#include "shm/wait.h"
#include "shmcomm.h"

#define SMC_MAX_WINDOWS 16 /* shared buffers a communicator lists at once; more stay plain memory */
#define SMC_OFFERED_RANGES 32 /* buffers offered for huge pages that a communicator remembers (coll/huge_pages.c) */

typedef struct {
  uint64_t start, end; /* the whole huge pages inside an offered buffer */
  uint32_t seen;       /* times offered; collapsed at the second */
} smc_offered_range_t;

#define SMC_CHOICE_CLASSES 24 /* sizes a communicator learns apart, a power of two each (coll/path_choice.c) */

#define SMC_CHOICE_RECENT 5 /* calls of the path taken whose median cost stands for it (coll/path_choice.c) */

typedef struct {
  double cost[2];        /* seconds per byte of the staged [0] path and the kernel's copy [1], as last learned; 0:
                          * untried */
  double recent[2][SMC_CHOICE_RECENT]; /* each path's costs since it was last tried afresh; 0: none */
  uint32_t until_other;  /* calls until the path not taken is tried again */
  uint32_t interval;     /* the last such wait: it doubles each time that path loses */
  uint32_t warming;      /* calls taken to learn both paths' first costs (coll/path_choice.c) */
  uint32_t trying;       /* a try (of the path not taken, or of one never learned) has had its first call */
} smc_choice_class_t;

struct smc_comm {
  int rank;
  int size;
  char name[128];          /* segment name, "/shmcomm-<token>-<generation>" */
  uint8_t* base;           /* the mapping */
  size_t total_bytes;
  smc_shm_header_t* hdr;
  smc_rank_ctl_t* ctl;     /* size entries */
  uint8_t* slots;          /* size x slot_bytes */
  size_t slot_bytes;
  size_t half_bytes;       /* one staging half: a step writes one half while peers may still read the other */
  size_t small_bytes;
  uint32_t seq;            /* the last value this rank posted */
  int parity;              /* the half the next step uses */
  int unsettled;           /* the last step (seq) returned early somewhere: the next collective checks it (step.c) */
  int holds_alive;         /* this rank holds ctl[rank].alive */
  int fd;                  /* the segment's file, kept open to reserve box memory (smc_segment_reserve) */
  double timeout_s;
  double liveness_s;
  int spin_us;
  int yield_us;
  int yield_now_us;          /* the yield of the next wait: yield_us, less after waits that outlasted it (step.c) */
  uint64_t waits_beside_peer; /* step waits (with yield_us) that yielded: a peer last ran on this rank's CPU */
  uint64_t waits_apart;       /* step waits (with yield_us) that polled instead: every peer last ran elsewhere */
  int cpu_each;              /* the ranks are no more than the CPUs this rank may run on (step.c, moving apart) */
  uint32_t move_in, move_every; /* waits beside a lower rank until this rank next moves apart, and between moves */
  uint64_t apart_at_move;    /* waits_apart at the last move */
  uint64_t moves;            /* moves apart (step.c) */
  smc_result_t broken;     /* non-success once a failure left the protocol state unknown */
  char broken_msg[512];
  smc_failure_t broken_failure; /* the failure data of that failure, repeated by every later refusal */
  int job_ranks[SMC_MAX_RANKS]; /* a copy of smc_config_t.job_ranks: nothing points into the caller's memory */
  uint64_t single_copy_bytes; /* inputs of at least this size move by single copy (coll/cma.c); 0: never */
  uint64_t broadcast_single_copy_bytes; /* broadcast's (smc_config_t) */
  uint64_t cache_bytes;       /* one core's L2 (smc_config_t.cache_bytes) */
  uint64_t shared_cache_bytes; /* the last-level cache (smc_config_t.shared_cache_bytes) */
  int single_copy_probed;     /* smc_config_t's */
  int single_copy_learned;    /* the kernel's copy proved slow at init: allgathers and alltoalls learn whether single
                               * copy pays (coll/path_choice.c) */
  size_t piece_bytes;         /* allreduce's bytes per rank and step (coll/allreduce.c); 0: a half's share */
  int piece_probed;           /* smc_config_t's */
  uint64_t pull_bytes;        /* allreduces and reduce-scatters of at least this size pull (coll/allreduce.c) */
  int pull_probed;            /* smc_config_t's */
  int race_pause_us;          /* smc_config_t's */
  int cma;                    /* every rank can read its peers' memory (decided together at init) */
  int cma_fast;               /* and every rank's kernel copy proved fast (coll/cma.c) */
  uint64_t cma_probe;         /* the value a neighbour reads at init to prove it reads this process */
  uint8_t* bounce;            /* single-copy reads between misaligned buffers pass through here (coll/cma.c) */
  size_t bounce_bytes;
  smc_window_t* windows[SMC_MAX_WINDOWS]; /* shared buffers every rank maps (coll/window.c) */
  uint64_t window_serial;                 /* how many this communicator has created, on every rank alike */
  uint64_t window_calls;                  /* collectives that read or wrote shared buffers directly */
  uint64_t pulled_calls;                  /* allreduces and reduce-scatters that pulled (coll/allreduce.c) */
  uint64_t pieces;                        /* the steps of the staged and pulled ones, a piece each */
  uint64_t single_copy_calls;             /* allgathers, alltoalls and broadcasts that moved by single copy */
  uint64_t shared_from_bytes;             /* smc_config_t's */
  uint64_t huge_bytes;                    /* a transparent huge page's size; 0: buffers are not offered */
  smc_offered_range_t offered[SMC_OFFERED_RANGES];
  uint32_t offered_next;                  /* the slot the next new range takes */
  uint64_t huge_collapses;                /* ranges collapsed into huge pages */
  /* What each path cost, where it is learned (coll/path_choice.c): pulling, and single copy by collective */
  smc_choice_class_t pull_classes[SMC_CHOICE_CLASSES];
  smc_choice_class_t allgather_classes[SMC_CHOICE_CLASSES];
  smc_choice_class_t alltoall_classes[SMC_CHOICE_CLASSES];
  struct {
    double start;     /* when the allgather or alltoall being learned began */
    uint64_t bytes;   /* its size, by which it is learned; 0: none is */
    uint64_t windows; /* window_calls then: a call that used shared buffers teaches nothing */
  } learning;
};

/* How messages and failure data name rank r of this communicator. */
static inline int smc_job_rank(const smc_comm_t* c, int r) { return c->job_ranks[r]; }

/* The half of rank r's slot that the current step uses. */
static inline uint8_t* smc_half(smc_comm_t* c, int r) {
  return c->slots + (size_t)r * c->slot_bytes + (size_t)c->parity * c->half_bytes;
}

/* liveness.c: SMC_SUCCESS while rank r is attached and alive; otherwise SMC_ERR_RANK_FAILED with a text and failure
 * data naming it. */
smc_result_t smc_peer_check(smc_comm_t* c, int r, const char* what);
/* This rank gave up waiting for rank r (a timeout naming it): a peer that finds this rank gone names r instead. */
void smc_comm_blame(smc_comm_t* c, int r);

/* step.c: the building blocks of every collective. A collective is a series of steps; in a step each rank writes
 * into its current half (smc_half), all ranks synchronise (smc_sync; more than once if the step has phases), each
 * reads what it needs from the others' halves, and the step ends with smc_flip. Alternating halves is what makes
 * this safe without a trailing barrier: before a rank writes a half again, the sync of the step in between proved
 * that every peer finished reading it.
 * smc_coll_begin: the sync of a collective's first step. Publishes `desc` and compares every rank's: a difference
 * fails the collective on every rank alike (SMC_ERR_MISMATCH, halves flipped) and leaves the communicator usable. */
smc_result_t smc_coll_begin(smc_comm_t* c, smc_desc_t* desc, const char* what);
/* smc_coll_begin_early: the first and only step of a collective in which every rank waits for `root` alone (a small
 * broadcast: its root returns once it has published, as MPI's may, and no receiver waits for the others). A rank
 * other than root checks root's descriptor against its own (a difference fails its call at once); the comparison of
 * every rank's, and the wait for the ranks not waited for, come at the start of this rank's next collective
 * (smc_coll_enter). Flips the halves on failure, as smc_coll_begin does. */
smc_result_t smc_coll_begin_early(smc_comm_t* c, smc_desc_t* desc, int root, const char* what);
smc_result_t smc_sync(smc_comm_t* c, const char* what);
static inline void smc_flip(smc_comm_t* c) { c->parity ^= 1; }
const smc_desc_t* smc_peer_desc(smc_comm_t* c, int r); /* valid between begin and the next step */
/* Whether any rank offered the kernel's copy in its descriptor, and so left its first piece or window unstaged. */
static inline int smc_kernel_copy_offered(smc_comm_t* c) {
  for (int j = 0; j < c->size; j++)
    if (smc_peer_desc(c, j)->kernel_copy) return 1;
  return 0;
}
/* Entry check of every public call: a broken communicator refuses work. */
smc_result_t smc_comm_usable(smc_comm_t* c, const char* what);
/* Entry of every collective: smc_comm_usable, then, after a step that returned early, the wait for every rank to have
 * taken it and the comparison of their descriptors. Where that step failed on a rank that does not know it yet (its
 * root, or a receiver that agreed with the root), this collective fails on every rank without a step, naming it. */
smc_result_t smc_coll_enter(smc_comm_t* c, const char* what);
/* A collective whose own argument check failed with rc (SMC_ERR_INVALID or SMC_ERR_NOMEM, this thread's error text
 * saying why) still takes its first step as a refusal (smc_coll_refuse), so that the peers fail at once instead of
 * waiting; returns rc with its text and failure data as they were. Other codes (a broken or NULL communicator) come
 * back untouched: no step can be taken then. */
smc_result_t smc_refuse_here(smc_comm_t* c, smc_coll_kind_t kind, smc_result_t rc);
uint64_t smc_digest(const uint64_t* values, int n, uint64_t seed);

/* cma.c: single copy through Linux cross-memory attach (process_vm_readv, process_vm_writev). A reader copies
 * straight from the owner's buffer, whose address the owner published in its descriptor (`addr`), instead of the
 * owner copying into its staging half and the reader copying out (alltoall, broadcast); or an owner writes straight
 * into the outputs whose addresses their ranks published (allgather). smc_cma_probe runs once at init, after every
 * rank attached: each rank reads a value from its neighbour's memory (the kernel allows writes on the same check),
 * and all ranks adopt single copy only if every rank could (a container without ptrace rights, or ranks in different
 * pid namespaces, keep the staging path).
 * smc_single_copy: whether a collective whose largest input is `bytes` takes it; the same answer on every rank.
 * smc_broadcast_single_copy: the same for a broadcast of `bytes`, by its own threshold.
 * smc_cma_read: copies `bytes` from rank r's address `remote` into `local`. */
smc_result_t smc_cma_probe(smc_comm_t* c, double timeout_s);
static inline int smc_single_copy(const smc_comm_t* c, uint64_t bytes) {
  return c->cma && c->single_copy_bytes > 0 && bytes >= c->single_copy_bytes;
}
/* smc_alltoall_single_copy: the same for an alltoall whose largest input is `bytes`. Single copy moves a part per
 * peer, one system call each: the parts' mean size decides. */
static inline int smc_alltoall_single_copy(const smc_comm_t* c, uint64_t bytes) {
  return smc_single_copy(c, bytes / (uint64_t)c->size);
}
/* smc_single_copy_learned: where the kernel's copy proved slow at init, an allgather whose input, or an alltoall
 * whose mean part, is `bytes` offers single copy only as each rank learns it pays (smc_single_copy_offer), up to
 * `steadier`, the input size (`whole`) from which single copy proved the steadier there, and is taken beyond. Each
 * call's cost then swings more with the machine's load than the paths differ, so that learning chose by chance. */
static inline int smc_single_copy_learned(const smc_comm_t* c, uint64_t bytes, uint64_t whole, uint64_t steadier) {
  return c->single_copy_learned && smc_single_copy(c, bytes) && whole < steadier;
}
static inline int smc_broadcast_single_copy(const smc_comm_t* c, uint64_t bytes) {
  return c->cma && c->broadcast_single_copy_bytes > 0 && bytes >= c->broadcast_single_copy_bytes;
}
/* smc_pull: whether an allreduce or reduce-scatter of `bytes` reads its range of the peers' inputs (and an allreduce
 * writes its reduced pieces straight into their outputs: coll/allreduce.c, pulled); by default only where the kernel's
 * copy proved fast on every rank, since each piece then goes through it once or twice per peer. */
static inline int smc_pull(const smc_comm_t* c, uint64_t bytes) {
  return c->cma && (c->cma_fast || !c->pull_probed) && c->pull_bytes > 0 && bytes >= c->pull_bytes;
}
/* smc_pull_learned: where the kernel's copy proved slow, an allreduce or reduce-scatter of `bytes` may still pull:
 * each rank learns which path costs less (coll/path_choice.c). */
static inline int smc_pull_learned(const smc_comm_t* c, uint64_t bytes) {
  return c->cma && !c->cma_fast && c->pull_probed && c->pull_bytes > 0 && bytes >= c->pull_bytes;
}
/* smc_pull_possible: whether an allreduce or reduce-scatter of `bytes` may pull, always or as learned. */
static inline int smc_pull_possible(const smc_comm_t* c, uint64_t bytes) {
  return smc_pull(c, bytes) || smc_pull_learned(c, bytes);
}
/* smc_pull_choose: whether this rank offers to pull an allreduce or reduce-scatter of `bytes` (every rank that can
 * pull publishes its buffers; where pulling is learned, rank 0's offer decides for all, since ranks that tried the
 * dearer path each on its own schedule would seldom try it together); smc_pull_learn: what one cost (`pulled`:
 * whether it pulled), after it succeeded. */
int smc_pull_choose(smc_comm_t* c, uint64_t bytes);
void smc_pull_learn(smc_comm_t* c, uint64_t bytes, int pulled, double seconds);
/* smc_single_copy_offer: whether this rank offers single copy for an allgather or alltoall of `bytes` (its input),
 * learned in `classes` (that collective's); it starts the timing. Rank 0's offer decides, as for pulling; the
 * others' say only whether they staged their first window. smc_single_copy_taught: what that call cost, once it
 * succeeded (`single`: whether it moved by single copy).
 * smc_choice_offer and smc_choice_learn: the same for any two paths, the kernel's copy or not, learned in `classes`
 * for sizes from `base`; only the rank that `leads` tries the dearer path now and then, the others offer the cheaper
 * (they stage or not as the leader most likely will). */
int smc_single_copy_offer(smc_comm_t* c, smc_choice_class_t* classes, uint64_t bytes);
void smc_single_copy_taught(smc_comm_t* c, smc_choice_class_t* classes, int single);
int smc_choice_offer(smc_choice_class_t* classes, uint64_t base, uint64_t bytes, int leads);
void smc_choice_learn(smc_choice_class_t* classes, uint64_t base, uint64_t bytes, int took, double seconds);
smc_result_t smc_cma_read(smc_comm_t* c, int r, void* local, uint64_t remote, uint64_t bytes, const char* what);
/* smc_cma_write: copies `bytes` from `local` into rank r's address `remote` (process_vm_writev). */
smc_result_t smc_cma_write(smc_comm_t* c, int r, uint64_t remote, const void* local, uint64_t bytes,
                           const char* what);

/* huge_pages.c: smc_huge_pages_init reads the huge page size where `enabled` (smc_config_t.huge_pages) and the kernel
 * has them. smc_huge_pages_offer: a buffer of this rank that its peers are about to reach by the kernel's copy; its
 * whole huge pages are collapsed into transparent huge pages the second time the same range is offered. */
void smc_huge_pages_init(smc_comm_t* c, int enabled);
void smc_huge_pages_offer(smc_comm_t* c, const void* p, uint64_t bytes);

/* window.c, for the collectives: the listed shared buffer holding [p, p + bytes), or NULL; its serial; rank r's buffer
 * as this process maps it (complete in every listed window); its size. smc_windows_close drops the communicator's
 * references (at destroy): the peers' buffers are unmapped, the callers' stay until they drop theirs. */
smc_window_t* smc_window_holding(smc_comm_t* c, const void* p, uint64_t bytes);
uint64_t smc_window_serial(const smc_window_t* w);
uint8_t* smc_window_peer(const smc_window_t* w, int r);
uint64_t smc_window_bytes(const smc_window_t* w);
void smc_windows_close(smc_comm_t* c);
/* smc_window_name: the shared buffer holding [data, data + bytes), named in `desc` (serial and offset) for the peers;
 * NULL, and nothing named, below the size from which shared buffers pay (smc_config_t.shared_from_bytes) or outside
 * them. After the first step: smc_windows_agreed, whether every rank's data lies in w (each rank's descriptor names it
 * with an offset that leaves room for `bytes`), and if so bufs[j] is rank j's data as this process maps it;
 * smc_any_window, whether any rank named one. Both give the same answer on every rank. */
smc_window_t* smc_window_name(smc_comm_t* c, smc_desc_t* desc, const void* data, uint64_t bytes);
int smc_windows_agreed(smc_comm_t* c, const smc_window_t* w, uint64_t bytes, uint8_t** bufs);
int smc_any_window(smc_comm_t* c);
/* smc_window_peer_data: rank j's data of `bytes` as this process maps it, where j's first step's descriptor named a
 * shared buffer this rank lists (it may have dropped one that j still uses); else NULL. For a collective whose ranks
 * may each choose, peer by peer, between the mapping and the kernel's copy. */
uint8_t* smc_window_peer_data(smc_comm_t* c, int j, uint64_t bytes);

#endif
