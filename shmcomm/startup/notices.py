# SPDX-License-Identifier: Apache-2.0
"""What the multi-host launcher says about failed ranks while MPI starts (its side: runner/notice_server.py).

MPI's start waits for every rank of the job and cannot say which one is missing, and neither can the ranks' own
shared memory, which spans one host. The launcher sees each rank's guard report its death or a stop as it happens;
it passes that on to every rank connected here, and later the cause of a rank's failure. A rank listens from init
to shutdown, in a thread of its own, which tries the launcher's addresses in turn: the first that answers is one
its host can route to. Without the launcher (mpiexec started by hand, srun) nothing is heard and init says what it
can without."""
import json
import logging
import socket
import threading

from shmcomm.transport import handshake
from shmcomm.vocabulary.exceptions import AuthenticationError

_CONNECT_TIMEOUT_S = 2.0


class LauncherNotices:
    """Listens to the launcher at `addresses` ("ip:port,..." or None) until close(), once both ends proved they hold
    `secret`, the job's; passes each rank's cause of failure to on_cause(rank, cause)."""

    def __init__(self, addresses, on_cause, secret):
        self._on_cause = on_cause
        self.failed = None  # the first notice of a rank that died or exited
        self.stopped = None  # the first notice of a stopped rank
        self._sock = None
        self._closed = False
        self._lock = threading.Lock()
        if addresses and secret is not None:
            threading.Thread(target=self._listen, args=(addresses.split(","), secret), name="shmcomm-notices",
                             daemon=True).start()

    def _listen(self, addresses, secret):
        for address in addresses:
            host, _, port = address.rpartition(":")
            try:
                sock = socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S)
                handshake.prove(sock, secret, "the launcher's notice server")
            except AuthenticationError as error:  # init goes on without notices, and says why
                logging.getLogger("shmcomm").warning("%s", error)
                return
            except (OSError, ValueError):
                continue
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._sock = sock
            sock.settimeout(None)
            try:
                for line in sock.makefile("rb"):
                    self._take(json.loads(line))
            except (OSError, ValueError):
                pass
            return

    @property
    def listening(self):
        return self._sock is not None

    def _take(self, notice):
        if not isinstance(notice, dict) or not isinstance(notice.get("rank"), int):
            return
        if isinstance(notice.get("cause"), str):
            self._on_cause(notice["rank"], notice["cause"])
            return
        text = "rank %d on %s %s" % (notice["rank"], notice.get("host", "?"), notice.get("what", "failed"))
        if notice.get("stopped"):
            self.stopped = self.stopped or (notice["rank"], text)
        else:
            self.failed = self.failed or (notice["rank"], text)

    def close(self):
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
