/* SPDX-License-Identifier: Apache-2.0 */
/* Is a peer still there? Each rank holds a robust, process-shared mutex for as long as it is attached. When a process
 * dies, even by SIGKILL, the kernel hands that mutex to the next locker with EOWNERDEAD, so a trylock tells a peer
 * that is alive (EBUSY) from one that died (EOWNERDEAD, then ENOTRECOVERABLE forever) without pids, which get reused,
 * or zombies, which still answer kill(pid, 0). */
#include <pthread.h>

#include "coll/comm.h"
#include "core/error.h"

/* 1 if rank r's process is gone, else 0; -1 (errno-style code in *err) if the check itself failed. */
static int gone(smc_comm_t* c, int r, int* err) {
  smc_rank_ctl_t* peer = &c->ctl[r];
  if (atomic_load(&peer->dead)) return 1;
  int rc = pthread_mutex_trylock(&peer->alive);
  if (rc == EBUSY) return 0;
  if (rc == EOWNERDEAD || rc == ENOTRECOVERABLE) {
    atomic_store(&peer->dead, 1);
    /* Unlocking without pthread_mutex_consistent makes the mutex permanently unrecoverable: every later trylock, from
     * any rank, reports the death too. */
    if (rc == EOWNERDEAD) pthread_mutex_unlock(&peer->alive);
    return 1;
  }
  if (rc == 0) {
    pthread_mutex_unlock(&peer->alive); /* not attached (yet, or any more: departed) */
    return 0;
  }
  *err = rc;
  return -1;
}

static smc_result_t died(smc_comm_t* c, int r, const char* what) {
  const int job_rank = smc_job_rank(c, r);
  return smc_set_peer_error(SMC_ERR_RANK_FAILED, job_rank, SMC_FIELD_NONE, "%s: rank %d (pid %d) %s", what, job_rank,
                            (int)c->ctl[r].pid, atomic_load(&c->ctl[r].failed) ? "failed" : "died");
}

smc_result_t smc_peer_check(smc_comm_t* c, int r, const char* what) {
  int err = 0, dead = gone(c, r, &err);
  if (dead < 0)
    return smc_set_error(SMC_ERR_SYSTEM, "%s: checking rank %d failed: %s", what, smc_job_rank(c, r), strerror(err));
  if (dead) return died(c, r, what);
  if (!atomic_load(&c->ctl[r].departed)) return SMC_SUCCESS; /* alive, or not attached yet (init waits for it) */
  /* A peer that shut down while this rank waits for it has most often raised first, for a rank that died: name the
   * dead rank, the cause, where there is one (a rank killed in init otherwise came out as a survivor's shutdown). */
  for (int o = 0; o < c->size; o++)
    if (o != c->rank && o != r && gone(c, o, &err) == 1) return died(c, o, what);
  /* Or it gave up on a rank that is stuck (stopped, or holding a box lock): name that one, as the peer did. */
  const int job_rank = smc_job_rank(c, r), blamed = atomic_load(&c->ctl[r].blamed) - 1;
  if (blamed >= 0 && blamed < c->size && blamed != c->rank && blamed != r)
    return smc_set_peer_error(SMC_ERR_RANK_FAILED, smc_job_rank(c, blamed), SMC_FIELD_NONE,
                              "%s: rank %d (pid %d) is stuck or gone: rank %d (pid %d) gave up waiting for it and left",
                              what, smc_job_rank(c, blamed), (int)c->ctl[blamed].pid, job_rank, (int)c->ctl[r].pid);
  return smc_set_peer_error(SMC_ERR_RANK_FAILED, job_rank, SMC_FIELD_NONE, "%s: rank %d (pid %d) %s", what, job_rank,
                            (int)c->ctl[r].pid, atomic_load(&c->ctl[r].failed) ? "failed" :
                            "has shut down; the ranks did not call the same collectives");
}

/* Names r as the rank this one gave up waiting for: a peer that then finds this one departed names r instead. */
void smc_comm_blame(smc_comm_t* c, int r) {
  if (r >= 0 && r < c->size && r != c->rank) atomic_store(&c->ctl[c->rank].blamed, r + 1);
}
