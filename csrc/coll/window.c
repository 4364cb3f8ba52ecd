/* SPDX-License-Identifier: Apache-2.0 */
/* Shared buffers (windows): memory every rank of a host maps, so a collective on it reads and writes the peers'
 * buffers directly, with no staging copy and no kernel copy (see coll/comm.h).
 *
 * Each rank backs its buffer with a memfd of its own: no name in /dev/shm to guess, to clean up after a crash or to
 * outlive the job. The peers take the file with pidfd_getfd (the ptrace check that single copy passes, Linux 5.6) and
 * map it. A buffer that some rank could not map stays this rank's plain memory, and collectives on it take the
 * ordinary paths: every rank learns in the creating call's last synchronisation whether all ranks mapped all. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "coll/comm.h"
#include "core/error.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434 /* the same number on every architecture since 5.3 */
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

struct smc_window {
  _Atomic int refs;  /* the caller's, and the communicator's while it lists the window */
  uint8_t* base;     /* this rank's buffer, mapped until the last reference goes */
  uint64_t bytes;
  uint64_t serial;   /* which of the communicator's windows: equal on every rank, since creating is collective */
  int shared;        /* every rank maps every rank's buffer: peer[] is complete */
  int size;
  uint8_t* peer[];   /* peer[r]: rank r's buffer in this process (peer[rank] = base) */
};

static void unmap_peers(smc_window_t* w) {
  for (int r = 0; r < w->size; r++) {
    if (w->peer[r] != NULL && w->peer[r] != w->base) munmap(w->peer[r], w->bytes);
    w->peer[r] = NULL;
  }
  w->shared = 0;
}

void smc_window_drop(smc_window_t* w) {
  if (w == NULL || atomic_fetch_sub(&w->refs, 1) != 1) return;
  unmap_peers(w);
  if (w->base != NULL) munmap(w->base, w->bytes);
  free(w);
}

void* smc_window_base(const smc_window_t* w) { return w->base; }
int smc_window_shared(const smc_window_t* w) { return w->shared; }

/* Drops the communicator's reference to windows nobody else holds any more (the caller dropped its own): their
 * buffers are unused, and a listed buffer is kept mapped, so that no new allocation can take its addresses. */
static void forget_unused(smc_comm_t* c) {
  for (int i = 0; i < SMC_MAX_WINDOWS; i++)
    if (c->windows[i] != NULL && atomic_load(&c->windows[i]->refs) == 1) {
      smc_window_drop(c->windows[i]);
      c->windows[i] = NULL;
    }
}

void smc_windows_close(smc_comm_t* c) {
  for (int i = 0; i < SMC_MAX_WINDOWS; i++)
    if (c->windows[i] != NULL) {
      unmap_peers(c->windows[i]); /* the peers' memory goes with the communicator; the caller's buffer stays */
      smc_window_drop(c->windows[i]);
      c->windows[i] = NULL;
    }
}

/* A free place in the window list, or -1. */
static int free_place(const smc_comm_t* c) {
  for (int i = 0; i < SMC_MAX_WINDOWS; i++)
    if (c->windows[i] == NULL) return i;
  return -1;
}

/* This rank's own buffer: a memfd with every page reserved (a full memory then fails here, with a message, instead
 * of a SIGBUS in a later collective). Where no memfd can be made (too many open files, a kernel without memfds) it
 * is anonymous memory, which stays this rank's own (*fd_out = -1). */
static smc_result_t make_own(smc_window_t* w, int* fd_out) {
  *fd_out = -1;
  int fd = memfd_create("shmcomm-window", MFD_CLOEXEC);
  if (fd >= 0) {
    int rc = ftruncate(fd, (off_t)w->bytes) == 0 ? 0 : errno;
    if (rc == 0) do {
        rc = posix_fallocate(fd, 0, (off_t)w->bytes);
      } while (rc == EINTR);
    void* p = rc == 0 ? mmap(NULL, w->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (p != MAP_FAILED) {
      madvise(p, w->bytes, MADV_HUGEPAGE); /* fewer TLB misses where the kernel gives shared memory huge pages */
      w->base = p;
      *fd_out = fd;
      return SMC_SUCCESS;
    }
    close(fd);
    if (rc == ENOSPC || rc == ENOMEM)
      return smc_set_error(SMC_ERR_NOMEM, "shared buffer: reserving %llu bytes failed: %s",
                           (unsigned long long)w->bytes, strerror(rc));
  }
  void* p = mmap(NULL, w->bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return smc_set_error(SMC_ERR_NOMEM, "shared buffer: mmap of %llu bytes failed: %s", (unsigned long long)w->bytes,
                         strerror(errno));
  w->base = p;
  return SMC_SUCCESS;
}

/* Maps rank r's buffer, whose file is descriptor `fd` in its process: 1 on success. A file smaller than the buffer
 * (never, from a peer that follows this protocol) is refused rather than mapped past its end. */
static int map_peer(smc_comm_t* c, smc_window_t* w, int r, int fd) {
  int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)c->ctl[r].pid, 0);
  if (pidfd < 0) return 0;
  int got = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
  close(pidfd);
  if (got < 0) return 0;
  struct stat st;
  void* p = MAP_FAILED;
  if (fstat(got, &st) == 0 && (uint64_t)st.st_size >= w->bytes)
    p = mmap(NULL, w->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, got, 0);
  close(got);
  if (p == MAP_FAILED) return 0;
  w->peer[r] = p;
  return 1;
}

