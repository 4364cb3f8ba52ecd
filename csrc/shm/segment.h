/* SPDX-License-Identifier: Apache-2.0 */
/* POSIX shared-memory segments private to this user. */
#ifndef SMC_SHM_SEGMENT_H_
#define SMC_SHM_SEGMENT_H_

#include <stddef.h>
#include <stdint.h>

#include "shmcomm.h"

/* Creates `name` exclusively with mode 0600, sizes it, reserves its first `reserve_bytes` (smc_segment_reserve) and
 * maps it. Fails if the name exists. *fd stays open for later reservations; smc_segment_close closes it. */
smc_result_t smc_segment_create(const char* name, size_t bytes, size_t reserve_bytes, void** base, int* fd);
/* Opens `name`, retrying until it exists and has reached `bytes` (its creator may still be sizing it), then maps it.
 * Refuses a segment owned by another user or readable by others. Returns SMC_ERR_TIMEOUT without setting a text if
 * it never appears, and SMC_ERR_ABANDONED, also without a text, once `abandon` (NULL: never) reads non-zero, so the
 * caller can say whom it waited for. *fd as for smc_segment_create. */
smc_result_t smc_segment_open(const char* name, size_t bytes, double timeout_s, const uint32_t* abandon, void** base,
                              int* fd);
/* Allocates bytes [offset, offset + bytes) of the segment's memory now. A segment is sized sparsely, and touching a
 * page that /dev/shm has no room for kills the process with SIGBUS: every range is reserved before it is first
 * touched, so that a full /dev/shm is an SMC_ERR_NOMEM naming the free space and the way out instead. */
smc_result_t smc_segment_reserve(int fd, size_t offset, size_t bytes, const char* what);
void smc_segment_close(int fd);
void smc_segment_unmap(void* base, size_t bytes);
void smc_segment_unlink(const char* name);

#endif
