/* SPDX-License-Identifier: Apache-2.0 */
/* The box server: serves this host's Soft Memory Boxes to the ranks of the other hosts, in C threads that never need
 * the Python interpreter. A rank computing in Python holds the interpreter lock for up to its switch interval
 * (5 ms) at a time; a server thread written in Python needs that lock several times per request, so a remote
 * exchange with a busy home rank took 20 ms instead of 0.07 ms (benchmarks/RESULTS.md). These threads only sleep in
 * the kernel on their sockets and in the box's own waits.
 *
 * One thread accepts; one thread per connection reads a request, applies it to the arena with the box calls of
 * csrc/shm/box.c and writes the reply. The messages are those of shmcomm/transport/box_wire.py (one request, one
 * reply; little-endian fixed headers, then a name, then elements). A connection owns what it opened: its box, the
 * boxes whose versions it bumps after an operation, and the box lock it holds; when the connection ends, however it
 * ends (the client closed it, its process died, the server stops), the held lock is released after the version is
 * bumped, so that readers can tell a holder was lost. The box lock is a robust recursive mutex owned by the thread
 * that took it: the connection's thread takes and releases it, so it is the right owner. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/error.h"
#include "shmcomm.h"

/* box_wire.py's operations and flags. */
enum { OP_CREATE = 1, OP_ATTACH, OP_READ, OP_WRITE, OP_ACCUMULATE, OP_LOCK, OP_UNLOCK, OP_WAIT, OP_VERSION,
       OP_DESTROY, OP_CLOSE, OP_TOUCH, OP_PING, OP_EXCHANGE };
enum { FLAG_EXIST_OK = 1, FLAG_THEN_TOUCH = 2 };  /* request flags */
enum { FLAG_STRIPED = 1 };                         /* attach's reply flag */
enum { REQUEST_BYTES = 48, REPLY_BYTES = 32, MAX_TOUCHED = 16 };
static const char STRIPED_SUFFIX[] = "@stripes";

typedef struct {
  uint8_t op, flags;
  uint16_t name_len;
  uint32_t dtype;
  uint64_t offset, count;
  double alpha, beta, timeout_s;
} request_t;

typedef struct {
  int32_t status;
  uint64_t version, count;
  uint32_t dtype, flags;
} reply_t;

typedef struct connection {
  struct connection* next;
  struct smc_box_server* server;
  pthread_t thread;
  int fd;
  int done;                       /* the thread has left; it may be joined (under server->mutex) */
  smc_box_t* box;                 /* the box this connection opened, and its name */
  char* box_name;
  size_t esize;
  long held;                      /* times it holds the box's lock */
  smc_box_t* touched[MAX_TOUCHED];
  char* touched_names[MAX_TOUCHED];
  int ntouched;
  uint8_t* payload;               /* elements in and out, grown as needed */
  size_t payload_cap;
} connection_t;

struct smc_box_server {
  smc_comm_t* comm;
  pid_t pid;                      /* the process whose threads serve: a forked child has none of them */
  int listener;
  int wake[2];                    /* a byte on wake[1] ends the accept loop */
  int port;
  pthread_t acceptor;
  pthread_mutex_t mutex;          /* guards connections and closed */
  connection_t* connections;
  int closed;
};

/* ---- the wire ---- */
static int recv_all(int fd, void* buf, size_t n) {
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

static int send_all(int fd, const void* head, size_t head_len, const void* body, size_t body_len) {
  struct iovec iov[2] = {{(void*)head, head_len}, {(void*)body, body_len}};
  struct msghdr msg;
  memset(&msg, 0, sizeof(msg));
  msg.msg_iov = iov;
  msg.msg_iovlen = body_len ? 2 : 1;
  while (msg.msg_iovlen > 0) {
    ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return 0;
    }
    while (sent > 0 && msg.msg_iovlen > 0) {
      if ((size_t)sent >= msg.msg_iov[0].iov_len) {
        sent -= (ssize_t)msg.msg_iov[0].iov_len;
        msg.msg_iov++;
        msg.msg_iovlen--;
      } else {
        msg.msg_iov[0].iov_base = (uint8_t*)msg.msg_iov[0].iov_base + sent;
        msg.msg_iov[0].iov_len -= (size_t)sent;
        sent = 0;
      }
    }
  }
  return 1;
}

