/* SPDX-License-Identifier: Apache-2.0 */
/* One connection of the box server (net/box_session.h): what it opened (its box, the boxes whose versions it bumps
 * after an operation, the box lock it holds) and each request applied with the box calls of csrc/coll/box.c. */
#define _GNU_SOURCE
#include "net/box_session.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "coll/comm.h"
#include "core/clock.h"
#include "core/error.h"
#include "net/wire.h"

enum { MAX_TOUCHED = 16 };

typedef struct {
  smc_comm_t* comm;
  int fd;
  smc_box_t* box;                 /* the box this connection opened, and its name */
  char* box_name;
  size_t esize;
  long held;                      /* times it holds the box's lock */
  smc_box_t* touched[MAX_TOUCHED];
  char* touched_names[MAX_TOUCHED];
  int ntouched;
  uint8_t* payload;               /* elements in and out, grown as needed */
  size_t payload_cap;
} session_t;

static int grow_payload(session_t* c, size_t bytes) {
  if (bytes <= c->payload_cap) return 1;
  uint8_t* p = (uint8_t*)realloc(c->payload, bytes);
  if (p == NULL) return 0;
  c->payload = p;
  c->payload_cap = bytes;
  return 1;
}

/* The locks a lost client held: the version bumped first, under the lock (recursive, held by this thread), so that
 * a waiting writer cannot get in between and the version still says where the lost holder's work ended. */
static void release_held(session_t* c) {
  if (c->box == NULL || c->held <= 0) return;
  uint64_t version;
  (void)smc_box_accumulate(c->box, 0, 0, NULL, 1.0, 1.0, &version);
  while (c->held > 0) {
    (void)smc_box_unlock(c->box);
    c->held--;
  }
}

static void close_box(session_t* c) {
  release_held(c);
  if (c->box != NULL) smc_box_close(c->box);
  c->box = NULL;
  free(c->box_name);
  c->box_name = NULL;
}

static void end_session(session_t* c) {
  for (int i = 0; i < c->ntouched; i++) {
    smc_box_close(c->touched[i]);
    free(c->touched_names[i]);
  }
  c->ntouched = 0;
  close_box(c);
}

/* Bumps the version of box `name` (a striped box's description, after its home stripe's part of an operation). */
static smc_result_t touch_named(session_t* c, const char* name, uint64_t* version) {
  smc_box_t* box = NULL;
  for (int i = 0; i < c->ntouched && box == NULL; i++)
    if (strcmp(c->touched_names[i], name) == 0) box = c->touched[i];
  if (box == NULL) {
    SMC_CHECK(smc_box_attach(c->comm, name, 0.0, &box));
    if (c->ntouched == MAX_TOUCHED) {  /* a connection serves one box; more names than this is a confused client */
      smc_box_close(box);
      return smc_set_error(SMC_ERR_INVALID, "box server: more than %d boxes touched on one connection", MAX_TOUCHED);
    }
    char* copy = strdup(name);
    if (copy == NULL) {
      smc_box_close(box);
      return smc_set_error(SMC_ERR_NOMEM, "box server: out of memory");
    }
    c->touched[c->ntouched] = box;
    c->touched_names[c->ntouched] = copy;
    c->ntouched++;
  }
  return smc_box_accumulate(box, 0, 0, NULL, 1.0, 1.0, version);
}

/* Applies one request whose name (NUL-terminated) and elements (in c->payload) have been read. Fills the reply and
 * says how many bytes of c->payload follow it; returns the core's code. */
