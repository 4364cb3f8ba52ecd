# SPDX-License-Identifier: Apache-2.0
"""How the ranks of a job that met without MPI connect over TCP: the world's mesh when the world forms (connect_mesh),
and later the members of a process set that spans hosts (SetDoor), through the same listeners. Every connection
first proves both ends hold the job's secret (handshake.py), then says which world, rank and set it is for."""
import socket
import struct
import threading
import time

from shmcomm.smb.wire import tuned  # small messages at once, big buffers for megabytes
from shmcomm.transport import handshake
from shmcomm.vocabulary.exceptions import AbandonedError, TimeoutError

_HELLO = struct.Struct("<64sQ")  # the world's token, the connecting rank
_SET_HELLO = struct.Struct("<64sQQ")  # "set " and the world's token, the connecting rank, the set's key


def connect_mesh(listener, addresses, rank, token, secret, timeout_s, superseded=lambda: None):
    """The sockets to every other rank of a world ({rank: socket}): this rank connects to the lower ranks and
    accepts the higher ones on `listener` (its own, whose address is addresses[rank]), in a thread that admits them
    from the start, so that no rank's handshake waits for its peer to finish connecting. Every connection first
    proves both ends hold `secret`, the job's (handshake.py); one from an older world (another token) is then
    closed. Raises TimeoutError naming the ranks that did not connect in time, or AbandonedError as soon as
    superseded() says why this world will not form (a newer membership came)."""
    deadline = time.monotonic() + timeout_s
    sockets, accepted, stop = {}, {}, threading.Event()
    acceptor = threading.Thread(target=_accept_higher, args=(listener, rank, len(addresses), token, secret, deadline,
                                                             accepted, stop), name="shmcomm-mesh", daemon=True)
    acceptor.start()
    try:
        for peer in range(rank):
            sockets[peer] = _connect_lower(addresses, rank, peer, token, secret, deadline, timeout_s, superseded)
        while acceptor.is_alive():
            acceptor.join(min(0.5, max(0.01, deadline - time.monotonic())))
            _check_superseded(superseded)
        sockets.update(accepted)
        if len(sockets) < len(addresses) - 1:
            missing = [r for r in range(len(addresses)) if r != rank and r not in sockets]
            raise TimeoutError("rank %d: ranks %s did not connect within %.0f s" % (rank, missing, timeout_s))
    except BaseException:
        stop.set()
        acceptor.join()  # it wakes within its accept's timeout or its handshake's: the listener is then free
        for sock in list(sockets.values()) + list(accepted.values()):
            sock.close()
        raise
    for sock in sockets.values():
        sock.setblocking(False)
    return sockets


def _connect_lower(addresses, rank, peer, token, secret, deadline, timeout_s, superseded):
    host, port = addresses[peer].rsplit(":", 1)
    while True:
        try:
            sock = tuned(socket.create_connection((host, int(port)), timeout=_step(deadline)))
            handshake.prove(sock, secret, "rank %d (for rank %d)" % (peer, rank), _step(deadline))
            sock.sendall(_HELLO.pack(token.encode(), rank))
            return sock
        except (OSError, TimeoutError) as error:  # the peer is not listening yet, or too busy to answer
            _check_superseded(superseded)
            if time.monotonic() > deadline:
                raise TimeoutError("rank %d could not connect to rank %d at %s within %.0f s: %s"
                                   % (rank, peer, addresses[peer], timeout_s, error)) from None
            time.sleep(0.05)


def _accept_higher(listener, rank, size, token, secret, deadline, accepted, stop):
    """Admits the ranks above `rank` into `accepted` ({rank: socket}) until all came, `stop` is set or the deadline
    passed."""
    while len(accepted) < size - 1 - rank and not stop.is_set() and time.monotonic() < deadline:
        listener.settimeout(min(0.5, max(0.01, deadline - time.monotonic())))
        try:
            sock, _ = listener.accept()
        except OSError:  # no one in this slice (or the listener closed: the deadline ends the loop)
            continue
        if not handshake.admit(tuned(sock), secret, "rank %d's listener for its peers" % rank, _step(deadline)):
            continue
        sock.settimeout(_step(deadline))
        try:
            got = _recv_exactly(sock, _HELLO.size)
        except OSError:
            got = None
        peer = _HELLO.unpack(got)[1] if got is not None else -1
        if got is None or got[:64].rstrip(b"\0") != token.encode() or not rank < peer < size or peer in accepted:
            sock.close()  # a straggler of an older world
            continue
        accepted[peer] = sock


