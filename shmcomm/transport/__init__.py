# SPDX-License-Identifier: Apache-2.0
"""Transports: how bytes move between the ranks of one communicator. The algorithms (shmcomm/algorithms/) compose
them; nothing above this package calls the C core's communication functions or MPI directly.

`shm.SharedMemory` joins the ranks of one host (or a subset: a process set, a logical grid's row or column) in one
shared-memory segment owned by the C core; `mpi.Mpi` the ranks of an MPI communicator, with a deadline on every wait
that MPI itself would leave unbounded; `tcp.Tcp` those of an elastic world across hosts. All offer the `Transport`
interface. `nccl.NcclComm` moves device memory and does not: its calls enqueue on a CUDA stream and return
(algorithms/device.py composes it with a host transport)."""
import abc

from shmcomm.vocabulary.exceptions import BrokenCommunicatorError


class Transport(abc.ABC):
    """The interface every transport offers. Subclasses set rank (this process's index), size (the member count) and
    ranks (the members' job ranks).

    Arguments are in the units of the C core: pointers, element counts and dtype codes (vocabulary/dtypes.py), byte
    counts, a 64-bit `tag` that every rank must pass equal (a digest of the collective's description,
    vocabulary/description.py) and `what`, how errors name the call. Failures raise the exceptions of
    shmcomm.vocabulary.exceptions; a transport that can no longer be trusted raises BrokenCommunicatorError for every
    later collective.

    `SharedMemory` adds the doorbells the engine sleeps on (doorbell(), ring_doorbell(everyone), wait_doorbell(seen,
    timeout_s)) and the Soft Memory Box arena; other hosts are not in its segment, so across hosts the engine cycles
    on its timer. `Mpi` and `Tcp` are `PointToPoint` transports too."""

    rank = 0
    size = 1
    ranks = (0,)
    doorbell_reaches_all = False
    carrier = None  # what carries the bytes, in a word: "shared memory", "mpi", "tcp"
    broken = None  # why calls are refused, once a failure left the ranks' messages out of step

    @abc.abstractmethod
    def allreduce(self, src, dst, count, dtype, op, prescale, postscale, divisor, tag, what):
        """dst = postscale * op(prescale * src of every rank) / divisor; `count` elements of `dtype`."""

    @abc.abstractmethod
    def reducescatter(self, src, dst, counts, dtype, op, prescale, postscale, divisor, tag, what):
        """Rank r gets elements [sum(counts[:r]), +counts[r]) of the allreduce of every src."""

    @abc.abstractmethod
    def broadcast(self, src, dst, nbytes, root, tag, what):
        """Root's `nbytes` at src land in every rank's dst."""

    @abc.abstractmethod
    def allgatherv(self, src, nbytes, dst, sizes, tag, what):
        """dst = every rank's src, in rank order; sizes[r] is rank r's byte count."""

    @abc.abstractmethod
    def alltoallv(self, src, send_sizes, dst, recv_sizes, tag, what):
        """send_sizes[j] bytes of src go to rank j; recv_sizes[j] bytes from rank j land in dst in rank order."""

    @abc.abstractmethod
    def barrier(self, what="barrier"):
        """Returns once every rank has called it."""

    @abc.abstractmethod
    def allgather_bytes(self, payload):
        """Every rank's bytes object, in rank order, within the deadline."""

    def usable(self, what):
        """Raises BrokenCommunicatorError, naming `what` and `broken`, once an earlier failure left this transport
        unusable."""
        if self.broken:
            raise BrokenCommunicatorError("%s: unusable after an earlier failure: %s" % (what, self.broken))

    def failed_ranks(self):
        """Job ranks known to be dead (liveness; MPI knows none)."""
        return []

    def set_spin(self, spin_us, yield_us):
        """How long waits poll, then yield the core, before they sleep; transports that do not poll ignore it."""

    def close(self):
        """Leaves the communicator; never blocks on peers."""


class PointToPoint(Transport):
    """A transport that also moves bytes between two of its ranks: the agreement's recursive doubling and the ring
    need it (`Mpi`, `Tcp`); the shared memory does not, since every rank reads its peers' slots directly. Buffers are
    uint8 numpy arrays."""

    @abc.abstractmethod
    def exchange(self, peer, send, send_bytes, recv, deadline, tag, late):
        """Sends send[:send_bytes] to `peer` and/or receives into `recv` from it (either may be None) by `deadline`
        (time.monotonic()); raises late() after it."""

    @abc.abstractmethod
    def sendrecv(self, send, dest, recv, source, tag, what="ring allreduce"):
        """One ring step: sends `send` to `dest` while receiving `recv` from `source`, within SHMCOMM_TIMEOUT."""


# The engine's negotiation messages are usually a few hundred bytes: each rank sends a fixed block (its length, then
# the start of its message) so one exchange settles the common case; longer messages send their rest in a second.
_BYTES_BLOCK = 2048  # a few hundred tensors' cache ids


def allgather_bytes_over(gatherv, n, payload):
    """allgather_bytes with any transport: gatherv(mine, every, sizes) puts every rank's `mine` (sizes[r] bytes from
    rank r) into the bytearray `every`, in rank order."""
    head = _BYTES_BLOCK - 8
    block = bytearray(_BYTES_BLOCK)
    block[:8] = len(payload).to_bytes(8, "little")
    first = payload[:head]
    block[8:8 + len(first)] = first
    out = bytearray(_BYTES_BLOCK * n)
    gatherv(block, out, [_BYTES_BLOCK] * n)
    sizes = [int.from_bytes(out[r * _BYTES_BLOCK:r * _BYTES_BLOCK + 8], "little") for r in range(n)]
    views = [bytes(out[r * _BYTES_BLOCK + 8:r * _BYTES_BLOCK + 8 + min(s, head)]) for r, s in enumerate(sizes)]
    rest = [max(s - head, 0) for s in sizes]
    if any(rest):  # the same decision on every rank: all saw the same lengths
        tail = bytearray(sum(rest))
        gatherv(bytes(payload[head:]), tail, rest)
        at = 0
        for r in range(n):
            views[r] += bytes(tail[at:at + rest[r]])
            at += rest[r]
    return views
