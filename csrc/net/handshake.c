/* SPDX-License-Identifier: Apache-2.0 */
/* The job's handshake (net/handshake.h). Four messages:
 *   client -> server  MAGIC, client nonce
 *   server -> client  MAGIC, server nonce
 *   client -> server  HMAC(secret, CLIENT_LABEL, client nonce, server nonce)
 *   server -> client  HMAC(secret, SERVER_LABEL, client nonce, server nonce)    only if the client's proof was right
 * A recorded client proof fails against any later server nonce, and the labels keep one side's proof from passing
 * for the other's. The secret never crosses the wire; neither end sends anything that names the job. */
#define _GNU_SOURCE
#include "net/handshake.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>

#include "core/clock.h"
#include "core/hmac.h"
#include "net/wire.h"

enum { NONCE = 32, MAGIC_BYTES = 8, HELLO = MAGIC_BYTES + NONCE };
static const char MAGIC[MAGIC_BYTES] = {'S', 'M', 'C', 'A', 'U', 'T', 'H', '1'};
static const char CLIENT_LABEL[] = "shmcomm client proof";
static const char SERVER_LABEL[] = "shmcomm server proof";

/* SMC_HANDSHAKE_PROVEN once n bytes came, CLOSED or TIMEOUT otherwise. */
static int recv_by(int fd, uint8_t* p, size_t n, double deadline) {
  while (n > 0) {
    double left = deadline - smc_now();
    if (left <= 0) return SMC_HANDSHAKE_TIMEOUT;
    struct pollfd w = {fd, POLLIN, 0};
    int ready = poll(&w, 1, (int)(left * 1e3) + 1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return SMC_HANDSHAKE_CLOSED;
    if (ready == 0) continue;  /* the deadline check above decides */
    ssize_t got = recv(fd, p, n, MSG_DONTWAIT);
    if (got == 0) return SMC_HANDSHAKE_CLOSED;
    if (got < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return SMC_HANDSHAKE_CLOSED;
    }
    p += got;
    n -= (size_t)got;
  }
  return SMC_HANDSHAKE_PROVEN;
}

static void proof(const uint8_t* key, size_t key_len, const char* label, const uint8_t* client, const uint8_t* server,
                  uint8_t* out) {
  const uint8_t* parts[3] = {(const uint8_t*)label, client, server};
  size_t lens[3] = {strlen(label), NONCE, NONCE};
  smc_hmac_sha256(key, key_len, parts, lens, 3, out);
}

/* Sends MAGIC and a fresh nonce (kept in `nonce`). */
static int send_hello(int fd, uint8_t* nonce) {
  if (getrandom(nonce, NONCE, 0) != NONCE) return SMC_HANDSHAKE_NO_RANDOM;
  return smc_wire_send(fd, MAGIC, MAGIC_BYTES, nonce, NONCE) ? SMC_HANDSHAKE_PROVEN : SMC_HANDSHAKE_CLOSED;
}

/* Reads the other end's MAGIC and nonce. */
static int recv_hello(int fd, uint8_t* nonce, double deadline) {
  uint8_t hello[HELLO];
  int rc = recv_by(fd, hello, HELLO, deadline);
  if (rc != SMC_HANDSHAKE_PROVEN) return rc;
  if (memcmp(hello, MAGIC, MAGIC_BYTES) != 0) return SMC_HANDSHAKE_FOREIGN;
  memcpy(nonce, hello + MAGIC_BYTES, NONCE);
  return SMC_HANDSHAKE_PROVEN;
}

static int usable(const uint8_t* key, size_t key_len, double timeout_s) {
  return key != NULL && key_len >= SMC_HANDSHAKE_MIN_KEY_BYTES && timeout_s >= 0;
}

int smc_handshake_prove(int fd, const uint8_t* key, size_t key_len, double timeout_s) {
  if (!usable(key, key_len, timeout_s)) return SMC_HANDSHAKE_WRONG;
  uint8_t mine[NONCE], theirs[NONCE], out[SMC_HMAC_BYTES], got[SMC_HMAC_BYTES];
  double deadline = smc_now() + timeout_s;
  int rc = send_hello(fd, mine);
  if (rc == SMC_HANDSHAKE_PROVEN) rc = recv_hello(fd, theirs, deadline);
  if (rc != SMC_HANDSHAKE_PROVEN) return rc;
  proof(key, key_len, CLIENT_LABEL, mine, theirs, out);
  if (!smc_wire_send(fd, out, sizeof(out), NULL, 0)) return SMC_HANDSHAKE_CLOSED;
  rc = recv_by(fd, got, sizeof(got), smc_now() + timeout_s);
  if (rc != SMC_HANDSHAKE_PROVEN) return rc;
  proof(key, key_len, SERVER_LABEL, mine, theirs, out);
  return smc_digests_equal(out, got) ? SMC_HANDSHAKE_PROVEN : SMC_HANDSHAKE_WRONG;
}

int smc_handshake_admit(int fd, const uint8_t* key, size_t key_len, double timeout_s) {
  if (!usable(key, key_len, timeout_s)) return SMC_HANDSHAKE_WRONG;
  uint8_t mine[NONCE], theirs[NONCE], out[SMC_HMAC_BYTES], got[SMC_HMAC_BYTES];
  double deadline = smc_now() + timeout_s;
  int rc = recv_hello(fd, theirs, deadline);
  if (rc == SMC_HANDSHAKE_PROVEN) rc = send_hello(fd, mine);
  if (rc == SMC_HANDSHAKE_PROVEN) rc = recv_by(fd, got, sizeof(got), deadline);
  if (rc != SMC_HANDSHAKE_PROVEN) return rc;
  proof(key, key_len, CLIENT_LABEL, theirs, mine, out);
  if (!smc_digests_equal(out, got)) return SMC_HANDSHAKE_WRONG;
  proof(key, key_len, SERVER_LABEL, theirs, mine, out);
  return smc_wire_send(fd, out, sizeof(out), NULL, 0) ? SMC_HANDSHAKE_PROVEN : SMC_HANDSHAKE_CLOSED;
}

const char* smc_handshake_refusal(int outcome) {
  switch (outcome) {
    case SMC_HANDSHAKE_WRONG: return "its proof of the job's secret is wrong (another secret, or a replayed handshake)";
    case SMC_HANDSHAKE_FOREIGN: return "it does not speak the job's handshake";
    case SMC_HANDSHAKE_TIMEOUT: return "it did not answer the handshake in time";
    case SMC_HANDSHAKE_NO_RANDOM: return "this host has no random numbers for a nonce";
    default: return "it closed the connection before proving it holds the job's secret";
  }
}

void smc_handshake_hmac(const uint8_t* key, size_t key_len, const uint8_t* message, size_t len, uint8_t* out) {
  const uint8_t* parts[1] = {message};
  smc_hmac_sha256(key, key_len, parts, &len, 1, out);
}