def _step(deadline):
    """How long one connection attempt or hello may take: short, so that a silent peer does not hold up the rest."""
    return min(5.0, max(0.1, deadline - time.monotonic()))


def _check_superseded(superseded):
    reason = superseded()
    if reason:
        raise AbandonedError(reason)


def _recv_exactly(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class SetDoor:
    """This rank's way to the other ranks of its world once the world has formed: the members of a process set that
    spans hosts connect to each other through their world listeners (`listener`, its own; `addresses` by job rank),
    each connecting to the members below it and admitting those above it. A connection says its set's key; one for a
    set this rank is not making yet (sets are made in any order, on several threads) waits here until it does."""

    def __init__(self, listener, addresses, token, secret):
        self._listener, self._addresses, self._token, self._secret = listener, addresses, token, secret
        self._waiting = {}  # {(key, job rank): socket} admitted, for a set not made yet
        self._lock = threading.Lock()  # one thread accepts at a time, for every set

    def close(self):
        """Closes the connections admitted for sets that were never made."""
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), {}
        for sock in waiting:
            sock.close()

    def connect_set(self, members, rank, key, timeout_s, what):
        """The sockets to every other member of the set `key` ({job rank: socket}), `rank` being this one's.

        Raises:
            TimeoutError: naming the members not connected within timeout_s.
            AuthenticationError: a member below this one does not hold the job's secret, or this rank does not.
        """
        deadline = time.monotonic() + timeout_s
        sockets = {}
        try:
            for peer in (m for m in members if m < rank):
                sockets[peer] = self._connect(peer, rank, key, deadline, what)
            higher = [m for m in members if m > rank]
            while not all((key, peer) in self._waiting for peer in higher) and time.monotonic() < deadline:
                with self._lock:
                    self._admit_one(rank, deadline)
            with self._lock:
                for peer in higher:
                    if (key, peer) in self._waiting:
                        sockets[peer] = self._waiting.pop((key, peer))
            missing = [m for m in members if m != rank and m not in sockets]
            if missing:
                raise TimeoutError("%s: rank %d: ranks %s did not connect within %.0f s" % (what, rank, missing,
                                                                                          timeout_s))
        except BaseException:
            for sock in sockets.values():
                sock.close()
            raise
        for sock in sockets.values():
            sock.setblocking(False)
        return sockets

    def _connect(self, peer, rank, key, deadline, what):
        """A connection to the lower member `peer` for set `key`, once it has said it took it (a byte back)."""
        host, port = self._addresses[peer].rsplit(":", 1)
        while True:
            try:
                sock = tuned(socket.create_connection((host, int(port)), timeout=_step(deadline)))
                try:
                    handshake.prove(sock, self._secret, "rank %d (for rank %d, %s)" % (peer, rank, what),
                                    _step(deadline))
                    sock.sendall(_SET_HELLO.pack(b"set " + self._token.encode(), rank, key))
                    if _recv_exactly(sock, 1) == b"\1":
                        return sock
                except BaseException:
                    sock.close()
                    raise
                sock.close()  # not taken: the peer's acceptor was one of an older world's
            except (OSError, TimeoutError):  # the peer is not listening, or too busy to answer
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("%s: rank %d could not connect to rank %d at %s in time"
                                   % (what, rank, peer, self._addresses[peer]))
            time.sleep(0.05)

    def _admit_one(self, rank, deadline):
        """Admits one connection (or none, in a short slice) into the waiting ones."""
        self._listener.settimeout(min(0.2, max(0.01, deadline - time.monotonic())))
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        if not handshake.admit(tuned(sock), self._secret, "rank %d's listener for its peers" % rank, _step(deadline)):
            return
        try:
            sock.settimeout(_step(deadline))
            got = _recv_exactly(sock, _SET_HELLO.size)
            hello = _SET_HELLO.unpack(got) if got is not None else None
            if hello is None or hello[0].rstrip(b"\0") != b"set " + self._token.encode() or hello[1] <= rank:
                sock.close()  # a straggler of an older world, or of its forming
                return
            sock.sendall(b"\1")
        except OSError:
            sock.close()
            return
        old = self._waiting.pop((hello[2], hello[1]), None)
        if old is not None:
            old.close()  # that peer gave up on it and connected again
        self._waiting[(hello[2], hello[1])] = sock
