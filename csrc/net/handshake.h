/* SPDX-License-Identifier: Apache-2.0 */
/* The handshake that opens every TCP connection of a job: each end proves it holds the job's secret, over nonces
 * both ends draw afresh, before anything else is sent (net/handshake.c says how). Python's servers and clients call
 * it through cffi (shmcomm/transport/handshake.py), the box server in C. */
#ifndef SMC_NET_HANDSHAKE_H_
#define SMC_NET_HANDSHAKE_H_

#include <stddef.h>
#include <stdint.h>

/* Outcomes: proven, or why not. CLOSED: the other end hung up (on a prover's side after its proof: it was refused). */
enum {
  SMC_HANDSHAKE_PROVEN = 0,
  SMC_HANDSHAKE_CLOSED = 1,
  SMC_HANDSHAKE_TIMEOUT = 2,
  SMC_HANDSHAKE_FOREIGN = 3,  /* what came is not this handshake: not a client or server of a job */
  SMC_HANDSHAKE_WRONG = 4,    /* a proof made with another secret, or for other nonces (a replay) */
  SMC_HANDSHAKE_NO_RANDOM = 5
};
/* How long the other end has to answer: both ends answer from C, whatever their process is busy with. */
enum { SMC_HANDSHAKE_MIN_KEY_BYTES = 16, SMC_HANDSHAKE_TIMEOUT_S = 10 };

/* The connecting end: returns one of the outcomes above within about 2 * timeout_s. */
int smc_handshake_prove(int fd, const uint8_t* key, size_t key_len, double timeout_s);
/* The accepting end: the client proves itself first, so an unproven one learns nothing but a random nonce. */
int smc_handshake_admit(int fd, const uint8_t* key, size_t key_len, double timeout_s);
/* Why a server refused a client, for its log line: outcome is one of the refusals above. */
const char* smc_handshake_refusal(int outcome);
/* HMAC-SHA256 of one message, for the tests that hold it to the standard's vectors. */
void smc_handshake_hmac(const uint8_t* key, size_t key_len, const uint8_t* message, size_t len, uint8_t* out);

#endif
