/* SPDX-License-Identifier: Apache-2.0 */
/* Elementwise kernels behind allreduce, reduce-scatter and box accumulate: smc_reduce and smc_axpby.
 *
 * How this file is organised, and why:
 *  - smc_reduce walks the data in blocks of BLOCK elements. Per block it loads srcs[0] into an accumulator array of
 *    the compute type (applying prescale), folds in srcs[1], srcs[2], ... in that order, then scales the block and
 *    stores it to dst. The accumulator stays in L1, results depend only on the inputs, and dst may be the very same
 *    buffer as any src (each block is read in full before it is written). Sums without a prescale fuse steps
 *    (DEFINE_PAIR_FLOAT, below): the stores of the steps bound them, not the arithmetic.
 *  - Each step is a small loop over restrict pointers that gcc -O3 vectorises. To vectorise, a loop must know its
 *    dtype and op at compile time, so DEFINE_KERNELS stamps out the steps for one dtype from its type, wrap type and
 *    kind of scaling (FLOAT or INT); the table near the bottom lists the dtypes. Dispatch on dtype and op happens
 *    once per call, not per element.
 *  - float16 and bfloat16 are converted block by block to float and then go through the float32 kernels, so they
 *    accumulate in float and round once. float16 uses the F16C instructions when the CPU has them (reduce/x86.h; gcc
 *    12 does not vectorise _Float16 casts); they give the same bits as the portable conversions in half.h. Two
 *    bfloat16 sources summed (two ranks) take one fused pass instead, with AVX512_BF16's rounding where the CPU has
 *    it; two float16 ones too where it has F16C.
 *  - HOT adds target_clones on x86-64 gcc, so one portable binary runs AVX-512 (with its 16-bit element instructions,
 *    which 16-bit floats need to fill 512-bit registers) or AVX2 code where the CPU has it.
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

/* Elements per block: the accumulator (2-4 KiB) and the source lines it meets stay in L1. */
#define BLOCK 512

/* Runtime CPU dispatch on x86-64 gcc. tests/c/Makefile defines SMC_REDUCE_HOT to pin one variant instead (and to
 * test the portable float16 path on a machine with F16C). */
#if defined(SMC_REDUCE_HOT)
#define HOT SMC_REDUCE_HOT
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define SMC_X86_DISPATCH 1
#include <immintrin.h>
#if __GNUC__ >= 12 /* the first to take an architecture level in target_clones */
#define HOT __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#else
#define HOT
#endif

/* Combining operators. Integer SUM/PROD compute in the wrap type W (unsigned, at least as wide as int) so that
 * overflow wraps without UB; the conversion back to a signed type keeps the low bits (gcc and clang define it so).
 * MIN/MAX return the accumulator unless the new value compares strictly less/greater: a NaN already in the
 * accumulator therefore sticks, a NaN arriving from a later source is ignored, and min(+0, -0) keeps the first. */
#define OP_SUM(W, a, b) ((W)(a) + (W)(b))
#define OP_PROD(W, a, b) ((W)(a) * (W)(b))
#define OP_MIN(W, a, b) ((b) < (a) ? (b) : (a))
#define OP_MAX(W, a, b) ((b) > (a) ? (b) : (a))

/* Scaling by a double: floats multiply in their own type; integers go through double and truncate toward zero,
 * clamped to the type's range (and NaN to 0) so that the conversion is never UB. */
#define SCALE_FLOAT(name, T, x, s) ((x) * (T)(s))
#define SCALE_INT(name, T, x, s) name##_from_double((double)(x) * (s))

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
#define DEFINE_FIRST(name, T, KIND)                                                            \
  HOT static void name##_first(T* restrict acc, const T* restrict src, size_t n, double pre) { \
    if (pre == 1.0) {                                                                          \
      for (size_t i = 0; i < n; i++) acc[i] = src[i];                                          \
    } else {                                                                                   \
      for (size_t i = 0; i < n; i++) acc[i] = SCALE_##KIND(name, T, src[i], pre);              \
    }                                                                                          \
  }

