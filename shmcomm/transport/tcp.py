# SPDX-License-Identifier: Apache-2.0
"""The TCP transport: ranks of a world that spans hosts without MPI (elastic, or started by torch's store).

An elastic job cannot take its cross-host transport from MPI: an MPI world cannot lose a process and go on, nor take
new ones in. Its worlds are formed anew at every membership (membership.py), and each world's ranks connect to each
other (tcp_connect.py; a process set across hosts connects its members the same way) and close the connections
when the world is left. A peer that dies closes its connections, so the survivors' next wait on it raises RankFailure
naming it at once, which lets the elastic loop roll back and re-form. It offers the MPI transport's interface
(mpi.py), so the algorithms use it alike."""
import selectors
import struct
import time

import numpy as np

from shmcomm.vocabulary import description
from shmcomm._native import ffi, lib
from shmcomm.vocabulary.exceptions import NotSupportedError, RankFailure, ShmCommError, TimeoutError
from shmcomm.transport import PointToPoint, kernels

_LENGTH = struct.Struct("<Q")


def _bytes(ptr, nbytes):
    return np.frombuffer(ffi.buffer(ptr, nbytes), dtype=np.uint8) if nbytes else np.empty(0, np.uint8)


class _Incoming:
    """A message being received: its length first, then its bytes into `buffer` (a uint8 array; None: a new one of
    the message's length)."""

    def __init__(self, buffer):
        self.buffer, self.head, self.length, self.got = buffer, b"", None, 0


