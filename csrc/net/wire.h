/* SPDX-License-Identifier: Apache-2.0 */
/* The box server's messages (shmcomm/smb/wire.py writes the same layout): a request is a 48-byte
 * little-endian header, then a name, then elements; a reply is a 32-byte header, then an error text (status 1:
 * "ClassName\nmessage", the class the client raises) or the elements read. */
#ifndef SMC_NET_WIRE_H_
#define SMC_NET_WIRE_H_

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "shmcomm.h"

enum { SMC_OP_CREATE = 1, SMC_OP_ATTACH, SMC_OP_READ, SMC_OP_WRITE, SMC_OP_ACCUMULATE, SMC_OP_LOCK, SMC_OP_UNLOCK,
       SMC_OP_WAIT, SMC_OP_VERSION, SMC_OP_DESTROY, SMC_OP_CLOSE, SMC_OP_TOUCH, SMC_OP_PING, SMC_OP_EXCHANGE };
/* Request flags. SMC_FLAG_STREAM (an exchange): the reply is an accepting header, then d in parts as x's parts arrive,
 * then the final header (the version), so that x and d travel at once; a refusal before any part is a plain error
 * reply, sent once x has been drained. */
enum { SMC_FLAG_EXIST_OK = 1, SMC_FLAG_THEN_TOUCH = 2, SMC_FLAG_STREAM = 4 };
enum { SMC_FLAG_STRIPED = 1 };                             /* attach's reply flag */
enum { SMC_REQUEST_BYTES = 48, SMC_REPLY_BYTES = 32 };

typedef struct {
  uint8_t op, flags;
  uint16_t name_len;
  uint32_t dtype;
  uint64_t offset, count;  /* offset: a version for SMC_OP_WAIT */
  double alpha, beta, timeout_s;
} smc_wire_request_t;

typedef struct {
  int32_t status;
  uint64_t version, count;
  uint32_t dtype, flags;
} smc_wire_reply_t;

/* 1 when all n bytes came, 0 when the connection ended first. */
int smc_wire_recv(int fd, void* buf, size_t n);
/* The same, waiting at most timeout_s for each arrival: 0 also when the sender fell silent that long, or the
 * connection failed (a reset included). */
int smc_wire_recv_within(int fd, void* buf, size_t n, double timeout_s);
/* Reads and drops n bytes (a refused request's elements, so that the next request is read whole), as
 * smc_wire_recv_within waits. */
int smc_wire_drain(int fd, uint64_t n, double timeout_s);
/* One message, header and body, in as few sendmsg calls as the socket takes; 0 when the connection ended. */
int smc_wire_send(int fd, const void* head, size_t head_len, const void* body, size_t body_len);
/* The same for n buffers (empty ones allowed); iov is consumed. */
int smc_wire_sendv(int fd, struct iovec* iov, int n);
void smc_wire_parse_request(const uint8_t* bytes, smc_wire_request_t* request);
void smc_wire_pack_reply(uint8_t* bytes, const smc_wire_reply_t* reply, uint32_t text_len);
/* "ClassName\nmessage" for a core code into text (cut to cap - 1 bytes); its length. */
int smc_wire_error_text(char* text, size_t cap, smc_result_t rc, const char* message);
/* An error reply for a core code, with the text the core wrote. */
int smc_wire_send_error(int fd, smc_result_t rc, const char* text);

#endif
