/* SPDX-License-Identifier: Apache-2.0 */
#include "shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/error.h"

static smc_result_t map_fd(int fd, size_t bytes, const char* name, void** base) {
  void* p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return smc_set_error(SMC_ERR_SYSTEM, "mmap of %s (%zu bytes) failed: %s", name, bytes, strerror(errno));
  *base = p;
  return SMC_SUCCESS;
}

smc_result_t smc_segment_reserve(int fd, size_t offset, size_t bytes, const char* what) {
  if (bytes == 0) return SMC_SUCCESS;
  int rc;
  do {
    rc = posix_fallocate(fd, (off_t)offset, (off_t)bytes);
  } while (rc == EINTR);
  if (rc == 0) return SMC_SUCCESS;
  if (rc == ENOSPC || rc == EFBIG) {
    struct statvfs fs;
    unsigned long long free_bytes = statvfs("/dev/shm", &fs) == 0 ? (unsigned long long)fs.f_bavail * fs.f_frsize : 0;
    return smc_set_error(SMC_ERR_NOMEM,
                         "%s: /dev/shm is full: %zu bytes of shared memory asked for, %llu free; give the job more "
                         "shared memory (docker run --shm-size, a larger /dev/shm), or ask for less (smaller boxes, "
                         "SHMCOMM_SMB_BYTES, SHMCOMM_SLOT_BYTES)",
                         what, bytes, free_bytes);
  }
  return smc_set_error(SMC_ERR_SYSTEM, "%s: reserving %zu bytes of shared memory failed: %s", what, bytes,
                       strerror(rc));
}

void smc_segment_close(int fd) {
  if (fd >= 0) close(fd);
}

smc_result_t smc_segment_create(const char* name, size_t bytes, size_t reserve_bytes, void** base, int* fd_out) {
  smc_result_t res = SMC_SUCCESS;
  int fd = -1;
  do {
    fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0 && errno == EEXIST)
    return smc_set_error(SMC_ERR_SYSTEM, "shared-memory segment %s exists already: another job uses this token", name);
  if (fd < 0) return smc_set_error(SMC_ERR_SYSTEM, "shm_open(%s) failed: %s", name, strerror(errno));
  /* The umask may have narrowed the mode, never widened it; set it explicitly anyway. */
  SYS_CHECK_GOTO(fchmod(fd, 0600), "fchmod", res, fail_unlink);
  SYS_CHECK_GOTO(ftruncate(fd, (off_t)bytes), "ftruncate", res, fail_unlink);
  SMC_CHECK_GOTO(smc_segment_reserve(fd, 0, reserve_bytes, "init"), res, fail_unlink);
  SMC_CHECK_GOTO(map_fd(fd, bytes, name, base), res, fail_unlink);
  *fd_out = fd;
  return SMC_SUCCESS;
fail_unlink:
  shm_unlink(name);
  close(fd);
  return res;
}

smc_result_t smc_segment_open(const char* name, size_t bytes, double timeout_s, const uint32_t* abandon, void** base,
                              int* fd_out) {
  smc_result_t res = SMC_SUCCESS;
  double deadline = smc_now() + timeout_s;
  double pause = 0.0005;
  int fd = -1;
  for (;;) {
    do {
      fd = shm_open(name, O_RDWR, 0);
    } while (fd < 0 && errno == EINTR);
    if (fd >= 0) {
      struct stat st;
      SYS_CHECK_GOTO(fstat(fd, &st), "fstat", res, fail);
      if (st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
        res = smc_set_error(SMC_ERR_SYSTEM, "refusing %s: owned by uid %d with mode %o (expected uid %d, mode 0600)",
                            name, (int)st.st_uid, (unsigned)(st.st_mode & 0777), (int)geteuid());
        goto fail;
      }
      if ((size_t)st.st_size == bytes) break;
      if (st.st_size != 0) {
        res = smc_set_error(SMC_ERR_INVALID,
                            "segment %s has %lld bytes, this rank expects %zu: the ranks were started with different "
                            "sizes or SHMCOMM_* settings",
                            name, (long long)st.st_size, bytes);
        goto fail;
      }
      close(fd); /* created but not sized yet */
      fd = -1;
    } else if (errno != ENOENT) {
      return smc_set_error(SMC_ERR_SYSTEM, "shm_open(%s) failed: %s", name, strerror(errno));
    }
    if (abandon != NULL && __atomic_load_n(abandon, __ATOMIC_ACQUIRE)) return SMC_ERR_ABANDONED;
    if (smc_now() > deadline) return SMC_ERR_TIMEOUT; /* the caller knows whom it waited for */
    smc_sleep(pause);
    if (pause < 0.01) pause *= 2;
  }
  SMC_CHECK_GOTO(map_fd(fd, bytes, name, base), res, fail);
  *fd_out = fd;
  return SMC_SUCCESS;
fail:
  if (fd >= 0) close(fd);
  return res;
}

void smc_segment_unmap(void* base, size_t bytes) {
  if (base != NULL) munmap(base, bytes);
}

void smc_segment_unlink(const char* name) { shm_unlink(name); }
