/* SPDX-License-Identifier: Apache-2.0 */
#include "core/error.h"

#include <stdarg.h>
#include <stdio.h>

/* Thread-local so that the engine thread and the user's thread never overwrite each other's failure. */
static __thread char last_error[1024];
static __thread smc_failure_t last_failure = {SMC_SUCCESS, -1, SMC_FIELD_NONE, 0};

static void record(smc_failure_t failure, const char* fmt, va_list ap) {
  vsnprintf(last_error, sizeof(last_error), fmt, ap);
  last_failure = failure;
}

smc_result_t smc_set_error(smc_result_t rc, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  record((smc_failure_t){rc, -1, SMC_FIELD_NONE, 0}, fmt, ap);
  va_end(ap);
  return rc;
}

smc_result_t smc_set_peer_error(smc_result_t rc, int rank, smc_field_t field, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  record((smc_failure_t){rc, rank, field, 0}, fmt, ap);
  va_end(ap);
  return rc;
}

smc_result_t smc_set_failure(smc_result_t rc, const smc_failure_t* failure, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  record(*failure, fmt, ap);
  va_end(ap);
  return rc;
}

void smc_failure_mark_earlier(void) { last_failure.earlier = 1; }

const char* smc_last_error(void) { return last_error; }

void smc_last_failure(smc_failure_t* out) {
  if (out != NULL) *out = last_failure;
}
