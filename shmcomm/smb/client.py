# SPDX-License-Identifier: Apache-2.0
"""Boxes on other hosts: where each host's box servers listen (BoxNetwork, learned once at init over MPI), and the
handle to one box in another host's arena (RemoteBoxHandle: box.BoxHandle's interface, each call one request to the
box's home host and its reply, wire.py).

Every reply is awaited with a deadline: SHMCOMM_TIMEOUT, plus the operation's own timeout for a lock or a version
wait. A home host whose connection closes or that does not answer in time makes the call raise HostFailure naming
it, and the handle refuses every later call."""
import socket
import threading
import time

from shmcomm._native import ffi, lib
from shmcomm.vocabulary.exceptions import HostFailure, InvalidArgumentError
from shmcomm.smb import wire
from shmcomm.transport import handshake, kernels
from shmcomm.smb.rollcall import name_silent_ranks

_CONNECT_TIMEOUT_S = 5.0  # per address tried; a host has few
# Exchanges of this many bytes or more stream (wire.FLAG_STREAM): below it one part is the whole exchange anyway, and
# a plain request can leave before this host's own stripes are done (stripes.StripedHandle._each).
STREAM_BYTES = 64 << 10


class BoxNetwork:
    """`servers[h]`: the (addresses, port) of each rank's box server on host h, in local rank order; `host_names[h]`
    and `host_ranks[h]`: what errors say of host h; `host`: this process's host; `local_rank`: which of a host's
    servers this process talks to (its own local rank, wrapped), so that a host's ranks share the serving;
    `secret`: the job's, which every connection proves."""

    def __init__(self, server, host, local_rank, servers, host_names, host_ranks, timeout_s, secret):
        self.server = server
        self.secret = secret
        self.host = host
        self.hosts = len(servers)
        self.local_rank = local_rank
        self.servers = servers
        self.host_names = host_names
        self.host_ranks = host_ranks
        self.timeout_s = timeout_s
        self.roll_call = None  # rollcall.RollCall of the job: a failing home host names the ranks that hold it up

    def describe(self, host):
        ranks = self.host_ranks[host]
        return "host %d (%s, ranks %s)" % (host, self.host_names[host], ", ".join(str(r) for r in ranks))

    def connect(self, host, what):
        """A connection to one of `host`'s box servers, both ends proven to be the job's (AuthenticationError
        otherwise), or HostFailure naming the host."""
        addresses, port = self.servers[host][self.local_rank % len(self.servers[host])]
        failures = []
        for address in addresses:
            try:
                sock = wire.tuned(socket.create_connection((address, port),
                                                           timeout=min(_CONNECT_TIMEOUT_S, self.timeout_s)))
            except OSError as error:
                failures.append("%s:%d: %s" % (address, port, error))
                continue
            handshake.prove(sock, self.secret, "%s: the box server of its home %s" % (what, self.describe(host)))
            return sock
        raise HostFailure("%s: cannot reach its home %s (%s)" % (what, self.describe(host), "; ".join(failures)
                                                                  or "it has no address"), host=self.host_names[host])

    def close(self):
        self.server.close()


