# SPDX-License-Identifier: Apache-2.0
"""The box server: in every rank of a job that spans hosts, threads of the C core (csrc/net/box_server.c) that accept
connections from the ranks of the other hosts and apply their box operations to this host's arena, one thread per
connection, in the messages of wire.py.

Why a server thread and not MPI one-sided RMA (measured in benchmarks/smb.py, figures in benchmarks/RESULTS.md):
- MPI accumulates are atomic only against other MPI accumulates of the same op and datatype; the home host's own
  ranks write through the box's lock in shared memory, which no MPI_Accumulate respects, and beta != 1 has no
  predefined MPI op at all. The server applies every operation under the same lock as the local ranks.
- MPICH applies a passive-target accumulate that falls back to active messages only when the target enters MPI, and
  the home host's ranks are computing, not calling MPI. A server thread sleeping in the kernel on its socket wakes
  as soon as bytes arrive.
- A thread blocked in MPI's own wait polls a core, which ranks oversubscribing two cores cannot spare; a socket wait
  costs nothing while no request comes, and a dead peer is seen as a closed connection, not as an MPI hang.

Why in C: a server thread written in Python needs the interpreter lock several times per request, and a rank that
computes in Python (a training loop of small torch operations) gives that lock up only every switch interval (5 ms).
With such a home rank a remote 4 KiB exchange took 20.6 ms through a Python server thread, against 0.07 ms with the
home rank idle (benchmarks/RESULTS.md, "The box server without the interpreter"). The C threads never touch the
interpreter: they serve at the same speed whatever the home rank's Python does.

The lock of a box is a robust, recursive pthread mutex: owned by the thread that took it. A remote lock is taken by
the connection's thread and released by it, so it is released when the connection ends too: a client that dies
holding a box lock (its process gone, its connection closed by its kernel) has its locks released and the box's
version bumped, as the C core does for a local holder that dies. A client whose whole host vanished closes nothing;
the server's TCP keepalive finds it gone within about 7 s of silence, with the same result."""
import fcntl
import socket
import struct

from shmcomm._native import check, ffi, lib

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
        self._timeout_s = timeout_s
        out = ffi.new("smc_box_server_t **")
        check(lib.smc_box_server_start(shm.handle, out))
        self._server = out[0]
        self.address = (interface_addresses(), int(lib.smc_box_server_port(self._server)))

    def close(self):
        """Stops accepting and ends every connection; waits (up to the timeout) for their threads to leave the arena,
        which is unmapped after this (a thread in a lock or version wait leaves when that wait ends)."""
        server, self._server = self._server, None
        if server is not None:
            lib.smc_box_server_stop(server, self._timeout_s)
