# SPDX-License-Identifier: Apache-2.0
"""Deadlines for MPI's waits, which have none: a watchdog thread for blocking receives, polling for the rest."""
import os
import threading
import time
import weakref

_WATCH_PERIOD_S = 0.1
_CLOSE_POLL_S = 0.01  # how long poll() polls before it sleeps
_FINE_WAIT_S = 0.2  # how long wait_all() keeps its sleeps short (up to 1e-3 s) before they may grow to 1e-2 s


class Watchdog:
    """A thread that wakes ten times a second cancels the receive a wait is blocked on once its deadline has passed
    (MPI_Cancel of a receive is what every MPI supports). The wait itself stays MPI's own, not a polling loop in
    Python, which costs the CPU time that oversubscribed ranks share; only where threads may not call MPI (below
    MPI_THREAD_MULTIPLE) the receive is polled."""

    def __init__(self):
        from mpi4py import MPI

        self._lock = threading.Lock()
        self._armed = None  # (deadline, request) of the wait in progress
        self._thread = None
        self._threads_may_call_mpi = MPI.Query_thread() == MPI.THREAD_MULTIPLE

    def wait(self, request, deadline, late):
        """Waits for a receive request; cancels it at `deadline` and raises what late() returns."""
        from mpi4py import MPI

        if not self._threads_may_call_mpi:  # poll instead
            wait_all([request], deadline, late)
            return
        if self._thread is None:  # it ends once its watchdog is gone (shutdown, init again)
            self._thread = threading.Thread(target=_watch, args=(weakref.ref(self),), name="shmcomm-watchdog",
                                            daemon=True)
            self._thread.start()
        armed = (deadline, request)
        self._armed = armed
        status = MPI.Status()
        try:
            request.Wait(status)
        finally:
            with self._lock:
                self._armed = None
        if status.Is_cancelled():
            raise late()

    def cancel_if_late(self):
        armed = self._armed
        if armed is not None and time.monotonic() > armed[0]:
            with self._lock:
                if self._armed is armed:  # still waiting (the wait disarms under this lock once it returns)
                    try:
                        armed[1].Cancel()
                    except Exception:  # it completed at this very moment: nothing to cancel
                        pass


def _watch(ref):
    while True:
        time.sleep(_WATCH_PERIOD_S)
        watchdog = ref()
        if watchdog is None:
            return
        watchdog.cancel_if_late()
        del watchdog


def poll(requests, deadline, late):
    """Waits for MPI requests that should complete soon: polls closely for _CLOSE_POLL_S, yielding the core in
    between (MPI's own waits poll too), then with sleeps until `deadline` (wait_all)."""
    from mpi4py import MPI

    if MPI.Request.Testall(requests):
        return
    until = time.monotonic() + _CLOSE_POLL_S
    while time.monotonic() < until:
        os.sched_yield()
        if MPI.Request.Testall(requests):
            return
    wait_all(requests, deadline, late)


def spin(requests, deadline, late):
    """Waits for MPI requests as MPI's own blocking wait does, testing them (which drives MPI's progress) and yielding
    the core in between, but only until `deadline`; then raises what late() returns, leaving them pending. For data
    phases, whose steps progress only while they are tested: a sleep would stall them."""
    from mpi4py import MPI

    while not MPI.Request.Testall(requests):
        if time.monotonic() > deadline:
            raise late()
        os.sched_yield()


def wait_all(requests, deadline, late):
    """Waits for MPI requests until `deadline`, polling; then raises what late() returns, leaving them pending (the
    caller's communicator is then unusable)."""
    from mpi4py import MPI

    # Short sleeps (up to 1e-3 s) for the first _FINE_WAIT_S, then up to 1e-2 s. With more ranks than cores, a peer's
    # answer is often a few scheduler slices away, and the longer sleep each time overshot it, which slowed
    # synchronous training. Longer waits (a rank idle until its peers' next step) go back to the longer sleep, so that
    # they cost next to nothing.
    pause, fine_until = 1e-4, time.monotonic() + _FINE_WAIT_S
    while not MPI.Request.Testall(requests):
        now = time.monotonic()
        if now > deadline:
            raise late()
        time.sleep(pause)
        pause = min(2 * pause, 1e-3 if now < fine_until else 1e-2)
