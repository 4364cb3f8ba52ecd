# SPDX-License-Identifier: Apache-2.0
"""What a rank that dies of an uncaught exception leaves for the others and for shmcommrun, in the private directory
the launcher names (SHMCOMM_ERROR_REPORT_DIR): rank<N>, its traceback (printed by the multi-host launcher when
MPI_Abort cut it off the output), and rank<N>.cause, one line `Type: message`, unless the exception was itself a
report of a peer's failure or bad argument. The cause lets the launcher blame the rank that failed first, and the
other ranks say why it left. Across hosts the directory may not be on the rank's host: the cause also goes to the
rank's guard (SHMCOMM_GUARD_SOCKET), and the launcher's notices bring it to the other ranks (heard)."""
import _io
import gc
import os
import select
import sys
import traceback

from shmcomm import env
from shmcomm.vocabulary.exceptions import PeerArgumentError, RankFailure


def save(name, text):
    """Writes `text` to <dir>/<name> (0600, complete or absent: renamed into place); nothing without the directory."""
    directory = env.error_report_dir()
    if directory is None:
        return
    path = os.path.join(directory, name)
    partial = path + ".partial"
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        data = text.encode("utf-8", errors="backslashreplace")
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        return
    finally:
        os.close(fd)
    try:
        os.rename(partial, path)
    except OSError:
        pass


def guard_socket():
    """The descriptor of the guard's socket, or None: the variable can reach a process that did not inherit the
    socket (a rank's own subprocess), where that number is another file, so the socket's inode must match too."""
    named = env.guard_socket()
    try:
        return named[0] if named is not None and os.fstat(named[0]).st_ino == named[1] else None
    except OSError:
        return None


def wait_for_guard(timeout_s=2.0):
    """Returns once the guard has passed on everything this rank wrote to its output so far (the caller waited until
    the guard read it), or after timeout_s; at once without a guard. MPI_Abort may kill the guard right after."""
    fd = _tell_guard("")  # an empty line asks; the guard answers with one byte
    try:
        if fd is not None and select.select([fd], [], [], timeout_s)[0]:
            os.read(fd, 1)
    except OSError:
        pass


def _tell_guard(line):
    """Writes a line to the guard's socket, if there is one, in one write; returns the socket's descriptor."""
    fd = guard_socket()
    if fd is not None:
        try:
            os.write(fd, (line + "\n").encode("utf-8", errors="backslashreplace"))
        except OSError:
            return None
    return fd


def heard(rank, line):
    """Keeps rank `rank`'s cause as the launcher's notices told it (startup/notices.py), for cause()."""
    _heard[rank] = line


_heard = {}  # rank: the cause the launcher heard from that rank's guard, for hosts that cannot read its file
_own = []  # this rank's own cause, once it has saved one


def own_cause():
    """The cause this rank saved for its own failure (save_uncaught), or None."""
    return _own[0] if _own else None


def own_failure(rank, value):
    """Whether exception `value` is rank `rank`'s own failure, not its report of a peer's: a peer that died or hung
    (RankFailure) or a peer's bad argument (PeerArgumentError) is that peer's cause, found in that peer's report."""
    if isinstance(value, (RankFailure, PeerArgumentError)):
        return value.rank is None or value.rank == rank
    return True


def save_uncaught(rank, kind, value, tb):
    """Saves an uncaught exception: its cause first (what the others look for), then its traceback; returns the
    traceback's text."""
    if own_failure(rank, value):
        message = " ".join(str(value).split())  # one line
        line = ("%s: %s" % (kind.__name__, message) if message else kind.__name__)[:500]
        _own[:] = [line]
        save("rank%d.cause" % rank, line)
        _tell_guard(line)
    text = "".join(traceback.format_exception(kind, value, tb))
    save("rank%d" % rank, text)
    return text


def report_uncaught_exceptions(rank, mark_failed):
    """Saves every uncaught exception of this rank (save_uncaught), then calls mark_failed() (the peers that find
    the rank gone then say it failed), before Python's own hook prints it."""
    previous = sys.excepthook
    if getattr(previous, "saves_reports", False):
        return  # installed by an earlier world of this process

    def hook(kind, value, tb):
        try:
            save_uncaught(rank, kind, value, tb)
            if own_failure(rank, value):
                mark_failed()
        except BaseException:
            pass  # the report is a help; the traceback below must still be printed
        previous(kind, value, tb)
        _exit_without_tracing_live_objects()

    hook.saves_reports = True
    sys.excepthook = hook


def _exit_without_tracing_live_objects():
    """The interpreter exits after this hook, and the job waits for it: with torch loaded, the garbage collections
    of Python's teardown trace every live object several times, most of the exit's time. Collect what is garbage
    now (its finalizers run), flush every open file, then freeze the rest: teardown still clears every module, so
    objects held from modules are still finalized, and a file kept in a reference cycle loses nothing. Not in an
    interactive session, which goes on after a traceback."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return
    gc.collect()
    for thing in gc.get_objects():
        # The C base of every file object: io.IOBase is an ABC, whose check costs more than the teardown saved, and
        # isinstance() would read each object's __class__, which some libraries' lazy objects warn about.
        if issubclass(type(thing), _io._IOBase):
            try:
                if not thing.closed:
                    thing.flush()
            except Exception:
                pass  # a file that cannot be flushed now would not be at teardown either
    gc.freeze()


def cause(rank, directory=None):
    """The line rank `rank` left as its cause (in directory, or as heard from the launcher), or None."""
    directory = directory or env.error_report_dir()
    if directory is None:
        return _heard.get(rank)
    try:
        with open(os.path.join(directory, "rank%d.cause" % rank), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return _heard.get(rank)


def with_cause(text, rank):
    """A peer failure's message about `rank`, with the cause that rank left, if any, in parentheses."""
    why = cause(rank) if rank is not None else None
    return "%s (%s)" % (text, why) if why else text


def first_cause(directory):
    """(rank, cause) of the rank that saved its cause first in `directory`, or None."""
    found = []
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    for name in names:
        number = name[len("rank"):-len(".cause")]
        if name.startswith("rank") and name.endswith(".cause") and number.isdigit():
            try:
                found.append((os.stat(os.path.join(directory, name)).st_mtime_ns, int(number)))
            except OSError:
                continue
    if not found:
        return None
    rank = min(found)[1]
    return rank, cause(rank, directory)

