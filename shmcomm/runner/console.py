# SPDX-License-Identifier: Apache-2.0
"""The launcher's console: the ranks' output forwarded as it is written, each line prefixed with its rank and
stream in Horovod's format ([1]<stdout>: ...), progress bars (carriage-return updates) and unfinished lines included."""

import codecs
import os
import re
import select
import threading
import time

_READ_BYTES = 1 << 16
# An unfinished line waits up to this long for its end before it is shown: Python's unbuffered print() writes each
# argument and the newline apart, and lines cut by other ranks' output at every write would be unreadable.
_HOLD_S = 0.1

# Reentrant: the signal handler prints from the main thread, which may hold the lock at that moment.
_console_lock = threading.RLock()
# Per console (stdout and stderr on one terminal are one): the rank stream whose line is unfinished there, and
# whether its cursor is back at the line's start after a '\r' (a progress bar redrawing itself).
_unfinished = {}
# (console, rank stream) whose unfinished line another's output ended: a newline it then writes was already written
# for it (Python's unbuffered print() writes a line's text and its newline separately).
_cut = set()
_LINE_BREAKS = re.compile(r"(\r\n|\n|\r)")


def _console_of(stream):
    try:
        st = os.fstat(stream.fileno())
        return (st.st_dev, st.st_ino)
    except (AttributeError, OSError, ValueError):
        return id(stream)


def _prefixed(text, owner, state, prefix):
    """`text` from the rank stream `owner` with `prefix()` before each line's first character, from the cursor
    `state` ("new": a line's start, "cr": after a carriage return, "mid"); returns (text, state after it)."""
    out = []
    for piece in _LINE_BREAKS.split(text):
        if not piece:
            continue
        if piece == "\r":
            out.append(piece)
            state = "cr"
        elif piece in ("\n", "\r\n"):
            out.append(prefix() + piece if state == "new" else piece)
            state = "new"
        else:
            out.append(prefix() + piece if state != "mid" else piece)
            state = "mid"
    return "".join(out), state


def write_console(stream, text, owner=None, prefix=None):
    """Writes `text` to the launcher's `stream`. With `owner` (a rank's stream), each line of the text gets
    `prefix()` and may stay unfinished, to be continued by that owner's next text; whatever else is written to the
    same console first ends it with a newline, and its rest gets the prefix again."""
    with _console_lock:
        console = _console_of(stream)
        pending = _unfinished.pop(console, None)
        state, lead = "new", ""
        if pending is not None:
            if pending[0] == owner:
                state = pending[1]
            else:
                lead = "\n"  # another's unfinished line ends here, with the newline it would have written next
                _cut.add((console, pending[0]))
        if (console, owner) in _cut:
            _cut.discard((console, owner))
            text = text[1:] if text.startswith("\n") else text[2:] if text.startswith("\r\n") else text
        if owner is not None:
            text, state = _prefixed(text, owner, state, prefix)
            if state != "new":
                _unfinished[console] = (owner, state)
        _write(stream, lead + text)


def end_line(stream, owner):
    """Ends `owner`'s unfinished line with a newline, if it has one (its output has ended)."""
    with _console_lock:
        console = _console_of(stream)
        if _unfinished.get(console, (None,))[0] == owner:
            del _unfinished[console]
            _write(stream, "\n")


def _write(stream, text):
    try:
        stream.flush()
        buffer = getattr(stream, "buffer", None)
        if buffer is None:
            stream.write(text)
            stream.flush()
        else:
            buffer.write(text.encode(stream.encoding or "utf-8", errors="replace"))
            buffer.flush()
    except (OSError, ValueError):
        pass  # a closed console must not stop the job or its supervision


def rank_prefix(rank, label, stamp=False):
    """What starts each line of a rank's stream on the console: `[1]<stdout>: `, after the time of day when `stamp`
    (--prefix-output-with-timestamp)."""
    tag = f"[{rank}]<{label}>: "
    return (lambda: time.strftime("%a %b %d %H:%M:%S %Y") + tag) if stamp else (lambda: tag)


def forward_output(rank, pipe, stream, label, raw_file, stamp=False):
    """Copies one pipe of a rank to the launcher's stream as it comes, each line prefixed (with the time of day first
    when `stamp`, as --prefix-output-with-timestamp asks); raw_file, if given, gets the bytes as they are."""
    owner = (rank, label)
    prefix = rank_prefix(rank, label, stamp)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        for data in _chunks(pipe.fileno()):
            if raw_file is not None:
                raw_file.write(data)
                raw_file.flush()
            text = decoder.decode(data)
            if text:
                write_console(stream, text, owner, prefix)
        text = decoder.decode(b"", final=True)
        if text:
            write_console(stream, text, owner, prefix)
    finally:
        end_line(stream, owner)
        pipe.close()
        if raw_file is not None:
            raw_file.close()


def _chunks(fd):
    """What the rank writes to `fd`, as it comes: finished lines at once, an unfinished one once it is finished or
    has waited _HOLD_S (a progress bar's updates then show at that pace)."""
    held, deadline = b"", 0.0
    while True:
        if held and not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            yield held
            held = b""
            continue
        data = os.read(fd, _READ_BYTES)
        if not data:
            if held:
                yield held
            return
        if not held:
            deadline = time.monotonic() + _HOLD_S
        data = held + data
        finished = data.rfind(b"\n") + 1
        if finished:
            yield data[:finished]
        held = data[finished:]
        if len(held) >= _READ_BYTES:
            yield held
            held = b""

