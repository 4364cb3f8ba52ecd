/* SPDX-License-Identifier: Apache-2.0 */
/* Allreduce and reduce-scatter over the staging slots of one host.
 *
 * Small messages (up to small_bytes, a quarter of it for 16-bit floats) take one step: every rank copies its whole
 * input into its half, all sync, and every rank reduces all halves itself. Redundant arithmetic, but a single
 * synchronisation, which is what latency is made of.
 *
 * Larger messages are cut into one range per rank; rank r owns range r. Each step moves one piece of every range:
 *   1. copy-in:  rank r copies piece k of every range j != r into section j of its half. Its own piece stays in its
 *                input, it reads it from there.
 *   2. sync
 *   3. reduce:   rank r reduces section r of every half (and its own input) into its output. Each element is reduced
 *                by exactly one rank in a fixed operand order, so every rank ends with bit-identical results.
 *   For allreduce, also:
 *   3b. rank r copies its reduced piece into section r of its half (or, where an output apart from the input
 *       streams past the cache, reduces into that section and streams the piece out from there, as does a
 *       reduce-scatter's: bypasses);
 *   4. sync
 *   5. gather:   rank r copies section j of rank j's half into its output, for every j != r.
 *   Or, where the ranks pull (two ranks whose kernel copy is fast, or where pulling proves the cheaper path:
 *   coll/path_choice.c), no step synchronises: rank r reads piece k of range r straight out of every peer's input,
 *   reduces it and writes it straight into every peer's output (pulled), and one synchronisation after the last
 *   step says that every output is whole.
 * In place in shared buffers that every rank maps (coll/window.c), no step copies anything into a half: rank r
 * reduces range r of every rank's buffer into its own and copies the result into every peer's (in_windows).
 * Pulled pieces and those in shared buffers are sized so that a step's working set stays in cache; a staged step
 * moves as much as a half holds, since each synchronises. Reduce-scatter is steps 1-3 with per-rank ranges given by
 * the caller, or pulls its ranges where allreduce would. */
#include "coll/comm.h"
#include "core/clock.h"
#include "core/copy.h"
#include "core/error.h"

typedef struct {
  const uint8_t* src;
  uint8_t* dst;           /* allreduce: the full output; reduce-scatter: this rank's range only */
  smc_datatype_t dtype;
  smc_redop_t op;
  double prescale, postscale;
  int64_t divisor;
  size_t esize;
  const uint64_t* start;  /* per-rank range, in elements */
  const uint64_t* len;
  int gather;             /* allreduce: every rank receives every range */
} plan_t;

static smc_result_t check_args(smc_comm_t* c, const void* send, const void* recv, size_t count, smc_datatype_t dtype,
                               smc_redop_t op, int64_t divisor, const char* what) {
  SMC_CHECK(smc_coll_enter(c, what));
  if ((unsigned)dtype >= SMC_NUM_DTYPES) return smc_set_error(SMC_ERR_INVALID, "%s: unknown dtype %d", what, dtype);
  if ((unsigned)op >= SMC_NUM_OPS) return smc_set_error(SMC_ERR_INVALID, "%s: unknown op %d", what, op);
  if (divisor < 1) return smc_set_error(SMC_ERR_INVALID, "%s: divisor %lld < 1", what, (long long)divisor);
  if (count > SMC_MAX_BYTES / smc_dtype_size(dtype))
    return smc_set_error(SMC_ERR_INVALID, "%s: count %zu is too large", what, count);
  if (count > 0 && (send == NULL || recv == NULL)) return smc_set_error(SMC_ERR_INVALID, "%s: NULL buffer", what);
  return SMC_SUCCESS;
}

/* A single rank's reduction: its own input, scaled. Unscaled it is a copy, which memmove's streaming stores take at
 * copy speed where the kernels' loop first reads every destination line; a torus whose hosts run one rank each makes
 * its row step so. */
static smc_result_t alone(const void* send, void* recv, size_t count, const plan_t* p) {
  if (count == 0) return SMC_SUCCESS;
  if (p->prescale == 1.0 && p->postscale == 1.0 && p->divisor == 1) {
    smc_copy(recv, send, count * p->esize);
    return SMC_SUCCESS;
  }
  return smc_reduce(recv, &send, 1, count, p->dtype, p->op, p->prescale, p->postscale, p->divisor);
}

