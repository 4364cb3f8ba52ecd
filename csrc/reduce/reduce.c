/* SPDX-License-Identifier: Apache-2.0 */
/* Elementwise kernels behind allreduce, reduce-scatter and box accumulate: smc_reduce and smc_axpby.
 *
 * How this file is organised, and why:
 *  - smc_reduce walks the data in blocks of BLOCK elements. Per block it loads srcs[0] into an accumulator array of
 *    the compute type (applying prescale), folds in srcs[1], srcs[2], ... in that order, then scales the block and
 *    stores it to dst. The accumulator stays in L1, 16-bit floats are rounded once, results depend only on the
 *    inputs, and dst may be the very same buffer as any src (each block is read in full before it is written).
 *  - Each step is a small loop over restrict pointers that gcc -O3 vectorises. To vectorise, a loop must know its
 *    dtype and op at compile time, so DEFINE_KERNELS stamps out the steps for one dtype from a few parameters
 *    (storage type, compute type, wrap type, load/store conversion, FLOAT or INT scaling); the table at the bottom
 *    lists the dtypes. Dispatch on dtype and op happens once per call, not per element.
 *  - HOT adds target_clones on x86-64 gcc, so one portable binary runs AVX-512 or AVX2 code where the CPU has it.
 *  - Floating-point contraction is off: an FMA in one clone and not in another would make results depend on the
 *    CPU, while ranks must agree bit for bit with each other and with a plain scalar reference.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#else
#pragma STDC FP_CONTRACT OFF
#endif

#include <stdint.h>

#include "core/error.h"
#include "reduce/half.h"
#include "shmcomm.h"

/* Elements per block: 512 keeps the accumulator at 2-4 KiB, well inside L1 next to the source lines. */
#define BLOCK 512

#if defined(SMC_REDUCE_HOT) /* tests/c/Makefile pins one variant to test each clone's code */
#define HOT SMC_REDUCE_HOT
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HOT
#endif

#define IDENT(x) (x)

/* Combining operators. Integer SUM/PROD compute in the wrap type W (unsigned, at least as wide as int) so that
 * overflow wraps without UB; the conversion back to a signed type keeps the low bits (gcc and clang define it so).
 * MIN/MAX return the accumulator unless the new value compares strictly less/greater: a NaN already in the
 * accumulator therefore sticks, a NaN arriving from a later source is ignored, and min(+0, -0) keeps the first. */
#define OP_SUM(W, a, b) ((W)(a) + (W)(b))
#define OP_PROD(W, a, b) ((W)(a) * (W)(b))
#define OP_MIN(W, a, b) ((b) < (a) ? (b) : (a))
#define OP_MAX(W, a, b) ((b) > (a) ? (b) : (a))

/* Scaling a loaded value by a double: floats multiply in the compute type; integers go through double and truncate
 * toward zero, clamped to the type's range (and NaN to 0) so that the conversion is never UB. */
#define SCALE_FLOAT(name, C, x, s) ((x) * (C)(s))
#define SCALE_INT(name, C, x, s) name##_from_double((double)(x) * (s))

#define DEFINE_FROM_DOUBLE(name, T, MIN, MAX)                                          \
  static inline T name##_from_double(double v) {                                       \
    return v != v ? 0 : v <= (double)(MIN) ? (MIN) : v >= (double)(MAX) ? (MAX) : (T)v; \
  }

DEFINE_FROM_DOUBLE(i8, int8_t, INT8_MIN, INT8_MAX)
DEFINE_FROM_DOUBLE(u8, uint8_t, 0, UINT8_MAX)
DEFINE_FROM_DOUBLE(i16, int16_t, INT16_MIN, INT16_MAX)
DEFINE_FROM_DOUBLE(i32, int32_t, INT32_MIN, INT32_MAX)
DEFINE_FROM_DOUBLE(i64, int64_t, INT64_MIN, INT64_MAX)

/* acc[i] = pre(src[i]) */
#define DEFINE_FIRST(name, S, C, LOAD, KIND)                                                   \
  HOT static void name##_first(C* restrict acc, const S* restrict src, size_t n, double pre) { \
    if (pre == 1.0) {                                                                          \
      for (size_t i = 0; i < n; i++) acc[i] = LOAD(src[i]);                                    \
    } else {                                                                                   \
      for (size_t i = 0; i < n; i++) acc[i] = SCALE_##KIND(name, C, LOAD(src[i]), pre);        \
    }                                                                                          \
  }

/* acc[i] = op(acc[i], pre(src[i])) */
#define DEFINE_COMBINE(name, S, C, W, LOAD, KIND, opname, OP)                                          \
  HOT static void name##_##opname(C* restrict acc, const S* restrict src, size_t n, double pre) {      \
    if (pre == 1.0) {                                                                                  \
      for (size_t i = 0; i < n; i++) {                                                                 \
        C v = LOAD(src[i]);                                                                            \
        acc[i] = OP(W, acc[i], v);                                                                     \
      }                                                                                                \
    } else {                                                                                           \
      for (size_t i = 0; i < n; i++) {                                                                 \
        C v = SCALE_##KIND(name, C, LOAD(src[i]), pre);                                                \
        acc[i] = OP(W, acc[i], v);                                                                     \
      }                                                                                                \
    }                                                                                                  \
  }

