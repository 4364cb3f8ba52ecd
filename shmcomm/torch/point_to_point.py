# SPDX-License-Identifier: Apache-2.0
"""send and recv for the torch.distributed backend: each (sender, receiver, tag) of a group is a channel, a
two-rank process set in shared memory that carries its messages in order as broadcasts from the sender. A channel's
own thread on each side runs them, so that isend returns at once and a ring of sends cannot deadlock."""
import concurrent.futures
import threading

from torch.futures import Future

from shmcomm import collectives, process_sets
from shmcomm.torch.tensor_views import data
from shmcomm.vocabulary.exceptions import InvalidArgumentError, NotSupportedError


class Channels:
    """The channels of one process group on this rank, opened on first use and closed with the group: each holds a
    thread and a two-rank segment until then, so a program that sends under many tags holds as many."""

    def __init__(self, group_key, ranks):
        self._key = group_key
        self._ranks = ranks
        self._open = {}  # (sender, receiver, tag) -> (its thread, its process set once opened)
        self._lock = threading.Lock()

    def transfer(self, tensor, sender, receiver, tag, what):
        """Starts sending (on the sender) or receiving (on the receiver) `tensor` over the channel; returns a torch
        Future that completes with [tensor] once the message has gone or arrived, or with the error."""
        if sender == receiver:
            raise InvalidArgumentError("%s: rank %d cannot send to itself" % (what, sender))
        if not tensor.is_cpu:
            raise NotSupportedError("%s: point to point serves CPU tensors; this one is on %s" % (what, tensor.device))
        if not isinstance(tag, int) or tag < 0:
            raise InvalidArgumentError("%s: the tag must be a non-negative int, got %r" % (what, tag))
        key = (self._ranks[sender], self._ranks[receiver], tag)
        with self._lock:
            if key not in self._open:
                self._open[key] = [concurrent.futures.ThreadPoolExecutor(1, "shmcomm-p2p"), None]
            entry = self._open[key]
        moved = data(tensor, what)
        done = Future()
        ran = entry[0].submit(self._carry, entry, key, moved)
        ran.add_done_callback(lambda f: done.set_exception(f.exception()) if f.exception() else
                              done.set_result([tensor]))
        return done

    def _carry(self, entry, key, moved):
        name = "p2p %d>%d tag %d" % key  # the same on both sides, in errors
        if entry[1] is None:
            entry[1] = process_sets.members_only(sorted(key[:2]), "%s/%s" % (self._key, name))
        collectives.broadcast_(moved, key[0], name=name, process_set=entry[1])

    def close(self):
        """Waits for the messages under way, then closes every channel."""
        with self._lock:
            entries, self._open = list(self._open.values()), {}
        for entry in entries:
            entry[0].shutdown(wait=True)  # first: a message under way may be opening its channel's set
            if entry[1] is not None:
                process_sets.remove_process_set(entry[1])
