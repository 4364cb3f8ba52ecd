/* SPDX-License-Identifier: Apache-2.0 */
/* The box server's messages on a socket (net/wire.h). */
#define _GNU_SOURCE
#include "net/wire.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

int smc_wire_recv(int fd, void* buf, size_t n) {
  uint8_t* p = (uint8_t*)buf;
  while (n > 0) {
    ssize_t got = recv(fd, p, n, 0);
    if (got == 0) return 0;
    if (got < 0) {
      if (errno == EINTR) continue;
      return 0;
    }
    p += got;
    n -= (size_t)got;
  }
  return 1;
}

int smc_wire_sendv(int fd, struct iovec* iov, int n) {
  struct msghdr msg;
  memset(&msg, 0, sizeof(msg));
  msg.msg_iov = iov;
  msg.msg_iovlen = (size_t)n;
  while (msg.msg_iovlen > 0 && msg.msg_iov[0].iov_len == 0) {
    msg.msg_iov++;
    msg.msg_iovlen--;
  }
  while (msg.msg_iovlen > 0) {
    ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return 0;
    }
    while (msg.msg_iovlen > 0 && (size_t)sent >= msg.msg_iov[0].iov_len) {
      sent -= (ssize_t)msg.msg_iov[0].iov_len;
      msg.msg_iov++;
      msg.msg_iovlen--;
    }
    if (msg.msg_iovlen > 0) {
      msg.msg_iov[0].iov_base = (uint8_t*)msg.msg_iov[0].iov_base + sent;
      msg.msg_iov[0].iov_len -= (size_t)sent;
    }
  }
  return 1;
}

int smc_wire_send(int fd, const void* head, size_t head_len, const void* body, size_t body_len) {
  struct iovec iov[2] = {{(void*)head, head_len}, {(void*)body, body_len}};
  return smc_wire_sendv(fd, iov, 2);
}

void smc_wire_parse_request(const uint8_t* b, smc_wire_request_t* r) {
  r->op = b[0];
  r->flags = b[1];
  memcpy(&r->name_len, b + 2, 2);
  memcpy(&r->dtype, b + 4, 4);
  memcpy(&r->offset, b + 8, 8);
  memcpy(&r->count, b + 16, 8);
  memcpy(&r->alpha, b + 24, 8);
  memcpy(&r->beta, b + 32, 8);
  memcpy(&r->timeout_s, b + 40, 8);
}

void smc_wire_pack_reply(uint8_t* b, const smc_wire_reply_t* r) {
  memcpy(b, &r->status, 4);
  memcpy(b + 4, &r->text_len, 4);
  memcpy(b + 8, &r->version, 8);
  memcpy(b + 16, &r->count, 8);
  memcpy(b + 24, &r->dtype, 4);
  memcpy(b + 28, &r->flags, 4);
}

void smc_wire_parse_reply(const uint8_t* b, smc_wire_reply_t* r) {
  memcpy(&r->status, b, 4);
  memcpy(&r->text_len, b + 4, 4);
  memcpy(&r->version, b + 8, 8);
  memcpy(&r->count, b + 16, 8);
  memcpy(&r->dtype, b + 24, 4);
  memcpy(&r->flags, b + 28, 4);
}

/* The exception class the client raises for a core code (shmcomm/_native.py's table, as box_wire.py names them). */
static const char* error_class(smc_result_t rc) {
  switch (rc) {
    case SMC_ERR_INVALID: return "InvalidArgumentError";
    case SMC_ERR_SYSTEM: return "SystemError";
    case SMC_ERR_TIMEOUT: return "TimeoutError";
    case SMC_ERR_RANK_FAILED: return "RankFailure";
    case SMC_ERR_NOMEM: return "OutOfMemoryError";
    case SMC_ERR_EXISTS: return "BoxExistsError";
    case SMC_ERR_NOT_FOUND: return "BoxNotFoundError";
    case SMC_ERR_BROKEN: return "BrokenCommunicatorError";
    default: return "ShmCommError";
  }
}

int smc_wire_error_text(char* text, size_t cap, smc_result_t rc, const char* message) {
  int n = snprintf(text, cap, "%s\n%s", error_class(rc), message);
  if (n < 0) n = 0;
  if ((size_t)n >= cap) n = (int)cap - 1;
  return n;
}

int smc_wire_send_error(int fd, smc_result_t rc, const char* text) {
  char message[SMC_WIRE_TEXT_BYTES];
  int n = smc_wire_error_text(message, sizeof(message), rc, text);
  uint8_t head[SMC_REPLY_BYTES];
  smc_wire_reply_t r = {.status = 1, .text_len = (uint32_t)n};
  smc_wire_pack_reply(head, &r);
  return smc_wire_send(fd, head, sizeof(head), message, (size_t)n);
}

int smc_wire_recv_within(int fd, void* buf, size_t n, double timeout_s) {
  uint8_t* p = (uint8_t*)buf;
  while (n > 0) {
    struct pollfd w = {fd, POLLIN, 0};
    int ready = poll(&w, 1, (int)(timeout_s * 1e3) + 1);
    if (ready == 0) return 0;
    if (ready < 0) {
      if (errno == EINTR) continue;
      return 0;
    }
    ssize_t got = recv(fd, p, n, MSG_DONTWAIT);
    if (got == 0) return 0;
    if (got < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return 0;  /* reset by a client that left with a reply unread, among others */
    }
    p += got;
    n -= (size_t)got;
  }
  return 1;
}

int smc_wire_drain(int fd, uint64_t n, double timeout_s) {
  uint8_t scratch[65536];
  while (n > 0) {
    size_t step = n < sizeof(scratch) ? (size_t)n : sizeof(scratch);
    if (!smc_wire_recv_within(fd, scratch, step, timeout_s)) return 0;
    n -= step;
  }
  return 1;
}