/* dst[i] = fin(acc[i]). Floats: one multiply by postscale/divisor, that factor rounded once to the compute type. */
#define DEFINE_FINISH_FLOAT(name, S, C, STORE)                                                                  \
  HOT static void name##_finish(S* restrict dst, const C* restrict acc, size_t n, double post, int64_t div) { \
    if (post == 1.0 && div == 1) {                                                                            \
      for (size_t i = 0; i < n; i++) dst[i] = STORE(acc[i]);                                                  \
    } else {                                                                                                  \
      const C f = (C)(post / (double)div);                                                                    \
      for (size_t i = 0; i < n; i++) dst[i] = STORE(acc[i] * f);                                              \
    }                                                                                                         \
  }

/* Integers: postscale through double (truncating, clamped), then C division by the divisor (toward zero). */
#define DEFINE_FINISH_INT(name, S, C, STORE)                                                                    \
  HOT static void name##_finish(S* restrict dst, const C* restrict acc, size_t n, double post, int64_t div) { \
    if (post == 1.0 && div == 1) {                                                                            \
      for (size_t i = 0; i < n; i++) dst[i] = acc[i];                                                         \
    } else {                                                                                                  \
      for (size_t i = 0; i < n; i++) {                                                                        \
        C v = post == 1.0 ? acc[i] : name##_from_double((double)acc[i] * post);                               \
        dst[i] = div == 1 ? v : (C)((int64_t)v / div);                                                        \
      }                                                                                                       \
    }                                                                                                         \
  }

/* dst[i] = beta*dst[i] + alpha*src[i]. No restrict: dst may be src. */
#define DEFINE_AXPBY_FLOAT(name, S, C, W, LOAD, STORE)                                                \
  HOT static void name##_axpby(S* dst, const S* src, size_t n, double alpha, double beta) {         \
    const C a = (C)alpha, b = (C)beta;                                                               \
    for (size_t i = 0; i < n; i++) dst[i] = STORE(b * LOAD(dst[i]) + a * LOAD(src[i]));              \
  }

#define DEFINE_AXPBY_INT(name, S, C, W, LOAD, STORE)                                                 \
  HOT static void name##_axpby(S* dst, const S* src, size_t n, double alpha, double beta) {         \
    if (alpha == 1.0 && beta == 1.0) {                                                               \
      for (size_t i = 0; i < n; i++) dst[i] = (C)((W)dst[i] + (W)src[i]);                            \
    } else {                                                                                         \
      for (size_t i = 0; i < n; i++) dst[i] = name##_from_double(beta * (double)dst[i] + alpha * (double)src[i]); \
    }                                                                                                \
  }

typedef void (*reduce_fn)(void* dst, const void* const* srcs, int nsrcs, size_t count, smc_redop_t op, double pre,
                          double post, int64_t div);
typedef void (*axpby_fn)(void* dst, const void* src, size_t count, double alpha, double beta);

/* All steps for one dtype, plus its block driver `name_reduce` with the uniform signature of reduce_fn. */
#define DEFINE_KERNELS(name, S, C, W, LOAD, STORE, KIND)                                                       \
  DEFINE_FIRST(name, S, C, LOAD, KIND)                                                                        \
  DEFINE_COMBINE(name, S, C, W, LOAD, KIND, sum, OP_SUM)                                                      \
  DEFINE_COMBINE(name, S, C, W, LOAD, KIND, min, OP_MIN)                                                      \
  DEFINE_COMBINE(name, S, C, W, LOAD, KIND, max, OP_MAX)                                                      \
  DEFINE_COMBINE(name, S, C, W, LOAD, KIND, prod, OP_PROD)                                                    \
  DEFINE_FINISH_##KIND(name, S, C, STORE)                                                                     \
  DEFINE_AXPBY_##KIND(name, S, C, W, LOAD, STORE)                                                             \
  static void name##_reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, smc_redop_t op,      \
                            double pre, double post, int64_t div) {                                           \
    void (*combine)(C* restrict, const S* restrict, size_t, double) =                                         \
        op == SMC_SUM ? name##_sum : op == SMC_MIN ? name##_min : op == SMC_MAX ? name##_max : name##_prod;   \
    _Alignas(64) C acc[BLOCK];                                                                                \
    for (size_t off = 0; off < count; off += BLOCK) {                                                         \
      size_t n = count - off < BLOCK ? count - off : BLOCK;                                                   \
      name##_first(acc, (const S*)srcs[0] + off, n, pre);                                                     \
      for (int k = 1; k < nsrcs; k++) combine(acc, (const S*)srcs[k] + off, n, pre);                          \
      name##_finish((S*)dst + off, acc, n, post, div);                                                        \
    }                                                                                                         \
  }                                                                                                           \
  static void name##_axpby_any(void* dst, const void* src, size_t count, double alpha, double beta) {         \
    name##_axpby((S*)dst, (const S*)src, count, alpha, beta);                                                 \
  }

