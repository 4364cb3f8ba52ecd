# SPDX-License-Identifier: Apache-2.0
"""The elastic launcher's side of the membership (the workers' side: startup/membership.py): a TCP server every
worker connects to, on whatever host it runs.

A worker's first line says who it is and where its peers reach it; from then on it is ready, and the launcher may
put it in the next membership. The launcher sends every membership record to every connected worker (and the newest
one to a worker that connects later). A worker whose connection closes is gone, whatever its launcher-side process
(ssh, a launcher agent) says."""
import errno
import json
import socket
import threading

from shmcomm.startup.addresses import interface_addresses, source_address


def local_addresses(interfaces=None):
    """This machine's IPv4 addresses (of `interfaces` only, if given), loopback last: the workers try them in turn,
    and the first that answers is one their host can route to."""
    found = interface_addresses(interfaces)
    return found if interfaces or "127.0.0.1" in found else found + ["127.0.0.1"]


def reaching(hosts):
    """The addresses of this machine that route to `hosts` (names or addresses), or None when one of them does not
    resolve here (a name only ssh knows, say)."""
    found = set()
    for host in hosts:
        try:
            source = source_address(socket.gethostbyname(host))
        except OSError:
            return None
        if source is None:
            return None
        found.add(source)
    return sorted(found)


def open_listener(interfaces=None, local_only=False, hosts=()):
    """(TCP listeners, one port, and their addresses "ip:port" in the order clients should try them): on loopback
    when the whole job is on this host (local_only), on the addresses of the named `interfaces`, else on the
    addresses that reach the other `hosts`, else, where one of them does not resolve here, on every interface."""
    where = ["127.0.0.1"] if local_only else local_addresses(interfaces) if interfaces else reaching(hosts)
    listeners, port = _bind_all(where or [""])
    return listeners, ["%s:%d" % (a, port) for a in where or local_addresses()]


def _bind_all(addresses, tries=20):
    """(listening sockets on `addresses`, their one port: the one the system picks for the first)."""
    for _ in range(tries):
        listeners = []
        try:
            for address in addresses:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listeners.append(listener)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((address, listeners[0].getsockname()[1] if len(listeners) > 1 else 0))
                listener.listen(1024)
            return listeners, listeners[0].getsockname()[1]
        except OSError as error:
            hang_up(listeners)
            if error.errno != errno.EADDRINUSE:  # the port the first got is taken on another address: try again
                raise
    raise OSError(errno.EADDRINUSE, "no port free on every one of %s" % ", ".join(addresses))


def accept_until_closed(listeners, serve, secret, name):
    """Accepts connections on `listeners` in a thread each until they are closed; each connection that proves it
    holds `secret` (transport/handshake.py) is served by serve(sock), in a thread of its own."""
    from shmcomm.transport import handshake  # here: the launcher's report of a build without the C core imports this

    def admit_and_serve(sock):
        if handshake.admit(sock, secret, "the launcher's %s server" % name):
            serve(sock)

    def accept(listener):
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=admit_and_serve, args=(sock,), name=name, daemon=True).start()
    for listener in listeners:
        threading.Thread(target=accept, args=(listener,), name=name + "-accept", daemon=True).start()


def hang_up(sockets):
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


class MembershipServer:
    """Serves the workers that prove they hold `secret`, the job's, on `interfaces` (open_listener)."""

    def __init__(self, secret, interfaces=None, local_only=False):
        self.listeners, self.addresses = open_listener(interfaces, local_only)
        self.lock = threading.Lock()
        self.workers = {}  # worker id -> {"address", "host", "pid"} once it said hello
        self.connections = {}  # worker id -> socket
        self.gone = set()  # workers whose connection closed
        self.record = None
        self.closed = False
        accept_until_closed(self.listeners, self._serve, secret, "membership")

    def _serve(self, sock):
        """Reads the worker's hello, then waits for its connection to close."""
        wid = None
        try:
            reader = sock.makefile("rb")
            hello = json.loads(reader.readline() or b"null")
            if not isinstance(hello, dict) or not isinstance(hello.get("worker"), int):
                sock.close()
                return
            wid = hello["worker"]
            with self.lock:
                self.workers[wid] = hello
                self.connections[wid] = sock
                if self.record is not None:
                    self._send(wid, sock, self.record)
            while reader.read(4096):  # workers say nothing more: this returns when the connection closes
                pass
        except (OSError, ValueError):
            pass
        finally:
            with self.lock:
                if wid is not None:
                    self.gone.add(wid)
                    self.connections.pop(wid, None)
            sock.close()

    def _send(self, wid, sock, record):
        try:
            sock.sendall((json.dumps(record) + "\n").encode())
        except OSError:  # a worker that stopped reading: it is as good as gone
            self.gone.add(wid)
            self.connections.pop(wid, None)
            sock.close()

    def ready(self, wid):
        with self.lock:
            return wid in self.workers and wid not in self.gone

    def address_of(self, wid):
        return self.workers[wid]["address"]

    def publish(self, record):
        with self.lock:
            self.record = record
            for wid, sock in list(self.connections.items()):
                self._send(wid, sock, record)

    def close(self):
        self.closed = True
        hang_up(self.listeners)
        with self.lock:
            hang_up(self.connections.values())
            self.connections = {}
