/* SPDX-License-Identifier: Apache-2.0
 *
 * shmcomm.h: the one public C header of the shmcomm core. csrc/ffi_build.py feeds every line of it that is not
 * a preprocessor directive to cffi's cdef, so it must stay C99 and free of macros in declarations.
 *
 * Conventions: every non-trivial function returns smc_result_t; on failure the calling thread's last-error text
 * (smc_last_error) says what went wrong and its failure data (smc_last_failure) says it as numbers. Ranks are named
 * by their job rank (smc_config_t.job_ranks) in both. `count` is in elements, `*_bytes` in bytes. In-place iff
 * sendbuf == recvbuf.
 */
#ifndef SHMCOMM_H_
#define SHMCOMM_H_

#include <stddef.h>
#include <stdint.h>

typedef enum {
  SMC_SUCCESS = 0,
  SMC_ERR_INVALID = 1,     /* bad argument from the caller */
  SMC_ERR_SYSTEM = 2,      /* a system call failed */
  SMC_ERR_TIMEOUT = 3,     /* a wait ran past its limit while every peer was alive */
  SMC_ERR_RANK_FAILED = 4, /* a peer died or left; the communicator is unusable from now on */
  SMC_ERR_MISMATCH = 5,    /* ranks called different collectives or disagreed on arguments; every rank hears */
  SMC_ERR_NOMEM = 6,       /* out of memory, or the box arena is full */
  SMC_ERR_EXISTS = 7,      /* a box of that name exists already */
  SMC_ERR_NOT_FOUND = 8,   /* no box of that name */
  SMC_ERR_BROKEN = 9,      /* an earlier failure left the communicator unusable */
  SMC_ERR_REFUSED = 10,    /* a peer's call of the same collective failed its own checks (smc_coll_refuse): every
                            * other rank gets it at once, naming that rank and its error; the communicator lives */
  SMC_ERR_ABANDONED = 11   /* init gave up because the caller set its abandon word (smc_config_t.abandon) */
} smc_result_t;

typedef enum {
  SMC_FLOAT16 = 0,
  SMC_BFLOAT16 = 1,
  SMC_FLOAT32 = 2,
  SMC_FLOAT64 = 3,
  SMC_INT8 = 4,
  SMC_UINT8 = 5,
  SMC_INT16 = 6,
  SMC_INT32 = 7,
  SMC_INT64 = 8,
  SMC_NUM_DTYPES = 9
} smc_datatype_t;

typedef enum {
  SMC_SUM = 0,
  SMC_MIN = 1,
  SMC_MAX = 2,
  SMC_PROD = 3,
  SMC_NUM_OPS = 4
} smc_redop_t;

/* What a collective is, everywhere: in the descriptor every rank publishes and compares (csrc/coll/step.c), the
 * engine's negotiation and the cross-host agreement; Python reads lib.SMC_COLL_*, so there is one numbering. */
typedef enum {
  SMC_COLL_BARRIER = 1,
  SMC_COLL_ALLREDUCE = 2,
  SMC_COLL_REDUCESCATTER = 3,
  SMC_COLL_BROADCAST = 4,
  SMC_COLL_ALLGATHERV = 5,
  SMC_COLL_ALLTOALLV = 6,
  SMC_COLL_WINDOW = 7 /* creating a shared buffer (smc_window_create) */
} smc_coll_kind_t;

/* A part of a collective's description that ranks can disagree on, in the order the check compares them. */
typedef enum {
  SMC_FIELD_NONE = 0,
  SMC_FIELD_COLL = 1,  /* different collectives */
  SMC_FIELD_DTYPE = 2,
  SMC_FIELD_COUNT = 3, /* element or byte counts, also one rank's share of an allgather or alltoall */
  SMC_FIELD_OP = 4,
  SMC_FIELD_ROOT = 5,
  SMC_FIELD_SCALE = 6, /* prescale, postscale or divisor */
  SMC_FIELD_TAG = 7    /* the caller's tag or the per-rank counts: the shapes differ */
} smc_field_t;