/* Elements of rank j's range that step k moves. */
static size_t piece_len(const plan_t* p, int j, size_t k, size_t per_piece) {
  uint64_t done = (uint64_t)k * per_piece;
  if (done >= p->len[j]) return 0;
  return p->len[j] - done < per_piece ? (size_t)(p->len[j] - done) : per_piece;
}

/* Bytes of the whole buffer the ranges cover. */
static uint64_t total_bytes(const smc_comm_t* c, const plan_t* p) {
  return (p->start[c->size - 1] + p->len[c->size - 1]) * p->esize;
}

/* Whether the output is written with streaming stores: where it lies apart from the input and the ranks' inputs and
 * outputs together outgrow the last-level cache, it leaves the cache before anyone reads it, and a cached store first
 * reads every line it writes, a third more memory traffic where the memory is the limit. */
static int bypasses(const smc_comm_t* c, const plan_t* p) {
  return p->dst != p->src && 2 * (uint64_t)c->size * total_bytes(c, p) > c->shared_cache_bytes;
}

/* Pulling. Each rank publishes its input and its output in its first step's descriptor (`own` and `addr`, 0: it
 * will not pull), and the ranks pull only if every one did, so every rank takes the same path whatever its settings.
 * Rank r then reads range r of every peer's input by the kernel's copy (process_vm_readv) into its half, which no
 * peer reads in this path, reduces it with its own and writes the result into every peer's output
 * (process_vm_writev, the piece still in its cache), a piece at a time. Only rank r reads or writes range r of any
 * rank's buffers, in place or not, so the pieces need no synchronisation: the first step's proved every input whole,
 * pull_finish's proves every output written. Against the staging steps, no peer copies a piece into its half for
 * this rank to read out of the other core's cache, and no step waits for the slowest rank. A reduce-scatter pulls
 * the same way (its input and its output apart), reduces into its output and writes nothing into the peers'; its
 * last synchronisation says only that every peer has read this rank's input. */
static int pulling_agreed(smc_comm_t* c, const plan_t* p, uint64_t bytes, uint64_t* ins, uint64_t* outs) {
  int all = 1, offered = 1;
  for (int j = 0; j < c->size; j++) {
    ins[j] = smc_peer_desc(c, j)->own;
    outs[j] = smc_peer_desc(c, j)->addr;
    all = all && ins[j] != 0 && (outs[j] != 0 || !p->gather);
    offered = offered && smc_peer_desc(c, j)->kernel_copy;
  }
  /* every rank can; where pulling is learned, rank 0's offer decides (coll/path_choice.c), else all offer alike */
  return all && (smc_pull_learned(c, bytes) ? smc_peer_desc(c, 0)->kernel_copy : offered);
}

/* Whether some rank meant to pull or named a shared buffer, and so took no copy before the first synchronisation. */
static int someone_copies_late(smc_comm_t* c) { return smc_any_window(c) || smc_kernel_copy_offered(c); }

/* The last synchronisation of a pulled allreduce: after it every peer's writes into this rank's output are done.
 * Each rank first puts whether its writes succeeded in its half (free: its last reader finished before the last
 * step's synchronisation), so that a rank whose output a peer failed to fill raises too, naming that peer. */
static smc_result_t pull_finish(smc_comm_t* c, smc_result_t wrote, const char* what) {
  *(volatile uint64_t*)smc_half(c, c->rank) = wrote == SMC_SUCCESS ? 0 : 1;
  smc_result_t rc = smc_sync(c, what);
  if (rc == SMC_SUCCESS && wrote == SMC_SUCCESS)
    for (int j = 0; j < c->size && rc == SMC_SUCCESS; j++)
      if (j != c->rank && *(volatile const uint64_t*)smc_half(c, j) != 0)
        rc = smc_set_peer_error(SMC_ERR_SYSTEM, smc_job_rank(c, j), SMC_FIELD_NONE,
                                "%s: rank %d could not write its part of the result into this rank's output", what,
                                smc_job_rank(c, j));
  smc_flip(c);
  return rc != SMC_SUCCESS ? rc : wrote;
}