static void parse_request(const uint8_t* b, request_t* r) {
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

static void pack_reply(uint8_t* b, const reply_t* r, uint32_t text_len) {
  memcpy(b, &r->status, 4);
  memcpy(b + 4, &text_len, 4);
  memcpy(b + 8, &r->version, 8);
  memcpy(b + 16, &r->count, 8);
  memcpy(b + 24, &r->dtype, 4);
  memcpy(b + 28, &r->flags, 4);
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

static int send_error(int fd, smc_result_t rc, const char* text) {
  char message[1200];
  int n = snprintf(message, sizeof(message), "%s\n%s", error_class(rc), text);
  if (n < 0) n = 0;
  if ((size_t)n >= sizeof(message)) n = (int)sizeof(message) - 1;
  uint8_t head[REPLY_BYTES];
  reply_t r = {1, 0, 0, 0, 0};
  pack_reply(head, &r, (uint32_t)n);
  return send_all(fd, head, sizeof(head), message, (size_t)n);
}

/* ---- one connection's state ---- */
static int grow_payload(connection_t* c, size_t bytes) {
  if (bytes <= c->payload_cap) return 1;
  uint8_t* p = (uint8_t*)realloc(c->payload, bytes);
  if (p == NULL) return 0;
  c->payload = p;
  c->payload_cap = bytes;
  return 1;
}

/* Reads and drops n bytes: the elements of a request that is refused, so that the next request is read whole. */
static int drain(int fd, uint64_t n) {
  uint8_t scratch[65536];
  while (n > 0) {
    size_t step = n < sizeof(scratch) ? (size_t)n : sizeof(scratch);
    if (!recv_all(fd, scratch, step)) return 0;
    n -= step;
  }
  return 1;
}

/* The locks a lost client held: the version bumped first, under the lock (recursive, held by this thread), so that
 * a waiting writer cannot get in between and the version still says where the lost holder's work ended. */
static void release_held(connection_t* c) {
  if (c->box == NULL || c->held <= 0) return;
  uint64_t version;
  (void)smc_box_accumulate(c->box, 0, 0, NULL, 1.0, 1.0, &version);
  while (c->held > 0) {
    (void)smc_box_unlock(c->box);
    c->held--;
  }
}

static void close_box(connection_t* c) {
  release_held(c);
  if (c->box != NULL) smc_box_close(c->box);
  c->box = NULL;
  free(c->box_name);
  c->box_name = NULL;
}

static void end_session(connection_t* c) {
  for (int i = 0; i < c->ntouched; i++) {
    smc_box_close(c->touched[i]);
    free(c->touched_names[i]);
  }
  c->ntouched = 0;
  close_box(c);
}

/* Bumps the version of box `name` (a striped box's description, after its home stripe's part of an operation). */
static smc_result_t touch_named(connection_t* c, const char* name, uint64_t* version) {
  smc_box_t* box = NULL;
  for (int i = 0; i < c->ntouched && box == NULL; i++)
    if (strcmp(c->touched_names[i], name) == 0) box = c->touched[i];
  if (box == NULL) {
    SMC_CHECK(smc_box_attach(c->server->comm, name, 0.0, &box));
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

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The box `name`, or the description of the striped box of that name, waiting up to timeout_s for either
 * (transport/box.py's find_box). */
static smc_result_t find_box(connection_t* c, const char* name, double timeout_s, int* striped) {
  size_t len = strlen(name);
  char* described = (char*)malloc(len + sizeof(STRIPED_SUFFIX));
  if (described == NULL) return smc_set_error(SMC_ERR_NOMEM, "box server: out of memory");
  memcpy(described, name, len);
  memcpy(described + len, STRIPED_SUFFIX, sizeof(STRIPED_SUFFIX));
  double deadline = now_s() + (smc_timeout_ok(timeout_s) ? timeout_s : 0.0);
  double pause = 0.0005;
  smc_result_t rc;
  for (;;) {
    const char* candidates[2] = {name, described};
    for (int i = 0; i < 2; i++) {
      rc = smc_box_attach(c->server->comm, candidates[i], 0.0, &c->box);
      if (rc == SMC_SUCCESS) {
        c->box_name = strdup(candidates[i]);
        *striped = i == 1;
        free(described);
        return SMC_SUCCESS;
      }
      if (rc != SMC_ERR_NOT_FOUND) {
        free(described);
        return rc;
      }
    }
    if (now_s() >= deadline) break;
    struct timespec t = {0, (long)(pause * 1e9)};
    nanosleep(&t, NULL);
    pause = pause * 2 < 0.02 ? pause * 2 : 0.02;
  }
  free(described);
  return smc_set_error(SMC_ERR_NOT_FOUND, "box '%s' does not exist (waited %.1f s)", name, timeout_s);
}

/* Applies one request whose name (NUL-terminated) and elements (in c->payload) have been read. Fills the reply and
 * says how many bytes of c->payload follow it; returns the core's code. */
static smc_result_t apply(connection_t* c, const request_t* q, const char* name, reply_t* r, size_t* out_bytes) {
  uint64_t version = 0;
  r->count = q->count;
  r->dtype = q->dtype;
  *out_bytes = 0;
  if (q->op == OP_PING) return SMC_SUCCESS;
  if (q->op == OP_CREATE || q->op == OP_ATTACH) {
    if (c->box != NULL) return smc_set_error(SMC_ERR_INVALID, "box server: this connection holds a box already");
    int striped = 0;
    if (q->op == OP_CREATE) {
      SMC_CHECK(smc_box_create(c->server->comm, name, (size_t)q->count, (smc_datatype_t)q->dtype,
                               (q->flags & FLAG_EXIST_OK) != 0, &c->box));
      c->box_name = strdup(name);
    } else {
      SMC_CHECK(find_box(c, name, q->timeout_s, &striped));
    }
    c->esize = smc_dtype_size(smc_box_dtype(c->box));
    r->count = smc_box_count(c->box);
    r->dtype = (uint32_t)smc_box_dtype(c->box);
    r->flags = striped ? FLAG_STRIPED : 0;
    r->version = smc_box_version(c->box);
    return SMC_SUCCESS;
  }
  if (c->box == NULL) return smc_set_error(SMC_ERR_INVALID, "box server: no box is open on this connection");
  size_t count = (size_t)q->count;
  switch (q->op) {
    case OP_READ:
      if (!grow_payload(c, count * c->esize)) return smc_set_error(SMC_ERR_NOMEM, "box server: out of memory");
      SMC_CHECK(smc_box_read(c->box, (size_t)q->offset, count, c->payload, NULL));
      *out_bytes = count * c->esize;
      break;
    case OP_WRITE:
      SMC_CHECK(smc_box_write(c->box, (size_t)q->offset, count, count ? c->payload : NULL, &version));
      break;
    case OP_ACCUMULATE:
      SMC_CHECK(smc_box_accumulate(c->box, (size_t)q->offset, count, count ? c->payload : NULL, q->alpha, q->beta,
                                   &version));
      break;
    case OP_EXCHANGE:  /* the payload becomes d, which goes back */
      SMC_CHECK(smc_box_exchange(c->box, (size_t)q->offset, count, count ? c->payload : NULL, q->alpha, &version));
      *out_bytes = count * c->esize;
      break;
    case OP_TOUCH:
      SMC_CHECK(smc_box_accumulate(c->box, 0, 0, NULL, 1.0, 1.0, &version));
      break;
    case OP_LOCK:
      SMC_CHECK(smc_box_lock(c->box, q->timeout_s));
      c->held++;
      break;
    case OP_UNLOCK:
      SMC_CHECK(smc_box_unlock(c->box));
      c->held--;
      break;
    case OP_WAIT:
      SMC_CHECK(smc_box_wait_version(c->box, q->offset, q->timeout_s, &version));
      break;
    case OP_DESTROY: {
      char* box_name = c->box_name;
      c->box_name = NULL;
      close_box(c);
      smc_result_t rc = smc_box_destroy(c->server->comm, box_name);
      free(box_name);
      SMC_CHECK(rc);
      break;
    }
    case OP_CLOSE:
      end_session(c);
      break;
    case OP_VERSION:
      break;
    default:
      return smc_set_error(SMC_ERR_INVALID, "box server: unknown operation %u", (unsigned)q->op);
  }
  int carries = q->op == OP_WRITE || q->op == OP_ACCUMULATE || q->op == OP_EXCHANGE;
  if (q->op != OP_WAIT && q->op != OP_TOUCH && !carries && c->box != NULL) version = smc_box_version(c->box);
  r->version = version;
  return SMC_SUCCESS;
}

/* Serves one request; 0 when the connection is to end (the client left, or asked to close). */
static int serve_one(connection_t* c) {
  uint8_t head[REQUEST_BYTES];
  if (!recv_all(c->fd, head, sizeof(head))) return 0;
  request_t q;
  parse_request(head, &q);
  char name[65536];
  if (q.name_len && !recv_all(c->fd, name, q.name_len)) return 0;
  name[q.name_len] = '\0';
  int carries = q.op == OP_WRITE || q.op == OP_ACCUMULATE || q.op == OP_EXCHANGE;
  uint64_t in_bytes = carries ? q.count * (uint64_t)c->esize : 0;
  smc_result_t rc = SMC_SUCCESS;
  const char* refused = NULL;
  int sized = carries || q.op == OP_READ;  /* the server allocates count elements for these */
  if (sized && c->box != NULL && (q.count > smc_box_count(c->box) || q.offset > smc_box_count(c->box) - q.count)) {
    /* Checked before anything is allocated for it: the client checks too, so this is a confused or hostile one. */
    rc = smc_set_error(SMC_ERR_INVALID, "box '%s': elements [%llu, %llu) are outside its %zu (box server)",
                       c->box_name ? c->box_name : "?", (unsigned long long)q.offset,
                       (unsigned long long)(q.offset + q.count), smc_box_count(c->box));
    refused = smc_last_error();
  } else if (in_bytes && !grow_payload(c, (size_t)in_bytes)) {
    rc = smc_set_error(SMC_ERR_NOMEM, "box server: out of memory for %llu bytes", (unsigned long long)in_bytes);
    refused = smc_last_error();
  }
  if (refused != NULL) {
    if (!drain(c->fd, in_bytes)) return 0;
    return send_error(c->fd, rc, refused) && q.op != OP_CLOSE && q.op != OP_DESTROY;
  }
  if (in_bytes && !recv_all(c->fd, c->payload, (size_t)in_bytes)) return 0;  /* nothing half-received is applied */

  reply_t r = {0, 0, 0, 0, 0};
  size_t out_bytes = 0;
  rc = apply(c, &q, name, &r, &out_bytes);
  if (rc == SMC_SUCCESS && carries && (q.flags & FLAG_THEN_TOUCH)) rc = touch_named(c, name, &r.version);
  int ok;
  if (rc != SMC_SUCCESS) {
    ok = send_error(c->fd, rc, smc_last_error());
  } else {
    uint8_t reply[REPLY_BYTES];
    pack_reply(reply, &r, 0);
    ok = send_all(c->fd, reply, sizeof(reply), c->payload, out_bytes);
  }
  return ok && q.op != OP_CLOSE && q.op != OP_DESTROY && q.op != OP_PING;
}

static void* serve(void* arg) {
  connection_t* c = (connection_t*)arg;
  while (serve_one(c)) {
  }
  end_session(c);
  free(c->payload);
  c->payload = NULL;
  pthread_mutex_lock(&c->server->mutex);
  shutdown(c->fd, SHUT_RDWR);
  c->done = 1;
  pthread_mutex_unlock(&c->server->mutex);
  return NULL;
}

/* Joins the threads of connections that ended (under server->mutex), so that a long job does not collect them. */
static void reap(smc_box_server_t* s) {
  connection_t** link = &s->connections;
  while (*link != NULL) {
    connection_t* c = *link;
    if (c->done) {
      *link = c->next;
      pthread_join(c->thread, NULL);
      close(c->fd);
      free(c);
    } else {
      link = &c->next;
    }
  }
}

static void tune(int fd) {
  int one = 1, big = 4 << 20;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &big, sizeof(big));  /* capped by the system: what it allows is fine */
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &big, sizeof(big));
}

static void* accept_loop(void* arg) {
  smc_box_server_t* s = (smc_box_server_t*)arg;
  struct pollfd fds[2] = {{s->listener, POLLIN, 0}, {s->wake[0], POLLIN, 0}};
  for (;;) {
    int n = poll(fds, 2, -1);  /* woken by a client, or by stop(): no timeout needed, nothing else can happen */
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || fds[1].revents) return NULL;
    if (!(fds[0].revents & POLLIN)) continue;
    int fd = accept4(s->listener, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue;  /* the client gave up already, or descriptors ran out: the next one may fare better */
    tune(fd);
    connection_t* c = (connection_t*)calloc(1, sizeof(*c));
    pthread_mutex_lock(&s->mutex);
    reap(s);
    if (c == NULL || s->closed) {
      pthread_mutex_unlock(&s->mutex);
      close(fd);
      free(c);
      continue;
    }
    c->server = s;
    c->fd = fd;
    if (pthread_create(&c->thread, NULL, serve, c) != 0) {
      pthread_mutex_unlock(&s->mutex);
      close(fd);
      free(c);
      continue;
    }
    c->next = s->connections;
    s->connections = c;
    pthread_mutex_unlock(&s->mutex);
  }
}

smc_result_t smc_box_server_start(smc_comm_t* comm, smc_box_server_t** out) {
  if (comm == NULL || out == NULL) return smc_set_error(SMC_ERR_INVALID, "box server: NULL argument");
  smc_box_server_t* s = (smc_box_server_t*)calloc(1, sizeof(*s));
  if (s == NULL) return smc_set_error(SMC_ERR_NOMEM, "box server: out of memory");
  s->comm = comm;
  s->pid = getpid();
  s->listener = s->wake[0] = s->wake[1] = -1;
  pthread_mutex_init(&s->mutex, NULL);
  smc_result_t rc = SMC_SUCCESS;
  int one = 1;
  struct sockaddr_in addr;
  socklen_t len = sizeof(addr);
  memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  SYS_CHECK_GOTO(s->listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), "box server: socket", rc, fail);
  SYS_CHECK_GOTO(setsockopt(s->listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)), "box server: setsockopt", rc,
                 fail);
  SYS_CHECK_GOTO(bind(s->listener, (struct sockaddr*)&addr, sizeof(addr)), "box server: bind", rc, fail);
  SYS_CHECK_GOTO(listen(s->listener, 128), "box server: listen", rc, fail);
  SYS_CHECK_GOTO(getsockname(s->listener, (struct sockaddr*)&addr, &len), "box server: getsockname", rc, fail);
  s->port = ntohs(addr.sin_port);
  SYS_CHECK_GOTO(pipe2(s->wake, O_CLOEXEC), "box server: pipe", rc, fail);
  if (pthread_create(&s->acceptor, NULL, accept_loop, s) != 0) {
    rc = smc_set_error(SMC_ERR_SYSTEM, "box server: cannot start its thread");
    goto fail;
  }
  *out = s;
  return SMC_SUCCESS;
fail:
  if (s->listener >= 0) close(s->listener);
  if (s->wake[0] >= 0) close(s->wake[0]);
  if (s->wake[1] >= 0) close(s->wake[1]);
  pthread_mutex_destroy(&s->mutex);
  free(s);
  return rc;
}

int smc_box_server_port(const smc_box_server_t* server) { return server == NULL ? -1 : server->port; }

/* Joins `thread` by `deadline`; 0 if it is still running then. */
static int join_by(pthread_t thread, double deadline) {
  double left = deadline - now_s();
  if (left < 0) left = 0;
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += (time_t)left;
  until.tv_nsec += (long)((left - (double)(time_t)left) * 1e9);
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  return pthread_timedjoin_np(thread, NULL, &until) == 0;
}

int smc_box_server_stop(smc_box_server_t* s, double timeout_s) {
  if (s == NULL) return 1;
  if (getpid() != s->pid) {
    /* A forked child (a data loader's worker, say) stopping its copy: the threads and the connections are the
     * parent's, and shutting the shared sockets down would end the parent's serving. Only the copies go. */
    close(s->listener);
    close(s->wake[0]);
    close(s->wake[1]);
    return 1;
  }
  double deadline = now_s() + (smc_timeout_ok(timeout_s) ? timeout_s : 0.0);
  pthread_mutex_lock(&s->mutex);
  s->closed = 1;
  for (connection_t* c = s->connections; c != NULL; c = c->next) shutdown(c->fd, SHUT_RDWR);
  pthread_mutex_unlock(&s->mutex);
  char byte = 1;
  while (write(s->wake[1], &byte, 1) < 0 && errno == EINTR) {
  }
  pthread_join(s->acceptor, NULL);  /* it only waits in poll, which the byte ends */
  /* A connection's thread in a lock or version wait leaves when that wait ends, within the client's timeout. */
  int all = 1;
  pthread_mutex_lock(&s->mutex);
  connection_t* c = s->connections;
  s->connections = NULL;
  pthread_mutex_unlock(&s->mutex);
  while (c != NULL) {
    connection_t* next = c->next;
    if (join_by(c->thread, deadline)) {
      close(c->fd);
      free(c);
    } else {
      pthread_detach(c->thread);  /* it still uses its connection_t and the arena: both are left to it */
      all = 0;
    }
    c = next;
  }
  close(s->listener);
  close(s->wake[0]);
  close(s->wake[1]);
  if (all) {
    pthread_mutex_destroy(&s->mutex);
    free(s);
  }
  return all;
}