/* A failure as data, so that callers never parse the text. */
typedef struct {
  smc_result_t code; /* what failed; for SMC_ERR_BROKEN, the earlier failure that broke the communicator */
  int rank;          /* job rank of the peer that died, left or is late, or of the first rank whose call differs
                      * from the communicator's rank 0 (rank 1 when rank 0 is the odd one out); -1 if none */
  smc_field_t field; /* mismatches: the first field that differs; SMC_FIELD_NONE otherwise */
  int earlier;       /* 1: a step that returned early failed (coll/step.c), which not every peer fails at once */
} smc_failure_t;

/* How a rank finds its peers and how it waits. Every rank of a job passes the same values except `rank`. */
typedef struct {
  const char* token;      /* job token: 8..64 characters of [A-Za-z0-9_]; names the shared segment */
  int generation;         /* bumped on each init in one process, so init/shutdown/init meets a fresh segment */
  int rank;               /* 0 .. size-1 */
  int size;               /* ranks sharing this segment (the ranks of one host) */
  double start_timeout_s; /* how long init waits for every rank to attach */
  double timeout_s;       /* how long any collective wait may last while all peers are alive */
  double liveness_s;      /* how often a sleeping waiter checks that the peers it waits for are alive */
  size_t slot_bytes;      /* per-rank staging buffer, split in two halves used alternately */
  size_t small_bytes;     /* allreduce up to this many bytes takes the one-step path */
  size_t arena_bytes;     /* room for Soft Memory Boxes */
  int spin_us;            /* microseconds a waiter polls before it sleeps on a futex */
  int yield_us;           /* then microseconds a step's waiter yields (a peer last ran on its CPU), or polls, before
                           * it sleeps; with it, no polling first */
  size_t single_copy_bytes; /* allgather inputs and alltoall parts per peer (their mean) of at least this size move
                             * by single copy (CMA) where every rank may reach its peers' memory; 0: never */
  size_t broadcast_single_copy_bytes; /* the same for broadcast buffers; 0: never */
  size_t cache_bytes;     /* one core's L2: single copy's chunks, and where its copies start to bypass it; 0: 1 MiB */
  size_t shared_cache_bytes; /* the last-level cache: reductions whose data outgrow it write past it; 0: 8 L2s */
  int single_copy_probed; /* 1: where the kernel's copy proves slow at init on any rank (coll/cma.c), allgathers and
                           * alltoalls learn whether single copy pays; 0: it always does from single_copy_bytes */
  size_t piece_bytes;     /* allreduce and reduce-scatter move at most this many bytes of each rank's range per step,
                           * so that a step's copies stay in the cache; 0: as many as a staging half holds */
  int piece_probed;       /* 1: piece_bytes sizes pulled steps only, staged ones take a half's share; 0: both */
  size_t pull_bytes;      /* allreduces and reduce-scatters of at least this size read each rank's range of the
                           * peers' inputs (and allreduces write its reduced pieces straight into their outputs) by
                           * cross-memory attach where every rank's kernel copy proved fast at init, instead of
                           * through the staging halves; 0: never */
  int pull_probed;        /* 1: pull only where every rank's kernel copy proved fast at init; 0: wherever every rank
                           * may read its peers' memory (a set pull_bytes forces the path) */
  size_t shared_from_bytes; /* collectives on at least this much data in shared buffers (smc_window_create) read
                             * and write the peers' buffers directly */
  int huge_pages;         /* 1: a buffer that peers reach by the kernel's copy has the whole huge pages inside it
                           * collapsed into transparent huge pages the second time it is used so (coll/huge_pages.c);
                           * 0: buffers are left as they are */
  int race_pause_us;      /* tests only: a box accumulate or exchange pauses this long between its read and its write
                           * under the box lock, so that a lock that does not exclude loses an update every time */
  const int* job_ranks;   /* size entries: the job rank of each rank here, for messages and failure data; NULL
                           * means rank r is job rank r. Copied by smc_comm_create. */
  const uint32_t* abandon;  /* NULL, or a word another thread of the caller sets to non-zero when the world being
                             * formed will not be (an elastic job's newer membership replaced it): init's waits for
                             * the other ranks then stop within liveness_s with SMC_ERR_ABANDONED, instead of
                             * waiting out start_timeout_s for ranks that went on to the newer world. Read only
                             * during smc_comm_create. */
} smc_config_t;

