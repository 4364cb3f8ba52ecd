/* SPDX-License-Identifier: Apache-2.0 */
/* A client's side of one request to another host's box server (shmcomm.h, "box client"), in the messages of
 * net/wire.h, without the interpreter: the caller's Python (shmcomm/smb/client.py) hands over its socket's
 * descriptor and its buffers, and the interpreter lock is free while the bytes travel.
 *
 * Every wait is a poll with what is left of the caller's deadline; sends and receives never block (MSG_DONTWAIT),
 * whether or not the descriptor is in non-blocking mode (Python's sockets with a timeout are). */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>

#include "core/clock.h"
#include "net/wire.h"
#include "shmcomm.h"

typedef struct {
  int fd;
  double deadline;
  /* what is still to go */
  const uint8_t* parts[2];
  size_t lens[2];
  /* what is still to come: the reply's header, then its text or elements, then (streamed) the final header */
  uint8_t* reply;
  char* text;
  size_t text_cap;
  uint8_t* in;
  size_t in_len;
  int streamed;
  int stage;         /* 0: (first) header; 1: text; 2: elements; 3: final header; 4: done */
  size_t got;        /* bytes of the current stage received */
  uint32_t text_len;
} exchange_t;

static int left_to_send(const exchange_t* x) { return x->lens[0] + x->lens[1] > 0; }

/* Sends what the socket takes now; 0 when the connection ended. */
static int send_some(exchange_t* x) {
  struct iovec iov[2];
  int n = 0;
  for (int i = 0; i < 2; i++)
    if (x->lens[i] > 0) iov[n++] = (struct iovec){(void*)x->parts[i], x->lens[i]};
  struct msghdr msg;
  memset(&msg, 0, sizeof(msg));
  msg.msg_iov = iov;
  msg.msg_iovlen = (size_t)n;
  ssize_t sent = sendmsg(x->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (sent < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  for (int i = 0; i < 2 && sent > 0; i++) {
    size_t take = (size_t)sent < x->lens[i] ? (size_t)sent : x->lens[i];
    x->parts[i] += take;
    x->lens[i] -= take;
    sent -= (ssize_t)take;
  }
  return 1;
}

/* Where the current stage's bytes go, and how many it wants. */
static uint8_t* stage_buffer(exchange_t* x, size_t* want) {
  switch (x->stage) {
    case 0: case 3: *want = SMC_REPLY_BYTES; return x->reply;
    case 1: *want = x->text_len; return (uint8_t*)x->text;
    default: *want = x->in_len; return x->in;
  }
}

/* The stage after a complete one; 0 for a reply no server sends. */
static int next_stage(exchange_t* x) {
  smc_wire_reply_t reply;
  smc_wire_parse_reply(x->reply, &reply);
  x->got = 0;
  if (x->stage == 0 || x->stage == 3) {
    x->text_len = reply.text_len;
    if (reply.status != 0) {
      if (x->text_len >= x->text_cap) return 0;
      x->stage = 1;
    } else if (x->stage == 0 && x->in_len > 0) {
      x->stage = 2;
    } else {
      x->stage = x->stage == 0 && x->streamed ? 3 : 4;
    }
  } else if (x->stage == 1) {
    x->text[x->text_len] = '\0';
    x->stage = 4;
  } else {
    x->stage = x->streamed ? 3 : 4;
  }
  return 1;
}

/* Receives what has come; 0 when the connection ended or sent what no server sends (an error text longer than the
 * server ever writes, SMC_WIRE_TEXT_BYTES). */
static int receive_some(exchange_t* x) {
  size_t want;
  uint8_t* to = stage_buffer(x, &want);
  ssize_t got = recv(x->fd, to + x->got, want - x->got, MSG_DONTWAIT);
  if (got == 0) return 0;
  if (got < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  x->got += (size_t)got;
  while (x->got == want && x->stage != 4) {
    if (!next_stage(x)) return 0;
    stage_buffer(x, &want);
  }
  return 1;
}

/* Runs the exchange until `until_sent` (only the sending) or everything is done. */
static int run(exchange_t* x, int until_sent) {
  for (;;) {
    int sending = left_to_send(x), receiving = !until_sent && x->stage != 4;
    if (!sending && !receiving) return 0;
    struct pollfd p = {x->fd, (short)((sending ? POLLOUT : 0) | (receiving ? POLLIN : 0)), 0};
    double left = x->deadline - smc_now();
    if (left <= 0) return SMC_WIRE_TIMEOUT;
    int ready = poll(&p, 1, left > 1e6 ? -1 : (int)(left * 1e3) + 1);
    if (ready < 0 && errno != EINTR) return SMC_WIRE_CLOSED;
    if (ready <= 0) continue;
    if (p.revents & POLLIN && receiving && !receive_some(x)) return SMC_WIRE_CLOSED;
    if (p.revents & POLLOUT && sending && !send_some(x)) return SMC_WIRE_CLOSED;
    if (p.revents & (POLLERR | POLLNVAL) || (p.revents & POLLHUP && !(p.revents & POLLIN))) return SMC_WIRE_CLOSED;
  }
}

static void start(exchange_t* x, int fd, const void* head, size_t head_len, const void* out, size_t out_len,
                  double timeout_s) {
  memset(x, 0, sizeof(*x));
  x->fd = fd;
  /* NaN and negative: no wait at all; past a thousand years (infinity among them): that long, not for ever. */
  x->deadline = smc_now() + (timeout_s >= 0 ? (timeout_s < 3e10 ? timeout_s : 3e10) : 0.0);
  x->parts[0] = (const uint8_t*)head;
  x->lens[0] = head_len;
  x->parts[1] = (const uint8_t*)out;
  x->lens[1] = out_len;
}

int smc_box_send(int fd, const void* head, size_t head_len, const void* out, size_t out_len, double timeout_s) {
  exchange_t x;
  start(&x, fd, head, head_len, out, out_len, timeout_s);
  return run(&x, 1);
}

int smc_box_receive(int fd, void* in, size_t in_len, double timeout_s, void* reply, char* text, size_t text_cap) {
  if (text_cap < SMC_WIRE_TEXT_BYTES) return SMC_WIRE_CLOSED;
  exchange_t x;
  start(&x, fd, NULL, 0, NULL, 0, timeout_s);
  x.reply = (uint8_t*)reply;
  x.text = text;
  x.text_cap = text_cap;
  x.in = (uint8_t*)in;
  x.in_len = in_len;
  return run(&x, 0);
}

int smc_box_exchange_streamed(int fd, const void* head, size_t head_len, void* x_to_d, size_t bytes,
                              double timeout_s, void* reply, char* text, size_t text_cap) {
  if (text_cap < SMC_WIRE_TEXT_BYTES) return SMC_WIRE_CLOSED;
  exchange_t x;
  start(&x, fd, head, head_len, x_to_d, bytes, timeout_s);
  x.reply = (uint8_t*)reply;
  x.text = text;
  x.text_cap = text_cap;
  x.in = (uint8_t*)x_to_d;  /* d never overtakes x: the server sends a part's d once it has that part's x */
  x.in_len = bytes;
  x.streamed = 1;
  return run(&x, 0);  /* after a refusal x still goes whole: the server drains it, and the connection stays in step */
}
