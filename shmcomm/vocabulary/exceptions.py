# SPDX-License-Identifier: Apache-2.0
"""The exceptions shmcomm raises. Each also derives from the builtin a caller would naturally catch."""
import builtins


class ShmCommError(RuntimeError):
    """Base of every shmcomm error."""


class NotInitializedError(ShmCommError, builtins.ValueError):
    """A call that needs ``init()`` came before it (Horovod raises ValueError here)."""


class InvalidArgumentError(ShmCommError, builtins.ValueError):
    """Bad input: wrong dtype, device, layout, root, splits..."""


class MismatchError(ShmCommError, builtins.ValueError):
    """Ranks called different collectives or disagreed on their arguments. Raised on every rank; the job goes on.
    ``field`` says what differed where the C core found it: "collective", "dtype", "count", "op", "root", "scale" or
    "shape" (the shapes or per-rank counts); None otherwise."""

    def __init__(self, message, field=None):
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        return (type(self), (self.args[0], self.field))


class NotSupportedError(InvalidArgumentError, builtins.NotImplementedError):
    """A feature shmcomm does not offer (Adasum)."""


class PeerArgumentError(ShmCommError, builtins.ValueError):
    """Another rank's call of the same collective failed its own checks (a bad argument there), so no rank ran it.
    Raised at once on every other rank, naming that rank (``rank``) and its error; that rank raises its own error.
    The job goes on: the next collectives work."""

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank))


class TimeoutError(ShmCommError, builtins.TimeoutError):
    """A wait ran past its limit while every peer was alive."""


class RankFailure(ShmCommError):
    """A peer died or left. ``rank`` names it (None when unknown); the communicator is unusable afterwards."""

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank))


class HostFailure(RankFailure):
    """A host stopped answering (its ranks died, or its network is gone). ``host`` names it; a Soft Memory Box whose
    home it was is unusable from then on."""

    def __init__(self, message, host=None):
        super().__init__(message)
        self.host = host

    def __reduce__(self):
        return (type(self), (self.args[0], self.host))


class AbandonedError(ShmCommError):
    """Init gave up forming a world that will not be: a newer one replaced it (an elastic job's next membership)."""


class BrokenCommunicatorError(ShmCommError):
    """An earlier failure left the communicator unusable; shut down and init again."""


class SystemError(ShmCommError, OSError):
    """An operating-system call failed (shared memory, mapping, locks)."""


class OutOfMemoryError(ShmCommError, MemoryError):
    """Out of memory, or the Soft Memory Box arena is full."""


class BoxExistsError(ShmCommError, FileExistsError):
    """A Soft Memory Box of that name exists already."""


class BoxNotFoundError(ShmCommError, KeyError):
    """No Soft Memory Box of that name."""

    def __str__(self):  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic training: workers were added (or removed without a failure); raised by State.commit() and
    check_host_updates() on every rank at once, so that the job re-forms at this consistent point. As Horovod's,
    `skip_sync` says whether the state needs no broadcast afterwards."""

    def __init__(self, skip_sync=False):
        super().__init__("the job's workers changed")
        self.skip_sync = skip_sync