typedef struct smc_comm smc_comm_t;
typedef struct smc_box smc_box_t;
typedef struct smc_window smc_window_t;

/* ---- limits (shmcomm/env/values.py reads them too) ---- */
/* The most bytes any buffer can hold: no mapping is larger than the address space (57 bits with 5-level paging).
 * Larger sizes (a negative count cast to unsigned, a sum that wrapped) are refused instead of read past. */
#define SMC_MAX_BYTES ((uint64_t)1 << 57)
/* The longest wait, in seconds: a timeout must be a number from 0 to this (every wait ends). */
#define SMC_MAX_SECONDS 1e9

/* ---- errors ---- */
const char* smc_last_error(void);            /* this thread's text for its last failure */
void smc_last_failure(smc_failure_t* out);   /* this thread's data for its last failure */

/* ---- communicator (csrc/coll/comm.c) ---- */
/* Creates or attaches the job segment, waits until all `size` ranks have attached, then removes the segment's name
 * so nothing is left in /dev/shm whatever happens next. */
smc_result_t smc_comm_create(const smc_config_t* config, smc_comm_t** comm);
/* Leaves the job; never blocks on peers. Safe on NULL. */
void smc_comm_destroy(smc_comm_t* comm);
/* Says that this rank leaves because of an error of its own (an uncaught exception), before it does: peers that
 * then find it gone say it failed instead of guessing that the ranks called different collectives. Safe on NULL. */
void smc_comm_mark_failed(smc_comm_t* comm);
/* Doorbells: one counter per rank that its engine sleeps on between cycles. A rank rings its own when it queues
 * work, and every rank's (rank -1) when the others must wake too (join, shutdown). */
void smc_comm_doorbell_ring(smc_comm_t* comm, int rank);
uint32_t smc_comm_doorbell_value(smc_comm_t* comm);
/* Sleeps while this rank's doorbell still reads `seen`, at most timeout_s; returns the value it reads then. */
uint32_t smc_comm_doorbell_wait(smc_comm_t* comm, uint32_t seen, double timeout_s);
/* Changes how long waits poll, and how long a collective's waits then yield the core, before they sleep (the
 * engine polls briefly while its caller computes, and yields while its caller waits). */
void smc_comm_set_spin(smc_comm_t* comm, int spin_us, int yield_us);
/* 1 when large allgather, alltoall and broadcast inputs move by single copy (every rank could read its neighbour's
 * memory at init, and single_copy_bytes is not 0). */
int smc_comm_single_copy(smc_comm_t* comm);
/* The sizes from which single copy moves allgather's and alltoall's pieces (broadcast = 0) or broadcast's buffer
 * (broadcast = 1), after init's probe (smc_config_t.single_copy_probed); 0 where nothing moves by single copy. */
uint64_t smc_comm_single_copy_from(smc_comm_t* comm, int broadcast);
/* 1 where allgathers and alltoalls from single_copy_from's size move by single copy only as each rank learns that it
 * pays (the kernel's copy proved slow at init: smc_config_t.single_copy_probed); 0 where they always do. */
int smc_comm_single_copy_learned(smc_comm_t* comm);
/* The size from which allreduces and reduce-scatters read the peers' inputs (and allreduces write the reduced pieces
 * into the peers' outputs: smc_config_t.pull_bytes), always or where it proves cheaper; 0 where none does. */