smc_result_t smc_window_create(smc_comm_t* c, uint64_t bytes, uint64_t tag, int share, smc_window_t** out) {
  if (out == NULL) return smc_set_error(SMC_ERR_INVALID, "shared buffer: NULL result");
  *out = NULL;
  SMC_CHECK(smc_coll_enter(c, "shared buffer"));
  const uint64_t serial = c->window_serial++; /* on every rank, whatever fails below, so that serials stay equal */
  if (bytes == 0 || bytes > SMC_MAX_BYTES)
    return smc_refuse_here(c, SMC_COLL_WINDOW,
                           smc_set_error(SMC_ERR_INVALID, "shared buffer: %llu bytes", (unsigned long long)bytes));
  smc_window_t* w = calloc(1, sizeof(*w) + (size_t)c->size * sizeof(uint8_t*));
  if (w == NULL) return smc_refuse_here(c, SMC_COLL_WINDOW, smc_set_error(SMC_ERR_NOMEM, "shared buffer: no memory"));
  atomic_init(&w->refs, 1);
  w->bytes = bytes;
  w->size = c->size;
  w->serial = serial;
  int fd = -1;
  smc_result_t rc = make_own(w, &fd);
  if (rc != SMC_SUCCESS) {
    free(w);
    return smc_refuse_here(c, SMC_COLL_WINDOW, rc);
  }
  w->peer[c->rank] = w->base;
  if (c->size == 1) {
    if (fd >= 0) close(fd);
    *out = w;
    return SMC_SUCCESS;
  }
  forget_unused(c);
  smc_desc_t desc = {.prescale = 1, .postscale = 1, .divisor = 1, .count = bytes,
                     .tag = smc_digest(&tag, 1, serial), .addr = share && fd >= 0 ? (uint64_t)fd : UINT64_MAX,
                     .coll = SMC_COLL_WINDOW, .root = -1};
  rc = smc_coll_begin(c, &desc, "shared buffer");
  if (rc != SMC_SUCCESS) {
    if (fd >= 0) close(fd);
    smc_window_drop(w);
    return rc;
  }
  int mapped = share && fd >= 0 && free_place(c) >= 0;
  for (int r = 0; r < c->size && mapped; r++)
    if (r != c->rank) {
      uint64_t theirs = smc_peer_desc(c, r)->addr;
      mapped = theirs != UINT64_MAX && map_peer(c, w, r, (int)theirs);
    }
  /* The half is free (nothing of this step was written there): whether this rank mapped every buffer. */
  *(volatile uint64_t*)smc_half(c, c->rank) = (uint64_t)mapped;
  rc = smc_sync(c, "shared buffer");
  if (fd >= 0) close(fd); /* every peer has its own descriptor or gave up: the sync proves both */
  for (int r = 0; r < c->size && rc == SMC_SUCCESS && mapped; r++)
    mapped = *(volatile const uint64_t*)smc_half(c, r) != 0;
  smc_flip(c);
  if (rc != SMC_SUCCESS) {
    smc_window_drop(w);
    return rc;
  }
  if (mapped) {
    w->shared = 1;
    atomic_fetch_add(&w->refs, 1);
    c->windows[free_place(c)] = w;
  } else {
    unmap_peers(w);
    w->peer[c->rank] = w->base;
  }
  *out = w;
  return SMC_SUCCESS;
}

smc_window_t* smc_window_holding(smc_comm_t* c, const void* p, uint64_t bytes) {
  const uintptr_t at = (uintptr_t)p;
  for (int i = 0; i < SMC_MAX_WINDOWS; i++) {
    smc_window_t* w = c->windows[i];
    if (w != NULL && at >= (uintptr_t)w->base && bytes <= w->bytes && at - (uintptr_t)w->base <= w->bytes - bytes)
      return w;
  }
  return NULL;
}

uint64_t smc_window_serial(const smc_window_t* w) { return w->serial; }

uint8_t* smc_window_peer(const smc_window_t* w, int r) { return w->peer[r]; }

uint64_t smc_window_bytes(const smc_window_t* w) { return w->bytes; }

/* Every rank names its data's shared buffer (serial and offset) in its first step's descriptor; after that step each
 * reads the others' from their descriptors alone, so all reach the same verdict. A window every rank names is one every
 * rank mapped completely: creating it told every rank whether all did. */
smc_window_t* smc_window_name(smc_comm_t* c, smc_desc_t* desc, const void* data, uint64_t bytes) {
  smc_window_t* w = bytes >= c->shared_from_bytes ? smc_window_holding(c, data, bytes) : NULL;
  if (w != NULL) {
    desc->window = w->serial + 1;
    desc->window_at = (uint64_t)((const uint8_t*)data - w->base);
  }
  return w;
}

int smc_windows_agreed(smc_comm_t* c, const smc_window_t* w, uint64_t bytes, uint8_t** bufs) {
  if (w == NULL) return 0;
  for (int j = 0; j < c->size; j++) {
    const smc_desc_t* d = smc_peer_desc(c, j);
    if (d->window != w->serial + 1 || d->window_at > w->bytes - bytes) return 0;
    bufs[j] = w->peer[j] + d->window_at;
  }
  return 1;
}

int smc_any_window(smc_comm_t* c) {
  for (int j = 0; j < c->size; j++)
    if (smc_peer_desc(c, j)->window != 0) return 1;
  return 0;
}

uint8_t* smc_window_peer_data(smc_comm_t* c, int j, uint64_t bytes) {
  const smc_desc_t* d = smc_peer_desc(c, j);
  for (int i = 0; d->window != 0 && i < SMC_MAX_WINDOWS; i++) {
    const smc_window_t* w = c->windows[i];
    if (w != NULL && w->serial + 1 == d->window && bytes <= w->bytes && d->window_at <= w->bytes - bytes)
      return w->peer[j] + d->window_at;
  }
  return NULL;
}
