# SPDX-License-Identifier: Apache-2.0
"""Who is holding a job up, across hosts: a roll call answered by a thread on every rank.

A rank whose wait across hosts times out knows only whom it waited for, which is often a rank that waits in turn for
the one that stopped (a torus column waits on a rank whose host waits on the stopped one). Before it raises, it asks
every rank of the job to answer (silent()); a thread on every rank answers within a tenth of a second, whatever that
rank is doing, unless the process is stopped, hung with the GIL held, or gone. Those that do not answer within the
grace are named in the error: the ranks holding the job up.

The messages travel on a communicator of their own (a duplicate of the world's), so that they never match the
collectives' messages. Answering from a thread needs MPI_THREAD_MULTIPLE (mpi4py's default); below that
(HOROVOD_MPI_THREADS_DISABLE) there is no roll call and errors name only the rank waited for.

A process that found ranks holding the job up, or abandoned a wait across hosts, must not call MPI_Finalize at exit:
MPICH's waits there for every process of the job, stopped ones included, for ever. It exits without it
(exit_without_finalize), with code 1, and the launcher stops the job."""
import atexit
import os
import sys
import threading
import time

import numpy as np

_PING = 0x7C0
_PONG_TAGS = range(0x7C1, 0x7C1 + 4096)  # one per roll call in turn: a late answer never counts for a later call
_ANSWER_PERIOD_S = 0.02
_GRACE_S = 1.0  # how long a roll call waits for answers; answers come within _ANSWER_PERIOD_S unless a rank is stuck


class RollCall:
    """Answers roll calls on this rank (a daemon thread) and makes them (silent())."""

    def __init__(self, world):
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = world.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._calls = 0
        self.held_up_by = []  # the ranks a roll call found silent
        self._sent = []  # requests of answers and pings still in flight (their buffers live with them)
        self._sent_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            self._thread = threading.Thread(target=self._answer, name="shmcomm-rollcall", daemon=True)
            self._thread.start()

    def _answer(self):
        MPI = self._mpi
        status = MPI.Status()
        while not self._stop.wait(_ANSWER_PERIOD_S):
            try:
                while self.comm.Iprobe(MPI.ANY_SOURCE, _PING, status):
                    asked = np.empty(1, np.int64)
                    self.comm.Recv([asked, MPI.INT64_T], status.Get_source(), _PING)
                    self._keep([self.comm.Isend([asked, MPI.INT64_T], status.Get_source(), int(asked[0]))])
                self._keep([])
            except MPI.Exception:
                return  # MPI finalized or broken under us: nothing left to answer for

    def _keep(self, requests):
        with self._sent_lock:
            self._sent = [r for r in self._sent if not r.Test()] + requests

    def silent(self, grace_s=_GRACE_S):
        """The ranks (of the world) that do not answer within grace_s; [] where there is no roll call."""
        if self._thread is None or self.size == 1:
            return []
        MPI = self._mpi
        tag = _PONG_TAGS[self._calls % len(_PONG_TAGS)]
        self._calls += 1
        others = [r for r in range(self.size) if r != self.rank]
        asked = np.full(1, tag, np.int64)
        answers = {r: np.empty(1, np.int64) for r in others}
        receives = {r: self.comm.Irecv([answers[r], MPI.INT64_T], r, tag) for r in others}
        self._keep([self.comm.Isend([asked, MPI.INT64_T], r, _PING) for r in others])
        deadline = time.monotonic() + grace_s
        pending = dict(receives)
        while pending and time.monotonic() < deadline:
            pending = {r: q for r, q in pending.items() if not q.Test()}
            time.sleep(0.005)
        silent = []
        for rank, request in sorted(pending.items()):  # a receive can always be cancelled; its wait then returns
            request.Cancel()
            status = MPI.Status()
            request.Wait(status)
            if status.Is_cancelled():
                silent.append(rank)  # (else its answer came in at the last moment)
        self.held_up_by = sorted(set(self.held_up_by) | set(silent))
        return silent

    def exit_without_finalize(self, transports):
        """At exit (registered after mpi4py's import, so it comes before MPI_Finalize): when ranks held the job up
        or a wait across hosts was abandoned, flushes the output and exits with code 1 instead of finalizing."""
        def check():
            broken = [t.broken for t in transports if t is not None and t.broken]
            if not self.held_up_by and not broken:
                return
            why = ("rank(s) %s did not answer" % ", ".join(map(str, self.held_up_by)) if self.held_up_by
                   else "a wait across hosts was abandoned (%s)" % broken[0])
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os.write(2, ("shmcomm: exiting with code 1 without MPI_Finalize, which would wait for every rank: "
                         "%s\n" % why).encode())
            os._exit(1)
        atexit.register(check)

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)


def name_silent_ranks(error, roll_call):
    """Adds to an error (a timeout, a host that failed) the ranks that do not answer a roll call, once (nested calls
    see it done); a RankFailure naming no rank names the silent one, if it is one."""
    if roll_call is None or getattr(error, "roll_called", False):
        return
    error.roll_called = True
    silent = roll_call.silent()
    if silent and error.args:
        error.args = (str(error.args[0]) + _describe(silent),) + error.args[1:]
        if len(silent) == 1 and getattr(error, "rank", 0) is None:
            error.rank = silent[0]


def _describe(ranks):
    names = ("rank %d does" % ranks[0]) if len(ranks) == 1 else "ranks %s do" % ", ".join(map(str, ranks))
    return "; %s not answer at all (stopped, or hung outside shmcomm): the job waits on %s" % (
        names, "it" if len(ranks) == 1 else "them")