/* acc[i] = op(acc[i], pre(src[i])) */
#define DEFINE_COMBINE(name, T, W, KIND, opname, OP)                                                  \
  HOT static void name##_##opname(T* restrict acc, const T* restrict src, size_t n, double pre) {     \
    if (pre == 1.0) {                                                                                 \
      for (size_t i = 0; i < n; i++) acc[i] = OP(W, acc[i], src[i]);                                  \
    } else {                                                                                          \
      for (size_t i = 0; i < n; i++) {                                                                \
        T v = SCALE_##KIND(name, T, src[i], pre);                                                     \
        acc[i] = OP(W, acc[i], v);                                                                    \
      }                                                                                               \
    }                                                                                                 \
  }

/* dst[i] = fin(acc[i]). Floats: one multiply by postscale/divisor, that factor rounded once to the type. */
#define DEFINE_FINISH_FLOAT(name, T)                                                                            \
  HOT static void name##_finish(T* restrict dst, const T* restrict acc, size_t n, double post, int64_t div) { \
    const T f = (T)(post / (double)div);                                                                      \
    if (post == 1.0 && div == 1) {                                                                            \
      for (size_t i = 0; i < n; i++) dst[i] = acc[i];                                                         \
    } else {                                                                                                  \
      for (size_t i = 0; i < n; i++) dst[i] = acc[i] * f;                                                     \
    }                                                                                                         \
  }

/* Integers: postscale through double (truncating, clamped), then C division by the divisor (toward zero). */
#define DEFINE_FINISH_INT(name, T)                                                                              \
  HOT static void name##_finish(T* restrict dst, const T* restrict acc, size_t n, double post, int64_t div) { \
    if (post == 1.0 && div == 1) {                                                                            \
      for (size_t i = 0; i < n; i++) dst[i] = acc[i];                                                         \
    } else {                                                                                                  \
      for (size_t i = 0; i < n; i++) {                                                                        \
        T v = post == 1.0 ? acc[i] : name##_from_double((double)acc[i] * post);                               \
        dst[i] = div == 1 ? v : (T)((int64_t)v / div);                                                        \
      }                                                                                                       \
    }                                                                                                         \
  }

/* dst[i] = beta*dst[i] + alpha*src[i]. No restrict: dst may be src. */
#define DEFINE_AXPBY_FLOAT(name, T, W)                                                        \
  HOT static void name##_axpby(T* dst, const T* src, size_t n, double alpha, double beta) { \
    const T a = (T)alpha, b = (T)beta;                                                       \
    for (size_t i = 0; i < n; i++) dst[i] = b * dst[i] + a * src[i];                         \
  }

#define DEFINE_AXPBY_INT(name, T, W)                                                          \
  HOT static void name##_axpby(T* dst, const T* src, size_t n, double alpha, double beta) { \
    if (alpha == 1.0 && beta == 1.0) {                                                       \
      for (size_t i = 0; i < n; i++) dst[i] = (T)((W)dst[i] + (W)src[i]);                    \
    } else {                                                                                 \
      for (size_t i = 0; i < n; i++) {                                                       \
        dst[i] = name##_from_double(beta * (double)dst[i] + alpha * (double)src[i]);         \
      }                                                                                      \
    }                                                                                        \
  }

/* Two sources summed without a prescale (two ranks' inputs): one pass, where the steps above take three, each storing.
 * No restrict: dst may be either source, and gcc's run-time check still vectorises that. The same operations in the
 * same order as the steps, so the same bits. Integers take the steps. */
