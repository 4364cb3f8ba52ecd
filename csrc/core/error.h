/* SPDX-License-Identifier: Apache-2.0 */
/* Error reporting: every failure sets this thread's last-error text and failure data, and returns its code. */
#ifndef SMC_CORE_ERROR_H_
#define SMC_CORE_ERROR_H_

#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "shmcomm.h"

/* A failure no particular peer caused: the failure data is {rc, -1, SMC_FIELD_NONE}. */
smc_result_t smc_set_error(smc_result_t rc, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
/* A failure because of one peer: `rank` is its job rank; `field`, for a mismatch, the first field that differs. */
smc_result_t smc_set_peer_error(smc_result_t rc, int rank, smc_field_t field, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Returns rc with `failure` as the failure data: SMC_ERR_BROKEN keeps the data of the failure that broke the
 * communicator, so that callers still learn which peer it was. */
smc_result_t smc_set_failure(smc_result_t rc, const smc_failure_t* failure, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Marks this thread's failure as one of a step that returned early (smc_failure_t.earlier). */
void smc_failure_mark_earlier(void);

/* a + b, saturated at SMC_MAX_BYTES + 1, for summing per-rank sizes that are checked against SMC_MAX_BYTES. */
static inline uint64_t smc_add_bytes(uint64_t a, uint64_t b) {
  return a > SMC_MAX_BYTES || b > SMC_MAX_BYTES || a + b > SMC_MAX_BYTES ? SMC_MAX_BYTES + 1 : a + b;
}

/* A wait's limit in seconds: a number, not negative, not infinite (every wait ends). */
static inline int smc_timeout_ok(double s) { return s >= 0 && s <= SMC_MAX_SECONDS; }

/* Propagates a failure: the callee already wrote the text. */
#define SMC_CHECK(call)            \
  do {                             \
    smc_result_t rc_ = (call);     \
    if (rc_ != SMC_SUCCESS) return rc_; \
  } while (0)

#define SMC_CHECK_GOTO(call, res, label) \
  do {                                   \
    (res) = (call);                      \
    if ((res) != SMC_SUCCESS) goto label; \
  } while (0)

/* Runs a syscall-like statement that returns -1 and sets errno, retrying on EINTR. */
#define SYS_CHECK_GOTO(stmt, what, res, label)                                           \
  do {                                                                                   \
    int sys_rc_;                                                                         \
    do {                                                                                 \
      sys_rc_ = (int)(stmt);                                                             \
    } while (sys_rc_ == -1 && errno == EINTR);                                           \
    if (sys_rc_ == -1) {                                                                 \
      (res) = smc_set_error(SMC_ERR_SYSTEM, "%s failed: %s", (what), strerror(errno));   \
      goto label;                                                                        \
    }                                                                                    \
  } while (0)

#endif
