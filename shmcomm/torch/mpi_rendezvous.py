# SPDX-License-Identifier: Apache-2.0
"""torch's env:// rendezvous where MPI started the job and nothing gave torch its variables (a plain `mpiexec python
script.py` whose script calls `init_process_group("shmcomm")`): shmcomm starts from MPI's numbers, rank 0 opens
torch's TCPStore on a free port, and the other ranks learn where from shmcomm's collectives. Wherever torch's
variables are set (shmcommrun, torchrun, a user), torch's own env:// handler runs, unchanged."""
import json
import socket
from datetime import timedelta

import numpy as np
from torch.distributed import TCPStore

from shmcomm import basics, collectives, env
from shmcomm.startup.addresses import interface_addresses, source_address


def install(registry):
    """Puts this handler before torch's own for env:// in `registry` (torch's private table of rendezvous handlers,
    which its public register_rendezvous_handler cannot replace an entry of); idempotent."""
    torchs = registry["env"]
    if getattr(torchs, "from_mpi", False):
        return

    def handler(url, timeout=timedelta(minutes=30), **kwargs):
        if not env.launched_by_mpi() or env.torch_rendezvous_given():
            yield from torchs(url, timeout=timeout, **kwargs)
            return
        yield from _from_mpi(timeout)

    handler.from_mpi = True
    registry["env"] = handler


def _from_mpi(timeout):
    basics.init()
    rank, size = basics.rank(), basics.size()
    store = where = None
    if rank == 0:  # torch's store listens on every interface; the name is where its own client finds it
        store = TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
        where = {"host": socket.gethostname(), "port": store.port,
                 "addresses": [a for a in interface_addresses() if not a.startswith("127.")]}
    where = _rank_0s(where)
    if rank != 0:
        reached = [a for a in where["addresses"] if source_address(a) is not None]
        host = "127.0.0.1" if where["host"] == socket.gethostname() or not reached else reached[0]
        store = TCPStore(host, where["port"], size, False, timeout=timeout)
    yield store, rank, size
    raise RuntimeError("the env:// rendezvous from MPI's numbers cannot run again: MPI's job does not change")


def _rank_0s(description):
    """Rank 0's `description` (JSON; None elsewhere) on every rank, through shmcomm's numpy-level broadcast: the
    engine stays unstarted, as the backend's own calls leave it."""
    data = np.frombuffer(json.dumps(description).encode(), np.uint8) if description is not None else None
    length = np.array([0 if data is None else len(data)], np.int64)
    collectives.broadcast_(length, 0, name="torch rendezvous length")
    payload = data.copy() if data is not None else np.empty(int(length[0]), np.uint8)
    collectives.broadcast_(payload, 0, name="torch rendezvous")
    return json.loads(payload.tobytes())
