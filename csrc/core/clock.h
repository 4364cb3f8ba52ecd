/* SPDX-License-Identifier: Apache-2.0 */
#ifndef SMC_CORE_CLOCK_H_
#define SMC_CORE_CLOCK_H_

#include <time.h>

/* Monotonic seconds: deadlines must not jump with the wall clock. */
static inline double smc_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void smc_sleep(double seconds) {
  struct timespec ts;
  ts.tv_sec = (time_t)seconds;
  ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
  while (nanosleep(&ts, &ts) != 0) {
  }
}

#endif
