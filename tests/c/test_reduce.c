/* SPDX-License-Identifier: Apache-2.0 */
/* Unit test for csrc/reduce: smc_reduce and smc_axpby against a plain scalar reference, the 16-bit conversions
 * against an independent reference built on double arithmetic, and a --bench mode for the hot loops.
 * Usage: test_reduce [--bench]. Prints "N passed, N failed"; exits 1 on any failure. */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "reduce/half.h"
#include "shmcomm.h"

static int passed, failed;

static void check(int ok, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(int ok, const char* fmt, ...) {
  if (ok) {
    passed++;
    return;
  }
  if (++failed <= 40) {
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
  }
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { /* splitmix64 */
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static double rnd_unit(void) { return (double)(rnd() >> 11) * 0x1p-53; }

static const char* dtype_names[] = {"f16", "bf16", "f32", "f64", "i8", "u8", "i16", "i32", "i64"};
static const char* op_names[] = {"sum", "min", "max", "prod"};

/* ---- reference 16-bit conversions: round |x| to `sig` significant bits (min exponent emin) with rint ---- */

static double round_to_format(double a, int sig, int emin) {
  int e;
  frexp(a, &e); /* a = m * 2^e, m in [0.5, 1) */
  if (e - 1 < emin) e = emin + 1;
  double ulp = ldexp(1.0, e - sig);
  return rint(a / ulp) * ulp; /* default rounding mode: nearest even */
}

static uint16_t ref_float_to_half(float f) {
  uint32_t x = smc_f32_to_bits(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  if (isnan(f)) return (uint16_t)(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  double q = round_to_format(fabs((double)f), 11, -14);
  if (q >= 65536.0) return (uint16_t)(sign | 0x7c00u);
  if (q < 0x1p-14) return (uint16_t)(sign | (uint16_t)(q * 0x1p24));
  int e;
  double m = frexp(q, &e);
  return (uint16_t)(sign | ((e - 1 + 15) << 10) | (uint16_t)((m * 2.0 - 1.0) * 1024.0));
}

static double ref_half_to_double(uint16_t h) {
  int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v = exp == 0 ? ldexp(mant, -24) : exp == 31 ? (mant ? NAN : INFINITY) : ldexp(1024 + mant, exp - 25);
  return (h & 0x8000) ? -v : v;
}

static uint16_t ref_float_to_bf16(float f) {
  uint32_t x = smc_f32_to_bits(f);
  if (isnan(f)) return (uint16_t)((x >> 16) | 0x40u);
  double q = round_to_format(fabs((double)f), 8, -126);
  if (q >= 0x1p128) q = INFINITY;
  return (uint16_t)(((x >> 16) & 0x8000u) | (smc_f32_to_bits((float)q) >> 16));
}

static int half_is_nan(uint16_t h) { return (h & 0x7fff) > 0x7c00; }
static int bf16_is_nan(uint16_t h) { return (h & 0x7fff) > 0x7f80; }

static void test_conversions(void) {
  int bad = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float f = smc_half_to_float((uint16_t)h);
    double r = ref_half_to_double((uint16_t)h);
    if (half_is_nan((uint16_t)h)) {
      bad += !isnan(f) || smc_float_to_half(f) != (h | 0x200u);
    } else {
      bad += (double)f != r || !signbit(f) != !signbit(r) || smc_float_to_half(f) != h;
    }
  }
  check(bad == 0, "half -> float -> half over all 65536 halves: %d bad", bad);

  /* Every rounding boundary: for each finite half, the midpoint to the next one and the floats around it. */
  bad = 0;
  for (uint32_t h = 0; h < 0x7c00; h++) {
    float lo = smc_half_to_float((uint16_t)h);
    float hi = h == 0x7bff ? 65536.0f : smc_half_to_float((uint16_t)(h + 1));
    float mid = (float)(((double)lo + (double)hi) / 2);
    float probes[] = {lo, mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY), nextafterf(lo, INFINITY)};
    for (int p = 0; p < 5; p++) {
      for (int s = 0; s < 2; s++) {
        float v = s ? -probes[p] : probes[p];
        uint16_t got = smc_float_to_half(v), want = ref_float_to_half(v);
        if (got != want && bad++ < 5) printf("  f2h(%a) = %#x, want %#x\n", (double)v, got, want);
#if defined(__FLT16_MAX__) && defined(__x86_64__)
        _Float16 c = (_Float16)v; /* the compiler's conversion as a second opinion */
        uint16_t cb;
        memcpy(&cb, &c, 2);
        if (cb != want && bad++ < 5) printf("  _Float16(%a) = %#x, want %#x\n", (double)v, cb, want);
#endif
      }
    }
  }
  check(bad == 0, "float -> half at every rounding boundary: %d bad", bad);

  bad = 0;
  for (int i = 0; i < 2000000; i++) {
    float v = smc_bits_to_f32((uint32_t)rnd());
    uint16_t h = smc_float_to_half(v), hr = ref_float_to_half(v);
    uint16_t b = smc_float_to_bf16(v), br = ref_float_to_bf16(v);
    if ((h != hr || b != br) && bad++ < 5) printf("  %a: half %#x/%#x bf16 %#x/%#x\n", (double)v, h, hr, b, br);
  }
  check(bad == 0, "float -> half/bf16 on 2M random bit patterns: %d bad", bad);

  bad = 0;
  for (uint32_t h = 0; h < 65536; h++) { /* bf16 midpoints and neighbours */
    uint32_t x = h << 16;
    uint32_t probes[] = {x, x | 0x8000u, x | 0x7fffu, x | 0x8001u, x | 1u};
    for (int p = 0; p < 5; p++) {
      float v = smc_bits_to_f32(probes[p]);
      uint16_t got = smc_float_to_bf16(v), want = ref_float_to_bf16(v);
      if (got != want && bad++ < 5) printf("  f2bf(%#x) = %#x, want %#x\n", probes[p], got, want);
    }
    if (!bf16_is_nan((uint16_t)h)) bad += smc_float_to_bf16(smc_bf16_to_float((uint16_t)h)) != h;
  }
  check(bad == 0, "float -> bf16 at every rounding boundary: %d bad", bad);
  check(smc_float_to_half(65520.0f) == 0x7c00 && smc_float_to_half(65519.99f) == 0x7bff, "half overflow edge");
  check(smc_float_to_half(0x1p-25f) == 0 && smc_float_to_half(nextafterf(0x1p-25f, 1)) == 1, "half underflow edge");
  check(smc_float_to_bf16(INFINITY) == 0x7f80 && smc_float_to_bf16(-INFINITY) == 0xff80, "bf16 inf");
  check(bf16_is_nan(smc_float_to_bf16(smc_bits_to_f32(0x7f800001u))), "bf16 keeps a low-payload NaN a NaN");
}

/* ---- scalar reference for smc_reduce / smc_axpby ---- */

static int is_float(smc_datatype_t t) { return t <= SMC_FLOAT64; }

static double load_num(smc_datatype_t t, const void* p, size_t i) {
  switch (t) {
    case SMC_FLOAT16: return smc_half_to_float(((const uint16_t*)p)[i]);
    case SMC_BFLOAT16: return smc_bf16_to_float(((const uint16_t*)p)[i]);
    case SMC_FLOAT32: return ((const float*)p)[i];
    case SMC_FLOAT64: return ((const double*)p)[i];
    default: return 0;
  }
}

static int64_t load_int(smc_datatype_t t, const void* p, size_t i) {
  switch (t) {
    case SMC_INT8: return ((const int8_t*)p)[i];
    case SMC_UINT8: return ((const uint8_t*)p)[i];
    case SMC_INT16: return ((const int16_t*)p)[i];
    case SMC_INT32: return ((const int32_t*)p)[i];
    case SMC_INT64: return ((const int64_t*)p)[i];
    default: return 0;
  }
}

static void store_num(smc_datatype_t t, void* p, size_t i, double v) {
  switch (t) {
    case SMC_FLOAT16: ((uint16_t*)p)[i] = ref_float_to_half((float)v); break;
    case SMC_BFLOAT16: ((uint16_t*)p)[i] = ref_float_to_bf16((float)v); break;
    case SMC_FLOAT32: ((float*)p)[i] = (float)v; break;
    case SMC_FLOAT64: ((double*)p)[i] = v; break;
    case SMC_INT8: ((int8_t*)p)[i] = (int8_t)v; break;
    case SMC_UINT8: ((uint8_t*)p)[i] = (uint8_t)v; break;
    case SMC_INT16: ((int16_t*)p)[i] = (int16_t)v; break;
    case SMC_INT32: ((int32_t*)p)[i] = (int32_t)v; break;
    case SMC_INT64: ((int64_t*)p)[i] = (int64_t)v; break;
    default: break;
  }
}

static int int_bits(smc_datatype_t t) {
  return t == SMC_INT8 || t == SMC_UINT8 ? 8 : t == SMC_INT16 ? 16 : t == SMC_INT32 ? 32 : 64;
}

/* The low bits of v, read back as the dtype's value: two's-complement wrap-around. */
static int64_t wrap(smc_datatype_t t, uint64_t v) {
  int bits = int_bits(t);
  if (bits == 64) return (int64_t)v;
  v &= (1ull << bits) - 1;
  if (t != SMC_UINT8 && (v >> (bits - 1))) return (int64_t)v - (int64_t)(1ull << bits);
  return (int64_t)v;
}

static int64_t int_max(smc_datatype_t t) { return t == SMC_UINT8 ? 255 : (int64_t)((1ull << (int_bits(t) - 1)) - 1); }
static int64_t int_min(smc_datatype_t t) { return t == SMC_UINT8 ? 0 : -int_max(t) - 1; }

/* trunc toward zero, then clamp to the dtype's range; NaN -> 0 */
static int64_t trunc_clamp(smc_datatype_t t, double v) {
  if (isnan(v)) return 0;
  v = trunc(v);
  if (v <= (double)int_min(t)) return int_min(t);
  if (v >= (double)int_max(t)) return int_max(t);
  return (int64_t)v;
}

static float fop(smc_redop_t op, float a, float b) {
  switch (op) {
    case SMC_SUM: return a + b;
    case SMC_PROD: return a * b;
    case SMC_MIN: return b < a ? b : a;
    default: return b > a ? b : a;
  }
}

static double dop(smc_redop_t op, double a, double b) {
  switch (op) {
    case SMC_SUM: return a + b;
    case SMC_PROD: return a * b;
    case SMC_MIN: return b < a ? b : a;
    default: return b > a ? b : a;
  }
}

static int64_t iop(smc_datatype_t t, smc_redop_t op, int64_t a, int64_t b) {
  switch (op) {
    case SMC_SUM: return wrap(t, (uint64_t)a + (uint64_t)b);
    case SMC_PROD: return wrap(t, (uint64_t)a * (uint64_t)b);
    case SMC_MIN: return b < a ? b : a;
    default: return b > a ? b : a;
  }
}

static void ref_reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, smc_datatype_t t, smc_redop_t op,
                       double pre, double post, int64_t div) {
  for (size_t i = 0; i < count; i++) {
    if (t == SMC_FLOAT64) {
      double acc = 0;
      for (int k = 0; k < nsrcs; k++) {
        double x = load_num(t, srcs[k], i);
        if (pre != 1.0) x = x * pre;
        acc = k == 0 ? x : dop(op, acc, x);
      }
      if (post != 1.0 || div != 1) acc = acc * (post / (double)div);
      store_num(t, dst, i, acc);
    } else if (is_float(t)) {
      float acc = 0;
      for (int k = 0; k < nsrcs; k++) {
        float x = (float)load_num(t, srcs[k], i);
        if (pre != 1.0) x = x * (float)pre;
        acc = k == 0 ? x : fop(op, acc, x);
      }
      if (post != 1.0 || div != 1) acc = acc * (float)(post / (double)div);
      store_num(t, dst, i, acc);
    } else {
      int64_t acc = 0;
      for (int k = 0; k < nsrcs; k++) {
        int64_t x = load_int(t, srcs[k], i);
        if (pre != 1.0) x = trunc_clamp(t, (double)x * pre);
        acc = k == 0 ? x : iop(t, op, acc, x);
      }
      if (post != 1.0) acc = trunc_clamp(t, (double)acc * post);
      if (div != 1) acc = acc / div;
      switch (t) { /* integer store without going through double (int64 does not fit) */
        case SMC_INT64: ((int64_t*)dst)[i] = acc; break;
        default: store_num(t, dst, i, (double)acc); break;
      }
    }
  }
}

static void ref_axpby(void* dst, const void* src, size_t count, smc_datatype_t t, double alpha, double beta) {
  for (size_t i = 0; i < count; i++) {
    if (t == SMC_FLOAT64) {
      store_num(t, dst, i, beta * load_num(t, dst, i) + alpha * load_num(t, src, i));
    } else if (is_float(t)) {
      float d = (float)load_num(t, dst, i), s = (float)load_num(t, src, i);
      store_num(t, dst, i, (float)beta * d + (float)alpha * s);
    } else {
      int64_t d = load_int(t, dst, i), s = load_int(t, src, i);
      int64_t r = alpha == 1.0 && beta == 1.0 ? wrap(t, (uint64_t)d + (uint64_t)s)
                                              : trunc_clamp(t, beta * (double)d + alpha * (double)s);
      if (t == SMC_INT64) {
        ((int64_t*)dst)[i] = r;
      } else {
        store_num(t, dst, i, (double)r);
      }
    }
  }
}

/* Equal bit for bit, except that any NaN equals any NaN. */
static size_t first_mismatch(smc_datatype_t t, const void* a, const void* b, size_t count) {
  size_t sz = smc_dtype_size(t);
  for (size_t i = 0; i < count; i++) {
    const char* pa = (const char*)a + i * sz;
    const char* pb = (const char*)b + i * sz;
    if (memcmp(pa, pb, sz) == 0) continue;
    if (is_float(t) && isnan(load_num(t, a, i)) && isnan(load_num(t, b, i))) continue;
    return i;
  }
  return (size_t)-1;
}

static void fill_random(smc_datatype_t t, void* p, size_t count) {
  static const double specials[] = {0.0, -0.0, INFINITY, -INFINITY, NAN, 65504.0, 1e-7, -3.0};
  for (size_t i = 0; i < count; i++) {
    if (is_float(t)) {
      double v = (rnd_unit() * 2 - 1) * (t == SMC_FLOAT16 || t == SMC_BFLOAT16 ? 4.0 : 100.0);
      if (rnd() % 64 == 0) v = specials[rnd() % 8];
      store_num(t, p, i, v);
    } else {
      uint64_t r = rnd();
      memcpy((char*)p + i * smc_dtype_size(t), &r, smc_dtype_size(t)); /* the full range; little-endian low bytes */
    }
  }
}

/* ---- tests ---- */

static void test_reduce_matrix(void) {
  static const int nsrcs_list[] = {1, 2, 3, 8};
  static const size_t counts[] = {0, 1, 7, 1000, 4099};
  static const struct {
    double pre, post;
    int64_t div;
  } scales[] = {{1, 1, 1}, {0.5, 1, 1}, {1, 3.0, 1}, {1, 1, 3}, {-0.25, 2.5, 7}};
  enum { MAXN = 8, MAXC = 4099 + 1 };
  for (int t = 0; t < SMC_NUM_DTYPES; t++) {
    size_t sz = smc_dtype_size((smc_datatype_t)t);
    char* bufs[MAXN];
    for (int k = 0; k < MAXN; k++) bufs[k] = malloc(MAXC * sz);
    char* got = malloc(MAXC * sz);
    char* want = malloc(MAXC * sz);
    int bad = 0, cases = 0;
    for (int op = 0; op < SMC_NUM_OPS; op++) {
      for (size_t ni = 0; ni < sizeof(nsrcs_list) / sizeof(nsrcs_list[0]); ni++) {
        for (size_t ci = 0; ci < sizeof(counts) / sizeof(counts[0]); ci++) {
          for (size_t si = 0; si < sizeof(scales) / sizeof(scales[0]); si++) {
            int n = nsrcs_list[ni];
            size_t count = counts[ci];
            const void* srcs[MAXN];
            for (int k = 0; k < n; k++) { /* odd sources start one element in: unaligned */
              srcs[k] = bufs[k] + (k % 2) * sz;
              fill_random((smc_datatype_t)t, (void*)srcs[k], count);
            }
            /* 0: separate dst; 1: dst is srcs[0]; 2: dst is the last src */
            for (int alias = 0; alias < 3; alias++) {
              if (alias > 0 && count == 0) continue;
              char* dst = alias == 0 ? got : (char*)srcs[alias == 1 ? 0 : n - 1];
              char saved[MAXC * 8];
              memcpy(saved, dst, count * sz);
              ref_reduce(want, srcs, n, count, (smc_datatype_t)t, (smc_redop_t)op, scales[si].pre, scales[si].post,
                         scales[si].div);
              smc_result_t rc = smc_reduce(dst, srcs, n, count, (smc_datatype_t)t, (smc_redop_t)op, scales[si].pre,
                                           scales[si].post, scales[si].div);
              size_t at = first_mismatch((smc_datatype_t)t, dst, want, count);
              cases++;
              if ((rc != SMC_SUCCESS || at != (size_t)-1) && bad++ < 5) {
                printf("  %s %s nsrcs=%d count=%zu scale#%zu alias=%d: rc=%d, mismatch at %lld\n", dtype_names[t],
                       op_names[op], n, count, si, alias, (int)rc, (long long)at);
              }
              memcpy(dst, saved, count * sz);
            }
          }
        }
      }
    }
    check(bad == 0, "reduce %s: %d of %d cases differ from the reference", dtype_names[t], bad, cases);
    for (int k = 0; k < MAXN; k++) free(bufs[k]);
    free(got);
    free(want);
  }
}

static uint16_t reduce_half(smc_datatype_t t, const uint16_t* vals, int n, double pre, double post, int64_t div) {
  const void* srcs[8];
  for (int k = 0; k < n; k++) srcs[k] = &vals[k];
  uint16_t out = 0xdead;
  smc_reduce(&out, srcs, n, 1, t, SMC_SUM, pre, post, div);
  return out;
}

static void test_16bit_rounding(void) {
  uint16_t tenth = smc_float_to_half(0.1f);
  uint16_t three[] = {tenth, tenth, tenth};
  uint16_t once = smc_float_to_half(smc_half_to_float(tenth) * 3.0f);
  check(reduce_half(SMC_FLOAT16, three, 3, 1, 1, 1) == once && once == 0x34cc, "f16: 3 x 0.1 rounds once to %#x",
        once);
  /* 1 + 7 * 2^-11: rounding after each add sticks at 1.0 (ties to even); rounding once gives 1 + 2^-8. */
  uint16_t ones[8] = {0x3c00, 0x1000, 0x1000, 0x1000, 0x1000, 0x1000, 0x1000, 0x1000};
  check(reduce_half(SMC_FLOAT16, ones, 8, 1, 1, 1) == 0x3c04, "f16: accumulates in float, rounds once");
  uint16_t bones[8] = {0x3f80, 0x3b80, 0x3b80, 0x3b80, 0x3b80, 0x3b80, 0x3b80, 0x3b80}; /* 1 and 2^-8 */
  check(reduce_half(SMC_BFLOAT16, bones, 8, 1, 1, 1) == 0x3f84, "bf16: accumulates in float, rounds once");
  uint16_t big[] = {0x7bff, 0x7bff}; /* 65504 */
  check(reduce_half(SMC_FLOAT16, big, 2, 1, 1, 1) == 0x7c00, "f16: 65504 + 65504 = inf");
  uint16_t nbig[] = {0xfbff, 0xfbff};
  check(reduce_half(SMC_FLOAT16, nbig, 2, 1, 1, 1) == 0xfc00, "f16: -65504 + -65504 = -inf");
  check(reduce_half(SMC_FLOAT16, big, 2, 1, 1, 2) == 0x7bff, "f16: (65504 + 65504) / 2 = 65504, no overflow in float");
  check(reduce_half(SMC_FLOAT16, big, 2, 0.5, 1, 1) == 0x7bff, "f16: prescale 0.5 then sum = 65504");
  uint16_t edge[] = {0x7bff, 0x4c00}; /* 65504 + 16 = 65520: a tie, rounds to even = inf */
  check(reduce_half(SMC_FLOAT16, edge, 2, 1, 1, 1) == 0x7c00, "f16: 65504 + 16 = inf");
  uint16_t nan_in[] = {0x7e00, 0x3c00};
  check(half_is_nan(reduce_half(SMC_FLOAT16, nan_in, 2, 1, 1, 1)), "f16: NaN + 1 = NaN");
  uint16_t bnan[] = {0x7f81, 0x3f80};
  check(bf16_is_nan(reduce_half(SMC_BFLOAT16, bnan, 2, 1, 1, 1)), "bf16: NaN + 1 = NaN");
  uint16_t infs[] = {0x7c00, 0x3c00};
  check(reduce_half(SMC_FLOAT16, infs, 2, 1, 1, 1) == 0x7c00, "f16: inf + 1 = inf");
  uint16_t sub[] = {0x0001, 0x0001}; /* smallest subnormals */
  check(reduce_half(SMC_FLOAT16, sub, 2, 1, 1, 1) == 0x0002, "f16: subnormal sum");
  check(reduce_half(SMC_FLOAT16, sub, 2, 1, 1, 4) == 0x0000, "f16: 2^-23 / 4 = 2^-25 ties to 0");
}

/* Through the public API, so that whichever conversion smc_reduce picks (F16C or half.h) is checked: every 16-bit
 * value passes unchanged (NaN quieted), and the midpoint of every adjacent pair rounds to nearest even. */
static void check_16bit_exhaustive(const char* what) {
  for (int t = SMC_FLOAT16; t <= SMC_BFLOAT16; t++) {
    int is_half = t == SMC_FLOAT16;
    uint16_t* in = malloc(65536 * 2);
    uint16_t* next = malloc(65536 * 2);
    uint16_t* out = malloc(65536 * 2);
    for (uint32_t h = 0; h < 65536; h++) {
      in[h] = (uint16_t)h;
      next[h] = (uint16_t)((h & 0x7fff) == (is_half ? 0x7bffu : 0x7f7fu) ? h : h + 1); /* no step onto Inf */
    }
    const void* one[] = {in};
    int bad = 0;
    smc_reduce(out, one, 1, 65536, (smc_datatype_t)t, SMC_SUM, 1, 1, 1);
    for (uint32_t h = 0; h < 65536; h++) {
      int nan = is_half ? half_is_nan((uint16_t)h) : bf16_is_nan((uint16_t)h);
      bad += out[h] != (nan ? (h | (is_half ? 0x200u : 0x40u)) : h);
    }
    const void* pair[] = {in, next};
    smc_reduce(out, pair, 2, 65536, (smc_datatype_t)t, SMC_SUM, 1, 0.5, 1);
    for (uint32_t h = 0; h < 65536; h++) {
      float a = is_half ? smc_half_to_float(in[h]) : smc_bf16_to_float(in[h]);
      float b = is_half ? smc_half_to_float(next[h]) : smc_bf16_to_float(next[h]);
      float mid = (a + b) * 0.5f;
      uint16_t want = is_half ? ref_float_to_half(mid) : ref_float_to_bf16(mid);
      int nan = is_half ? half_is_nan(want) : bf16_is_nan(want);
      bad += nan ? !(is_half ? half_is_nan(out[h]) : bf16_is_nan(out[h])) : out[h] != want;
    }
    check(bad == 0, "%s %s: identity and midpoint rounding over all values: %d bad", dtype_names[t], what, bad);
    free(in);
    free(next);
    free(out);
  }
}

static void test_16bit_exhaustive(void) {
  check_16bit_exhaustive("(default FP environment)");
#if defined(__x86_64__) && defined(__GNUC__)
  /* Conversions must not depend on FTZ/DAZ (a framework may set them, e.g. torch.set_flush_denormal). */
  unsigned csr = __builtin_ia32_stmxcsr();
  __builtin_ia32_ldmxcsr(csr | 0x8040u);
  check_16bit_exhaustive("(FTZ and DAZ set)");
  __builtin_ia32_ldmxcsr(csr);
#endif
}

static void test_integers(void) {
  int8_t a8[] = {100, -7, 7, 100}, b8[] = {100, 0, 0, 2};
  const void* s8[] = {a8, b8};
  int8_t o8[4];
  smc_reduce(o8, s8, 2, 4, SMC_INT8, SMC_SUM, 1, 1, 1);
  check(o8[0] == -56, "i8: 100 + 100 wraps to -56 (got %d)", o8[0]);
  smc_reduce(o8, s8, 2, 4, SMC_INT8, SMC_SUM, 1, 1, 2);
  check(o8[0] == -28 && o8[1] == -3 && o8[2] == 3, "i8: divisor truncates toward zero");
  smc_reduce(o8, s8, 2, 4, SMC_INT8, SMC_SUM, 1, 0.5, 1);
  check(o8[1] == -3 && o8[2] == 3, "i8: postscale truncates toward zero");
  smc_reduce(o8, s8, 2, 4, SMC_INT8, SMC_SUM, 2.0, 1, 1);
  check(o8[0] == (int8_t)(127 + 127) && o8[3] == (int8_t)(127 + 4), "i8: prescale clamps before the wrapping sum");
  smc_reduce(o8, s8, 2, 4, SMC_INT8, SMC_PROD, 1, 1, 1);
  check(o8[0] == 16 && o8[3] == -56, "i8: product wraps");

  uint8_t a_u8[] = {200}, b_u8[] = {100};
  const void* su8[] = {a_u8, b_u8};
  uint8_t ou8;
  smc_reduce(&ou8, su8, 2, 1, SMC_UINT8, SMC_SUM, 1, 1, 1);
  check(ou8 == 44, "u8: 200 + 100 wraps to 44");
  smc_reduce(&ou8, su8, 2, 1, SMC_UINT8, SMC_SUM, -1.0, 1, 1);
  check(ou8 == 0, "u8: negative prescale clamps to 0");

  int16_t a16[] = {300, INT16_MIN}, b16[] = {300, -1};
  const void* s16[] = {a16, b16};
  int16_t o16[2];
  smc_reduce(o16, s16, 2, 2, SMC_INT16, SMC_PROD, 1, 1, 1);
  check(o16[0] == 24464 && o16[1] == INT16_MIN, "i16: product wraps (300*300, MIN*-1)");

  int32_t a32[] = {INT32_MAX, INT32_MIN}, b32[] = {1, -1};
  const void* s32[] = {a32, b32};
  int32_t o32[2];
  smc_reduce(o32, s32, 2, 2, SMC_INT32, SMC_SUM, 1, 1, 1);
  check(o32[0] == INT32_MIN && o32[1] == INT32_MAX, "i32: sum wraps both ways");
  smc_reduce(o32, s32, 2, 2, SMC_INT32, SMC_MIN, 1, 1, 1);
  check(o32[0] == 1 && o32[1] == INT32_MIN, "i32: min");

  int64_t a64[] = {INT64_MAX, INT64_MIN, 3037000500}, b64[] = {1, -1, 3037000500};
  const void* s64[] = {a64, b64};
  int64_t o64[3];
  smc_reduce(o64, s64, 2, 3, SMC_INT64, SMC_SUM, 1, 1, 1);
  check(o64[0] == INT64_MIN && o64[1] == INT64_MAX, "i64: sum wraps both ways");
  smc_reduce(o64, s64, 2, 3, SMC_INT64, SMC_PROD, 1, 1, 1);
  check(o64[2] == (int64_t)(3037000500ull * 3037000500ull), "i64: product wraps");
  smc_reduce(o64, s64, 1, 2, SMC_INT64, SMC_SUM, 4.0, 1, 1);
  check(o64[0] == INT64_MAX && o64[1] == INT64_MIN, "i64: prescale clamps to the range");
  smc_reduce(o64, s64, 2, 3, SMC_INT64, SMC_MAX, 1, 1, 3);
  check(o64[0] == INT64_MAX / 3 && o64[1] == -1 / 3 && o64[2] == 3037000500 / 3, "i64: max then divide");
}

static void test_axpby(void) {
  static const double coefs[][2] = {{1, 1}, {0.5, 2}, {-1, 0}, {3.25, -0.75}, {100, 1}, {1e30, 1}};
  enum { N = 1029 };
  for (int t = 0; t < SMC_NUM_DTYPES; t++) {
    size_t sz = smc_dtype_size((smc_datatype_t)t);
    char *dst = malloc(N * sz), *src = malloc(N * sz), *want = malloc(N * sz);
    int bad = 0;
    for (size_t c = 0; c < sizeof(coefs) / sizeof(coefs[0]); c++) {
      for (int alias = 0; alias < 2; alias++) {
        fill_random((smc_datatype_t)t, dst, N);
        fill_random((smc_datatype_t)t, src, N);
        const char* s = alias ? dst : src;
        memcpy(want, dst, N * sz);
        ref_axpby(want, alias ? want : src, N, (smc_datatype_t)t, coefs[c][0], coefs[c][1]);
        smc_result_t rc = smc_axpby(dst, s, N, (smc_datatype_t)t, coefs[c][0], coefs[c][1]);
        size_t at = first_mismatch((smc_datatype_t)t, dst, want, N);
        if ((rc != SMC_SUCCESS || at != (size_t)-1) && bad++ < 3) {
          printf("  axpby %s alpha=%g beta=%g alias=%d: mismatch at %lld\n", dtype_names[t], coefs[c][0], coefs[c][1],
                 alias, (long long)at);
        }
      }
    }
    check(bad == 0, "axpby %s matches the reference", dtype_names[t]);
    free(dst);
    free(src);
    free(want);
  }
  int8_t d8[] = {127, -128}, s8[] = {1, -1};
  smc_axpby(d8, s8, 2, SMC_INT8, 1, 1);
  check(d8[0] == -128 && d8[1] == 127, "axpby i8: 1/1 wraps");
  smc_axpby(d8, s8, 2, SMC_INT8, 1000, 1);
  check(d8[0] == 127 && d8[1] == -128, "axpby i8: other coefficients clamp");
  uint16_t h[] = {0x3c00}, hs[] = {0x3c00};
  smc_axpby(h, hs, 1, SMC_FLOAT16, 0.5, 2);
  check(h[0] == 0x4100, "axpby f16: 2*1 + 0.5*1 = 2.5");
}

static void test_errors(void) {
  float a[4] = {1, 2, 3, 4}, out[4];
  const void* srcs[] = {a, a};
  const void* nulls[] = {a, NULL};
  check(smc_reduce(out, srcs, 2, 4, (smc_datatype_t)9, SMC_SUM, 1, 1, 1) == SMC_ERR_INVALID, "bad dtype");
  check(strstr(smc_last_error(), "dtype") != NULL, "error text names the dtype: '%s'", smc_last_error());
  check(smc_reduce(out, srcs, 2, 4, (smc_datatype_t)-1, SMC_SUM, 1, 1, 1) == SMC_ERR_INVALID, "negative dtype");
  check(smc_reduce(out, srcs, 2, 4, SMC_FLOAT32, (smc_redop_t)4, 1, 1, 1) == SMC_ERR_INVALID, "bad op");
  check(smc_reduce(out, srcs, 0, 4, SMC_FLOAT32, SMC_SUM, 1, 1, 1) == SMC_ERR_INVALID, "nsrcs 0");
  check(smc_reduce(out, srcs, 2, 4, SMC_FLOAT32, SMC_SUM, 1, 1, 0) == SMC_ERR_INVALID, "divisor 0");
  check(smc_reduce(out, srcs, 2, 4, SMC_INT32, SMC_SUM, 1, 1, -2) == SMC_ERR_INVALID, "divisor < 0");
  check(smc_reduce(NULL, srcs, 2, 4, SMC_FLOAT32, SMC_SUM, 1, 1, 1) == SMC_ERR_INVALID, "NULL dst");
  check(smc_reduce(out, NULL, 2, 4, SMC_FLOAT32, SMC_SUM, 1, 1, 1) == SMC_ERR_INVALID, "NULL srcs");
  check(smc_reduce(out, nulls, 2, 4, SMC_FLOAT32, SMC_SUM, 1, 1, 1) == SMC_ERR_INVALID, "NULL srcs[1]");
  check(smc_reduce(NULL, NULL, 2, 0, SMC_FLOAT32, SMC_SUM, 1, 1, 1) == SMC_SUCCESS, "count 0 with NULLs is fine");
  check(smc_axpby(out, a, 4, (smc_datatype_t)12, 1, 1) == SMC_ERR_INVALID, "axpby bad dtype");
  check(smc_axpby(NULL, a, 4, SMC_FLOAT32, 1, 1) == SMC_ERR_INVALID, "axpby NULL dst");
  check(smc_axpby(out, NULL, 4, SMC_FLOAT32, 1, 1) == SMC_ERR_INVALID, "axpby NULL src");
  check(smc_axpby(NULL, NULL, 0, SMC_FLOAT32, 1, 1) == SMC_SUCCESS, "axpby count 0");
  static const size_t sizes[] = {2, 2, 4, 8, 1, 1, 2, 4, 8};
  int ok = 1;
  for (int t = 0; t < SMC_NUM_DTYPES; t++) ok &= smc_dtype_size((smc_datatype_t)t) == sizes[t];
  check(ok && smc_dtype_size((smc_datatype_t)9) == 0 && smc_dtype_size((smc_datatype_t)-1) == 0, "smc_dtype_size");
}

/* ---- --bench ---- */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void bench(smc_datatype_t t, int nsrcs, size_t chunk_bytes) {
  size_t sz = smc_dtype_size(t), count = chunk_bytes / sz;
  void* bufs[9];
  const void* srcs[8];
  for (int k = 0; k <= nsrcs; k++) {
    bufs[k] = aligned_alloc(64, chunk_bytes);
    fill_random(t, bufs[k], count);
    if (k < nsrcs) srcs[k] = bufs[k];
  }
  double best = 0;
  for (int rep = 0; rep < 5; rep++) {
    int iters = 0;
    double t0 = now_s(), t1;
    do {
      for (int j = 0; j < 100; j++) smc_reduce(bufs[nsrcs], srcs, nsrcs, count, t, SMC_SUM, 1, 1, 1);
      iters += 100;
      t1 = now_s();
    } while (t1 - t0 < 0.2);
    double gbs = (double)chunk_bytes * iters / (t1 - t0) / 1e9;
    if (gbs > best) best = gbs;
  }
  printf("bench %-4s SUM nsrcs=%d chunk=%zu KiB: %.1f GB/s of output\n", dtype_names[t], nsrcs, chunk_bytes >> 10,
         best);
  for (int k = 0; k <= nsrcs; k++) free(bufs[k]);
}

int main(int argc, char** argv) {
  if (argc > 1 && strcmp(argv[1], "--bench") == 0) {
    bench(SMC_FLOAT32, 2, 256 << 10);
    bench(SMC_FLOAT16, 2, 256 << 10);
    bench(SMC_BFLOAT16, 2, 256 << 10);
    bench(SMC_FLOAT32, 8, 256 << 10);
    return 0;
  }
  test_conversions();
  test_reduce_matrix();
  test_16bit_rounding();
  test_16bit_exhaustive();
  test_integers();
  test_axpby();
  test_errors();
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
