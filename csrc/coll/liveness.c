/* SPDX-License-Identifier: Apache-2.0 */
/* Is a peer still there? Each rank holds a robust, process-shared mutex for as long as it is attached. When a process
 * dies, even by SIGKILL, the kernel hands that mutex to the next locker with EOWNERDEAD, so a trylock tells a peer
 * that is alive (EBUSY) from one that died (EOWNERDEAD, then ENOTRECOVERABLE forever) without pids, which get reused,
 * or zombies, which still answer kill(pid, 0). */
#include <pthread.h>

#include "coll/comm.h"
#include "core/error.h"

smc_result_t smc_peer_check(smc_comm_t* c, int r, const char* what) {
  smc_rank_ctl_t* peer = &c->ctl[r];
  const int job_rank = smc_job_rank(c, r);
  if (atomic_load(&peer->dead))
    return smc_set_peer_error(SMC_ERR_RANK_FAILED, job_rank, SMC_FIELD_NONE, "%s: rank %d (pid %d) died", what,
                              job_rank, (int)peer->pid);
  int rc = pthread_mutex_trylock(&peer->alive);
  if (rc == EBUSY) return SMC_SUCCESS;
  if (rc == EOWNERDEAD || rc == ENOTRECOVERABLE) {
    atomic_store(&peer->dead, 1);
    /* Unlocking without pthread_mutex_consistent makes the mutex permanently unrecoverable: every later trylock, from
     * any rank, reports the death too. */
    if (rc == EOWNERDEAD) pthread_mutex_unlock(&peer->alive);
    return smc_set_peer_error(SMC_ERR_RANK_FAILED, job_rank, SMC_FIELD_NONE, "%s: rank %d (pid %d) died", what,
                              job_rank, (int)peer->pid);
  }
  if (rc == 0) {
    pthread_mutex_unlock(&peer->alive);
    if (atomic_load(&peer->departed))
      return smc_set_peer_error(SMC_ERR_RANK_FAILED, job_rank, SMC_FIELD_NONE,
                                "%s: rank %d (pid %d) has shut down; the ranks did not call the same collectives",
                                what, job_rank, (int)peer->pid);
    return SMC_SUCCESS; /* not attached yet: only possible during init, which waits for it */
  }
  return smc_set_error(SMC_ERR_SYSTEM, "%s: checking rank %d failed: %s", what, job_rank, strerror(rc));
}