class Tcp(PointToPoint):
    """A transport over the connections `sockets` ({peer index: socket}) of rank `rank` among `ranks` (job ranks);
    `hosts` names each rank's host, for the errors.

    Every wait has the deadline of SHMCOMM_TIMEOUT; a transport whose wait failed refuses every later call
    (BrokenCommunicatorError), its streams being out of step. Every message is framed (8 bytes of length, then the
    bytes), and every call moves at most one message each way between two ranks, all of them at once (a selector
    over non-blocking sockets), so that no rank waits on a peer that waits to send. The collectives are direct:
    allgather and alltoall send to every peer; allreduce and reduce-scatter send each rank its share, which it reduces
    in rank order (the same bits wherever it runs), then the shares are gathered. That is fewer messages than a ring,
    and fine for the few hosts elastic worlds span."""

    carrier = "tcp"

    def __init__(self, sockets, rank, ranks, hosts, timeout_s, what="across hosts", door=None):
        self.sockets, self.rank, self.ranks, self.size = sockets, rank, list(ranks), len(ranks)
        self.hosts = list(hosts)
        self.timeout_s = timeout_s
        self.what = what
        self.door = door  # the tcp_connect.SetDoor that process sets across hosts connect through; None: they cannot
        self.broken = None  # why calls are refused: a wait failed, the streams are out of step

    def deadline(self):
        return time.monotonic() + self.timeout_s

    def close(self):
        for sock in self.sockets.values():
            sock.close()
        self.sockets = {}

    def subset(self, ranks, key, what):
        """A transport over `ranks` (job ranks of this transport, this rank among them): its own connections between
        them, made through the door within the deadline, which only they make, tagged by `key` (an int the same on
        all of them and distinct among the sets made at the same time)."""
        if self.door is None:
            raise NotSupportedError("%s: this world's ranks cannot connect to each other again" % what)
        me = self.ranks[self.rank]
        sockets = self.door.connect_set(ranks, me, key, self.timeout_s, what)
        return Tcp({ranks.index(r): sock for r, sock in sockets.items()}, ranks.index(me), ranks,
                   [self.hosts[self.ranks.index(r)] for r in ranks], self.timeout_s, what, self.door)

    def _name(self, peer):
        return "rank %d on %s" % (self.ranks[peer], self.hosts[peer])

    # ---- the one way bytes move: at most one message each way with each peer, all at once ----
    def _move(self, sends, receives, what, deadline=None, late=None):
        """sends: {peer: bytes-like}; receives: {peer: uint8 array to fill, or None for a new one}. Returns
        {peer: the received bytes (a uint8 array)}. Raises RankFailure when a peer's connection closes (it died
        or left), TimeoutError (or late()) at the deadline."""
        self.usable(what)
        deadline = self.deadline() if deadline is None else deadline
        outgoing = {}
        for peer, data in sends.items():
            body = memoryview(data).cast("B")
            outgoing[peer] = [memoryview(_LENGTH.pack(len(body))), body]
        incoming = {peer: _Incoming(buffer) for peer, buffer in receives.items()}
        done = {}
        selector = selectors.DefaultSelector()
        try:
            for peer in set(outgoing) | set(incoming):
                selector.register(self.sockets[peer], self._events(peer, outgoing, incoming), peer)
            while outgoing or incoming:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.broken = "%s timed out" % what
                    if late is not None:
                        raise late()
                    raise TimeoutError("%s: timed out after %.0f s waiting for %s (stuck, or in another collective; "
                                       "SHMCOMM_TIMEOUT sets the limit)" % (
                                           what, self.timeout_s,
                                           ", ".join(self._name(p) for p in sorted(set(outgoing) | set(incoming)))))
                for key, events in selector.select(min(remaining, 1.0)):
                    peer = key.data
                    try:
                        if events & selectors.EVENT_READ and peer in incoming and self._receive(peer,
                                                                                               incoming[peer]):
                            done[peer] = incoming.pop(peer).buffer
                        if events & selectors.EVENT_WRITE and peer in outgoing and self._send(peer, outgoing[peer]):
                            del outgoing[peer]
                    except OSError as error:  # reset, broken pipe, closed
                        self.broken = "%s lost %s" % (what, self._name(peer))
                        raise RankFailure("%s: %s closed its connection (it died or left the job): %s"
                                          % (what, self._name(peer), error), self.ranks[peer]) from None
                    events = self._events(peer, outgoing, incoming)
                    if events:
                        selector.modify(key.fileobj, events, peer)
                    else:
                        selector.unregister(key.fileobj)
        except ShmCommError:
            raise
        except BaseException:
            self.broken = "%s was interrupted" % what
            raise
        finally:
            selector.close()
        return done

    @staticmethod
    def _events(peer, outgoing, incoming):
        return (selectors.EVENT_WRITE if peer in outgoing else 0) | (selectors.EVENT_READ if peer in incoming else 0)

    def _send(self, peer, parts):
        """Sends what the socket takes now; True once the whole message is out."""
        sock = self.sockets[peer]
        while parts:
            try:
                n = sock.send(parts[0])
            except BlockingIOError:
                return False
            parts[0] = parts[0][n:]
            if len(parts[0]):
                return False
            parts.pop(0)
        return True

    def _receive(self, peer, message):
        """Receives what has arrived; True once the whole message is in."""
        sock = self.sockets[peer]
        try:
            while message.length is None:
                chunk = sock.recv(_LENGTH.size - len(message.head))
                if not chunk:
                    raise ConnectionResetError("connection closed")
                message.head += chunk
                if len(message.head) == _LENGTH.size:
                    self._start(peer, message, _LENGTH.unpack(message.head)[0])
            view = memoryview(message.buffer).cast("B")
            while message.got < message.length:
                n = sock.recv_into(view[message.got:message.length])
                if n == 0:
                    raise ConnectionResetError("connection closed")
                message.got += n
        except BlockingIOError:
            return False
        return True

    def _start(self, peer, message, length):
        if message.buffer is None:
            message.buffer = np.empty(length, np.uint8)
        elif length > message.buffer.nbytes:
            self.broken = "a message longer than expected"
            raise ShmCommError("%s: %s sent %d bytes where at most %d were expected (a collective out of step)"
                               % (self.what, self._name(peer), length, message.buffer.nbytes))
        message.buffer = message.buffer[:length]
        message.length = length

    def _peers(self):
        return [p for p in range(self.size) if p != self.rank]

    # ---- collectives (after the agreement) ----
    def allgatherv(self, src, nbytes, dst, sizes, tag, what):
        out = _bytes(dst, sum(sizes))
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        mine = _bytes(src, nbytes)
        self._move({p: mine for p in self._peers()}, {p: out[offsets[p]:offsets[p + 1]] for p in self._peers()},
                   what)
        out[offsets[self.rank]:offsets[self.rank + 1]] = mine

    def alltoallv(self, src, send_sizes, dst, recv_sizes, tag, what):
        into, out_of = _bytes(dst, sum(recv_sizes)), _bytes(src, sum(send_sizes))
        at_in = np.concatenate([[0], np.cumsum(recv_sizes)]).astype(int)
        at_out = np.concatenate([[0], np.cumsum(send_sizes)]).astype(int)
        self._move({p: out_of[at_out[p]:at_out[p + 1]] for p in self._peers()},
                   {p: into[at_in[p]:at_in[p + 1]] for p in self._peers()}, what)
        into[at_in[self.rank]:at_in[self.rank + 1]] = out_of[at_out[self.rank]:at_out[self.rank + 1]]

    def broadcast(self, src, dst, nbytes, root, tag, what):
        if self.rank == root:
            if dst != src:
                ffi.memmove(dst, src, nbytes)
            self._move({p: _bytes(dst, nbytes) for p in self._peers()}, {}, what)
        else:
            self._move({}, {root: _bytes(dst, nbytes)}, what)

    def barrier(self, what="barrier"):
        self._move({p: b"" for p in self._peers()}, {p: None for p in self._peers()}, what)

    def allgather_bytes(self, payload):
        got = self._move({p: payload for p in self._peers()}, {p: None for p in self._peers()}, "negotiation")
        return [bytes(payload) if r == self.rank else got[r].tobytes() for r in range(self.size)]

    def allgather_rows(self, row):
        """Every rank's int64 row (a description after a disagreement); None if that fails."""
        try:
            every = self.allgather_bytes(row.astype(np.int64).tobytes())
        except ShmCommError:
            return None
        return np.array([np.frombuffer(b, dtype=np.int64) for b in every])

    def allreduce(self, src, dst, count, dtype, op, prescale, postscale, divisor, tag, what):
        """Every rank reduces its share of the elements in rank order, then the shares are gathered. 16-bit floats
        are scaled, reduced and divided in float32 and rounded once, as the core does."""
        esize = kernels.itemsize(dtype)
        if dtype in kernels.HALF:
            work, work_dtype = kernels.widened(_bytes(src, count * esize), dtype), lib.SMC_FLOAT32
        else:
            if dst != src:
                ffi.memmove(dst, src, count * esize)
            work, work_dtype = _bytes(dst, count * esize), dtype
        work = work.view(np.uint8)
        shares = description.shares(count, self.size)
        mine = self._reduce_shares(work, count, work_dtype, shares, op, prescale, postscale, divisor, what)
        wsize = kernels.itemsize(work_dtype)
        self.allgatherv(ffi.from_buffer(mine), mine.nbytes, ffi.from_buffer(work), [s * wsize for s in shares],
                        tag, what)
        if dtype in kernels.HALF:
            kernels.narrow_into(_bytes(dst, count * esize), work.view(np.float32), dtype)

    def reducescatter(self, src, dst, counts, dtype, op, prescale, postscale, divisor, tag, what):
        """allreduce's first half: this rank's share, counts[rank] elements, into dst."""
        esize = kernels.itemsize(dtype)
        total = sum(counts)
        if dtype in kernels.HALF:
            work, work_dtype = kernels.widened(_bytes(src, total * esize), dtype), lib.SMC_FLOAT32
        else:
            work, work_dtype = _bytes(src, total * esize).copy(), dtype  # the input stays as it was
        mine = self._reduce_shares(work.view(np.uint8), total, work_dtype, list(counts), op, prescale, postscale,
                                   divisor, what)
        if dtype in kernels.HALF:
            kernels.narrow_into(_bytes(dst, counts[self.rank] * esize), mine.view(np.float32), dtype)
        else:
            _bytes(dst, mine.nbytes)[:] = mine

    def _reduce_shares(self, work, count, dtype, shares, op, prescale, postscale, divisor, what):
        """Sends rank r its share of `work` (uint8, `count` elements of `dtype`, scaled by prescale here), reduces
        what every rank sent for this rank's share in rank order, and scales it: returns it (uint8)."""
        esize = kernels.itemsize(dtype)
        kernels.scale(ffi.from_buffer(work), count, dtype, prescale)
        at = np.concatenate([[0], np.cumsum(shares)]).astype(int) * esize
        n = shares[self.rank]
        parts = np.empty((self.size, n * esize), np.uint8)
        self._move({p: work[at[p]:at[p + 1]] for p in self._peers()}, {p: parts[p] for p in self._peers()}, what)
        parts[self.rank] = work[at[self.rank]:at[self.rank + 1]]
        total = parts[0].copy()
        pair = ffi.new("void *[2]")
        for r in range(1, self.size):
            kernels.reduce_pair(ffi.from_buffer(total), ffi.from_buffer(total), ffi.from_buffer(parts[r]), n, dtype,
                                op, what, pair)
        kernels.scale(ffi.from_buffer(total), n, dtype, postscale, divisor)
        return total

    # ---- point to point ----
    def exchange(self, peer, send, send_bytes, recv, deadline, tag, late):
        """Sends send[:send_bytes] to `peer` and/or receives into `recv` from it (either may be None), by
        `deadline`; raises late() after it."""
        self._move({peer: send[:send_bytes]} if send is not None else {},
                   {peer: recv} if recv is not None else {}, self.what, deadline, late)

    def sendrecv(self, send, dest, recv, source, tag, what="ring allreduce"):
        """One ring step: send to `dest` while receiving from `source` (uint8 arrays)."""
        self._move({dest: send}, {source: recv}, what)
