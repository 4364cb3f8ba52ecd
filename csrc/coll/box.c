/* SPDX-License-Identifier: Apache-2.0 */
/* Soft Memory Box: named, typed buffers in the job arena that every rank of the host reads, writes and accumulates
 * into. The registry (names, places, handle counts) sits in the segment header under one robust lock; each box has
 * its own robust, recursive lock, so that an accumulate is atomic against every other writer and a user may hold the
 * lock across several operations. A holder that dies releases the lock to the next taker (EOWNERDEAD), which
 * marks it consistent, bumps the version (what was under way may be half done) and goes on: boxes are meant to
 * outlive a lost worker. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "coll/comm.h"
#include "shm/segment.h"
#include "core/clock.h"
#include "core/copy.h"
#include "core/error.h"

struct smc_box {
  smc_comm_t* comm;
  smc_box_entry_t* entry;
  uint8_t* data;
  size_t esize;
  double timeout_s;
};

static smc_result_t lock_robust_as(pthread_mutex_t* m, double timeout_s, const char* what, int* recovered);

static smc_result_t lock_robust(pthread_mutex_t* m, double timeout_s, const char* what) {
  int recovered;
  return lock_robust_as(m, timeout_s, what, &recovered);
}

/* `recovered`: the previous holder died holding it (EOWNERDEAD). */
static smc_result_t lock_robust_as(pthread_mutex_t* m, double timeout_s, const char* what, int* recovered) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += (time_t)timeout_s;
  ts.tv_nsec += (long)((timeout_s - (double)(time_t)timeout_s) * 1e9);
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec += 1;
    ts.tv_nsec -= 1000000000L;
  }
  int rc;
  do {
    rc = pthread_mutex_timedlock(m, &ts);
  } while (rc == EINTR);
  *recovered = rc == EOWNERDEAD;
  if (rc == EOWNERDEAD) rc = pthread_mutex_consistent(m);
  if (rc == 0) return SMC_SUCCESS;
  if (rc == ETIMEDOUT) return smc_set_error(SMC_ERR_TIMEOUT, "%s: lock not obtained within %.1f s", what, timeout_s);
  return smc_set_error(SMC_ERR_SYSTEM, "%s: lock failed: %s", what, strerror(rc));
}

static uint64_t bump_version(smc_box_entry_t* e);

static smc_box_entry_t* find_live(smc_shm_header_t* h, const char* name) {
  for (int i = 0; i < SMC_MAX_BOXES; i++)
    if (h->boxes[i].state == BOX_LIVE && strncmp(h->boxes[i].name, name, SMC_BOX_NAME_MAX) == 0) return &h->boxes[i];
  return NULL;
}

/* A free entry whose old space fits, else a never-used entry with fresh space from the end of the arena. The
 * space is reserved in /dev/shm before it is handed out (smc_segment_reserve), and fresh space is taken from the
 * arena only once that has worked, so a full /dev/shm costs the arena nothing. */
static smc_result_t allocate(smc_comm_t* c, size_t bytes, smc_box_entry_t** out) {
  smc_shm_header_t* h = c->hdr;
  smc_box_entry_t* blank = NULL;
  for (int i = 0; i < SMC_MAX_BOXES; i++) {
    smc_box_entry_t* e = &h->boxes[i];
    if (e->state != BOX_FREE) continue;
    if (e->offset != 0 && e->capacity_bytes >= bytes) {
      SMC_CHECK(smc_segment_reserve(c->fd, e->offset, bytes, "box create"));
      *out = e;
      return SMC_SUCCESS;
    }
    if (e->offset == 0 && blank == NULL) blank = e;
  }
  size_t need = (bytes + SMC_CACHE_LINE - 1) / SMC_CACHE_LINE * SMC_CACHE_LINE;
  if (need == 0) need = SMC_CACHE_LINE;
  if (blank == NULL) return smc_set_error(SMC_ERR_NOMEM, "box: all %d box entries are in use", SMC_MAX_BOXES);
  if (h->arena_used + need > h->arena_bytes)
    return smc_set_error(SMC_ERR_NOMEM, "box: the arena is full (%llu of %llu bytes used, %zu more needed); raise "
                         "SHMCOMM_SMB_BYTES", (unsigned long long)h->arena_used, (unsigned long long)h->arena_bytes, need);
  SMC_CHECK(smc_segment_reserve(c->fd, h->arena_offset + h->arena_used, need, "box create"));
  blank->offset = h->arena_offset + h->arena_used;
  blank->capacity_bytes = need;
  h->arena_used += need;
  *out = blank;
  return SMC_SUCCESS;
}