#define DEFINE_PAIR_FLOAT(name, T, IN_T, IN, OUT)                                                            \
  HOT static void name##_pair(void* d, const void* x, const void* y, size_t n, double post, int64_t div) { \
    IN_T* dst = d;                                                                                          \
    const IN_T *a = x, *b = y;                                                                              \
    const T f = (T)(post / (double)div);                                                                    \
    if (post == 1.0 && div == 1) {                                                                          \
      for (size_t i = 0; i < n; i++) dst[i] = OUT(IN(a[i]) + IN(b[i]));                                     \
    } else {                                                                                                \
      for (size_t i = 0; i < n; i++) dst[i] = OUT((IN(a[i]) + IN(b[i])) * f);                               \
    }                                                                                                       \
  }
#define AS_IS(x) (x)
#define DEFINE_PAIR_INT(name, T, IN_T, IN, OUT) \
  static void name##_pair(void* d, const void* x, const void* y, size_t n, double post, int64_t div) {}
#define PAIRS_FLOAT 1
#define PAIRS_INT 0

/* Whether a reduction is two sources summed without a prescale, which the pair passes take. */
static inline int pair_sum(int nsrcs, smc_redop_t op, double pre) { return nsrcs == 2 && op == SMC_SUM && pre == 1.0; }

/* All steps for one dtype, plus its block driver and an axpby entry with the uniform signatures of the table. */
#define DEFINE_KERNELS(name, T, W, KIND)                                                                      \
  DEFINE_FIRST(name, T, KIND)                                                                                \
  DEFINE_COMBINE(name, T, W, KIND, sum, OP_SUM)                                                              \
  DEFINE_COMBINE(name, T, W, KIND, min, OP_MIN)                                                              \
  DEFINE_COMBINE(name, T, W, KIND, max, OP_MAX)                                                              \
  DEFINE_COMBINE(name, T, W, KIND, prod, OP_PROD)                                                            \
  DEFINE_FINISH_##KIND(name, T)                                                                              \
  DEFINE_AXPBY_##KIND(name, T, W)                                                                            \
  DEFINE_PAIR_##KIND(name, T, T, AS_IS, AS_IS)                                                                \
  typedef void (*name##_combine_fn)(T* restrict acc, const T* restrict src, size_t n, double pre);          \
  static name##_combine_fn name##_combine_for(smc_redop_t op) {                                             \
    return op == SMC_SUM ? name##_sum : op == SMC_MIN ? name##_min : op == SMC_MAX ? name##_max : name##_prod; \
  }                                                                                                          \
  static void name##_reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, smc_redop_t op,     \
                            double pre, double post, int64_t div) {                                          \
    if (PAIRS_##KIND && pair_sum(nsrcs, op, pre)) {                                                          \
      name##_pair(dst, srcs[0], srcs[1], count, post, div);                                                  \
      return;                                                                                                \
    }                                                                                                        \
    name##_combine_fn combine = name##_combine_for(op);                                                      \
    _Alignas(64) T acc[BLOCK];                                                                               \
    /* More sources summed: the first two in one pass, the last with the scaling, two stores fewer per block */ \
    const int sums = PAIRS_##KIND && nsrcs > 2 && op == SMC_SUM && pre == 1.0;                               \
    for (size_t off = 0; off < count; off += BLOCK) {                                                        \
      size_t n = count - off < BLOCK ? count - off : BLOCK;                                                  \
      if (sums) {                                                                                            \
        name##_pair(acc, (const T*)srcs[0] + off, (const T*)srcs[1] + off, n, 1.0, 1);                      \
        for (int k = 2; k < nsrcs - 1; k++) combine(acc, (const T*)srcs[k] + off, n, pre);                  \
        name##_pair((T*)dst + off, acc, (const T*)srcs[nsrcs - 1] + off, n, post, div);                     \
        continue;                                                                                            \
      }                                                                                                      \
      name##_first(acc, (const T*)srcs[0] + off, n, pre);                                                    \
      for (int k = 1; k < nsrcs; k++) combine(acc, (const T*)srcs[k] + off, n, pre);                         \
      name##_finish((T*)dst + off, acc, n, post, div);                                                       \
    }                                                                                                        \
  }                                                                                                          \
  static void name##_axpby_any(void* dst, const void* src, size_t count, double alpha, double beta) {        \
    name##_axpby((T*)dst, (const T*)src, count, alpha, beta);                                                \
  }

