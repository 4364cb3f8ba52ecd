/* SPDX-License-Identifier: Apache-2.0 */
/* The box server's messages on a socket; their format is in shmcomm.h ("the box server's messages"). */
#ifndef SMC_NET_WIRE_H_
#define SMC_NET_WIRE_H_

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "shmcomm.h"

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
/* "ClassName\nmessage" for a core code into text (cut to cap - 1 bytes); its length. */
int smc_wire_error_text(char* text, size_t cap, smc_result_t rc, const char* message);
/* An error reply for a core code, with the text the core wrote. */
int smc_wire_send_error(int fd, smc_result_t rc, const char* text);

#endif