class RemoteBoxHandle:
    """box.BoxHandle's interface for the box `name` whose home is `host` (a BoxNetwork's host index)."""

    def __init__(self, network, host, name, count=None, dtype=None, exist_ok=True, timeout_s=0.0):
        self._network = network
        self._host = host
        self._name = name
        self._what = "box '%s'" % name
        self._broken = None
        self._lock = threading.Lock()  # one request at a time on the connection
        self._sock = network.connect(host, self._what)
        self._reply = ffi.new("uint8_t[]", wire.REPLY.size)
        self._text = ffi.new("char[]", lib.SMC_WIRE_TEXT_BYTES)
        self.esize = 0
        encoded = name.encode()
        if count is not None:
            request = wire.REQUEST.pack(wire.CREATE, wire.FLAG_EXIST_OK if exist_ok else 0, len(encoded), dtype, 0,
                                        count, 0.0, 0.0, 0.0)
            reply = self._call(request + encoded, 0.0)
        else:
            request = wire.REQUEST.pack(wire.ATTACH, 0, len(encoded), 0, 0, 0, 0.0, 0.0, timeout_s)
            reply = self._call(request + encoded, timeout_s)
        _, self.count, self.dtype, flags = reply
        self.striped = bool(flags & wire.FLAG_STRIPED)
        self.esize = kernels.itemsize(self.dtype)

    @property
    def closed(self):
        """Closed by its user (a handle whose home failed is not: every call says why it fails)."""
        return self._sock is None and self._broken is None

    detached = False  # the connection, not this host's arena, is what it needs

    def _fail(self, why):
        self._broken = "%s: its home %s %s" % (self._what, self._network.describe(self._host), why)
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        error = HostFailure(self._broken, host=self._network.host_names[self._host])
        name_silent_ranks(error, self._network.roll_call)
        return error

    def _call(self, request, wait_s, payload=None, into=None):
        """Sends one request (and the elements it carries: payload, a (pointer, bytes) pair), awaits the reply (and
        the elements it carries, into `into`, another such pair): (version, count, dtype, flags)."""
        return self._receive(self._send(request, wait_s, payload), into)

    def _send(self, request, wait_s, payload=None):
        """The first half of _call; the connection is this caller's until _receive (the request's reply) is done.
        Returns the request's deadline."""
        self._lock.acquire()
        try:
            sock = self._usable()
            started = time.monotonic()
            deadline = (started, started + self._network.timeout_s + wait_s)
            ptr, nbytes = payload or (ffi.NULL, 0)
            self._check(lib.smc_box_send(sock.fileno(), request, len(request), ptr, nbytes, deadline[1] - started),
                        started)
            return deadline
        except BaseException:
            self._lock.release()
            raise

    def _receive(self, deadline, into=None):
        try:
            ptr, nbytes = into or (ffi.NULL, 0)
            left = max(deadline[1] - time.monotonic(), 0.0)
            self._check(lib.smc_box_receive(self._sock.fileno(), ptr, nbytes, left, self._reply, self._text,
                                            len(self._text)), deadline[0])
        finally:
            self._lock.release()
        return self._replied()

    def _exchange_streamed(self, request, ptr, nbytes):
        """An exchange whose d comes back while x still goes (wire.FLAG_STREAM), in one call into the core."""
        with self._lock:
            sock = self._usable()
            started = time.monotonic()
            self._check(lib.smc_box_exchange_streamed(sock.fileno(), request, len(request), ptr, nbytes,
                                                      self._network.timeout_s, self._reply, self._text,
                                                      len(self._text)), started)
        return self._replied()[0]

    def _usable(self):
        if self._sock is None:
            raise HostFailure(self._broken, host=self._network.host_names[self._host]) if self._broken else \
                InvalidArgumentError("%s is closed" % self._what)
        return self._sock

    def _check(self, rc, started):
        if rc == lib.SMC_WIRE_TIMEOUT:
            raise self._fail("did not answer within %.1f s (SHMCOMM_TIMEOUT sets the limit)"
                             % (time.monotonic() - started))
        if rc != 0:
            raise self._fail("closed the connection (the host or its rank is gone)")

    def _replied(self):
        """The reply's (version, count, dtype, flags), or the home's error raised."""
        status, _, version, count, dtype, flags = wire.REPLY.unpack(ffi.buffer(self._reply))
        if status != 0:
            class_name, _, message = ffi.string(self._text).decode("utf-8", "replace").partition("\n")
            raise wire.error_from(class_name, message)
        return version, count, dtype, flags

    def start(self, op, offset, count, ptr, alpha=1.0, beta=1.0, then_touch=None):
        """Sends a read, write, accumulate or exchange ("read", "write", "accumulate", "exchange") without waiting
        for its reply; the returned function waits for it (and returns the version). A striped box sends to all its
        hosts first. then_touch: the name of a box at the same home whose version the home bumps once this operation
        is done (and whose version comes back instead), in the same round trip. An exchange of STREAM_BYTES or more
        is done here, whole (its d streams back while its x goes, which needs both directions at once)."""
        nbytes = count * self.esize
        code = {"read": wire.READ, "write": wire.WRITE, "accumulate": wire.ACCUMULATE, "exchange": wire.EXCHANGE}[op]
        touch = then_touch.encode() if then_touch is not None and op != "read" else b""
        streamed = op == "exchange" and nbytes >= STREAM_BYTES
        flags = (wire.FLAG_THEN_TOUCH if touch else 0) | (wire.FLAG_STREAM if streamed else 0)
        request = wire.REQUEST.pack(code, flags, len(touch), 0, offset, count, alpha, beta, 0.0) + touch
        if streamed:
            version = self._exchange_streamed(request, ptr, nbytes)
            return lambda: version
        deadline = self._send(request, 0.0, (ptr, nbytes) if count and op != "read" else None)
        into = (ptr, nbytes) if count and op in ("read", "exchange") else None
        return lambda: self._receive(deadline, into)[0]

    def _simple(self, op, offset=0, count=0, alpha=0.0, beta=0.0, timeout_s=0.0, payload=None, into=None):
        request = wire.REQUEST.pack(op, 0, 0, 0, offset, count, alpha, beta, timeout_s)
        return self._call(request, timeout_s, payload, into)[0]

    def version(self):
        return self._simple(wire.VERSION)

    def data(self, nbytes):
        raise InvalidArgumentError("%s lives on %s: view() needs the box's memory on this host; read() copies it "
                                   "here" % (self._what, self._network.describe(self._host)))

    def read(self, offset, count, dst):
        self._simple(wire.READ, offset, count, into=(dst, count * self.esize) if count else None)

    def write(self, offset, count, src):
        return self._simple(wire.WRITE, offset, count, payload=(src, count * self.esize) if count else None)

    def accumulate(self, offset, count, src, alpha, beta):
        return self._simple(wire.ACCUMULATE, offset, count, alpha, beta,
                            payload=(src, count * self.esize) if count else None)

    def exchange(self, offset, count, x_to_d, alpha):
        """box.BoxHandle.exchange at the home: x goes, d comes back into the same buffer."""
        return self.start("exchange", offset, count, x_to_d, alpha)()

    def touch(self):
        """Bumps the version without changing an element."""
        return self._simple(wire.TOUCH)

    def lock(self, timeout_s):
        self._simple(wire.LOCK, timeout_s=timeout_s)

    def unlock(self):
        self._simple(wire.UNLOCK)

    def wait_version(self, version, timeout_s):
        return self._simple(wire.WAIT, version, timeout_s=timeout_s)

    def close(self):
        if self._sock is not None:
            try:
                self._simple(wire.CLOSE)
            except Exception:  # the home host is gone: nothing to tell it
                pass
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def destroy(self):
        self._simple(wire.DESTROY)
        self._sock.close()
        self._sock = None
