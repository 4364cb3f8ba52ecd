/* SPDX-License-Identifier: Apache-2.0 */
/* The box server: serves this host's Soft Memory Boxes to the ranks of the other hosts, in C threads that never need
 * the Python interpreter. A rank computing in Python holds the interpreter lock for up to its switch interval at a
 * time; a server thread written in Python needs that lock several times per request, so a remote exchange with a
 * busy home rank would wait on it (benchmarks/RESULTS.md). These threads only sleep in the kernel on their sockets
 * and in the box's own waits.
 *
 * Here: one thread accepts, and each connection gets a thread of its own, which first takes the client's proof that
 * it holds the job's secret (net/handshake.c; there, not in the accepting thread, so that a client that stays silent
 * holds up no one else), then serves its requests (net/box_session.c: one request, one reply, in the messages of
 * net/wire.c and shmcomm/smb/wire.py) and releases what the connection held when it ends, however it ends. The box
 * lock is a robust recursive mutex owned by the thread that took it: the connection's thread takes and releases it,
 * so it is the right owner. */
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

#include "core/clock.h"
#include "coll/comm.h"
#include "core/error.h"
#include "net/box_session.h"
#include "net/handshake.h"
#include "shmcomm.h"

enum { MAX_KEY_BYTES = 64 };

typedef struct connection {
  struct connection* next;
  struct smc_box_server* server;
  pthread_t thread;
  int fd;
  int done;                       /* the thread has left; it may be joined (under server->mutex) */
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
  size_t key_len;
  uint8_t key[MAX_KEY_BYTES];  /* the job's secret: only who proves it holds it is served */
};

/* One line on stderr per refused connection, naming the peer: the only trace an outsider leaves. */
static void log_refusal(const smc_box_server_t* s, int fd, int outcome) {
  struct sockaddr_in peer;
  socklen_t len = sizeof(peer);
  char address[INET_ADDRSTRLEN] = "?";
  memset(&peer, 0, sizeof(peer));
  if (getpeername(fd, (struct sockaddr*)&peer, &len) == 0) inet_ntop(AF_INET, &peer.sin_addr, address, sizeof(address));
  dprintf(2, "shmcomm: rank %d's box server refused a connection from %s:%d: %s\n",
          s->comm->job_ranks[s->comm->rank], address, ntohs(peer.sin_port), smc_handshake_refusal(outcome));
}

static void* serve(void* arg) {
  connection_t* c = (connection_t*)arg;
  smc_box_server_t* s = c->server;
  int outcome = smc_handshake_admit(c->fd, s->key, s->key_len, SMC_HANDSHAKE_TIMEOUT_S);
  if (outcome == SMC_HANDSHAKE_PROVEN) {
    smc_box_session_serve(s->comm, c->fd);
  } else {
    pthread_mutex_lock(&s->mutex);
    int stopping = s->closed;  /* a connection the stop shut down was not refused */
    pthread_mutex_unlock(&s->mutex);
    if (!stopping) log_refusal(s, c->fd, outcome);
  }
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

/* Keepalive: a client whose host vanished (power lost, a link cut) sends nothing more, not even a FIN, and its
 * thread would wait in recv for ever, holding the box lock it may hold. After KEEP_IDLE_S of silence the kernel
 * probes the peer; a host that is gone answers with a reset, or not at all (KEEP_COUNT probes KEEP_INTERVAL_S apart),
 * and recv fails: the session ends and releases what it held within about 7 s. A live client's kernel answers
 * the probes however busy its process is, so a holder that computes for long keeps its lock. */
enum { KEEP_IDLE_S = 2, KEEP_INTERVAL_S = 1, KEEP_COUNT = 5 };

static void tune(int fd) {
  int one = 1, big = 4 << 20, idle = KEEP_IDLE_S, interval = KEEP_INTERVAL_S, count = KEEP_COUNT;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
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

smc_result_t smc_box_server_start(smc_comm_t* comm, const char* address, const uint8_t* key, size_t key_len,
                                   smc_box_server_t** out) {
  if (comm == NULL || address == NULL || key == NULL || out == NULL)
    return smc_set_error(SMC_ERR_INVALID, "box server: NULL argument");
  if (key_len < SMC_HANDSHAKE_MIN_KEY_BYTES || key_len > MAX_KEY_BYTES)
    return smc_set_error(SMC_ERR_INVALID, "box server: the job's secret must have %d to %d bytes",
                         SMC_HANDSHAKE_MIN_KEY_BYTES, MAX_KEY_BYTES);
  struct sockaddr_in addr;
  memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  if (inet_pton(AF_INET, address, &addr.sin_addr) != 1)
    return smc_set_error(SMC_ERR_INVALID, "box server: '%.64s' is not an IPv4 address", address);
  smc_box_server_t* s = (smc_box_server_t*)calloc(1, sizeof(*s));
  if (s == NULL) return smc_set_error(SMC_ERR_NOMEM, "box server: out of memory");
  s->comm = comm;
  s->pid = getpid();
  memcpy(s->key, key, key_len);
  s->key_len = key_len;
  s->listener = s->wake[0] = s->wake[1] = -1;
  pthread_mutex_init(&s->mutex, NULL);
  smc_result_t rc = SMC_SUCCESS;
  int one = 1;
  socklen_t len = sizeof(addr);
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
  explicit_bzero(s->key, sizeof(s->key));
  free(s);
  return rc;
}

int smc_box_server_port(const smc_box_server_t* server) { return server == NULL ? -1 : server->port; }

/* Joins `thread` by `deadline`; 0 if it is still running then. */
static int join_by(pthread_t thread, double deadline) {
  double left = deadline - smc_now();
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
  double deadline = smc_now() + (smc_timeout_ok(timeout_s) ? timeout_s : 0.0);
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
    explicit_bzero(s->key, sizeof(s->key));
    free(s);
  }
  return all;
}
