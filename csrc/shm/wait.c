/* SPDX-License-Identifier: Apache-2.0 */
/* Spin-then-sleep waits, with a yield between for collectives.
 *
 * A waiter first polls the word for `spin_us` microseconds: on an idle core the peer usually posts within
 * microseconds and a sleep/wake pair would cost more than the wait. Then it registers in `sleepers` and sleeps on the
 * futex, so that with more ranks than cores (normal here) the waiter hands its core to the rank it waits for.
 *
 * Between the two, a collective's waiter may yield for `yield_us` (the default with more ranks than cores). A futex
 * wake-up costs the waker a system call and the sleeper a trip through the scheduler, several of them per step;
 * sched_yield gives the core at once to whichever rank is queued on it, often the one being waited for, and costs
 * nothing where the core has no one else to run. Measured with 4 and 8 ranks on 2 cores: small allreduce, broadcast
 * and allgather took 10-40% less time than with sleeping alone (benchmarks/RESULTS.md). The yield lasts at most a
 * liveness interval, so a dead peer is still found in time.
 *
 * The lost-wake-up race is closed by ordering: the poster stores the word, then reads `sleepers`; the waiter
 * increments `sleepers`, then re-reads the word, and the kernel re-checks the word inside FUTEX_WAIT. Both sides use
 * sequentially consistent operations, so one of them always sees the other. */
#include "shm/wait.h"

#include <limits.h>
#include <sched.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/clock.h"

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

void smc_futex_sleep(_Atomic uint32_t* word, uint32_t expected, double seconds) {
  if (seconds <= 0) return;
  struct timespec ts;
  ts.tv_sec = (time_t)seconds;
  ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
  /* Not FUTEX_PRIVATE: the word is shared between processes. EINTR, EAGAIN and ETIMEDOUT all mean "look again". */
  syscall(SYS_futex, (uint32_t*)word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

void smc_futex_wake_all(_Atomic uint32_t* word) { syscall(SYS_futex, (uint32_t*)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

void smc_post(_Atomic uint32_t* word, _Atomic uint32_t* sleepers, uint32_t value) {
  atomic_store(word, value);
  if (atomic_load(sleepers) != 0) smc_futex_wake_all(word);
}

smc_result_t smc_wait_reach(_Atomic uint32_t* word, _Atomic uint32_t* sleepers, uint32_t target,
                            const smc_wait_opts_t* opts) {
  double start = 0;
  if (opts->spin_us > 0) {
    /* Bounded by time, not by iterations: how long a pause instruction takes differs tenfold between CPUs. */
    for (unsigned i = 1;; i++) {
      if (smc_reached(atomic_load_explicit(word, memory_order_acquire), target)) return SMC_SUCCESS;
      cpu_relax();
      if ((i & 63) == 0) {
        double now = smc_now();
        if (start == 0)
          start = now;
        else if (now - start >= 1e-6 * opts->spin_us)
          break;
      }
    }
  }
  if (opts->yield_us > 0) {
    double yield_s = 1e-6 * opts->yield_us;
    double until = smc_now() + (yield_s < opts->liveness_s ? yield_s : opts->liveness_s);
    do {
      if (smc_reached(atomic_load_explicit(word, memory_order_acquire), target)) return SMC_SUCCESS;
      sched_yield();
    } while (smc_now() < until);
  }
  start = smc_now();
  double next_check = start + opts->liveness_s;
  for (;;) {
    atomic_fetch_add(sleepers, 1);
    uint32_t seen = atomic_load(word);
    if (smc_reached(seen, target)) {
      atomic_fetch_sub(sleepers, 1);
      return SMC_SUCCESS;
    }
    double now = smc_now();
    double until = next_check < start + opts->timeout_s ? next_check : start + opts->timeout_s;
    smc_futex_sleep(word, seen, until - now);
    atomic_fetch_sub(sleepers, 1);
    if (smc_reached(atomic_load(word), target)) return SMC_SUCCESS;
    now = smc_now();
    if (now >= next_check) {
      next_check = now + opts->liveness_s;
      if (opts->check != NULL) {
        smc_result_t rc = opts->check(opts->check_arg);
        if (rc != SMC_SUCCESS) return rc;
      }
    }
    if (now - start >= opts->timeout_s) return SMC_ERR_TIMEOUT;
  }
}
