/* SPDX-License-Identifier: Apache-2.0 */
/* The x86 instructions that the portable code in reduce.c cannot reach, for 16-bit floats: F16C's conversions of
 * float16, and AVX512_BF16's rounding to bfloat16. Part of csrc/reduce/reduce.c, which includes it where it
 * dispatches at run time (SMC_X86_DISPATCH), after half.h; each gives the same bits as the portable code. */
#ifndef SMC_REDUCE_X86_H_
#define SMC_REDUCE_X86_H_

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "reduce/half.h"

/* 8 halves per instruction, faster than the bit manipulation. Rounding is set in the instruction (nearest even), not
 * taken from MXCSR; NaNs come out quiet with the top payload bits, as in half.h. */
__attribute__((target("avx,f16c"))) static void f16c_to_float(float* restrict out, const uint16_t* restrict in,
                                                              size_t n) {
  size_t vec_end = n & ~(size_t)7;
  for (size_t i = 0; i < vec_end; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(in + i))));
  }
  for (size_t i = vec_end; i < n; i++) out[i] = smc_half_to_float(in[i]);
}

__attribute__((target("avx,f16c"))) static void f16c_from_float(uint16_t* restrict out, const float* restrict in,
                                                                size_t n) {
  size_t vec_end = n & ~(size_t)7;
  for (size_t i = 0; i < vec_end; i += 8) {
    _mm_storeu_si128((__m128i*)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (size_t i = vec_end; i < n; i++) out[i] = smc_float_to_half(in[i]);
}

/* Two float16 sources summed in one pass, as DEFINE_PAIR_FLOAT does for the other floats. dst may be either source:
 * each vector is read in full before it is written. */
__attribute__((target("avx,f16c"))) static void f16c_pair(void* d, const void* x, const void* y, size_t n,
                                                          double post, int64_t div) {
  uint16_t* dst = d;
  const uint16_t *a = x, *b = y;
  const float f = (float)(post / (double)div);
  const int scaled = post != 1.0 || div != 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 s = _mm256_add_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(a + i))),
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + i))));
    if (scaled) s = _mm256_mul_ps(s, _mm256_set1_ps(f));
    _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; i++) {
    float s = smc_half_to_float(a[i]) + smc_half_to_float(b[i]);
    dst[i] = smc_float_to_half(scaled ? s * f : s);
  }
}

/* bfloat16's pair with the CPU's rounding instruction (AVX512_BF16), which takes a float subnormal as zero: lanes
 * holding one take half.h's rounding instead, so the bits are the portable code's on every CPU. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void bf16_pair_native(
    void* d, const void* x, const void* y, size_t n, double post, int64_t div) {
  uint16_t* dst = d;
  const uint16_t *a = x, *b = y;
  const float f = (float)(post / (double)div);
  const int scaled = post != 1.0 || div != 1;
  const __m512i exponent = _mm512_set1_epi32(0x7f800000), mantissa = _mm512_set1_epi32(0x007fffff);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i wa = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + i)));
    __m512i wb = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(b + i)));
    __m512 s = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wa, 16)),
                             _mm512_castsi512_ps(_mm512_slli_epi32(wb, 16)));
    if (scaled) s = _mm512_mul_ps(s, _mm512_set1_ps(f));
    __m256i r = (__m256i)_mm512_cvtneps_pbh(s);
    __m512i bits = _mm512_castps_si512(s);
    __mmask16 sub = _mm512_testn_epi32_mask(bits, exponent) & _mm512_test_epi32_mask(bits, mantissa);
    if (sub) { /* half.h's rounding of those lanes: add 0x7fff and the lowest kept bit, keep the top half */
      __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      __m512i up = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
      r = _mm256_mask_mov_epi16(r, sub, _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
    }
    _mm256_storeu_si256((__m256i*)(dst + i), r);
  }
  for (; i < n; i++) {
    float s = smc_bf16_to_float(a[i]) + smc_bf16_to_float(b[i]);
    dst[i] = smc_float_to_bf16(scaled ? s * f : s);
  }
}

static int cpu_has_bf16_rounding(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

static int cpu_has_f16c(void) {
  __builtin_cpu_init(); /* cheap once done; needed only if we run before libgcc's constructor */
  return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}

#endif
