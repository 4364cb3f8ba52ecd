/* SPDX-License-Identifier: Apache-2.0 */
/* The box server (csrc/net/box_server.c) through its wire, as a client on another host sees it: the handshake that
 * admits only a client holding the job's secret, every operation, the typed errors, the stream staying in step
 * after a refused request, a lock lost with its connection (closed, or gone without a word), and a stop that ends
 * every connection. Built with the sanitizers too (tests/test_c_core.py). */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/socket.h>

#include "core/clock.h"
#include "harness.h"
#include "net/handshake.h"

static const uint8_t KEY[32] = "the job's secret, 32 bytes long";

enum { CREATE = 1, ATTACH, READ, WRITE, ACCUMULATE, LOCK, UNLOCK, WAIT, VERSION, DESTROY, CLOSE, TOUCH, PING,
       EXCHANGE };

typedef struct {
  int32_t status;
  uint64_t version, count;
  uint32_t dtype, flags;
  char text[512];
} reply_t;

static int connect_raw(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in addr;
  memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_port = htons((uint16_t)port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr*)&addr, sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* A connection that proved itself: what every client of the job opens. */
static int connect_to(int port) {
  int fd = connect_raw(port);
  if (fd >= 0 && smc_handshake_prove(fd, KEY, sizeof(KEY), 5.0) != SMC_HANDSHAKE_PROVEN) {
    close(fd);
    return -1;
  }
  return fd;
}

static int recv_all(int fd, void* buf, size_t n) {
  uint8_t* p = buf;
  while (n > 0) {
    ssize_t got = recv(fd, p, n, 0);
    if (got <= 0) return 0;
    p += got;
    n -= (size_t)got;
  }
  return 1;
}

/* One request (header, name, elements) and its reply (header, error text or `out_bytes` of elements); 0 if the
 * connection ended instead. */
static int call(int fd, int op, int flags, const char* name, uint32_t dtype, uint64_t offset, uint64_t count,
                double alpha, double beta, double timeout_s, const void* data, size_t data_bytes, void* out,
                size_t out_bytes, reply_t* r) {
  uint8_t head[48];
  uint16_t name_len = (uint16_t)strlen(name);
  head[0] = (uint8_t)op;
  head[1] = (uint8_t)flags;
  memcpy(head + 2, &name_len, 2);
  memcpy(head + 4, &dtype, 4);
  memcpy(head + 8, &offset, 8);
  memcpy(head + 16, &count, 8);
  memcpy(head + 24, &alpha, 8);
  memcpy(head + 32, &beta, 8);
  memcpy(head + 40, &timeout_s, 8);
  if (send(fd, head, sizeof(head), MSG_NOSIGNAL) != (ssize_t)sizeof(head)) return 0;
  if (name_len && send(fd, name, name_len, MSG_NOSIGNAL) != (ssize_t)name_len) return 0;
  if (data_bytes && send(fd, data, data_bytes, MSG_NOSIGNAL) != (ssize_t)data_bytes) return 0;
  uint8_t reply[32];
  if (!recv_all(fd, reply, sizeof(reply))) return 0;
  uint32_t text_len;
  memcpy(&r->status, reply, 4);
  memcpy(&text_len, reply + 4, 4);
  memcpy(&r->version, reply + 8, 8);
  memcpy(&r->count, reply + 16, 8);
  memcpy(&r->dtype, reply + 24, 4);
  memcpy(&r->flags, reply + 28, 4);
  r->text[0] = '\0';
  if (r->status != 0) {
    char* text = malloc(text_len + 1);
    if (!recv_all(fd, text, text_len)) return free(text), 0;
    text[text_len] = '\0';
    snprintf(r->text, sizeof(r->text), "%s", text);
    free(text);
  } else if (out_bytes && !recv_all(fd, out, out_bytes)) {
    return 0;
  }
  return 1;
}

static int starts_with(const char* text, const char* prefix) { return strncmp(text, prefix, strlen(prefix)) == 0; }

static int closed_by_peer(int fd) {
  char byte;
  return recv(fd, &byte, 1, 0) == 0;
}

static void pack_request(uint8_t* head, int op, int flags, uint64_t offset, uint64_t count, double alpha) {
  memset(head, 0, 48);
  head[0] = (uint8_t)op;
  head[1] = (uint8_t)flags;
  memcpy(head + 8, &offset, 8);
  memcpy(head + 16, &count, 8);
  memcpy(head + 24, &alpha, 8);
}

static uint64_t reply_version(const uint8_t* reply) {
  uint64_t v;
  memcpy(&v, reply + 8, 8);
  return v;
}

static int32_t reply_status(const uint8_t* reply) {
  int32_t v;
  memcpy(&v, reply, 4);
  return v;
}

/* The exchange whose d streams back while x goes (SMC_FLAG_STREAM), through the client's own calls: a box of
 * several parts, exact values, one version step; refusals in step; a client gone in the middle, or silent for the
 * job's timeout, loses the lock, and the version says so. */
static void streamed_exchanges(int port) {
  enum { N = 300000 };  /* 2.4 MB of float64: several parts */
  reply_t r;
  uint8_t head[48], reply[32];
  char text[SMC_WIRE_TEXT_BYTES];
  double* c = malloc(N * sizeof(double));
  double* x = malloc(N * sizeof(double));
  for (int i = 0; i < N; i++) c[i] = i;
  int s = connect_to(port);
  EXPECT(call(s, CREATE, 0, "big", SMC_FLOAT64, 0, N, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0, "create big: %s",
         r.text);
  pack_request(head, WRITE, 0, 0, N, 0);
  EXPECT(smc_box_send(s, head, 48, c, N * sizeof(double), 5.0) == 0 &&
             smc_box_receive(s, NULL, 0, 5.0, reply, text, sizeof(text)) == 0 && reply_status(reply) == 0 &&
             reply_version(reply) == 1,
         "a write by the client's calls: %s", text);
  for (int i = 0; i < N; i++) x[i] = 3.0 * i;  /* d = 0.5 (3i - i) = i; the centre becomes 2i */
  pack_request(head, EXCHANGE, 4, 0, N, 0.5);
  EXPECT(smc_box_exchange_streamed(s, head, 48, x, N * sizeof(double), 5.0, reply, text, sizeof(text)) == 0 &&
             reply_status(reply) == 0 && reply_version(reply) == 2,
         "a streamed exchange: status %d version %llu %s", reply_status(reply),
         (unsigned long long)reply_version(reply), reply_status(reply) ? text : "");
  int wrong = 0;
  for (int i = 0; i < N; i++) wrong += x[i] != (double)i;
  EXPECT(wrong == 0, "d exact: %d wrong", wrong);
  pack_request(head, READ, 0, 0, N, 0);
  EXPECT(smc_box_send(s, head, 48, NULL, 0, 5.0) == 0 &&
             smc_box_receive(s, c, N * sizeof(double), 5.0, reply, text, sizeof(text)) == 0,
         "read back: %s", text);
  wrong = 0;
  for (int i = 0; i < N; i++) wrong += c[i] != 2.0 * i;
  EXPECT(wrong == 0, "the centre took d: %d wrong", wrong);
  /* Refused past the end, with its x drained: the connection stays in step. */
  pack_request(head, EXCHANGE, 4, 10, N, 0.5);
  EXPECT(smc_box_exchange_streamed(s, head, 48, x, N * sizeof(double), 5.0, reply, text, sizeof(text)) == 0 &&
             reply_status(reply) == 1 && starts_with(text, "InvalidArgumentError\n"),
         "refused past the end: %s", text);
  /* Refused while another holds the lock (for the job's timeout, 1 s), then in step. */
  int holder = connect_to(port);
  EXPECT(call(holder, ATTACH, 0, "big", 0, 0, 0, 0, 0, 1.0, NULL, 0, NULL, 0, &r) &&
             call(holder, LOCK, 0, "", 0, 0, 0, 0, 0, 1.0, NULL, 0, NULL, 0, &r) && r.status == 0,
         "another holds the lock: %s", r.text);
  pack_request(head, EXCHANGE, 4, 0, N, 0.5);
  EXPECT(smc_box_exchange_streamed(s, head, 48, x, N * sizeof(double), 10.0, reply, text, sizeof(text)) == 0 &&
             reply_status(reply) == 1 && starts_with(text, "TimeoutError\n"),
         "refused: the lock is held: %s", text);
  EXPECT(call(holder, UNLOCK, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0, "unlock: %s", r.text);
  EXPECT(call(s, VERSION, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.version == 2, "in step, version %llu",
         (unsigned long long)r.version);
  /* A client gone in the middle: its lock comes back, and the version moved. */
  pack_request(head, EXCHANGE, 4, 0, N, 0.5);
  EXPECT(send(s, head, 48, MSG_NOSIGNAL) == 48 && send(s, x, 100000, MSG_NOSIGNAL) == 100000 &&
             recv_all(s, reply, sizeof(reply)) && reply_status(reply) == 0,
         "half an exchange, accepted (the server holds the lock)");
  close(s);  /* the first part's d unread: the server's next send or receive finds the connection reset */
  EXPECT(call(holder, LOCK, 0, "", 0, 0, 0, 0, 0, 5.0, NULL, 0, NULL, 0, &r) && r.status == 0,
         "the lock of a client gone in the middle: %s", r.text);
  EXPECT(call(holder, VERSION, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.version == 3, "bumped: %llu",
         (unsigned long long)r.version);
  EXPECT(call(holder, UNLOCK, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0, "unlock: %s", r.text);
  /* A client silent in the middle for the job's timeout is dropped, and the lock comes back. */
  s = connect_to(port);
  EXPECT(call(s, ATTACH, 0, "big", 0, 0, 0, 0, 0, 1.0, NULL, 0, NULL, 0, &r) && r.status == 0, "attach: %s", r.text);
  EXPECT(send(s, head, 48, MSG_NOSIGNAL) == 48 && send(s, x, 100000, MSG_NOSIGNAL) == 100000 &&
             recv_all(s, reply, sizeof(reply)) && reply_status(reply) == 0,
         "accepted, then silence");
  double t0 = smc_now();
  EXPECT(call(holder, LOCK, 0, "", 0, 0, 0, 0, 0, 10.0, NULL, 0, NULL, 0, &r) && r.status == 0,
         "the lock of a silent client: %s", r.text);
  double waited = smc_now() - t0;
  EXPECT(waited > 0.7 && waited < 4.0, "dropped after the job's timeout (1 s): %.1f s", waited);
  char rest[65536];
  ssize_t got;
  while ((got = recv(s, rest, sizeof(rest), 0)) > 0) {  /* what came before the drop: its first part's d */
  }
  EXPECT(got == 0 || errno == ECONNRESET, "the silent client's connection ended: %s", strerror(errno));
  close(s);
  EXPECT(call(holder, VERSION, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.version == 4, "bumped: %llu",
         (unsigned long long)r.version);
  EXPECT(call(holder, UNLOCK, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0, "unlock: %s", r.text);
  /* A plain request left half sent: its connection ends after the job's timeout. */
  s = connect_to(port);
  EXPECT(call(s, ATTACH, 0, "big", 0, 0, 0, 0, 0, 1.0, NULL, 0, NULL, 0, &r) && r.status == 0, "attach: %s", r.text);
  pack_request(head, WRITE, 0, 0, 8, 0);
  EXPECT(send(s, head, 48, MSG_NOSIGNAL) == 48 && send(s, x, 16, MSG_NOSIGNAL) == 16, "half a write");
  t0 = smc_now();
  EXPECT(closed_by_peer(s), "a half-sent request's connection ends");
  waited = smc_now() - t0;
  EXPECT(waited > 0.7 && waited < 4.0, "after the job's timeout (1 s): %.1f s", waited);
  close(s);
  EXPECT(call(holder, DESTROY, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0, "destroy: %s", r.text);
  close(holder);
  free(c);
  free(x);
}

int main(void) {
  char token[64];
  make_token(token, sizeof(token), "bs");
  smc_config_t cfg = config(token, 0, 1);
  cfg.timeout_s = 1;  /* a streamed exchange's client that falls silent is dropped after this */
  cfg.arena_bytes = 4 << 20;  /* room for a box of several streamed parts */
  smc_comm_t* comm = NULL;
  if (smc_comm_create(&cfg, &comm) != SMC_SUCCESS) {
    fprintf(stderr, "create: %s\n", smc_last_error());
    return 1;
  }
  smc_box_server_t* server = NULL;
  EXPECT(smc_box_server_start(comm, "0.0.0.0", KEY, 8, &server) == SMC_ERR_INVALID, "a short secret is refused");
  EXPECT(smc_box_server_start(comm, "localhost", KEY, sizeof(KEY), &server) == SMC_ERR_INVALID, "not an address");
  EXPECT(smc_box_server_start(comm, "127.0.0.1", KEY, sizeof(KEY), &server) == SMC_SUCCESS, "start: %s",
         smc_last_error());
  int port = smc_box_server_port(server);
  EXPECT(port > 0, "a port: %d", port);
  reply_t r;

  /* Without the handshake, a request gets nothing back: the server closes the connection. */
  int outsider = connect_raw(port);
  EXPECT(!call(outsider, PING, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r), "an unproven ping is not answered");
  close(outsider);
  /* Another secret: refused after its proof, and the server's proof never comes. */
  uint8_t other[32];
  memcpy(other, KEY, sizeof(other));
  other[5] ^= 1;
  outsider = connect_raw(port);
  EXPECT(smc_handshake_prove(outsider, other, sizeof(other), 5.0) == SMC_HANDSHAKE_CLOSED, "another secret is refused");
  close(outsider);

  /* A ping is answered, then the server ends the connection (the roll call's use). */
  int fd = connect_to(port);
  EXPECT(call(fd, PING, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0, "ping");
  EXPECT(closed_by_peer(fd), "a ping's connection ends");
  close(fd);

  /* Every data operation on one box, as elastic averaging uses it. */
  int a = connect_to(port);
  double x[8], out[8];
  for (int i = 0; i < 8; i++) x[i] = i + 1;
  EXPECT(call(a, CREATE, 0, "centre", SMC_FLOAT64, 0, 8, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0 &&
             r.count == 8 && r.dtype == SMC_FLOAT64 && r.version == 0,
         "create: %d %s", r.status, r.text);
  EXPECT(call(a, WRITE, 0, "", 0, 0, 8, 0, 0, 0, x, sizeof(x), NULL, 0, &r) && r.status == 0 && r.version == 1,
         "write: %s", r.text);
  EXPECT(call(a, ACCUMULATE, 0, "", 0, 0, 8, 2.0, 1.0, 0, x, sizeof(x), NULL, 0, &r) && r.version == 2,
         "accumulate: %s", r.text);
  EXPECT(call(a, READ, 0, "", 0, 0, 8, 0, 0, 0, NULL, 0, out, sizeof(out), &r) && r.status == 0 && out[7] == 24,
         "read: %s %g", r.text, out[7]);
  double d[8];
  for (int i = 0; i < 8; i++) d[i] = 5 * (i + 1);  /* x = 5c/3: d = 0.5 (x - c) */
  EXPECT(call(a, EXCHANGE, 0, "", 0, 0, 8, 0.5, 0, 0, d, sizeof(d), d, sizeof(d), &r) && r.version == 3 &&
             d[2] == 3.0,
         "exchange: %s d[2]=%g", r.text, d[2]);
  EXPECT(call(a, READ, 0, "", 0, 2, 1, 0, 0, 0, NULL, 0, out, sizeof(double), &r) && out[0] == 12,
         "the centre took d: %g", out[0]);

  /* Refused requests say why in the client's terms, and the stream stays in step (their elements are read). */
  EXPECT(call(a, ACCUMULATE, 0, "", 0, 6, 4, 1, 1, 0, x, 4 * sizeof(double), NULL, 0, &r) && r.status == 1 &&
             starts_with(r.text, "InvalidArgumentError\n"),
         "past the end: %s", r.text);
  EXPECT(call(a, READ, 0, "", 0, 4, 1u << 30, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 1 &&
             strstr(r.text, "box 'centre'") != NULL,
         "a read past the end, refused before anything is allocated for it: %s", r.text);
  EXPECT(call(a, 99, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 1, "unknown op: %s", r.text);
  EXPECT(call(a, VERSION, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0 && r.version == 3,
         "in step after refusals: %s", r.text);
  EXPECT(call(a, CREATE, 0, "other", SMC_FLOAT32, 0, 4, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 1,
         "one box per connection: %s", r.text);
  int b = connect_to(port);
  EXPECT(call(b, WRITE, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 1, "no box open: %s", r.text);
  EXPECT(call(b, ATTACH, 0, "absent", 0, 0, 0, 0, 0, 0.1, NULL, 0, NULL, 0, &r) && r.status == 1 &&
             starts_with(r.text, "BoxNotFoundError\n"),
         "attach of a missing box: %s", r.text);

  /* A lock held by a connection that ends is released, and the version says so. */
  EXPECT(call(b, ATTACH, 0, "centre", 0, 0, 0, 0, 0, 1.0, NULL, 0, NULL, 0, &r) && r.status == 0 && r.count == 8,
         "attach: %s", r.text);
  EXPECT(call(a, LOCK, 0, "", 0, 0, 0, 0, 0, 1.0, NULL, 0, NULL, 0, &r) && r.status == 0, "lock: %s", r.text);
  EXPECT(call(b, LOCK, 0, "", 0, 0, 0, 0, 0, 0.2, NULL, 0, NULL, 0, &r) && r.status == 1 &&
             starts_with(r.text, "TimeoutError\n"),
         "the lock excludes: %s", r.text);
  close(a);  /* its holder gone */
  EXPECT(call(b, LOCK, 0, "", 0, 0, 0, 0, 0, 5.0, NULL, 0, NULL, 0, &r) && r.status == 0, "lock recovered: %s",
         r.text);
  EXPECT(call(b, VERSION, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.version == 4, "bumped: %llu",
         (unsigned long long)r.version);
  EXPECT(call(b, UNLOCK, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0, "unlock: %s", r.text);
  EXPECT(call(b, UNLOCK, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 1, "unlock unheld: %s",
         r.text);

  /* A holder whose host vanished sends nothing more, not even a FIN: the server's keepalive finds it gone. A socket
   * in TCP_REPAIR mode (root only) closes without sending a packet, as a host that lost power would. */
  int gone = connect_to(port), repair = 1;
  EXPECT(call(gone, ATTACH, 0, "centre", 0, 0, 0, 0, 0, 1.0, NULL, 0, NULL, 0, &r) && r.status == 0 &&
             call(gone, LOCK, 0, "", 0, 0, 0, 0, 0, 1.0, NULL, 0, NULL, 0, &r) && r.status == 0,
         "a holder that will vanish: %s", r.text);
  EXPECT(call(b, LOCK, 0, "", 0, 0, 0, 0, 0, 0.2, NULL, 0, NULL, 0, &r) && r.status == 1 &&
             starts_with(r.text, "TimeoutError\n"),
         "it holds the lock: %s", r.text);
  if (setsockopt(gone, IPPROTO_TCP, TCP_REPAIR, &repair, sizeof(repair)) == 0) {
    close(gone);
    double t0 = smc_now();
    EXPECT(call(b, LOCK, 0, "", 0, 0, 0, 0, 0, 30.0, NULL, 0, NULL, 0, &r) && r.status == 0,
           "the lock of a holder that vanished without a FIN comes back: %s", r.text);
    printf("the lock of a vanished holder came back after %.1f s\n", smc_now() - t0);
    EXPECT(call(b, VERSION, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.version == 5, "bumped: %llu",
           (unsigned long long)r.version);
    EXPECT(call(b, UNLOCK, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0, "unlock: %s", r.text);
  } else {
    EXPECT(getuid() != 0, "TCP_REPAIR refused to root: %s", strerror(errno));
    printf("not root: a holder that vanishes without a FIN is not tested here\n");
    close(gone);
  }

  /* A version wait ends by its timeout; a write with FLAG_THEN_TOUCH bumps the named box and returns its version. */
  EXPECT(call(b, WAIT, 0, "", 0, 100, 0, 0, 0, 0.1, NULL, 0, NULL, 0, &r) && starts_with(r.text, "TimeoutError\n"),
         "wait past the timeout: %s", r.text);
  int c = connect_to(port);
  EXPECT(call(c, CREATE, 0, "described", SMC_INT64, 0, 3, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0,
         "create: %s", r.text);
  EXPECT(call(b, WRITE, 2, "described", 0, 0, 1, 0, 0, 0, x, sizeof(double), NULL, 0, &r) && r.status == 0 &&
             r.version == 1,
         "then touch: %s %llu", r.text, (unsigned long long)r.version);

  streamed_exchanges(port);

  /* A forked child that stops its copy of the server leaves the parent's serving alone. */
  pid_t child = fork();
  if (child == 0) _exit(smc_box_server_stop(server, 1.0) == 1 ? 0 : 1);
  int status = -1;
  waitpid(child, &status, 0);
  EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child's stop: %d", status);
  fd = connect_to(port);
  EXPECT(fd >= 0 && call(fd, PING, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0,
         "still serving after a child's stop");
  close(fd);
  EXPECT(call(b, VERSION, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0,
         "a connection of the parent survives it");

  /* Attaching a striped box's name finds its description; destroying through that handle removes the description. */
  int maker = connect_to(port), e = connect_to(port);
  EXPECT(call(maker, CREATE, 0, "wide@stripes", SMC_INT64, 0, 3, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0,
         "create a description: %s", r.text);
  EXPECT(call(e, ATTACH, 0, "wide", 0, 0, 0, 0, 0, 1.0, NULL, 0, NULL, 0, &r) && r.status == 0 && r.flags == 1 &&
             r.count == 3,
         "attach finds the description: %s flags %u", r.text, r.flags);
  EXPECT(call(e, DESTROY, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0, "destroy: %s", r.text);
  close(e);
  e = connect_to(port);
  EXPECT(call(e, ATTACH, 0, "wide", 0, 0, 0, 0, 0, 0.1, NULL, 0, NULL, 0, &r) && r.status == 1 &&
             starts_with(r.text, "BoxNotFoundError\n"),
         "the description is gone: %s", r.text);
  close(e);
  close(maker);

  /* Destroy frees the name; stop ends the connections still open. */
  EXPECT(call(c, DESTROY, 0, "", 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0, &r) && r.status == 0, "destroy: %s", r.text);
  EXPECT(closed_by_peer(c), "a destroy's connection ends");
  close(c);
  EXPECT(smc_box_server_stop(server, 5.0) == 1, "every thread left");
  EXPECT(closed_by_peer(b), "stop ends the connections");
  close(b);
  smc_comm_destroy(comm);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