static smc_result_t pulled(smc_comm_t* c, const plan_t* p, const uint64_t* ins, const uint64_t* outs, size_t section,
                           size_t per_piece, const char* what) {
  const void* srcs[SMC_MAX_RANKS];
  const int me = c->rank, n = c->size;
  const size_t es = p->esize;
  uint8_t* mine = smc_half(c, me);
  /* An output apart from the input takes each reduced piece from this rank's own section (no peer's piece lands
   * there) by streaming stores, where it is too large to stay in cache (bypasses); an allreduce's peers are written
   * from there too. */
  const int bypass = bypasses(c, p);
  smc_result_t rc = SMC_SUCCESS;
  for (size_t k = 0; rc == SMC_SUCCESS; k++) {
    size_t l = piece_len(p, me, k, per_piece);
    if (l == 0) break;
    c->pieces++;
    size_t at = (p->start[me] + k * per_piece) * es;
    for (int j = 0; j < n && rc == SMC_SUCCESS; j++) {
      srcs[j] = j == me ? (const void*)(p->src + at) : mine + (size_t)j * section;
      if (j != me) rc = smc_cma_read(c, j, mine + (size_t)j * section, ins[j] + at, l * es, what);
    }
    uint8_t* out = p->gather ? p->dst + at : p->dst + k * per_piece * es;
    uint8_t* reduced = bypass ? mine + (size_t)me * section : out;
    if (rc == SMC_SUCCESS)
      rc = smc_reduce(reduced, srcs, n, l, p->dtype, p->op, p->prescale, p->postscale, p->divisor);
    for (int d = 1; p->gather && d < n && rc == SMC_SUCCESS; d++) {
      int j = (me + d) % n;
      rc = smc_cma_write(c, j, outs[j] + at, reduced, l * es, what);
    }
    if (bypass && rc == SMC_SUCCESS) smc_copy_streaming(out, reduced, l * es);
  }
  smc_flip(c); /* even after a failure: the peers wait in the last synchronisation */
  c->pulled_calls++;
  if (p->gather) return pull_finish(c, rc, what); /* which also says who failed to write into whose output */
  smc_result_t synced = smc_sync(c, what);        /* a reduce-scatter's: every peer has read this rank's input */
  smc_flip(c);
  return synced != SMC_SUCCESS ? synced : rc;
}

/* Step k's copy-in: piece k of every peer's range into its section of this rank's half. */
static void copy_in(smc_comm_t* c, const plan_t* p, size_t k, size_t section, size_t per_piece) {
  uint8_t* mine = smc_half(c, c->rank);
  for (int j = 0; j < c->size; j++) {
    size_t l = piece_len(p, j, k, per_piece);
    if (j != c->rank && l > 0)
      smc_copy(mine + (size_t)j * section, p->src + (p->start[j] + k * per_piece) * p->esize, l * p->esize);
  }
}

/* The in-place allreduce of shared buffers: rank r reduces range r of every rank's buffer into its own, a piece at
 * a time so that the piece is still in cache when it copies it into every peer's buffer. A reduce-scatter of shared
 * inputs reduces range r into rank r's output and copies nothing. Only rank r touches range r of any buffer, so the
 * pieces need no synchronisation; the one that began the call proved every input whole, the one at the end proves
 * every range reduced. Per element that is n reads and n writes, where the staging path also copies every piece into
 * a half and the pulling one passes it through the kernel. */
static smc_result_t in_windows(smc_comm_t* c, const plan_t* p, uint8_t* const* bufs, size_t per_piece,
                               const char* what) {
  const void* srcs[SMC_MAX_RANKS];
  const int me = c->rank, n = c->size;
  const size_t es = p->esize;
  smc_result_t rc = SMC_SUCCESS;
  for (size_t k = 0; rc == SMC_SUCCESS; k++) {
    size_t l = piece_len(p, me, k, per_piece);
    if (l == 0) break;
    size_t at = (p->start[me] + k * per_piece) * es;
    for (int j = 0; j < n; j++) srcs[j] = bufs[j] + at;
    uint8_t* out = p->gather ? bufs[me] + at : p->dst + k * per_piece * es;
    rc = smc_reduce(out, srcs, n, l, p->dtype, p->op, p->prescale, p->postscale, p->divisor);
    for (int d = 1; p->gather && d < n && rc == SMC_SUCCESS; d++) smc_copy(bufs[(me + d) % n] + at, out, l * es);
  }
  smc_result_t synced = smc_sync(c, what); /* even after a failed reduction: the peers wait for this one */
  smc_flip(c);
  c->window_calls++;
  return synced != SMC_SUCCESS ? synced : rc;
}

