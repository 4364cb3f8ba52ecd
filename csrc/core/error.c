/* SPDX-License-Identifier: Apache-2.0 */
#include "core/error.h"

#include <stdarg.h>
#include <stdio.h>

/* Thread-local so that the engine thread and the user's thread never overwrite each other's text. */
static __thread char last_error[1024];

smc_result_t smc_set_error(smc_result_t rc, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof(last_error), fmt, ap);
  va_end(ap);
  return rc;
}

const char* smc_last_error(void) { return last_error; }

const char* smc_result_string(smc_result_t rc) {
  switch (rc) {
    case SMC_SUCCESS: return "success";
    case SMC_ERR_INVALID: return "invalid argument";
    case SMC_ERR_SYSTEM: return "system error";
    case SMC_ERR_TIMEOUT: return "timeout";
    case SMC_ERR_RANK_FAILED: return "rank failed";
    case SMC_ERR_MISMATCH: return "mismatch across ranks";
    case SMC_ERR_NOMEM: return "out of memory";
    case SMC_ERR_EXISTS: return "already exists";
    case SMC_ERR_NOT_FOUND: return "not found";
    case SMC_ERR_BROKEN: return "communicator broken";
  }
  return "unknown error";
}
