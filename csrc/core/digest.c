/* SPDX-License-Identifier: Apache-2.0 */
/* The digests ranks compare to find that they called alike: a step's tag (a dtype and a shape) and the cross-host
 * agreement's signature (a whole description). Python (shmcomm/vocabulary/description.py) and the quick calls
 * (csrc/py) both call these, so both paths build the same digests from one layout. */
#include <string.h>

#include "shmcomm.h"

/* splitmix64's finaliser: every input bit reaches every output bit. */
static uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/* Words go in with their position, so that moving a number from one field to the next changes the digest. */
static uint64_t add(uint64_t h, uint64_t word, uint64_t* at) {
  return mix(h ^ (word + 0x9E3779B97F4A7C15ULL * ++*at));
}

static uint64_t add_bits(uint64_t h, double value, uint64_t* at) {
  uint64_t bits;
  value = value == 0.0 ? 0.0 : value; /* -0.0 scales as 0.0 does */
  memcpy(&bits, &value, sizeof bits);
  return add(h, bits, at);
}

uint64_t smc_shape_tag(int64_t dtype, const int64_t* dims, int ndim) {
  uint64_t at = 0, h = add(0, (uint64_t)ndim, &at);
  h = add(h, (uint64_t)dtype, &at);
  for (int d = 0; d < ndim; d++) h = add(h, (uint64_t)dims[d], &at);
  return h;
}

uint64_t smc_signature(int kind, int64_t dtype, const int64_t* dims, int ndim, int64_t op, double prescale,
                       double postscale, int64_t root, const int64_t* extra, int nextra) {
  uint64_t at = 0, h = smc_shape_tag(dtype, dims, ndim);
  h = add(h, (uint64_t)kind, &at);
  h = add(h, (uint64_t)op, &at);
  h = add_bits(h, prescale, &at);
  h = add_bits(h, postscale, &at);
  h = add(h, (uint64_t)root, &at);
  h = add(h, (uint64_t)nextra, &at);
  for (int i = 0; i < nextra; i++) h = add(h, (uint64_t)extra[i], &at);
  return h;
}