DEFINE_KERNELS(f32, float, float, FLOAT)
DEFINE_KERNELS(f64, double, double, FLOAT)
DEFINE_KERNELS(i8, int8_t, uint32_t, INT)
DEFINE_KERNELS(u8, uint8_t, uint32_t, INT)
DEFINE_KERNELS(i16, int16_t, uint32_t, INT)
DEFINE_KERNELS(i32, int32_t, uint32_t, INT)
DEFINE_KERNELS(i64, int64_t, uint64_t, INT)

/* ---- 16-bit floats: whole blocks converted to float, then the float32 kernels ---- */

typedef void (*to_float_fn)(float* restrict out, const uint16_t* restrict in, size_t n);
typedef void (*from_float_fn)(uint16_t* restrict out, const float* restrict in, size_t n);

#define DEFINE_CONVERSIONS(name, TO_FLOAT, FROM_FLOAT)                                                 \
  HOT static void name##_to_float(float* restrict out, const uint16_t* restrict in, size_t n) {      \
    for (size_t i = 0; i < n; i++) out[i] = TO_FLOAT(in[i]);                                          \
  }                                                                                                   \
  HOT static void name##_from_float(uint16_t* restrict out, const float* restrict in, size_t n) {    \
    for (size_t i = 0; i < n; i++) out[i] = FROM_FLOAT(in[i]);                                        \
  }

DEFINE_CONVERSIONS(f16, smc_half_to_float, smc_float_to_half)
DEFINE_CONVERSIONS(bf16, smc_bf16_to_float, smc_float_to_bf16)

#ifdef SMC_X86_DISPATCH
#include "reduce/x86.h"
#endif

static void f16_conversions(to_float_fn* to_float, from_float_fn* from_float) {
  *to_float = f16_to_float;
  *from_float = f16_from_float;
#ifdef SMC_X86_DISPATCH
  if (cpu_has_f16c()) {
    *to_float = f16c_to_float;
    *from_float = f16c_from_float;
  }
#endif
}

static void half_reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, smc_redop_t op, double pre,
                        double post, int64_t div, to_float_fn to_float, from_float_fn from_float) {
  f32_combine_fn combine = f32_combine_for(op);
  _Alignas(64) float acc[BLOCK], tmp[BLOCK];
  for (size_t off = 0; off < count; off += BLOCK) {
    size_t n = count - off < BLOCK ? count - off : BLOCK;
    /* Scaling passes only run when a scale is set; otherwise convert straight into or out of acc. */
    to_float(pre == 1.0 ? acc : tmp, (const uint16_t*)srcs[0] + off, n);
    if (pre != 1.0) f32_first(acc, tmp, n, pre);
    for (int k = 1; k < nsrcs; k++) {
      to_float(tmp, (const uint16_t*)srcs[k] + off, n);
      combine(acc, tmp, n, pre);
    }
    if (post != 1.0 || div != 1) f32_finish(tmp, acc, n, post, div);
    from_float((uint16_t*)dst + off, post != 1.0 || div != 1 ? tmp : acc, n);
  }
}

static void half_axpby(void* dst, const void* src, size_t count, double alpha, double beta, to_float_fn to_float,
                       from_float_fn from_float) {
  _Alignas(64) float d[BLOCK], s[BLOCK];
  for (size_t off = 0; off < count; off += BLOCK) {
    size_t n = count - off < BLOCK ? count - off : BLOCK;
    to_float(d, (const uint16_t*)dst + off, n);
    to_float(s, (const uint16_t*)src + off, n);
    f32_axpby(d, s, n, alpha, beta);
    from_float((uint16_t*)dst + off, d, n);
  }
}