/* The small path; a rank whose data is in shared buffer `w` took no copy before the first synchronisation, as in
 * pipelined below. */
static smc_result_t one_step(smc_comm_t* c, const plan_t* p, size_t count, smc_desc_t* desc, const smc_window_t* w) {
  const void* srcs[SMC_MAX_RANKS];
  if (desc->window == 0) smc_copy(smc_half(c, c->rank), p->src, count * p->esize);
  SMC_CHECK(smc_coll_begin(c, desc, "allreduce"));
  if (smc_any_window(c)) {
    uint8_t* bufs[SMC_MAX_RANKS];
    if (smc_windows_agreed(c, w, count * p->esize, bufs)) return in_windows(c, p, bufs, count, "allreduce");
    if (desc->window != 0) smc_copy(smc_half(c, c->rank), p->src, count * p->esize);
    SMC_CHECK(smc_sync(c, "allreduce"));
  }
  for (int r = 0; r < c->size; r++) srcs[r] = r == c->rank ? (const void*)p->src : (const void*)smc_half(c, r);
  smc_result_t rc = smc_reduce(p->dst, srcs, c->size, count, p->dtype, p->op, p->prescale, p->postscale, p->divisor);
  smc_flip(c);
  return rc;
}

/* Bytes of each rank's range a step moves: a half's share, or `piece` where that is smaller; whole cache lines. */
static size_t section_bytes(const smc_comm_t* c, size_t piece) {
  size_t section = c->half_bytes / (size_t)c->size;
  if (piece > 0 && piece < section) section = piece;
  section = section / SMC_CACHE_LINE * SMC_CACHE_LINE;
  return section < SMC_CACHE_LINE ? SMC_CACHE_LINE : section;
}

/* `w`: the shared buffer holding this rank's data (an in-place allreduce's, a reduce-scatter's input), or NULL. A
 * rank whose data is in one names it in its descriptor and takes no copy before the first synchronisation, as does
 * one that means to pull; if then not every rank named it (or meant to), those that did make that copy and every
 * rank synchronises once more, so all take the same steps. */