uint64_t smc_comm_pull_from(smc_comm_t* comm);
/* How many allreduces and reduce-scatters of this communicator did so; for logs and tests. */
uint64_t smc_comm_pulled_calls(smc_comm_t* comm);
/* How many pieces (at most smc_config_t.piece_bytes of each rank's range) the staged and pulled allreduces and
 * reduce-scatters of this communicator took, one step each; for tests. */
uint64_t smc_comm_pieces(smc_comm_t* comm);
/* How many allgathers, alltoalls and broadcasts of this communicator moved by single copy; for logs and tests. */
uint64_t smc_comm_single_copy_calls(smc_comm_t* comm);
/* Buffers (ranges of whole huge pages) this rank collapsed into transparent huge pages (smc_config_t.huge_pages). */
uint64_t smc_comm_huge_collapses(smc_comm_t* comm);
/* Step waits (with yield_us) that yielded to a peer on this rank's CPU; that polled; moves to another CPU; for tests. */
void smc_comm_waits(smc_comm_t* comm, uint64_t* yielded, uint64_t* polled, uint64_t* moved);
/* Ranks whose process is gone, as a bit mask (bit i = the communicator's i-th rank, job_ranks[i]; the first 64
 * only); for error reports and tests. Overwrites this thread's last failure. */
uint64_t smc_comm_failed_ranks(smc_comm_t* comm);

/* ---- collectives (csrc/coll/); every rank calls them in the same order ----
 * `tag` is any 64-bit value that must be equal on all ranks (a digest of shapes, say); a difference is a mismatch. */
/* recvbuf = postscale * op(prescale * sendbuf of every rank) / divisor. divisor is 1, or the size for an average. */
smc_result_t smc_allreduce(smc_comm_t* comm, const void* sendbuf, void* recvbuf, size_t count, smc_datatype_t dtype,
                           smc_redop_t op, double prescale, double postscale, int64_t divisor, uint64_t tag);
/* Rank r receives elements [sum(counts[0..r-1]), +counts[r]) of the reduction of every rank's sendbuf. */
smc_result_t smc_reducescatter(smc_comm_t* comm, const void* sendbuf, void* recvbuf, const uint64_t* counts,
                               smc_datatype_t dtype, smc_redop_t op, double prescale, double postscale,
                               int64_t divisor, uint64_t tag);
/* Root's sendbuf lands in every rank's recvbuf (the root's own too, unless they are the same buffer). */
smc_result_t smc_broadcast(smc_comm_t* comm, const void* sendbuf, void* recvbuf, size_t bytes, int root,
                           uint64_t tag);
/* recvbuf = concatenation of every rank's sendbuf; recv_bytes[r] is rank r's contribution and must be the same
 * array on every rank. */
smc_result_t smc_allgatherv(smc_comm_t* comm, const void* sendbuf, size_t send_bytes, void* recvbuf,
                            const uint64_t* recv_bytes, uint64_t tag);
/* send_bytes[j] bytes of sendbuf (in order) go to rank j; recv_bytes[j] bytes from rank j land in recvbuf in rank
 * order. recv_bytes[j] must equal rank j's send_bytes[me]. */
smc_result_t smc_alltoallv(smc_comm_t* comm, const void* sendbuf, const uint64_t* send_bytes, void* recvbuf,
                           const uint64_t* recv_bytes, uint64_t tag);
/* An allgather whose callers do not know each other's sizes: begin sends this rank's first window and returns every
 * rank's row count (rows of `row_bytes` bytes, which the tag must make equal on all ranks) from the same
 * synchronisation; finish, which every rank must call after a successful begin, moves the rest into recvbuf (rank
 * order). recvbuf NULL takes part without keeping anything, for a rank that has no place for the result. */
smc_result_t smc_allgather_begin(smc_comm_t* comm, const void* sendbuf, uint64_t send_rows, uint64_t row_bytes,
                                 uint64_t tag, uint64_t* every_rows);