static smc_result_t apply(session_t* c, const smc_wire_request_t* q, const char* name, smc_wire_reply_t* r,
                          size_t* out_bytes) {
  uint64_t version = 0;
  r->count = q->count;
  r->dtype = q->dtype;
  *out_bytes = 0;
  if (q->op == SMC_OP_PING) return SMC_SUCCESS;
  if (q->op == SMC_OP_CREATE || q->op == SMC_OP_ATTACH) {
    if (c->box != NULL) return smc_set_error(SMC_ERR_INVALID, "box server: this connection holds a box already");
    int striped = 0;
    if (q->op == SMC_OP_CREATE)
      SMC_CHECK(smc_box_create(c->comm, name, (size_t)q->count, (smc_datatype_t)q->dtype,
                               (q->flags & SMC_FLAG_EXIST_OK) != 0, &c->box));
    else
      SMC_CHECK(smc_box_find(c->comm, name, q->timeout_s, &c->box, &striped));
    size_t size = strlen(name) + sizeof(SMC_BOX_STRIPED_SUFFIX);  /* the name destroy() removes */
    c->box_name = (char*)malloc(size);
    if (c->box_name == NULL) {
      close_box(c);
      return smc_set_error(SMC_ERR_NOMEM, "box server: out of memory");
    }
    snprintf(c->box_name, size, "%s%s", name, striped ? SMC_BOX_STRIPED_SUFFIX : "");
    c->esize = smc_dtype_size(smc_box_dtype(c->box));
    r->count = smc_box_count(c->box);
    r->dtype = (uint32_t)smc_box_dtype(c->box);
    r->flags = striped ? SMC_FLAG_STRIPED : 0;
    r->version = smc_box_version(c->box);
    return SMC_SUCCESS;
  }
  if (c->box == NULL) return smc_set_error(SMC_ERR_INVALID, "box server: no box is open on this connection");
  size_t count = (size_t)q->count;
  switch (q->op) {
    case SMC_OP_READ:
      if (!grow_payload(c, count * c->esize)) return smc_set_error(SMC_ERR_NOMEM, "box server: out of memory");
      SMC_CHECK(smc_box_read(c->box, (size_t)q->offset, count, c->payload, NULL));
      *out_bytes = count * c->esize;
      break;
    case SMC_OP_WRITE:
      SMC_CHECK(smc_box_write(c->box, (size_t)q->offset, count, count ? c->payload : NULL, &version));
      break;
    case SMC_OP_ACCUMULATE:
      SMC_CHECK(smc_box_accumulate(c->box, (size_t)q->offset, count, count ? c->payload : NULL, q->alpha, q->beta,
                                   &version));
      break;
    case SMC_OP_EXCHANGE:  /* the payload becomes d, which goes back */
      SMC_CHECK(smc_box_exchange(c->box, (size_t)q->offset, count, count ? c->payload : NULL, q->alpha, &version));
      *out_bytes = count * c->esize;
      break;
    case SMC_OP_TOUCH:
      SMC_CHECK(smc_box_accumulate(c->box, 0, 0, NULL, 1.0, 1.0, &version));
      break;
    case SMC_OP_LOCK:
      SMC_CHECK(smc_box_lock(c->box, q->timeout_s));
      c->held++;
      break;
    case SMC_OP_UNLOCK:
      SMC_CHECK(smc_box_unlock(c->box));
      c->held--;
      break;
    case SMC_OP_WAIT:
      SMC_CHECK(smc_box_wait_version(c->box, q->offset, q->timeout_s, &version));
      break;
    case SMC_OP_DESTROY: {
      char* box_name = c->box_name;
      c->box_name = NULL;
      close_box(c);
      smc_result_t rc = smc_box_destroy(c->comm, box_name);
      free(box_name);
      SMC_CHECK(rc);
      break;
    }
    case SMC_OP_CLOSE:
      end_session(c);
      break;
    case SMC_OP_VERSION:
      break;
    default:
      return smc_set_error(SMC_ERR_INVALID, "box server: unknown operation %u", (unsigned)q->op);
  }
  int carries = q->op == SMC_OP_WRITE || q->op == SMC_OP_ACCUMULATE || q->op == SMC_OP_EXCHANGE;
  if (q->op != SMC_OP_WAIT && q->op != SMC_OP_TOUCH && !carries && c->box != NULL) version = smc_box_version(c->box);
  r->version = version;
  return SMC_SUCCESS;
}