/*             name  storage   compute   wrap      load               store              scaling */
DEFINE_KERNELS(f16,  uint16_t, float,    float,    smc_half_to_float, smc_float_to_half, FLOAT)
DEFINE_KERNELS(bf16, uint16_t, float,    float,    smc_bf16_to_float, smc_float_to_bf16, FLOAT)
DEFINE_KERNELS(f32,  float,    float,    float,    IDENT,             IDENT,             FLOAT)
DEFINE_KERNELS(f64,  double,   double,   double,   IDENT,             IDENT,             FLOAT)
DEFINE_KERNELS(i8,   int8_t,   int8_t,   uint32_t, IDENT,             IDENT,             INT)
DEFINE_KERNELS(u8,   uint8_t,  uint8_t,  uint32_t, IDENT,             IDENT,             INT)
DEFINE_KERNELS(i16,  int16_t,  int16_t,  uint32_t, IDENT,             IDENT,             INT)
DEFINE_KERNELS(i32,  int32_t,  int32_t,  uint32_t, IDENT,             IDENT,             INT)
DEFINE_KERNELS(i64,  int64_t,  int64_t,  uint64_t, IDENT,             IDENT,             INT)

/* Indexed by smc_datatype_t. */
static const struct {
  size_t size;
  reduce_fn reduce;
  axpby_fn axpby;
} dtypes[SMC_NUM_DTYPES] = {
    [SMC_FLOAT16] = {2, f16_reduce, f16_axpby_any}, [SMC_BFLOAT16] = {2, bf16_reduce, bf16_axpby_any},
    [SMC_FLOAT32] = {4, f32_reduce, f32_axpby_any}, [SMC_FLOAT64] = {8, f64_reduce, f64_axpby_any},
    [SMC_INT8] = {1, i8_reduce, i8_axpby_any},      [SMC_UINT8] = {1, u8_reduce, u8_axpby_any},
    [SMC_INT16] = {2, i16_reduce, i16_axpby_any},   [SMC_INT32] = {4, i32_reduce, i32_axpby_any},
    [SMC_INT64] = {8, i64_reduce, i64_axpby_any},
};

static int dtype_ok(smc_datatype_t dtype) { return (unsigned)dtype < (unsigned)SMC_NUM_DTYPES; }

/* 0 for an unknown dtype. */
size_t smc_dtype_size(smc_datatype_t dtype) { return dtype_ok(dtype) ? dtypes[dtype].size : 0; }

smc_result_t smc_reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, smc_datatype_t dtype,
                        smc_redop_t op, double prescale, double postscale, int64_t divisor) {
  if (!dtype_ok(dtype)) return smc_set_error(SMC_ERR_INVALID, "reduce: unknown dtype %d", (int)dtype);
  if ((unsigned)op >= (unsigned)SMC_NUM_OPS) return smc_set_error(SMC_ERR_INVALID, "reduce: unknown op %d", (int)op);
  if (nsrcs < 1) return smc_set_error(SMC_ERR_INVALID, "reduce: nsrcs is %d, must be at least 1", nsrcs);
  if (divisor < 1) {
    return smc_set_error(SMC_ERR_INVALID, "reduce: divisor is %lld, must be at least 1", (long long)divisor);
  }
  if (count == 0) return SMC_SUCCESS;
  if (!dst || !srcs) return smc_set_error(SMC_ERR_INVALID, "reduce: NULL %s with count %zu", dst ? "srcs" : "dst",
                                          count);
  for (int k = 0; k < nsrcs; k++) {
    if (!srcs[k]) return smc_set_error(SMC_ERR_INVALID, "reduce: srcs[%d] is NULL with count %zu", k, count);
  }
  dtypes[dtype].reduce(dst, srcs, nsrcs, count, op, prescale, postscale, divisor);
  return SMC_SUCCESS;
}

smc_result_t smc_axpby(void* dst, const void* src, size_t count, smc_datatype_t dtype, double alpha, double beta) {
  if (!dtype_ok(dtype)) return smc_set_error(SMC_ERR_INVALID, "axpby: unknown dtype %d", (int)dtype);
  if (count == 0) return SMC_SUCCESS;
  if (!dst || !src) return smc_set_error(SMC_ERR_INVALID, "axpby: NULL %s with count %zu", dst ? "src" : "dst", count);
  dtypes[dtype].axpby(dst, src, count, alpha, beta);
  return SMC_SUCCESS;
}