smc_result_t smc_allgather_finish(smc_comm_t* comm, const void* sendbuf, void* recvbuf, uint64_t row_bytes,
                                  const uint64_t* every_rows);
/* The same for alltoall: begin sends send_rows[j] (rows to rank j) with the first window and fills matrix[j*size+i],
 * the rows rank j sends rank i; finish moves the data, rows from rank j landing in rank order. */
smc_result_t smc_alltoall_begin(smc_comm_t* comm, const void* sendbuf, const uint64_t* send_rows, uint64_t row_bytes,
                                uint64_t tag, uint64_t* matrix);
smc_result_t smc_alltoall_finish(smc_comm_t* comm, const void* sendbuf, void* recvbuf, uint64_t row_bytes,
                                 const uint64_t* matrix);
smc_result_t smc_barrier(smc_comm_t* comm);
/* A call that failed this rank's own checks (a bad argument) still takes the collective's first step, announcing
 * `reason` instead of data, so that every peer's call fails at once with SMC_ERR_REFUSED, naming this rank and
 * `reason`, instead of waiting for it until the timeout. `kind` is the collective the caller meant to run. The
 * collectives above do this themselves when their own argument checks fail. Returns SMC_SUCCESS once every rank has
 * taken the step (the caller then reports its own error), or the failure of that step. */
smc_result_t smc_coll_refuse(smc_comm_t* comm, smc_coll_kind_t kind, const char* reason);
enum { SMC_REASON_MAX = 480 }; /* bytes of a refusal's reason that peers read, its NUL included */

/* ---- shared buffers (csrc/coll/window.c) ----
 * Collective: every rank makes a buffer of `bytes` (bytes and tag the same on every rank, else every rank fails with
 * SMC_ERR_MISMATCH) that every rank of the communicator maps,
 * so that an in-place allreduce, a reduce-scatter or alltoall of an input, an allgather into an output or a broadcast
 * of a buffer inside it reads and writes the peers' buffers directly. With share 0, or
 * where some rank cannot map the others' (no ptrace rights, a kernel before 5.6), the buffer is this rank's plain
 * memory (smc_window_shared says 0) and collectives on it take their ordinary paths. The buffer stays mapped until
 * the caller's reference is dropped, whatever happens to the communicator; smc_window_drop is safe from any thread. */
smc_result_t smc_window_create(smc_comm_t* comm, uint64_t bytes, uint64_t tag, int share, smc_window_t** out);
void* smc_window_base(const smc_window_t* window);
int smc_window_shared(const smc_window_t* window);
void smc_window_drop(smc_window_t* window);
/* How many collectives of this communicator read and wrote shared buffers directly; for logs and tests. */
uint64_t smc_comm_shared_calls(smc_comm_t* comm);

/* ---- Soft Memory Box (csrc/coll/box.c): named typed buffers in the job arena ---- */
/* Creates a box of `count` elements, zero-filled. exist_ok: attach instead when one of that name, dtype and count
 * exists. */
smc_result_t smc_box_create(smc_comm_t* comm, const char* name, size_t count, smc_datatype_t dtype, int exist_ok,
                            smc_box_t** box);
/* Attaches a box another rank creates, waiting up to timeout_s for it to appear. */
smc_result_t smc_box_attach(smc_comm_t* comm, const char* name, double timeout_s, smc_box_t** box);
/* A striped box (shmcomm/smb/stripes.py) is described by a box of its name with this suffix. */
#define SMC_BOX_STRIPED_SUFFIX "@stripes"
/* Attaches the box `name` or, where there is none, the description of the striped box of that name, waiting up to
 * timeout_s for either; *striped is 1 for the description. */