static smc_result_t open_handle(smc_comm_t* c, smc_box_entry_t* e, smc_box_t** out) {
  smc_box_t* b = calloc(1, sizeof(*b));
  if (b == NULL) return smc_set_error(SMC_ERR_NOMEM, "box: out of memory");
  b->comm = c;
  b->entry = e;
  b->data = c->base + e->offset;
  b->esize = smc_dtype_size((smc_datatype_t)e->dtype);
  b->timeout_s = c->timeout_s;
  e->handles++;
  *out = b;
  return SMC_SUCCESS;
}

static smc_result_t check_name(const char* name) {
  if (name == NULL || name[0] == '\0' || strlen(name) >= SMC_BOX_NAME_MAX)
    return smc_set_error(SMC_ERR_INVALID, "box: a name must have 1 to %d characters", SMC_BOX_NAME_MAX - 1);
  return SMC_SUCCESS;
}

smc_result_t smc_box_create(smc_comm_t* c, const char* name, size_t count, smc_datatype_t dtype, int exist_ok,
                            smc_box_t** box) {
  SMC_CHECK(smc_comm_usable(c, "box create"));
  SMC_CHECK(check_name(name));
  if ((unsigned)dtype >= SMC_NUM_DTYPES) return smc_set_error(SMC_ERR_INVALID, "box: unknown dtype %d", dtype);
  if (box == NULL) return smc_set_error(SMC_ERR_INVALID, "box create: output pointer is NULL");
  if (count > SMC_MAX_BYTES / 16) return smc_set_error(SMC_ERR_INVALID, "box: count %zu is too large", count);
  SMC_CHECK(lock_robust(&c->hdr->registry_lock, c->timeout_s, "box registry"));
  smc_result_t rc = SMC_SUCCESS;
  smc_box_entry_t* e = find_live(c->hdr, name);
  if (e != NULL) {
    if (!exist_ok)
      rc = smc_set_error(SMC_ERR_EXISTS, "box '%s' exists already", name);
    else if (e->count != count || e->dtype != (uint32_t)dtype)
      rc = smc_set_error(SMC_ERR_EXISTS, "box '%s' exists with %llu elements of dtype %u, not %zu of dtype %d", name,
                         (unsigned long long)e->count, e->dtype, count, (int)dtype);
    else
      rc = open_handle(c, e, box);
    goto out;
  }
  size_t bytes = count * smc_dtype_size(dtype);
  /* Reserved before the first touch (the memset): a full /dev/shm is an error here, not SIGBUS in whoever writes. */
  SMC_CHECK_GOTO(allocate(c, bytes, &e), rc, out);
  memset(c->base + e->offset, 0, bytes);
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutex_init(&e->lock, &attr);
  pthread_mutexattr_destroy(&attr);
  strncpy(e->name, name, SMC_BOX_NAME_MAX - 1);
  e->name[SMC_BOX_NAME_MAX - 1] = '\0';
  e->dtype = (uint32_t)dtype;
  e->count = count;
  atomic_store(&e->version, 0);
  atomic_store(&e->version_word, 0);
  e->handles = 0;
  e->holder = e->holder_tid = -1;
  e->depth = 0;
  e->state = BOX_LIVE;
  rc = open_handle(c, e, box);
out:
  pthread_mutex_unlock(&c->hdr->registry_lock);
  return rc;
}

/* Attaches the first of names[0..n) that exists, waiting up to timeout_s for any of them; *which says which. */
static smc_result_t attach_first(smc_comm_t* c, const char* const* names, int n, double timeout_s, smc_box_t** box,
                                 int* which) {
  double deadline = smc_now() + timeout_s, pause = 0.0005;
  for (;;) {
    SMC_CHECK(lock_robust(&c->hdr->registry_lock, c->timeout_s, "box registry"));
    smc_result_t rc = SMC_ERR_NOT_FOUND;
    for (int i = 0; i < n && rc == SMC_ERR_NOT_FOUND; i++) {
      smc_box_entry_t* e = find_live(c->hdr, names[i]);
      if (e != NULL) {
        rc = open_handle(c, e, box);
        *which = i;
      }
    }
    pthread_mutex_unlock(&c->hdr->registry_lock);
    if (rc != SMC_ERR_NOT_FOUND) return rc;
    if (smc_now() >= deadline)
      return smc_set_error(SMC_ERR_NOT_FOUND, "box '%s' does not exist (waited %.1f s)", names[0], timeout_s);
    smc_sleep(pause);
    if (pause < 0.02) pause *= 2;
  }
}

