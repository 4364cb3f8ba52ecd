/* SPDX-License-Identifier: Apache-2.0 */
/* SHA-256 and HMAC-SHA256 (core/hmac.h), written out here so that the core needs no crypto library at run time. */
#define _GNU_SOURCE
#include "core/hmac.h"

#include <string.h>

typedef struct {
  uint32_t h[8];
  uint8_t block[64];
  size_t used;     /* bytes in block */
  uint64_t total;  /* bytes hashed so far */
} sha256_t;

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void compress(sha256_t* s, const uint8_t* p) {
  uint32_t w[64], v[8];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  memcpy(v, s->h, sizeof(v));
  for (int i = 0; i < 64; i++) {
    uint32_t t1 = v[7] + (rotr(v[4], 6) ^ rotr(v[4], 11) ^ rotr(v[4], 25)) + ((v[4] & v[5]) ^ (~v[4] & v[6])) + K[i] +
                  w[i];
    uint32_t t2 = (rotr(v[0], 2) ^ rotr(v[0], 13) ^ rotr(v[0], 22)) + ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
    memmove(v + 1, v, 7 * sizeof(uint32_t));
    v[4] += t1;
    v[0] = t1 + t2;
  }
  for (int i = 0; i < 8; i++) s->h[i] += v[i];
}

static void start(sha256_t* s) {
  static const uint32_t first[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(s->h, first, sizeof(first));
  s->used = 0;
  s->total = 0;
}

static void add(sha256_t* s, const uint8_t* p, size_t n) {
  s->total += n;
  while (n > 0) {
    size_t take = 64 - s->used < n ? 64 - s->used : n;
    memcpy(s->block + s->used, p, take);
    s->used += take;
    p += take;
    n -= take;
    if (s->used == 64) {
      compress(s, s->block);
      s->used = 0;
    }
  }
}

static void finish(sha256_t* s, uint8_t* out) {
  uint64_t bits = s->total * 8;
  uint8_t pad[72] = {0x80};
  size_t pad_len = (s->used < 56 ? 56 : 120) - s->used;
  for (int i = 0; i < 8; i++) pad[pad_len + i] = (uint8_t)(bits >> (56 - 8 * i));
  add(s, pad, pad_len + 8);
  for (int i = 0; i < 8; i++) {
    out[4 * i] = (uint8_t)(s->h[i] >> 24);
    out[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
    out[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
    out[4 * i + 3] = (uint8_t)s->h[i];
  }
}

void smc_hmac_sha256(const uint8_t* key, size_t key_len, const uint8_t* const* parts, const size_t* lens, int n,
                     uint8_t* out) {
  uint8_t block[64] = {0}, inner[SMC_HMAC_BYTES];
  sha256_t s;
  if (key_len > 64) {  /* a long key is hashed first, as RFC 2104 says */
    start(&s);
    add(&s, key, key_len);
    finish(&s, block);
  } else if (key_len > 0) {
    memcpy(block, key, key_len);
  }
  for (int i = 0; i < 64; i++) block[i] ^= 0x36;
  start(&s);
  add(&s, block, 64);
  for (int i = 0; i < n; i++)
    if (lens[i] > 0) add(&s, parts[i], lens[i]);
  finish(&s, inner);
  for (int i = 0; i < 64; i++) block[i] ^= 0x36 ^ 0x5c;
  start(&s);
  add(&s, block, 64);
  add(&s, inner, sizeof(inner));
  finish(&s, out);
  explicit_bzero(block, sizeof(block));  /* no copy of the key left on the stack */
}

int smc_digests_equal(const uint8_t* a, const uint8_t* b) {
  volatile uint8_t differ = 0;
  for (int i = 0; i < SMC_HMAC_BYTES; i++) differ |= a[i] ^ b[i];
  return differ == 0;
}