/* An exchange with SMC_FLAG_STREAM (net/wire.h). Under one hold of the box lock each part of x is applied as it
 * arrives and its d goes back at once, so that x and d cross the network together instead of one after the other
 * (and the apply hides behind the transfer). The version moves once, after the last part, as for any exchange.
 * Parts of an eighth of a staging half (256 KiB by default): x, d and the centre's part stay in cache, and a part's
 * system calls are a small share of its transfer. A client that falls silent for the job's timeout in the middle
 * loses its connection, and with it the lock, as a lost holder does (release_held: the version says so). */
static int serve_streamed(session_t* c, const smc_wire_request_t* q, const char* name) {
  const size_t esize = c->esize, total = (size_t)q->count;
  size_t part_bytes = c->comm->half_bytes / 8;
  part_bytes = part_bytes < (64u << 10) ? (64u << 10) : part_bytes > (1u << 20) ? (1u << 20) : part_bytes;
  const size_t part = part_bytes / esize > 0 ? part_bytes / esize : 1;
  const size_t first = total < part ? total : part;
  /* The first part arrives before the lock is taken: an exchange of one part holds it only to apply, as a plain
   * one does, and a longer one from then to its last part. */
  smc_result_t rc = grow_payload(c, first * esize) ? SMC_SUCCESS
                                                   : smc_set_error(SMC_ERR_NOMEM, "box server: out of memory");
  size_t received = 0;
  if (rc == SMC_SUCCESS) {
    if (first && !smc_wire_recv_within(c->fd, c->payload, first * esize, c->comm->timeout_s)) return 0;
    received = first;
    rc = smc_box_lock(c->box, c->comm->timeout_s);
  }
  if (rc != SMC_SUCCESS) {  /* nothing applied: a plain refusal, once x is drained */
    char text[SMC_WIRE_TEXT_BYTES];
    snprintf(text, sizeof(text), "%s", smc_last_error());
    return smc_wire_drain(c->fd, (uint64_t)(total - received) * esize, c->comm->timeout_s) &&
           smc_wire_send_error(c->fd, rc, text);
  }
  c->held++;
  uint8_t accepted[SMC_REPLY_BYTES], final[SMC_REPLY_BYTES];
  smc_wire_reply_t r = {.count = q->count, .dtype = q->dtype};
  smc_wire_pack_reply(accepted, &r);
  char text[SMC_WIRE_TEXT_BYTES];
  for (size_t at = 0;; at += part) {
    const size_t n = total - at < part ? total - at : part;
    if (n && at > 0 && !smc_wire_recv_within(c->fd, c->payload, n * esize, c->comm->timeout_s))
      return 0;  /* release_held (end_session) gives the lock back */
    if (rc == SMC_SUCCESS && n) rc = smc_box_exchange_held(c->box, (size_t)q->offset + at, n, c->payload, q->alpha);
    if (rc != SMC_SUCCESS) memset(c->payload, 0, n * esize);  /* not applied: d = 0 leaves that part of x as it was */
    struct iovec iov[4];
    int k = 0;
    if (at == 0) iov[k++] = (struct iovec){accepted, sizeof(accepted)};
    if (n) iov[k++] = (struct iovec){c->payload, n * esize};
    const int last = at + n >= total;
    if (last) {
      uint64_t version = 0;
      smc_result_t bumped = smc_box_accumulate(c->box, 0, 0, NULL, 1.0, 1.0, &version);  /* the version, once */
      if (rc == SMC_SUCCESS) rc = bumped;
      if (rc == SMC_SUCCESS && (q->flags & SMC_FLAG_THEN_TOUCH)) rc = touch_named(c, name, &version);
      (void)smc_box_unlock(c->box);
      c->held--;
      r.version = version;
      r.status = rc == SMC_SUCCESS ? 0 : 1;
      int text_len = rc == SMC_SUCCESS ? 0 : smc_wire_error_text(text, sizeof(text), rc, smc_last_error());
      r.text_len = (uint32_t)text_len;
      smc_wire_pack_reply(final, &r);
      iov[k++] = (struct iovec){final, sizeof(final)};
      if (text_len) iov[k++] = (struct iovec){text, (size_t)text_len};
    }
    if (!smc_wire_sendv(c->fd, iov, k)) return 0;
    if (last) return 1;
  }
}

