# SPDX-License-Identifier: Apache-2.0
"""What every communicator the API and the engine use has in common: the host's shared-memory transport, which
holds the Soft Memory Box arena and the doorbells the engine sleeps on.

Two kinds exist: host.HostComm (the ranks of one host, or a process set of them) and world.WorldComm (a job across
hosts, or a logical grid on one). Both offer allreduce, allreduce_raw, broadcast, allgather, reducescatter,
alltoall, barrier and allgather_bytes on numpy arrays and torch tensors."""
from shmcomm.vocabulary import description
from shmcomm.vocabulary.exceptions import ShmCommError


class Communicator:
    def __init__(self, shm, topology, tuning, ranks):
        self.shm = shm                  # transport.shm.SharedMemory of this host's ranks
        self.topology = topology
        self.tuning = tuning
        self.ranks = list(ranks)        # the job ranks it holds, in order
        self.rank = self.ranks.index(topology.rank)
        self.size = len(self.ranks)
        self.closables = []             # further transports, and the launcher's notices, to close with it
        self.host_groups = [self.ranks]  # the job ranks of each host (WorldComm: of every host)
        self.across = None              # the transport across hosts (MPI, or an elastic world's TCP mesh), if any

    @property
    def doorbell_reaches_all(self):
        """Whether ringing reaches every rank's engine (a host's segment does; other hosts are not in it)."""
        return self.shm.size == self.size

    def ring_doorbell(self, everyone=False):
        self.shm.ring_doorbell(everyone)

    def doorbell(self):
        return self.shm.doorbell()

    def wait_doorbell(self, seen, timeout_s):
        return self.shm.wait_doorbell(seen, timeout_s)

    def set_spin(self, spin_us, yield_us):
        self.shm.set_spin(spin_us, yield_us)

    def failed_ranks(self):
        return self.shm.failed_ranks()

    def refused(self, kind, error, what):
        """`error`, after telling the peers: this rank's call of collective `kind` failed its own checks (a bad
        argument), and their calls of it must fail at once too (PeerArgumentError, naming this rank and `error`)
        instead of waiting for this rank until the timeout. Errors from a transport's steps have told them already
        (`told_peers`). If the peers cannot be told (one died), this rank's own error still stands; the
        communicator says what happened at the next call."""
        if not getattr(error, "told_peers", False):
            error.told_peers = True
            try:
                self.refuse(kind, str(error), what)
            except ShmCommError:
                pass
        return error

    def refuse(self, kind, reason, what):
        """Takes the first step of collective `kind` as a refusal carrying `reason` (see refused())."""
        self.shm.refuse(description.KIND[kind], reason, what)

    def mark_failed(self):
        """This rank leaves because of an error of its own (an uncaught exception): the peers will say it failed."""
        self.shm.mark_failed()

    def close(self):
        for transport in self.closables:
            transport.close()
        self.shm.close()