smc_result_t smc_box_attach(smc_comm_t* c, const char* name, double timeout_s, smc_box_t** box) {
  SMC_CHECK(smc_comm_usable(c, "box attach"));
  SMC_CHECK(check_name(name));
  if (!smc_timeout_ok(timeout_s)) return smc_set_error(SMC_ERR_INVALID, "box attach: timeout %g s", timeout_s);
  if (box == NULL) return smc_set_error(SMC_ERR_INVALID, "box attach: output pointer is NULL");
  int which;
  return attach_first(c, &name, 1, timeout_s, box, &which);
}

smc_result_t smc_box_find(smc_comm_t* c, const char* name, double timeout_s, smc_box_t** box, int* striped) {
  SMC_CHECK(smc_comm_usable(c, "box attach"));
  SMC_CHECK(check_name(name));
  if (!smc_timeout_ok(timeout_s)) return smc_set_error(SMC_ERR_INVALID, "box attach: timeout %g s", timeout_s);
  if (box == NULL || striped == NULL) return smc_set_error(SMC_ERR_INVALID, "box attach: output pointer is NULL");
  char described[SMC_BOX_NAME_MAX + sizeof(SMC_BOX_STRIPED_SUFFIX)];
  snprintf(described, sizeof(described), "%s%s", name, SMC_BOX_STRIPED_SUFFIX);
  const char* names[2] = {name, described};
  /* A description's name too long for a box cannot exist: then only the name itself is looked for. */
  int n = strlen(described) < SMC_BOX_NAME_MAX ? 2 : 1;
  return attach_first(c, names, n, timeout_s, box, striped);
}

void smc_box_close(smc_box_t* b) {
  if (b == NULL) return;
  smc_shm_header_t* h = b->comm->hdr;
  if (lock_robust(&h->registry_lock, b->timeout_s, "box close") == SMC_SUCCESS) {
    if (--b->entry->handles == 0 && b->entry->state == BOX_DOOMED) b->entry->state = BOX_FREE;
    pthread_mutex_unlock(&h->registry_lock);
  }
  free(b);
}

smc_result_t smc_box_destroy(smc_comm_t* c, const char* name) {
  SMC_CHECK(smc_comm_usable(c, "box destroy"));
  SMC_CHECK(check_name(name));
  SMC_CHECK(lock_robust(&c->hdr->registry_lock, c->timeout_s, "box registry"));
  smc_box_entry_t* e = find_live(c->hdr, name);
  if (e != NULL) e->state = e->handles == 0 ? BOX_FREE : BOX_DOOMED;
  pthread_mutex_unlock(&c->hdr->registry_lock);
  return e != NULL ? SMC_SUCCESS : smc_set_error(SMC_ERR_NOT_FOUND, "box '%s' does not exist", name);
}

/* Safe on NULL: NULL, 0 elements, SMC_NUM_DTYPES (no dtype), version 0. */
void* smc_box_data(smc_box_t* b) { return b != NULL ? b->data : NULL; }
size_t smc_box_count(smc_box_t* b) { return b != NULL ? (size_t)b->entry->count : 0; }
smc_datatype_t smc_box_dtype(smc_box_t* b) { return b != NULL ? (smc_datatype_t)b->entry->dtype : SMC_NUM_DTYPES; }
uint64_t smc_box_version(smc_box_t* b) { return b != NULL ? atomic_load(&b->entry->version) : 0; }

static smc_result_t check_range(smc_box_t* b, size_t offset, size_t count, const void* buf, const char* what) {
  if (b == NULL) return smc_set_error(SMC_ERR_INVALID, "%s: box is NULL", what);
  if (offset > b->entry->count || count > b->entry->count - offset)
    return smc_set_error(SMC_ERR_INVALID, "%s: elements [%zu, %zu) are outside box '%s' of %llu elements", what, offset,
                         offset + count, b->entry->name, (unsigned long long)b->entry->count);
  if (count > 0 && buf == NULL) return smc_set_error(SMC_ERR_INVALID, "%s: NULL buffer", what);
  return SMC_SUCCESS;
}

/* A holder that died may have left a write half done: the taker that recovers the lock bumps the version, so that
 * every reader and waiter can tell that the box changed under a writer that is gone. */