smc_result_t smc_box_find(smc_comm_t* comm, const char* name, double timeout_s, smc_box_t** box, int* striped);
/* Releases this handle; the box stays for others. */
void smc_box_close(smc_box_t* box);
/* Removes the box name; space is reused once no handle to it remains. */
smc_result_t smc_box_destroy(smc_comm_t* comm, const char* name);
void* smc_box_data(smc_box_t* box);
size_t smc_box_count(smc_box_t* box);
smc_datatype_t smc_box_dtype(smc_box_t* box);
uint64_t smc_box_version(smc_box_t* box);
/* Copies elements [offset, offset+count) out under the box lock; *version gets the version read. */
smc_result_t smc_box_read(smc_box_t* box, size_t offset, size_t count, void* dst, uint64_t* version);
/* Overwrites elements [offset, offset+count) and bumps the version. */
smc_result_t smc_box_write(smc_box_t* box, size_t offset, size_t count, const void* src, uint64_t* version);
/* dst = beta*dst + alpha*src over [offset, offset+count), atomic against every other writer; bumps the version. */
smc_result_t smc_box_accumulate(smc_box_t* box, size_t offset, size_t count, const void* src, double alpha,
                                double beta, uint64_t* version);
/* Elastic averaging's exchange in one step, atomic against every other writer: with c the elements
 * [offset, offset+count), d = alpha*(x - c), then c += d; x_to_d holds x on entry and d on return (the caller does
 * x -= d). Bumps the version. */
smc_result_t smc_box_exchange(smc_box_t* box, size_t offset, size_t count, void* x_to_d, double alpha,
                              uint64_t* version);
/* smc_box_exchange's arithmetic on [offset, offset+count) for a caller that holds the box lock, without the version
 * bump: one exchange applied in parts as its elements arrive (the box server's streamed exchange), whose holder
 * bumps the version once after the last part. */
smc_result_t smc_box_exchange_held(smc_box_t* box, size_t offset, size_t count, void* x_to_d, double alpha);
/* The box lock is recursive for its holder: read/write/accumulate inside lock/unlock do not deadlock. */
smc_result_t smc_box_lock(smc_box_t* box, double timeout_s);
smc_result_t smc_box_unlock(smc_box_t* box);
/* Waits until the version is at least min_version; *version gets the version seen. */
smc_result_t smc_box_wait_version(smc_box_t* box, uint64_t min_version, double timeout_s, uint64_t* version);

/* ---- box server (csrc/net/box_server.c): this host's boxes served to the other hosts, without Python ---- */
typedef struct smc_box_server smc_box_server_t;
/* Listens on `address` (IPv4; "0.0.0.0": every interface) on a port the system picks, and serves each connection
 * that proves it holds `key`, the job's secret (16 to 64 bytes; csrc/net/handshake.h), in a thread of its own. */
smc_result_t smc_box_server_start(smc_comm_t* comm, const char* address, const uint8_t* key, size_t key_len,
                                  smc_box_server_t** server);
int smc_box_server_port(const smc_box_server_t* server);
/* Stops accepting, ends every connection (releasing the box locks they held) and joins their threads, each by
 * timeout_s (a thread in a lock or version wait leaves when that wait ends). Returns 1 when every thread has left;
 * 0 if some had not by then (they are left to finish; the server's memory stays theirs). */
int smc_box_server_stop(smc_box_server_t* server, double timeout_s);

/* ---- digests (csrc/core/digest.c): equal on every rank for equal calls ----
 * A step's tag: the dtype key and the dimensions. The agreement's signature: the whole description (kind code, dtype
 * key, dimensions, op, scale factors, root) and `nextra` more numbers (counts, the path). */
uint64_t smc_shape_tag(int64_t dtype, const int64_t* dims, int ndim);
uint64_t smc_signature(int kind, int64_t dtype, const int64_t* dims, int ndim, int64_t op, double prescale,
                       double postscale, int64_t root, const int64_t* extra, int nextra);

