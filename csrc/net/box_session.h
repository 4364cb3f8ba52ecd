/* SPDX-License-Identifier: Apache-2.0 */
/* One connection of the box server: the requests of one client, applied to this host's arena. */
#ifndef SMC_NET_BOX_SESSION_H_
#define SMC_NET_BOX_SESSION_H_

#include "shmcomm.h"

/* Serves the requests arriving on `fd` until the client closes it, asks to close, or the connection breaks (the
 * server's stop shuts it down); then releases what the connection held: the box lock (after bumping the version, so
 * that readers can tell a holder was lost) and its box handles. Runs in the connection's own thread, which is then
 * the owner of the box locks it takes. */
void smc_box_session_serve(smc_comm_t* comm, int fd);

#endif