smc_result_t smc_box_lock(smc_box_t* b, double timeout_s) {
  if (b == NULL) return smc_set_error(SMC_ERR_INVALID, "box lock: box is NULL");
  if (!smc_timeout_ok(timeout_s)) return smc_set_error(SMC_ERR_INVALID, "box lock: timeout %g s", timeout_s);
  smc_box_entry_t* e = b->entry;
  smc_comm_t* c = b->comm;
  int recovered = 0;
  smc_result_t rc = lock_robust_as(&e->lock, timeout_s, e->name, &recovered);
  if (rc == SMC_ERR_TIMEOUT) {
    int holder = e->holder; /* read without the lock: only for the message */
    if (holder >= 0 && holder < c->size) {
      smc_comm_blame(c, holder);
      return smc_set_peer_error(SMC_ERR_TIMEOUT, smc_job_rank(c, holder), SMC_FIELD_NONE,
                                "box '%s': lock not obtained within %.1f s: rank %d (pid %d) holds it", e->name,
                                timeout_s, smc_job_rank(c, holder), (int)c->ctl[holder].pid);
    }
  }
  if (rc != SMC_SUCCESS) return rc;
  int tid = (int)syscall(SYS_gettid);
  if (recovered || e->holder_tid != tid) e->depth = 0; /* a dead or earlier holder's count is void */
  e->holder = c->rank;
  e->holder_tid = tid;
  e->depth++;
  if (recovered) bump_version(e);
  return SMC_SUCCESS;
}

static void unlock_box(smc_box_entry_t* e) {
  if (e->depth > 0 && --e->depth == 0) e->holder = e->holder_tid = -1;
  pthread_mutex_unlock(&e->lock);
}

smc_result_t smc_box_unlock(smc_box_t* b) {
  if (b == NULL) return smc_set_error(SMC_ERR_INVALID, "box unlock: box is NULL");
  smc_box_entry_t* e = b->entry;
  if (e->holder_tid != (int)syscall(SYS_gettid) || e->holder != b->comm->rank || e->depth == 0)
    return smc_set_error(SMC_ERR_INVALID, "box '%s': unlock without holding the lock", e->name);
  if (--e->depth == 0) e->holder = e->holder_tid = -1;
  int rc = pthread_mutex_unlock(&e->lock);
  if (rc == EPERM) return smc_set_error(SMC_ERR_INVALID, "box '%s': unlock without holding the lock", b->entry->name);
  return rc == 0 ? SMC_SUCCESS : smc_set_error(SMC_ERR_SYSTEM, "box unlock failed: %s", strerror(rc));
}

/* Called with the box lock held: publish the new version and wake version waiters. */
static uint64_t bump_version(smc_box_entry_t* e) {
  uint64_t v = atomic_fetch_add(&e->version, 1) + 1;
  smc_post(&e->version_word, &e->sleepers, (uint32_t)v);
  return v;
}

smc_result_t smc_box_read(smc_box_t* b, size_t offset, size_t count, void* dst, uint64_t* version) {
  SMC_CHECK(check_range(b, offset, count, dst, "box read"));
  SMC_CHECK(smc_box_lock(b, b->timeout_s));
  smc_copy(dst, b->data + offset * b->esize, count * b->esize);
  if (version != NULL) *version = atomic_load(&b->entry->version);
  unlock_box(b->entry);
  return SMC_SUCCESS;
}

smc_result_t smc_box_write(smc_box_t* b, size_t offset, size_t count, const void* src, uint64_t* version) {
  SMC_CHECK(check_range(b, offset, count, src, "box write"));
  SMC_CHECK(smc_box_lock(b, b->timeout_s));
  smc_copy(b->data + offset * b->esize, src, count * b->esize);
  uint64_t v = bump_version(b->entry);
  unlock_box(b->entry);
  if (version != NULL) *version = v;
  return SMC_SUCCESS;
}

/* Tests only (smc_config_t.race_pause_us): the locked section works on a copy of the range read before a pause and
 * written back after it, so that a writer the lock failed to exclude loses its update every time, not now and then.
 * Returns where the arithmetic goes: the copy, or the range itself when no pause is set (or no copy can be had). */
static uint8_t* paused_read(smc_box_t* b, uint8_t* range, size_t bytes) {
  int pause_us = b->comm->race_pause_us;
  uint8_t* copy = pause_us > 0 && bytes > 0 ? malloc(bytes) : NULL;
  if (copy == NULL) return range;
  memcpy(copy, range, bytes);
  usleep((useconds_t)pause_us);
  return copy;
}