/* ---- the agreement across hosts (shmcomm/algorithms/agreement.py; its rounds: csrc/coll/agreement.c) ----
 * A message is a header of SMC_AGREEMENT_HEADER_BYTES (uint64 words: signature, status, lowest failed rank + 1, 0 for
 * none, and the bytes of data that follow), then the data. Statuses, the worse the higher: REFUSED is a call that
 * failed a rank's own checks, FAILED a failed step. Data of SMC_AGREEMENT_HALVING_BYTES or more among 4 or more ranks
 * (after the fold) is reduced by halving and gathered by doubling. */
enum { SMC_AGREEMENT_OK = 0, SMC_AGREEMENT_MISMATCH = 1, SMC_AGREEMENT_REFUSED = 2, SMC_AGREEMENT_FAILED = 3 };
enum { SMC_AGREEMENT_HEADER_BYTES = 32, SMC_AGREEMENT_HALVING_BYTES = 65536, SMC_AGREEMENT_TAG = 0x5AC /* MPI */ };
/* What a round does with its peer: a folded rank hands over everything and adopts the verdict; its partner takes it
 * in, and gives the verdict back last; the others swap (recursive doubling). */
enum { SMC_ROUND_HAND_OVER = 0, SMC_ROUND_TAKE = 1, SMC_ROUND_SWAP = 2, SMC_ROUND_GIVE_BACK = 3 };
/* The rounds return this less the core's code when a reduction failed; an exchange SMC_EXCHANGE_LATE after its
 * deadline, SMC_EXCHANGE_RAISED when the Python transport it called raised (Python holds why). */
enum { SMC_CROSSING_REDUCE_FAILED = -1000, SMC_EXCHANGE_LATE = -1, SMC_EXCHANGE_RAISED = -2 };
/* One exchange of the rounds with `peer` (its index in the rounds' communicator): receive into `into` (up to
 * `into_len` bytes; NULL for none) and send the `out_len` bytes at `out` (out_len < 0: none), both by `deadline`
 * (monotonic seconds, the clock of Python's time.monotonic). Returns 0, SMC_EXCHANGE_LATE (a late receive
 * cancelled, a late send left pending), or another nonzero code of its own (MPI's error). */
typedef int (*smc_exchange_fn)(void* context, int peer, void* into, int into_len, const void* out, int out_len,
                               double deadline);
/* The rounds of the plan peers[k], kinds[k] over `exchange`. `message` and `incoming` are a header then room for
 * `capacity` bytes of data; `message` holds this rank's header and data, and the combined verdict and data
 * afterwards. `nbytes` of data (`count` elements of the core's type `code`) are reduced with `op`. Every wait ends
 * by `timeout_s` from the call. Returns 0; the exchange's code (*late_round: the round whose exchange failed); or
 * SMC_CROSSING_REDUCE_FAILED less the core's code where a reduction failed. */
int smc_agreement_rounds(smc_exchange_fn exchange, void* context, const int* peers, const int* kinds, int rounds,
                         int my_rank, void* message, void* incoming, uint64_t capacity, uint64_t nbytes,
                         uint64_t count, int code, int op, double timeout_s, int* late_round);
/* Combines header `theirs` into `mine` (csrc/coll/agreement.c's rules); returns whether both were OK and alike. */
int smc_agreement_combine(uint64_t* mine, const uint64_t* theirs);

/* ---- the box server's messages (csrc/net/wire.c) ----
 * A request is a little-endian header of SMC_REQUEST_BYTES, then a name (create and attach; with SMC_FLAG_THEN_TOUCH
 * the box whose version to bump afterwards), then elements; a reply is a header of SMC_REPLY_BYTES, then an error text
 * (status 1: "ClassName\nmessage", the class the client raises) or the elements read. Each header is its struct's
 * fields in order, little-endian, without padding (shmcomm/smb/wire.py reads the layout from these declarations). */
