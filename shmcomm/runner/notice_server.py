# SPDX-License-Identifier: Apache-2.0
"""The multi-host launcher's failure notices (the ranks' side is shmcomm/startup/notices.py): a TCP server every
rank connects to while MPI starts, on whatever host it runs.

Until MPI has started everywhere, a rank cannot learn from MPI which rank is missing: MPI_Init waits for all of them
and says nothing. The launcher can: each rank's guard (runner/rank_guard.py) prints a line when its rank dies, exits
or stays stopped, and those lines pass through the launcher, which sends them to every rank here; the ranks' init
then raises an error naming that rank instead of waiting out SHMCOMM_START_TIMEOUT."""
import json
import socket
import struct
import threading

from .elastic_server import accept_until_closed, hang_up, open_listener

_SEND_TIMEOUT_S = 2


class NoticeServer:
    """Sends each notice to every rank as one JSON line, {"rank": 3, "host": "h1", "what": "was killed by signal 9",
    "stopped": false}, and every notice so far to a rank that connects later. A rank's cause of failure, {"rank": 3,
    "cause": "ValueError: ..."}, goes out the same way for the errors of the others, whose hosts may not see its saved
    report. Ranks say nothing; a connection that closes is forgotten."""

    def __init__(self, secret, interfaces=None, hosts=()):
        self.listeners, self.addresses = open_listener(interfaces, hosts=hosts)
        self.lock = threading.Lock()
        self.notices = []  # every line sent so far, for ranks that connect later
        self.connections = set()
        self.closed = False
        accept_until_closed(self.listeners, self._serve, secret, "notice")

    def _serve(self, sock):
        """Sends the notices so far, then the new ones (publish), until the connection closes."""
        # A rank that stops reading (stopped, hung) must not hold up publish(), called as the job's output passes.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", _SEND_TIMEOUT_S, 0))
        with self.lock:
            if self.closed:
                sock.close()
                return
            self.connections.add(sock)
            for line in self.notices:
                self._send(sock, line)
        try:
            while sock.recv(4096):  # ranks say nothing: this returns when the connection closes
                pass
        except OSError:
            pass
        with self.lock:
            self.connections.discard(sock)
        sock.close()

    def _send(self, sock, line):
        """Called with the lock held. A rank that stopped reading is as good as gone."""
        try:
            sock.sendall(line)
        except OSError:
            self.connections.discard(sock)
            sock.close()

    def publish(self, rank, host, what, stopped=False):
        self._publish({"rank": rank, "host": host, "what": what, "stopped": stopped})

    def publish_cause(self, rank, cause):
        """Rank `rank` raised `cause` ("Type: message"), for the ranks' errors that name it (failure_reports.heard)."""
        self._publish({"rank": rank, "cause": cause})

    def _publish(self, notice):
        line = (json.dumps(notice) + "\n").encode()
        with self.lock:
            self.notices.append(line)
            for sock in list(self.connections):
                self._send(sock, line)

    def close(self):
        with self.lock:
            self.closed = True
            connections, self.connections = self.connections, set()
        hang_up(self.listeners)
        hang_up(connections)