/* Serves one request; 0 when the connection is to end (the client left, or asked to close). */
static int serve_one(session_t* c) {
  uint8_t head[SMC_REQUEST_BYTES];
  if (!smc_wire_recv(c->fd, head, sizeof(head))) return 0;
  smc_wire_request_t q;
  smc_wire_parse_request(head, &q);
  char name[65536];
  /* Between requests a client may stay silent for as long as it likes; inside one, at most the job's timeout. */
  if (q.name_len && !smc_wire_recv_within(c->fd, name, q.name_len, c->comm->timeout_s)) return 0;
  name[q.name_len] = '\0';
  int carries = q.op == SMC_OP_WRITE || q.op == SMC_OP_ACCUMULATE || q.op == SMC_OP_EXCHANGE;
  uint64_t in_bytes = carries ? q.count * (uint64_t)c->esize : 0;
  smc_result_t rc = SMC_SUCCESS;
  const char* refused = NULL;
  int sized = carries || q.op == SMC_OP_READ;  /* the server allocates count elements for these */
  int streamed = q.op == SMC_OP_EXCHANGE && (q.flags & SMC_FLAG_STREAM) && c->box != NULL;
  if (sized && c->box != NULL && (q.count > smc_box_count(c->box) || q.offset > smc_box_count(c->box) - q.count)) {
    /* Checked before anything is allocated for it: the client checks too, so this is a confused or hostile one. */
    rc = smc_set_error(SMC_ERR_INVALID, "box '%s': elements [%llu, %llu) are outside its %zu (box server)",
                       c->box_name ? c->box_name : "?", (unsigned long long)q.offset,
                       (unsigned long long)(q.offset + q.count), smc_box_count(c->box));
    refused = smc_last_error();
  } else if (streamed) {
    return serve_streamed(c, &q, name);
  } else if (in_bytes && !grow_payload(c, (size_t)in_bytes)) {
    rc = smc_set_error(SMC_ERR_NOMEM, "box server: out of memory for %llu bytes", (unsigned long long)in_bytes);
    refused = smc_last_error();
  }
  if (refused != NULL) {
    if (!smc_wire_drain(c->fd, in_bytes, c->comm->timeout_s)) return 0;
    return smc_wire_send_error(c->fd, rc, refused) && q.op != SMC_OP_CLOSE && q.op != SMC_OP_DESTROY;
  }
  if (in_bytes && !smc_wire_recv_within(c->fd, c->payload, (size_t)in_bytes, c->comm->timeout_s))
    return 0;  /* nothing half-read is applied */

  smc_wire_reply_t r = {0};
  size_t out_bytes = 0;
  rc = apply(c, &q, name, &r, &out_bytes);
  if (rc == SMC_SUCCESS && carries && (q.flags & SMC_FLAG_THEN_TOUCH)) rc = touch_named(c, name, &r.version);
  int ok;
  if (rc != SMC_SUCCESS) {
    ok = smc_wire_send_error(c->fd, rc, smc_last_error());
  } else {
    uint8_t reply[SMC_REPLY_BYTES];
    smc_wire_pack_reply(reply, &r);
    ok = smc_wire_send(c->fd, reply, sizeof(reply), c->payload, out_bytes);
  }
  return ok && q.op != SMC_OP_CLOSE && q.op != SMC_OP_DESTROY && q.op != SMC_OP_PING;
}

void smc_box_session_serve(smc_comm_t* comm, int fd) {
  session_t c;
  memset(&c, 0, sizeof(c));
  c.comm = comm;
  c.fd = fd;
  while (serve_one(&c)) {
  }
  end_session(&c);
  free(c.payload);
}