enum { SMC_OP_CREATE = 1, SMC_OP_ATTACH = 2, SMC_OP_READ = 3, SMC_OP_WRITE = 4, SMC_OP_ACCUMULATE = 5, SMC_OP_LOCK = 6,
       SMC_OP_UNLOCK = 7, SMC_OP_WAIT = 8, SMC_OP_VERSION = 9, SMC_OP_DESTROY = 10, SMC_OP_CLOSE = 11,
       SMC_OP_TOUCH = 12, SMC_OP_PING = 13, SMC_OP_EXCHANGE = 14 };
/* Request flags. SMC_FLAG_STREAM (an exchange): the reply is an accepting header, then d in parts as x's parts arrive,
 * then the final header (the version), so that x and d travel at once; a refusal before any part is a plain error
 * reply, sent once x has been drained. */
enum { SMC_FLAG_EXIST_OK = 1, SMC_FLAG_THEN_TOUCH = 2, SMC_FLAG_STREAM = 4 };
enum { SMC_FLAG_STRIPED = 1 }; /* attach's reply flag: the name belongs to a striped box, whose description came */
enum { SMC_REQUEST_BYTES = 48, SMC_REPLY_BYTES = 32 };

typedef struct {
  uint8_t op, flags;
  uint16_t name_len;
  uint32_t dtype;
  uint64_t offset, count; /* offset: a version for SMC_OP_WAIT */
  double alpha, beta, timeout_s;
} smc_wire_request_t;

typedef struct {
  int32_t status;
  uint32_t text_len;
  uint64_t version, count;
  uint32_t dtype, flags;
} smc_wire_reply_t;

void smc_wire_parse_request(const uint8_t* bytes, smc_wire_request_t* request);
void smc_wire_pack_reply(uint8_t* bytes, const smc_wire_reply_t* reply);
void smc_wire_parse_reply(const uint8_t* bytes, smc_wire_reply_t* reply);

/* ---- box client (csrc/net/box_request.c): one request to another host's box server, without Python ----
 * The request (header and name: head, head_len; elements: out, out_len) and the reply (its header into reply, then
 * an error text into text, NUL-terminated, or in_len bytes of elements into in) are the messages above. Each returns
 * 0 once done (the reply's status says whether the server refused), SMC_WIRE_CLOSED if the connection ended or broke,
 * SMC_WIRE_TIMEOUT if timeout_s passed first. text_cap: at least SMC_WIRE_TEXT_BYTES. */
enum { SMC_WIRE_CLOSED = 1, SMC_WIRE_TIMEOUT = 2, SMC_WIRE_TEXT_BYTES = 1280 };
/* The request alone; its reply is for smc_box_receive (requests to several hosts go out before any reply is awaited). */
int smc_box_send(int fd, const void* head, size_t head_len, const void* out, size_t out_len, double timeout_s);
int smc_box_receive(int fd, void* in, size_t in_len, double timeout_s, void* reply, char* text, size_t text_cap);
/* An exchange whose d streams back while x still goes (request flag SMC_FLAG_STREAM): the server applies x in
 * parts as they arrive and answers each with its d, into x_to_d (d never overtakes x). The reply is the final header
 * (the version), or a refusal. */
int smc_box_exchange_streamed(int fd, const void* head, size_t head_len, void* x_to_d, size_t bytes, double timeout_s,
                              void* reply, char* text, size_t text_cap);

/* ---- kernels (csrc/reduce/), exposed for tests and benchmarks ---- */
size_t smc_dtype_size(smc_datatype_t dtype);
/* dst[i] = postscale * op_k(prescale * srcs[k][i]) / divisor (16-bit floats summed in float); dst may be a src. */
smc_result_t smc_reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, smc_datatype_t dtype,
                        smc_redop_t op, double prescale, double postscale, int64_t divisor);
/* dst[i] = beta*dst[i] + alpha*src[i]; integers wrap on exact 1/1 sums and truncate otherwise. */
smc_result_t smc_axpby(void* dst, const void* src, size_t count, smc_datatype_t dtype, double alpha, double beta);

#endif
