# SPDX-License-Identifier: Apache-2.0
"""The box server: in every rank of a job that spans hosts, a thread that accepts connections from the ranks of the
other hosts and applies their box operations to this host's arena with the C core (box.BoxHandle), one thread per
connection.

Why a server thread and not MPI one-sided RMA (measured in benchmarks/smb.py, figures in benchmarks/RESULTS.md):
- MPI accumulates are atomic only against other MPI accumulates of the same op and datatype; the home host's own
  ranks write through the box's lock in shared memory, which no MPI_Accumulate respects, and beta != 1 has no
  predefined MPI op at all. The server applies every operation under the same lock as the local ranks.
- MPICH applies a passive-target accumulate that falls back to active messages only when the target enters MPI, and
  the home host's ranks are computing, not calling MPI. A server thread sleeping in the kernel on its socket wakes
  as soon as bytes arrive; cffi's calls and socket calls give up the GIL, so it runs while numpy computes.
- A thread blocked in MPI's own wait polls a core, which ranks oversubscribing two cores cannot spare; a socket wait
  costs nothing while no request comes, and a dead peer is seen as a closed connection, not as an MPI hang.

The servers are Python threads: they need the GIL between the C calls and the socket calls, which run without it.
numpy and shmcomm's own waits give it up; mpi4py's pickle-based calls (comm.allreduce, lowercase) keep it while they
wait, so a rank blocked in one serves nothing until it returns: use the buffer calls (comm.Allreduce) in a job that
uses boxes across hosts.

What a small operation costs (4 KiB, 2 simulated hosts of one core each, benchmarks/smb.py): one round trip, about
0.04-0.05 ms, against 0.03 ms for MPI's whole two-rank allreduce, whose progress spins in the caller while this
server sleeps in the kernel and wakes per request. Shortening the interpreter's switch interval (sys.setswitchinterval
1e-4) changed nothing: the time is the Python work and the wake-ups at both ends, not waits for the GIL. With both
hosts exchanging at once each host's one core also serves the other's request (0.10 ms). What remains to gain is a
server in C that needs no interpreter at all.

The lock of a box is a robust, recursive pthread mutex: owned by the thread that took it. A remote lock is taken by
the connection's thread and released by it, so it is released when the connection ends too: a client that dies
holding a box lock (its process gone, its connection closed by its kernel) has its locks released and the box's
version bumped, as the C core does for a local holder that dies."""
import fcntl
import socket
import struct
import threading

import numpy as np

from shmcomm._native import ffi
from shmcomm.exceptions import ShmCommError
from shmcomm.transport import box_wire as wire
from shmcomm.transport import kernels
from shmcomm.transport.box import BoxHandle, find_box

_SIOCGIFADDR = 0x8915


def interface_addresses():
    """This host's IPv4 addresses other than loopback, by interface: where the other hosts may reach it."""
    found = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            if name == "lo":
                continue
            try:
                raw = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            found.append(socket.inet_ntoa(raw[20:24]))
    finally:
        probe.close()
    return found


class BoxServer:
    """Listens on every interface; `address` is (addresses, port) for the other hosts."""

    def __init__(self, shm, timeout_s):
        self._shm = shm
        self._timeout_s = timeout_s
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("0.0.0.0", 0))
        self._listener.listen(128)
        self.address = (interface_addresses(), self._listener.getsockname()[1])
        self._connections = {}  # socket: its thread
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="shmcomm-box-server", daemon=True)
        self._thread.start()

    def _accept(self):
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # closed: shutdown
                return
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                thread = threading.Thread(target=self._serve, args=(wire.tuned(sock),), name="shmcomm-box-client",
                                          daemon=True)
                self._connections[sock] = thread
            thread.start()

    def close(self):
        """Stops accepting and ends every connection; waits for the threads to leave the arena, which is unmapped
        after this (a thread in a lock or version wait leaves when that wait ends)."""
        with self._lock:
            self._closed = True
            connections = list(self._connections.items())
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for sock, _ in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(self._timeout_s)
        for _, thread in connections:
            thread.join(self._timeout_s)

    # ---- one client's connection ----
    def _serve(self, sock):
        session = _Session(self._shm)
        try:
            head = bytearray(wire.REQUEST.size)
            while wire.recv_exactly(sock, memoryview(head)):
                request = wire.REQUEST.unpack(head)
                reply = session.apply(sock, request)
                if reply is None:  # the client went away in the middle of its request
                    break
                wire.send_parts(sock, reply)
                if request[0] in (wire.CLOSE, wire.DESTROY, wire.PING):
                    break
        except OSError:  # the connection broke: the client or its host is gone
            pass
        finally:
            session.end()
            with self._lock:
                self._connections.pop(sock, None)
            sock.close()