static smc_result_t pipelined(smc_comm_t* c, const plan_t* p, smc_desc_t* desc, const smc_window_t* w,
                              const char* what) {
  const void* srcs[SMC_MAX_RANKS];
  const int me = c->rank, n = c->size;
  const size_t es = p->esize;
  /* A piece of each range per step, at most piece_bytes where no step synchronises (pulled, or in shared buffers):
   * its copies then stay in the L2, where a pulled piece meets the kernel's copies. Staged steps take a half's share
   * unless piece_bytes was set (piece_probed): each costs a synchronisation, dear on a busy machine
   * (shmcomm/env/tuning.py, benchmarks/RESULTS.md). Every rank takes the same sizes, whichever path it means. */
  const size_t section = section_bytes(c, c->piece_probed ? 0 : c->piece_bytes);
  const size_t per_piece = section / es;
  const size_t cached = section_bytes(c, c->piece_bytes);
  uint64_t longest = 0;
  for (int j = 0; j < n; j++) longest = p->len[j] > longest ? p->len[j] : longest;
  size_t steps = longest == 0 ? 1 : (size_t)((longest + per_piece - 1) / per_piece);
  const int bypass = bypasses(c, p);

  for (size_t k = 0; k < steps; k++) {
    uint8_t* mine = smc_half(c, me);
    if (k > 0 || (desc->window == 0 && !desc->kernel_copy)) copy_in(c, p, k, section, per_piece);
    if (k == 0) {
      SMC_CHECK(smc_coll_begin(c, desc, what));
      uint8_t* bufs[SMC_MAX_RANKS];
      uint64_t ins[SMC_MAX_RANKS], outs[SMC_MAX_RANKS];
      if (smc_windows_agreed(c, w, total_bytes(c, p), bufs))
        return in_windows(c, p, bufs, cached / es, what);
      if (pulling_agreed(c, p, total_bytes(c, p), ins, outs))
        return pulled(c, p, ins, outs, cached, cached / es, what);
      if (someone_copies_late(c)) {
        if (desc->window != 0 || desc->kernel_copy) copy_in(c, p, 0, section, per_piece);
        SMC_CHECK(smc_sync(c, what));
      }
    } else {
      SMC_CHECK(smc_sync(c, what));
    }
    c->pieces++;

    size_t l = piece_len(p, me, k, per_piece);
    if (l > 0) {
      size_t at = p->start[me] + k * per_piece;
      for (int j = 0; j < n; j++) srcs[j] = j == me ? (const void*)(p->src + at * es) : smc_half(c, j) + (size_t)me * section;
      uint8_t* out = p->gather ? p->dst + at * es : p->dst + k * per_piece * es;
      uint8_t* shared = mine + (size_t)me * section;
      if (bypass) { /* reduced into its section (where an allreduce's peers read it), then streamed out */
        SMC_CHECK(smc_reduce(shared, srcs, n, l, p->dtype, p->op, p->prescale, p->postscale, p->divisor));
        smc_copy_streaming(out, shared, l * es);
      } else {
        SMC_CHECK(smc_reduce(out, srcs, n, l, p->dtype, p->op, p->prescale, p->postscale, p->divisor));
        if (p->gather) smc_copy(shared, out, l * es);
      }
    }
    if (p->gather) {
      SMC_CHECK(smc_sync(c, what));
      for (int j = 0; j < n; j++) {
        size_t lj = piece_len(p, j, k, per_piece);
        if (j != me && lj > 0)
          (bypass ? smc_copy_streaming : smc_copy)(p->dst + (p->start[j] + k * per_piece) * es,
                                                   smc_half(c, j) + (size_t)j * section, lj * es);
      }
    }
    smc_flip(c);
  }
  return SMC_SUCCESS;
}

/* pipelined, timed where this rank learns whether pulling pays (coll/path_choice.c); shared buffers' calls teach
 * nothing, as they neither stage nor pull. */
static smc_result_t timed(smc_comm_t* c, const plan_t* p, smc_desc_t* desc, const smc_window_t* w, uint64_t bytes,
                          const char* what) {
  if (!smc_pull_learned(c, bytes)) return pipelined(c, p, desc, w, what);
  const uint64_t pulled = c->pulled_calls, shared = c->window_calls;
  const double start = smc_now();
  smc_result_t rc = pipelined(c, p, desc, w, what);
  if (rc == SMC_SUCCESS && c->window_calls == shared)
    smc_pull_learn(c, bytes, c->pulled_calls != pulled, smc_now() - start);
  return rc;
}

