/* SPDX-License-Identifier: Apache-2.0 */
/* Error reporting: every failure sets this thread's last-error text and returns its code. */
#ifndef SMC_CORE_ERROR_H_
#define SMC_CORE_ERROR_H_

#include <errno.h>
#include <string.h>

#include "shmcomm.h"

smc_result_t smc_set_error(smc_result_t rc, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

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
