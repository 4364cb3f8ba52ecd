# SPDX-License-Identifier: Apache-2.0
"""Who is holding a job up, across hosts: a roll call that every rank's box server answers.

A rank whose wait across hosts times out knows only whom it waited for, often a rank that waits in turn for the one
that stopped. Before it raises, it pings every other rank's box server (server.py: C threads that answer whatever the
rank is doing), over TCP, not MPI, whose library may crash when a peer process is gone. A process stopped or frozen
(SIGSTOP, a debugger) does not answer, a gone one refuses the connection: both are named in the error. A process that
found ranks stopped exits with code 1 without MPI_Finalize, where MPICH would wait for them for ever
(exit_without_finalize), and the launcher stops the job."""
import atexit
import errno
import os
import socket
import sys
import threading
import time

from shmcomm.smb import wire
from shmcomm.transport import handshake
from shmcomm.vocabulary.exceptions import AuthenticationError, TimeoutError

_GRACE_S = 1.0  # how long a roll call waits for answers; a server thread answers within milliseconds
SILENT, GONE = "does not answer", "is gone"


class RollCall:
    """`network`: the job's client.BoxNetwork (where every rank's box server listens); `rank`: this one's."""

    def __init__(self, network, rank):
        self.rank = rank
        self.secret = network.secret
        self.servers = {}  # job rank: (addresses, port)
        for host, ranks in enumerate(network.host_ranks):
            for local, job_rank in enumerate(ranks):
                self.servers[job_rank] = network.servers[host][local]
        self.silent = []  # the ranks a roll call found silent (stopped or hung)

    def check(self, grace_s=_GRACE_S):
        """{rank: SILENT or GONE} for the other ranks that do not answer within grace_s. A rank hung in its own code
        still answers (its server's threads never need the interpreter): the ranks that wait for it name it. Each
        rank is asked in a thread of its own, through the job's handshake, so all are asked at once."""
        deadline = time.monotonic() + grace_s
        answers = {}
        askers = []
        for rank, (addresses, port) in self.servers.items():
            if rank == self.rank:
                continue
            if not addresses:
                answers[rank] = GONE
                continue
            asker = threading.Thread(target=self._ask, args=(rank, addresses[0], port, deadline, answers),
                                     name="shmcomm-roll-call", daemon=True)
            asker.start()
            askers.append((rank, asker))
        for rank, asker in askers:
            asker.join(max(0.0, deadline - time.monotonic()) + 0.1)
        states = {rank: answers.get(rank, SILENT) for rank in self.servers if rank != self.rank}  # SILENT: no word
        failed = {rank: state for rank, state in states.items() if state is not None}
        self.silent = sorted(set(self.silent) | {r for r, state in failed.items() if state == SILENT})
        return dict(sorted(failed.items()))

    def _ask(self, rank, address, port, deadline, answers):
        """answers[rank]: None once rank's server answered a ping, GONE if it refused or closed, SILENT if it did
        not answer by `deadline`."""
        try:
            with socket.create_connection((address, port), timeout=max(0.01, deadline - time.monotonic())) as sock:
                handshake.prove(sock, self.secret, "rank %d's box server" % rank,
                                max(0.01, deadline - time.monotonic()))
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                sock.sendall(wire.REQUEST.pack(wire.PING, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0))
                got = b""
                while len(got) < wire.REPLY.size:
                    data = sock.recv(wire.REPLY.size - len(got))
                    if not data:
                        raise OSError(errno.ECONNRESET, "closed")
                    got += data
            answers[rank] = None
        except (socket.timeout, TimeoutError):
            answers[rank] = SILENT
        except (OSError, AuthenticationError):
            answers[rank] = GONE

    def why_not_finalize(self):
        """Why this process must not call MPI_Finalize (a roll call found ranks stopped or hung: MPICH's finalize
        would wait for them for ever), or None. Ranks found gone may have ended well and wait in MPI_Finalize
        themselves; one that was killed makes hydra stop the job anyway."""
        if self.silent:
            return "rank(s) %s did not answer" % ", ".join(map(str, self.silent))
        return None


def exit_without_finalize(why):
    """At exit (registered after mpi4py's import, so it runs before MPI_Finalize): if why() says why MPI_Finalize
    would wait for ever, flushes the output and exits with code 1 instead."""
    def check():
        reason = why()
        if reason is None:
            return
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.write(2, ("shmcomm: exiting with code 1 without MPI_Finalize, which would wait for every rank: %s\n"
                     % reason).encode())
        os._exit(1)
    atexit.register(check)


def name_silent_ranks(error, roll_call):
    """Adds to an error (a timeout, a host that failed) the ranks that do not answer a roll call, once (nested calls
    see it done); a RankFailure naming no rank names the failed one, if it is one."""
    if roll_call is None or getattr(error, "roll_called", False):
        return
    error.roll_called = True
    failed = roll_call.check()
    if failed and error.args:
        error.args = (str(error.args[0]) + describe(failed),) + error.args[1:]
        if len(failed) == 1 and getattr(error, "rank", 0) is None:
            error.rank = next(iter(failed))


def describe(failed):
    """The sentence an error adds about ranks that did not answer a roll call ({rank: SILENT or GONE})."""
    silent = [r for r, state in failed.items() if state == SILENT]
    gone = [r for r, state in failed.items() if state == GONE]
    parts = []
    if silent:  # what holds the job up: ranks that ended have failed already, or will be reported by others
        parts.append("%s not answer at all (the process is stopped or frozen): the job waits on %s"
                     % (_ranks(silent, "does", "do"), "it" if len(silent) == 1 else "them"))
    if gone:
        parts.append("%s gone (the process ended)" % _ranks(gone, "is", "are"))
    return "; " + "; ".join(parts)


def _ranks(ranks, one, many):
    if len(ranks) == 1:
        return "rank %d %s" % (ranks[0], one)
    return "ranks %s %s" % (", ".join(map(str, ranks)), many)