#define BF16_IN(x) smc_bf16_to_float(x)
DEFINE_PAIR_FLOAT(bf16, float, uint16_t, BF16_IN, smc_float_to_bf16)

static void bf16_reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, smc_redop_t op, double pre,
                        double post, int64_t div) {
  if (pair_sum(nsrcs, op, pre)) {
#ifdef SMC_X86_DISPATCH
    if (cpu_has_bf16_rounding()) {
      bf16_pair_native(dst, srcs[0], srcs[1], count, post, div);
      return;
    }
#endif
    bf16_pair(dst, srcs[0], srcs[1], count, post, div);
    return;
  }
  half_reduce(dst, srcs, nsrcs, count, op, pre, post, div, bf16_to_float, bf16_from_float);
}

static void f16_reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, smc_redop_t op, double pre,
                       double post, int64_t div) {
  to_float_fn to_float;
  from_float_fn from_float;
  f16_conversions(&to_float, &from_float);
#ifdef SMC_X86_DISPATCH
  if (pair_sum(nsrcs, op, pre) && to_float == f16c_to_float) {
    f16c_pair(dst, srcs[0], srcs[1], count, post, div);
    return;
  }
#endif
  half_reduce(dst, srcs, nsrcs, count, op, pre, post, div, to_float, from_float);
}

static void f16_axpby_any(void* dst, const void* src, size_t count, double alpha, double beta) {
  to_float_fn to_float;
  from_float_fn from_float;
  f16_conversions(&to_float, &from_float);
  half_axpby(dst, src, count, alpha, beta, to_float, from_float);
}

/* No restrict: dst may be src. */
HOT static void bf16_axpby_any(void* dst, const void* src, size_t count, double alpha, double beta) {
  const float a = (float)alpha, b = (float)beta;
  uint16_t* d = dst;
  const uint16_t* s = src;
  for (size_t i = 0; i < count; i++) d[i] = smc_float_to_bf16(b * BF16_IN(d[i]) + a * BF16_IN(s[i]));
}

/* ---- entry points ---- */

typedef void (*reduce_fn)(void* dst, const void* const* srcs, int nsrcs, size_t count, smc_redop_t op, double pre,
                          double post, int64_t div);
typedef void (*axpby_fn)(void* dst, const void* src, size_t count, double alpha, double beta);

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
  if (count > SMC_MAX_BYTES / dtypes[dtype].size)
    return smc_set_error(SMC_ERR_INVALID, "reduce: count %zu is too large", count);
  if (!dst || !srcs) {
    return smc_set_error(SMC_ERR_INVALID, "reduce: %s is NULL with count %zu", dst ? "srcs" : "dst", count);
  }
  for (int k = 0; k < nsrcs; k++) {
    if (!srcs[k]) return smc_set_error(SMC_ERR_INVALID, "reduce: srcs[%d] is NULL with count %zu", k, count);
  }
  dtypes[dtype].reduce(dst, srcs, nsrcs, count, op, prescale, postscale, divisor);
  return SMC_SUCCESS;
}

smc_result_t smc_axpby(void* dst, const void* src, size_t count, smc_datatype_t dtype, double alpha, double beta) {
  if (!dtype_ok(dtype)) return smc_set_error(SMC_ERR_INVALID, "axpby: unknown dtype %d", (int)dtype);
  if (count == 0) return SMC_SUCCESS;
  if (count > SMC_MAX_BYTES / dtypes[dtype].size)
    return smc_set_error(SMC_ERR_INVALID, "axpby: count %zu is too large", count);
  if (!dst || !src) {
    return smc_set_error(SMC_ERR_INVALID, "axpby: %s is NULL with count %zu", dst ? "src" : "dst", count);
  }
  dtypes[dtype].axpby(dst, src, count, alpha, beta);
  return SMC_SUCCESS;
}
