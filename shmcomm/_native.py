# SPDX-License-Identifier: Apache-2.0
"""The compiled core and the one place where its return codes become exceptions."""
import re

from shmcomm import exceptions as exc

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
}
_RANK_IN_TEXT = re.compile(r"rank (\d+) \(pid")


def last_error():
    return ffi.string(lib.smc_last_error()).decode("utf-8", "replace")


_RANK = re.compile(r"\brank (\d+)")


def error_for(rc, prefix=None, ranks=None):
    """The exception for a failed call, with the C text (and an optional local prefix). The core numbers ranks
    within its communicator; `ranks` (the communicator's global ranks) turns them into the job's."""
    text = last_error()
    if ranks is not None and ranks != list(range(len(ranks))):
        text = _RANK.sub(lambda m: "rank %d" % ranks[int(m.group(1))] if int(m.group(1)) < len(ranks) else m.group(0),
                         text)
    if prefix and not text.startswith(prefix + ":"):
        text = "%s: %s" % (prefix, text)
    cls = _ERRORS.get(rc, exc.ShmCommError)
    if cls in (exc.RankFailure, exc.BrokenCommunicatorError):
        m = _RANK_IN_TEXT.search(text)
        if m and ("died" in text or "shut down" in text):
            return exc.RankFailure(text, int(m.group(1)))
        if cls is exc.RankFailure:
            return exc.RankFailure(text)
    return cls(text)

def check(rc):
    if rc != 0:
        raise error_for(rc)
