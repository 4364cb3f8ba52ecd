# SPDX-License-Identifier: Apache-2.0
"""torch.distributed's Work for the shmcomm backend: wait(), is_completed() and get_future() over a torch Future, so
that DDP's hooks can chain on it and async_op=True callers can wait for it. Most operations have finished when their
Work is made; their future is made only if asked for."""
import torch.distributed as dist
from torch.futures import Future


class Work(dist.Work):
    """An operation of the shmcomm backend, finished or under way: made by finished() or under_way()."""

    # Set after torch's own constructor, as attributes of the class by default: a constructor of our own costs every
    # call another Python frame on the way back to torch.
    _future = None  # a torch Future of the output tensors or of the error; None once finished with _tensors
    _tensors = None

    def get_future(self):
        """The torch Future of the operation's output tensors."""
        if self._future is None:
            self._future = Future()
            self._future.set_result(self._tensors)
        return self._future

    def wait(self, timeout=None):
        """Waits for the operation; raises its error (shmcomm's waits are bounded, so this wait is too).

        Returns:
            True.
        """
        if self._future is not None:
            self._future.wait()
        return True

    def is_completed(self):
        """Whether the operation has finished, well or not; never waits."""
        return self._future is None or self._future.done()

    def exception(self):
        """The operation's error once it has finished with one, else None."""
        if self._future is None or not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as error:
            return error
        return None

    def is_success(self):
        """Whether the operation has finished without an error; never waits."""
        return self.is_completed() and self.exception() is None

    def result(self):
        """The operation's output tensors (waits for them)."""
        return self.get_future().wait()


def finished(tensors):
    """The Work of an operation that ran to its end already, with these output tensors."""
    work = Work()
    work._tensors = tensors
    return work


def under_way(future):
    """The Work of an operation under way: `future` completes with its output tensors, or with its error."""
    work = Work()
    work._future = future
    return work
