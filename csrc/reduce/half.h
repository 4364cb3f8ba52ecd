/* SPDX-License-Identifier: Apache-2.0 */
/* 16-bit float formats <-> float, by bit manipulation.
 *
 * Why not _Float16 casts: gcc 12 turns them into one scalar vcvtph2ps per element (or a libgcc call without F16C),
 * while the branch-free selects below vectorise under every target clone and give the same bits on every machine.
 * Conversions to 16 bits round to nearest even; Inf stays Inf; NaN stays NaN (quiet bit set, sign and the top
 * payload bits kept). Results do not depend on FTZ/DAZ. */
#ifndef SMC_REDUCE_HALF_H_
#define SMC_REDUCE_HALF_H_

#include <stdint.h>

typedef union {
  float f;
  uint32_t u;
} smc_f32_bits_t;

static inline uint32_t smc_f32_to_bits(float f) {
  smc_f32_bits_t b;
  b.f = f;
  return b.u;
}

static inline float smc_bits_to_f32(uint32_t u) {
  smc_f32_bits_t b;
  b.u = u;
  return b.f;
}

/* c ? a : b for c in {0, 1}, written with masks: gcc turns a ?: whose arms hold float arithmetic into branches,
 * which stops vectorisation without AVX-512 masking. */
static inline uint32_t smc_select_u32(uint32_t c, uint32_t a, uint32_t b) {
  uint32_t m = 0u - c;
  return (a & m) | (b & ~m);
}

/* IEEE binary16 -> float: exact. */
static inline float smc_half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t em = (uint32_t)(h & 0x7fffu) << 13; /* exponent and mantissa, moved to float positions */
  uint32_t exp = em & 0x0f800000u;
  uint32_t normal = em + (112u << 23);  /* rebias the exponent: 127 - 15 */
  uint32_t infnan = em + (224u << 23);  /* exponent 31 -> 255, mantissa (NaN payload) kept */
  /* Subnormal m * 2^-24: build 2^-14 * (1 + m/1024) and subtract 2^-14; exact, and never a float subnormal. */
  uint32_t sub = smc_f32_to_bits(smc_bits_to_f32(em + (113u << 23)) - 0x1p-14f);
  uint32_t r = smc_select_u32(exp == 0x0f800000u, infnan, normal);
  r = smc_select_u32(exp == 0, sub, r);
  return smc_bits_to_f32(r | sign);
}

/* float -> IEEE binary16, round to nearest even; overflow gives Inf. */
static inline uint16_t smc_float_to_half(float f) {
  uint32_t x = smc_f32_to_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t a = x & 0x7fffffffu;
  /* Normal result: rebias, then add 0xfff plus the lowest kept bit so the shift rounds to nearest even. A carry out
   * of the mantissa bumps the exponent, which is right, up to Inf for |f| >= 65520. Wraps (harmlessly, unused) for
   * small a. */
  uint32_t normal = (a - (112u << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  /* Subnormal result (|f| < 2^-14): adding 0.5f, whose ulp is 2^-24, makes the FPU round to a multiple of the half
   * subnormal step; the low bits are then the half's bits. A float subnormal input gives 0 with or without DAZ. */
  uint32_t sub = smc_f32_to_bits(smc_bits_to_f32(a) + 0.5f) - 0x3f000000u;
  uint32_t r = smc_select_u32(a < (113u << 23), sub, normal);
  r = smc_select_u32(a >= 0x47800000u, 0x7c00u, r);                          /* |f| >= 65536 or Inf */
  r = smc_select_u32(a > 0x7f800000u, 0x7e00u | ((a >> 13) & 0x3ffu), r);   /* NaN */
  return (uint16_t)(r | sign);
}

/* bfloat16 is the top half of a float32. */
static inline float smc_bf16_to_float(uint16_t h) { return smc_bits_to_f32((uint32_t)h << 16); }

static inline uint16_t smc_float_to_bf16(float f) {
  uint32_t x = smc_f32_to_bits(f);
  uint32_t r = x + 0x7fffu + ((x >> 16) & 1u); /* round to nearest even; a carry can reach Inf, which is right */
  r = smc_select_u32((x & 0x7fffffffu) > 0x7f800000u, x | 0x00400000u, r); /* NaN: set the quiet bit */
  return (uint16_t)(r >> 16); /* selecting before the shift keeps the vectorised loop narrow */
}

#endif
