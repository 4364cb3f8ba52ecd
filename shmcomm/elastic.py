# SPDX-License-Identifier: Apache-2.0
"""Elastic training, framework-independent (Horovod's horovod.common.elastic): State and the run loop.

The training function runs inside `run_fn`. When a peer dies, a collective raises (RankFailure and the other
ShmCommErrors of a broken job: Horovod's HorovodInternalError); the loop restores the last commit, re-forms the world
without the dead worker (startup/membership.py), broadcasts rank 0's state to everyone and calls the function again.
When workers are added, State.commit() raises HostsUpdatedInterrupt on every rank at once and the world is re-formed
the same way. Every wait has a deadline: the collectives' own, and SHMCOMM_ELASTIC_TIMEOUT for a membership."""
import copy
import functools
import logging
import time

import numpy as np

from shmcomm.startup import membership
from shmcomm.vocabulary.exceptions import (HostsUpdatedInterrupt, InvalidArgumentError, MismatchError,
                                           NotInitializedError, ShmCommError)

log = logging.getLogger("shmcomm.elastic")

# Errors of the caller's own making: the world is fine, re-forming it would not help.
_CALLER_ERRORS = (MismatchError, InvalidArgumentError, NotInitializedError)


class State:
    """What survives a re-formed world. Subclasses define save() (keep a copy of the state), restore() (go back to
    it), sync() (everyone takes rank 0's) and reset() (after the world changed). `allreduce_max(int)` and `rank()`
    come from the framework."""

    def __init__(self, allreduce_max, rank):
        self._allreduce_max = allreduce_max
        self._rank = rank
        self._reset_callbacks = []
        self.recoveries = []  # ("lost" or "added", seconds from the failure or interrupt to the world re-formed,
        #                       the new size), for reports

    def register_reset_callbacks(self, callbacks):
        """Functions called after every re-formed world (e.g. to scale the learning rate to the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Saves the state (the point a failure rolls back to), then checks for added workers."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises HostsUpdatedInterrupt on every rank when the launcher has a newer membership (a collective: every
        rank calls it at the same point, and all of them decide alike)."""
        newest = self._allreduce_max(membership.current_generation())
        if newest > membership.joined_generation():
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def reset(self):
        pass


class ObjectState(State):
    """Plain Python values as attributes (state.epoch, state.batch), saved by deep copy, synced from rank 0."""

    def __init__(self, allreduce_max, rank, broadcast_object, **kwargs):
        super().__init__(allreduce_max, rank)
        self._broadcast_object = broadcast_object
        self._saved = dict(kwargs)
        self.__dict__.update(copy.deepcopy(kwargs))

    def save(self):
        self._saved = {k: copy.deepcopy(getattr(self, k)) for k in self._saved}

    def restore(self):
        self.__dict__.update(copy.deepcopy(self._saved))

    def sync(self):
        self.sync_values()
        self.save()

    def sync_values(self):
        if self._saved:
            self.__dict__.update(self._broadcast_object({k: getattr(self, k) for k in self._saved}))


def run_fn(func, reset):
    """Horovod's elastic loop around `func(state, *args, **kwargs)`; `reset()` leaves the world and joins the next
    membership (new segments, ranks renumbered, process sets registered again). Newcomers receive the state from the
    sync that follows."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
                failed_at, kind = time.monotonic(), "added"
                log.info("workers changed: re-forming the world")
            except ShmCommError as error:
                if isinstance(error, _CALLER_ERRORS):
                    raise
                failed_at, kind = time.monotonic(), "lost"
                log.warning("collective failed (%s): rolling back to the last commit", error)
                state.restore()
                skip_sync = False
            size = _reset_until_formed(reset)
            state.recoveries.append((kind, time.monotonic() - failed_at, size))
            state.on_reset()
    return wrapper


def _reset_until_formed(reset):
    """reset(), again if a worker fails while the world forms (each try joins a newer membership); a membership
    that does not come (MembershipError: stopped below --min-np, or the elastic timeout) ends the job."""
    while True:
        try:
            return reset()
        except membership.MembershipError:
            raise
        except ShmCommError as error:
            log.warning("the world did not form (%s): waiting for the next membership", error)


def allreduce_max_with(allreduce):
    """allreduce_max for State from a framework's blocking allreduce of a numpy-compatible int64 array."""
    def allreduce_max(value):
        return int(allreduce(np.array([value], dtype=np.int64))[0])
    return allreduce_max