class _Session:
    """What one connection holds: its box handle, and how many times it holds the box's lock."""

    def __init__(self, shm):
        self.shm = shm
        self.box = None
        self.esize = 0
        self.held = 0
        self.touched = {}  # name: handle of each box this connection bumped after an operation (FLAG_THEN_TOUCH)

    def apply(self, sock, request):
        """The reply to one request: (header and text, payload or None); None if the client left mid-request."""
        op, flags, name_len, dtype, offset, count, alpha, beta, timeout_s = request
        name = wire.recv_bytes(sock, name_len) if name_len else b""
        if name is None:
            return None
        payload = None
        if op in wire.CARRY_ELEMENTS:
            payload = np.empty(count * self.esize, dtype=np.uint8)
            if not wire.recv_exactly(sock, memoryview(payload)):
                return None  # nothing of a half-received write is applied
        try:
            if op in wire.CARRY_ELEMENTS and flags & wire.FLAG_THEN_TOUCH:
                reply, out = self._apply(op, 0, "", dtype, offset, count, alpha, beta, timeout_s, payload)
                version = self._touch(name.decode())
                return wire.REPLY.pack(0, 0, version, *wire.REPLY.unpack(reply)[3:]), out
            return self._apply(op, flags, name.decode(), dtype, offset, count, alpha, beta, timeout_s, payload)
        except ShmCommError as error:
            return wire.error_reply(error), None

    def _touch(self, name):
        """Bumps the version of the box `name` of this arena (a striped box's description, after its home stripe's
        part of an operation: the last part, so that the bump still says every stripe is done)."""
        box = self.touched.get(name)
        if box is None:
            box = self.touched[name] = BoxHandle(self.shm, name, timeout_s=0.0)
        return box.touch()

    def _apply(self, op, flags, name, dtype, offset, count, alpha, beta, timeout_s, payload):
        version, out, striped = 0, None, 0
        if op == wire.PING:  # a roll call (rollcall.py): this rank is here
            return wire.REPLY.pack(0, 0, 0, 0, 0, 0), None
        if op in (wire.CREATE, wire.ATTACH):
            if self.box is not None:
                raise ShmCommError("box server: this connection holds a box already")
            if op == wire.CREATE:
                self.box = BoxHandle(self.shm, name, count, dtype, exist_ok=bool(flags & wire.FLAG_EXIST_OK))
            else:
                self.box, is_striped = find_box(self.shm, name, timeout_s)
                striped = wire.FLAG_STRIPED if is_striped else 0
            self.esize = kernels.itemsize(self.box.dtype)
            count, dtype = self.box.count, self.box.dtype
        elif self.box is None:
            raise ShmCommError("box server: no box is open on this connection")
        elif op == wire.READ:
            out = np.empty(count * self.esize, dtype=np.uint8)
            self.box.read(offset, count, ffi.from_buffer(out))
        elif op in wire.CARRY_ELEMENTS:
            ptr = ffi.from_buffer(payload) if count else ffi.NULL
            if op == wire.WRITE:
                version = self.box.write(offset, count, ptr)
            elif op == wire.ACCUMULATE:
                version = self.box.accumulate(offset, count, ptr, alpha, beta)
            else:  # the payload becomes d, which goes back
                version = self.box.exchange(offset, count, ptr, alpha)
                out = payload
        elif op == wire.TOUCH:
            version = self.box.accumulate(0, 0, ffi.NULL, 1.0, 1.0)
        elif op == wire.LOCK:
            self.box.lock(timeout_s)
            self.held += 1
        elif op == wire.UNLOCK:
            self.box.unlock()
            self.held -= 1
        elif op == wire.WAIT:
            version = self.box.wait_version(offset, timeout_s)
        elif op == wire.DESTROY:
            self._release()
            box, self.box = self.box, None
            box.destroy()
        elif op == wire.CLOSE:
            self.end()
        if op not in (wire.WAIT, wire.TOUCH) + wire.CARRY_ELEMENTS and self.box is not None:
            version = self.box.version()
        return wire.REPLY.pack(0, 0, version, count, dtype, striped), out

    def _release(self):
        """Locks the client still held when it left: the version bumped so that readers can tell, then released.
        The bump comes first, under the lock (recursive, and held by this connection's thread): bumped after the
        unlock, a waiting writer would get in before it, and the version would no longer say where the lost
        holder's work ended."""
        if self.box is None or self.held <= 0:
            return
        self.box.accumulate(0, 0, ffi.NULL, 1.0, 1.0)
        while self.held > 0:
            self.box.unlock()
            self.held -= 1

    def end(self):
        for box in self.touched.values():
            box.close()
        self.touched.clear()
        if self.box is not None:
            try:
                self._release()
            except ShmCommError:  # the arena is gone (shutdown): nothing left to release
                pass
            self.box.close()
            self.box = None