smc_result_t smc_allreduce(smc_comm_t* c, const void* sendbuf, void* recvbuf, size_t count, smc_datatype_t dtype,
                           smc_redop_t op, double prescale, double postscale, int64_t divisor, uint64_t tag) {
  SMC_CHECK(smc_refuse_here(c, SMC_COLL_ALLREDUCE,
                            check_args(c, sendbuf, recvbuf, count, dtype, op, divisor, "allreduce")));
  plan_t p = {sendbuf, recvbuf, dtype, op, prescale, postscale, divisor, smc_dtype_size(dtype), NULL, NULL, 1};
  if (c->size == 1) return alone(sendbuf, recvbuf, count, &p);
  smc_desc_t desc = {.prescale = prescale, .postscale = postscale, .count = count, .tag = tag, .divisor = divisor,
                     .coll = SMC_COLL_ALLREDUCE, .dtype = dtype, .op = op, .root = -1};
  const uint64_t bytes = count * p.esize;
  smc_window_t* w = sendbuf == recvbuf ? smc_window_name(c, &desc, recvbuf, bytes) : NULL;
  /* Equal ranges, each a whole number of cache lines, so that no two ranks write the same line of the output. The
   * small path needs them only to take the shared buffers' path (the smallest calls' latency is made of such loops). */
  uint64_t start[SMC_MAX_RANKS], len[SMC_MAX_RANKS];
  p.start = start;
  p.len = len;
  /* The one-step path reduces every rank's whole input on every rank. 16-bit floats are converted to float and back
   * to be reduced, so that redundant work costs them more per byte than the second step saves from a quarter of
   * the size (benchmarks/RESULTS.md). */
  const int half_float = dtype == SMC_FLOAT16 || dtype == SMC_BFLOAT16;
  const uint64_t small = half_float ? c->small_bytes / 4 : c->small_bytes;
  if (bytes > small || w != NULL) {
    size_t line = SMC_CACHE_LINE / p.esize;
    size_t per = ((count + (size_t)c->size - 1) / (size_t)c->size + line - 1) / line * line;
    for (int j = 0; j < c->size; j++) {
      start[j] = (uint64_t)j * per < count ? (uint64_t)j * per : count;
      len[j] = count - start[j] < per ? count - start[j] : per;
    }
  }
  if (bytes <= small) return one_step(c, &p, count, &desc, w);
  /* pulled's ranges are one rank's alone only if input and output are the same buffer or apart */
  const uintptr_t in = (uintptr_t)sendbuf, out = (uintptr_t)recvbuf;
  if (smc_pull_possible(c, bytes) && (in == out || in + bytes <= out || out + bytes <= in)) {
    desc.own = (uint64_t)in; /* where the ranks agree to pull, the peers read its input and write into its output */
    desc.addr = (uint64_t)out;
    desc.kernel_copy = smc_pull_choose(c, bytes);
    /* ... by the kernel's copy (offered before the ranks agree: where they do not, a reused buffer is collapsed for
     * nothing, once) */
    if (desc.kernel_copy) smc_huge_pages_offer(c, sendbuf, bytes);
    if (desc.kernel_copy && out != in) smc_huge_pages_offer(c, recvbuf, bytes);
  }
  return timed(c, &p, &desc, w, bytes, "allreduce");
}

smc_result_t smc_reducescatter(smc_comm_t* c, const void* sendbuf, void* recvbuf, const uint64_t* counts,
                               smc_datatype_t dtype, smc_redop_t op, double prescale, double postscale,
                               int64_t divisor, uint64_t tag) {
  if (counts == NULL)
    return smc_refuse_here(c, SMC_COLL_REDUCESCATTER, smc_set_error(SMC_ERR_INVALID, "reducescatter: counts is NULL"));
  uint64_t start[SMC_MAX_RANKS], total = 0;
  for (int j = 0; c != NULL && j < c->size; j++) {
    start[j] = total;
    total = smc_add_bytes(total, counts[j]); /* a total this large is refused below */
  }
  /* A rank whose own range is empty may pass no output (XLA hands a NULL buffer to an empty result). */
  const uint64_t own = c != NULL && c->rank >= 0 && c->rank < c->size ? counts[c->rank] : 0;
  SMC_CHECK(smc_refuse_here(c, SMC_COLL_REDUCESCATTER, check_args(c, sendbuf, own ? recvbuf : sendbuf, (size_t)total,
                                                                  dtype, op, divisor, "reducescatter")));
  plan_t p = {sendbuf, recvbuf, dtype, op, prescale, postscale, divisor, smc_dtype_size(dtype), start, counts, 0};
  if (c->size == 1) return alone(sendbuf, recvbuf, (size_t)total, &p);
  smc_desc_t desc = {.prescale = prescale, .postscale = postscale, .count = total,
                     .tag = smc_digest(counts, c->size, tag), .divisor = divisor, .coll = SMC_COLL_REDUCESCATTER,
                     .dtype = dtype, .op = op, .root = -1};
  /* Peers read this rank's whole input during the call: only an output outside it may take the shared path. */
  const uint64_t bytes = total * p.esize;
  const uintptr_t in = (uintptr_t)sendbuf, out = (uintptr_t)recvbuf, out_bytes = counts[c->rank] * p.esize;
  int apart = out + out_bytes <= in || out >= in + bytes;
  smc_window_t* w = apart ? smc_window_name(c, &desc, sendbuf, bytes) : NULL;
  if (apart && smc_pull_possible(c, bytes)) { /* pulled: the peers read their ranges of it */
    desc.own = (uint64_t)in;
    desc.kernel_copy = smc_pull_choose(c, bytes);
    if (desc.kernel_copy) smc_huge_pages_offer(c, sendbuf, bytes);
  }
  return timed(c, &p, &desc, w, bytes, "reducescatter");
}
