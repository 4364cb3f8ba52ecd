/* SPDX-License-Identifier: Apache-2.0 */
/* POSIX shared-memory segments private to this user. */
#ifndef SMC_SHM_SEGMENT_H_
#define SMC_SHM_SEGMENT_H_

#include <stddef.h>

#include "shmcomm.h"

/* Creates `name` exclusively with mode 0600, sizes it and maps it. Fails if the name exists. */
smc_result_t smc_segment_create(const char* name, size_t bytes, void** base);
/* Opens `name`, retrying until it exists and has reached `bytes` (its creator may still be sizing it), then maps it.
 * Refuses a segment owned by another user or readable by others. Returns SMC_ERR_TIMEOUT without setting a text if
 * it never appears, so the caller can say whom it waited for. */
smc_result_t smc_segment_open(const char* name, size_t bytes, double timeout_s, void** base);
void smc_segment_unmap(void* base, size_t bytes);
void smc_segment_unlink(const char* name);

#endif
