/* SPDX-License-Identifier: Apache-2.0 */
/* HMAC-SHA256 (RFC 2104 over FIPS 180-4), for the handshake that proves a connection's ends belong to one job. */
#ifndef SMC_CORE_HMAC_H_
#define SMC_CORE_HMAC_H_

#include <stddef.h>
#include <stdint.h>

enum { SMC_HMAC_BYTES = 32 };

/* out = HMAC-SHA256(key, the concatenation of the n parts); parts may be empty. */
void smc_hmac_sha256(const uint8_t* key, size_t key_len, const uint8_t* const* parts, const size_t* lens, int n,
                     uint8_t* out);
/* 1 when the two digests are equal, in a time that does not depend on where they differ. */
int smc_digests_equal(const uint8_t* a, const uint8_t* b);

#endif
