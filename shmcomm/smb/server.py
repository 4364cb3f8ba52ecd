# SPDX-License-Identifier: Apache-2.0
"""The box server: in every rank of a job that spans hosts, threads of the C core (csrc/net/box_server.c) that accept
connections from the ranks of the other hosts and apply their box operations to this host's arena, one thread per
connection, in the messages of wire.py.

Not MPI one-sided RMA (benchmarks/smb.py): MPI accumulates are not atomic against the home ranks' own writes under the
box's lock, and progress waits for the target to call MPI, while a thread asleep on its socket wakes when bytes arrive
and costs no core. In C: a Python server thread would wait for the interpreter lock, which a home rank computing in
Python gives up only every switch interval; the C threads serve alike whatever the home rank does."""
from shmcomm._native import check, ffi, lib


class BoxServer:
    """Listens on `listen` (an IPv4 address of this host; "0.0.0.0": every interface) and serves only clients that
    prove they hold `secret`, the job's (transport/handshake.py); `address` is (addresses, port) for the other hosts,
    `reachable` the addresses they may try when it listens on every interface.

    A box's lock is a robust, recursive pthread mutex owned by the thread that took it: a remote lock is taken and
    released by the connection's thread, so a client that dies holding it (its connection closed by its kernel) has
    its locks released and the box's version bumped, as for a local holder that dies. A client whose whole host
    vanished closes nothing; the server's TCP keepalive finds it gone within about 7 s of silence, with the same
    result."""

    def __init__(self, shm, timeout_s, secret, listen, reachable):
        self._timeout_s = timeout_s
        out = ffi.new("smc_box_server_t **")
        check(lib.smc_box_server_start(shm.handle, listen.encode(), secret, len(secret), out))
        self._server = out[0]
        self.address = (reachable if listen == "0.0.0.0" else [listen], int(lib.smc_box_server_port(self._server)))

    def close(self):
        """Stops accepting and ends every connection; waits (up to the timeout) for their threads to leave the arena,
        which is unmapped after this (a thread in a lock or version wait leaves when that wait ends)."""
        server, self._server = self._server, None
        if server is not None:
            lib.smc_box_server_stop(server, self._timeout_s)
