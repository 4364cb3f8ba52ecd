# SPDX-License-Identifier: Apache-2.0
"""The exceptions shmcomm raises. Each also derives from the builtin a caller would naturally catch."""
import builtins


class ShmCommError(RuntimeError):
    """Base of every shmcomm error: `except shmcomm.ShmCommError` catches them all."""


class NotInitializedError(ShmCommError, builtins.ValueError):
    """A call that needs init() came before it, or after shutdown().

    Also a ValueError, as Horovod raises. Call `shmcomm.init()` (or `hvd.init()`) first.
    """


class InvalidArgumentError(ShmCommError, builtins.ValueError):
    """This rank's arguments are wrong: dtype, device, layout, shape of `output`, root, splits, op.

    Also a ValueError. Raised on this rank only; every other rank of the call raises PeerArgumentError naming this one,
    and no rank ran the call, so the job can go on.
    """


class MismatchError(ShmCommError, builtins.ValueError):
    """The ranks called different collectives, or the same one with arguments that disagree.

    Raised on every rank of the call at once; nothing was written, and the next collectives work. Also a ValueError.

    Attributes:
        field: what differed, where the C core found it: "collective", "dtype", "count", "op", "root", "scale" or
            "shape" (the shapes or per-rank counts); None otherwise.
    """

    def __init__(self, message, field=None):
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        return (type(self), (self.args[0], self.field))


class NotSupportedError(InvalidArgumentError, builtins.NotImplementedError):
    """A feature shmcomm does not offer here (Adasum outside torch's allreduce, CUDA tensors on a
    process set). Also an InvalidArgumentError and a NotImplementedError.
    """


class PeerArgumentError(ShmCommError, builtins.ValueError):
    """Another rank's call of the same collective failed its own checks, so no rank ran it.

    Raised at once on every other rank; that rank raises its own error (an InvalidArgumentError). The job goes on: the
    next collectives work.

    Attributes:
        rank: the rank whose arguments were refused.
    """

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank))


class TimeoutError(ShmCommError, builtins.TimeoutError):
    """A wait ran past its limit (SHMCOMM_TIMEOUT, or a call's `timeout`) while every peer was alive.

    Also the builtin TimeoutError. The message names the ranks that had not come: a rank stuck elsewhere in the
    program, or one calling a different collective. Raise SHMCOMM_TIMEOUT for ranks that pause long between
    collectives.
    """


class RankFailure(ShmCommError):
    """A peer died, or left the job, during a collective or while this rank waited for it.

    The communicator is unusable afterwards (the next call raises BrokenCommunicatorError): shut down, or let the
    launcher stop the job. Under `shmcommrun --elastic`, the job re-forms without the lost rank.

    Attributes:
        rank: the rank that failed (None when unknown).
    """

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank))


class HostFailure(RankFailure):
    """A host stopped answering: its ranks died, or its network is gone. A RankFailure.

    A Soft Memory Box whose home that host was is unusable from then on.

    Attributes:
        host: the host's name.
    """

    def __init__(self, message, host=None):
        super().__init__(message)
        self.host = host

    def __reduce__(self):
        return (type(self), (self.args[0], self.host))


class AuthenticationError(ShmCommError):
    """A TCP connection of the job failed its handshake: this process, or the one it reached, does not hold the
    job's secret (SHMCOMM_SECRET). The message names the other end's address.
    """


class AbandonedError(ShmCommError):
    """init() gave up forming a world that will not be: in an elastic job, a newer membership replaced
    it. init() itself joins the newer one; a caller sees this error only from lower layers.
    """


class BrokenCommunicatorError(ShmCommError):
    """An earlier failure (a RankFailure, a timeout inside a step) left the communicator
    unusable; call shutdown() and init() again, or end the job.
    """


class SystemError(ShmCommError, OSError):
    """An operating-system call failed: shared memory, mapping, locks. Also an OSError."""


class OutOfMemoryError(ShmCommError, MemoryError):
    """Out of memory: /dev/shm is full (the message names its free space), or the Soft Memory Box arena is.

    Shared memory is reserved before it is touched, so this error comes instead of a rank killed by SIGBUS, and the
    job goes on. Give /dev/shm more room (Docker: `--shm-size=1g`), lower SHMCOMM_SMB_BYTES, or destroy boxes no
    longer needed. Also a MemoryError.
    """


class BoxExistsError(ShmCommError, FileExistsError):
    """SoftMemoryBox(name, shape, create=True): a box of that name exists already. Also a
    FileExistsError.
    """


class BoxNotFoundError(ShmCommError, KeyError):
    """SoftMemoryBox(name) without a shape: no box of that name exists (within its timeout). Also a
    KeyError.
    """

    def __str__(self):  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic training: workers were added, or removed without a failure.

    Raised by State.commit() and check_host_updates() on every rank at once, so that the job re-forms at this consistent
    point; the elastic `run` decorator catches it.

    Args:
        skip_sync: True when the state needs no broadcast after the job re-forms (as Horovod's).
    """

    def __init__(self, skip_sync=False):
        super().__init__("the job's workers changed")
        self.skip_sync = skip_sync
