# SPDX-License-Identifier: Apache-2.0
"""The compiled core and the one place where its return codes become exceptions."""
import ctypes

from shmcomm.vocabulary import exceptions as exc

try:
    from shmcomm._C import ffi, lib
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "shmcomm's C core is not built (%s). Install the package with `pip install -e .` from the source tree." % e
    ) from e

_ERRORS = {
    lib.SMC_ERR_INVALID: exc.InvalidArgumentError,
    lib.SMC_ERR_SYSTEM: exc.SystemError,
    lib.SMC_ERR_TIMEOUT: exc.TimeoutError,
    lib.SMC_ERR_RANK_FAILED: exc.RankFailure,
    lib.SMC_ERR_MISMATCH: exc.MismatchError,
    lib.SMC_ERR_NOMEM: exc.OutOfMemoryError,
    lib.SMC_ERR_EXISTS: exc.BoxExistsError,
    lib.SMC_ERR_NOT_FOUND: exc.BoxNotFoundError,
    lib.SMC_ERR_BROKEN: exc.BrokenCommunicatorError,
    lib.SMC_ERR_REFUSED: exc.PeerArgumentError,
    lib.SMC_ERR_ABANDONED: exc.AbandonedError,
}
# MismatchError.field for the core's smc_field_t. The tag digests the shapes and the per-rank counts.
_FIELDS = {
    lib.SMC_FIELD_COLL: "collective",
    lib.SMC_FIELD_DTYPE: "dtype",
    lib.SMC_FIELD_COUNT: "count",
    lib.SMC_FIELD_OP: "op",
    lib.SMC_FIELD_ROOT: "root",
    lib.SMC_FIELD_SCALE: "scale",
    lib.SMC_FIELD_TAG: "shape",
}

# The cause a failed rank saved, added to a RankFailure's text: start-up knows where causes are and sets this
# (startup/bootstrap.py), so that the loader of the core, which the settings read their limits from, stays below it.
explain_rank_failure = None


def last_error():
    return ffi.string(lib.smc_last_error()).decode("utf-8", "replace")


def last_failure():
    """This thread's failure data from the core: .code, .rank (a job rank, -1 if none) and .field."""
    failure = ffi.new("smc_failure_t *")
    lib.smc_last_failure(failure)
    return failure


def error_for(rc, prefix=None):
    """The exception for a failed call, built from the core's failure data; its message is the C text (with an
    optional local prefix), which already numbers ranks as the job does."""
    text = last_error()
    if prefix and not text.startswith(prefix + ":"):
        text = "%s: %s" % (prefix, text)
    failure = last_failure()
    cls = _ERRORS.get(rc, exc.ShmCommError)
    # A rank died or shut down: in this call, or in the one that broke the communicator.
    if cls is exc.RankFailure or (cls is exc.BrokenCommunicatorError and failure.code == lib.SMC_ERR_RANK_FAILED):
        rank = failure.rank if failure.rank >= 0 else None
        return exc.RankFailure(explain_rank_failure(text, rank) if explain_rank_failure else text, rank)
    if cls is exc.PeerArgumentError:
        return exc.PeerArgumentError(text, failure.rank if failure.rank >= 0 else None)
    if cls is exc.MismatchError:
        error = exc.MismatchError(text, _FIELDS.get(failure.field))
        error.earlier = bool(failure.earlier)  # a small broadcast's: not every rank fails this step with it
        return error
    return cls(text)


def check(rc):
    if rc != 0:
        raise error_for(rc)


def quick_function(which, bound):
    """Function `which` of csrc/py/quick_calls.c (0: allreduce, 1: broadcast, 2: allgather, 3: alltoall,
    4: reducescatter, 5: allreduce across hosts of one rank each) bound to `bound`, the list that names its
    communicator (csrc/py/quick_calls.c, BOUND_ITEMS), as a Python callable; None where this build has none (Python
    before 3.11). The module holds a PyMethodDef; PyCFunction_NewEx makes it callable, with `bound` as its self."""
    method = lib.smc_quick_method(which)
    if method == ffi.NULL:
        return None
    new = ctypes.pythonapi.PyCFunction_NewEx
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.py_object, ctypes.py_object]
    return new(int(ffi.cast("uintptr_t", method)), bound, None)