static void paused_write(uint8_t* range, uint8_t* worked, size_t bytes) {
  if (worked == range) return;
  memcpy(range, worked, bytes);
  free(worked);
}

smc_result_t smc_box_accumulate(smc_box_t* b, size_t offset, size_t count, const void* src, double alpha,
                                double beta, uint64_t* version) {
  SMC_CHECK(check_range(b, offset, count, src, "box accumulate"));
  SMC_CHECK(smc_box_lock(b, b->timeout_s));
  uint8_t* range = b->data + offset * b->esize;
  uint8_t* worked = paused_read(b, range, count * b->esize);
  smc_result_t rc = smc_axpby(worked, src, count, (smc_datatype_t)b->entry->dtype, alpha, beta);
  paused_write(range, worked, count * b->esize);
  uint64_t v = rc == SMC_SUCCESS ? bump_version(b->entry) : 0;
  unlock_box(b->entry);
  if (version != NULL) *version = v;
  return rc;
}

/* d = alpha*x - alpha*c computed into the caller's buffer by the same axpby as accumulate (no kernel of its own),
 * then c += d, with the lock held: a read and an accumulate under one hold, so that a remote worker pays one round
 * trip, not two, and no other writer comes between the read of c and the update. */
static smc_result_t exchange_locked(smc_box_t* b, size_t offset, size_t count, void* x_to_d, double alpha) {
  smc_datatype_t dtype = (smc_datatype_t)b->entry->dtype;
  uint8_t* range = b->data + offset * b->esize;
  uint8_t* c = paused_read(b, range, count * b->esize);
  smc_result_t rc = smc_axpby(x_to_d, c, count, dtype, -alpha, alpha);
  if (rc == SMC_SUCCESS) rc = smc_axpby(c, x_to_d, count, dtype, 1.0, 1.0);
  paused_write(range, c, count * b->esize);
  return rc;
}

smc_result_t smc_box_exchange(smc_box_t* b, size_t offset, size_t count, void* x_to_d, double alpha,
                              uint64_t* version) {
  SMC_CHECK(check_range(b, offset, count, x_to_d, "box exchange"));
  SMC_CHECK(smc_box_lock(b, b->timeout_s));
  smc_result_t rc = exchange_locked(b, offset, count, x_to_d, alpha);
  uint64_t v = rc == SMC_SUCCESS ? bump_version(b->entry) : 0;
  unlock_box(b->entry);
  if (version != NULL) *version = v;
  return rc;
}

smc_result_t smc_box_exchange_held(smc_box_t* b, size_t offset, size_t count, void* x_to_d, double alpha) {
  SMC_CHECK(check_range(b, offset, count, x_to_d, "box exchange"));
  if (b->entry->holder_tid != (int)syscall(SYS_gettid) || b->entry->depth == 0)
    return smc_set_error(SMC_ERR_INVALID, "box '%s': a part of an exchange without holding the lock", b->entry->name);
  return exchange_locked(b, offset, count, x_to_d, alpha);
}

smc_result_t smc_box_wait_version(smc_box_t* b, uint64_t min_version, double timeout_s, uint64_t* version) {
  if (b == NULL) return smc_set_error(SMC_ERR_INVALID, "box wait: box is NULL");
  if (!smc_timeout_ok(timeout_s)) return smc_set_error(SMC_ERR_INVALID, "box wait: timeout %g s", timeout_s);
  smc_box_entry_t* e = b->entry;
  /* The same spin-then-sleep wait as the collectives, on the low 32 bits of the version (the futex word); a wait
   * more than 2^31 versions ahead is not a meaningful request. */
  smc_wait_opts_t opts = {b->comm->spin_us, timeout_s, timeout_s, NULL, NULL, 0}; /* no yield: a version may be long in coming */
  uint64_t v = atomic_load(&e->version);
  if (v < min_version && smc_wait_reach(&e->version_word, &e->sleepers, (uint32_t)min_version, &opts) != SMC_SUCCESS)
    return smc_set_error(SMC_ERR_TIMEOUT, "box '%s': version %llu not reached within %.1f s (at %llu)", e->name,
                         (unsigned long long)min_version, timeout_s, (unsigned long long)atomic_load(&e->version));
  if (version != NULL) *version = atomic_load(&e->version);
  return SMC_SUCCESS;
}
