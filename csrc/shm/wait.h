/* SPDX-License-Identifier: Apache-2.0 */
/* Cross-process waiting on 32-bit counters in shared memory: spin briefly, maybe yield, then sleep on a futex. */
#ifndef SMC_SHM_WAIT_H_
#define SMC_SHM_WAIT_H_

#include <stdatomic.h>
#include <stdint.h>

#include "shmcomm.h"

/* Called every `liveness_s` while a waiter sleeps; a non-success result ends the wait with that result. */
typedef smc_result_t (*smc_wait_check_fn)(void* arg);

typedef struct {
  int spin_us;          /* microseconds of polling before sleeping */
  double timeout_s;     /* from the start of the wait */
  double liveness_s;    /* how often `check` runs while asleep */
  smc_wait_check_fn check;
  void* check_arg;
  int yield_us;         /* after the polling, microseconds of sched_yield before sleeping */
} smc_wait_opts_t;

/* Stores `value` into *word and wakes whoever sleeps on it. */
void smc_post(_Atomic uint32_t* word, _Atomic uint32_t* sleepers, uint32_t value);

/* Waits until *word has reached `target` (wrap-around aware: (int32_t)(*word - target) >= 0).
 * Returns SMC_ERR_TIMEOUT without setting a text, so the caller can say what it waited for. */
smc_result_t smc_wait_reach(_Atomic uint32_t* word, _Atomic uint32_t* sleepers, uint32_t target,
                            const smc_wait_opts_t* opts);

/* A single futex sleep of at most `seconds` while *word == expected; for waits with their own loop. */
void smc_futex_sleep(_Atomic uint32_t* word, uint32_t expected, double seconds);
void smc_futex_wake_all(_Atomic uint32_t* word);

static inline int smc_reached(uint32_t value, uint32_t target) { return (int32_t)(value - target) >= 0; }

#endif
