# SPDX-License-Identifier: Apache-2.0
"""The output of a job across hosts: hydra's stream of the rank guards' frames (rank_guard.py), put back together
into each rank's text on the launcher's console, in --output-filename's files, and for the launcher's report."""
import codecs
import re

from .console import end_line, rank_prefix, write_console

_MAX_LINE_BYTES = 1 << 20


# Hydra's own diagnostics ("[mpiexec@host] HYD_pmci_wait_for_completion (...): ..."): the launcher's last line says
# what went wrong in words; these show with --verbose.
_HYDRA_LINE = re.compile(r"\[(mpiexec|proxy:[^\]]*)@[^\]]*\] ")


# A guard's frame (rank_guard.py): its rank's text and a newline, or with "+" its text that does not end a line yet;
# or its rank's cause of failure, for the report only.
_FRAME = re.compile(rb"\[(\d+)\]<(stdout|stderr|cause)>(\+?): ")


class _RankText:
    """One rank stream's text, put back together from its guard's frames: shown as it comes (and written as it is to
    raw_file, for --output-filename), and read by the report a whole line at a time."""

    def __init__(self, rank, label, raw_file, stamp):
        self.owner, self.tag, self.prefix = (rank, label), f"[{rank}]<{label}>: ", rank_prefix(rank, label, stamp)
        self.raw_file = raw_file
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.line = ""  # the unfinished line so far

    def add(self, stream, report, data):
        if self.raw_file is not None:
            self.raw_file.write(data)
            self.raw_file.flush()
        text = self.decoder.decode(data)
        write_console(stream, text, self.owner, self.prefix)
        *lines, self.line = (self.line + text).split("\n")
        for line in lines:
            report.read(self.tag + line + "\n")


def relay(pipe, stream, report, verbose, output_files, stamp):
    """Copies hydra's output (the guards' frames) to the launcher's, each rank's text as it was written, reading it.
    output_files: [(stdout, stderr)] per rank (--output-filename), or None."""
    texts = {}
    try:
        for raw in iter(lambda: pipe.readline(_MAX_LINE_BYTES), b""):
            frame = _FRAME.match(raw)
            if frame and frame.group(2) == b"cause":
                report.caused(int(frame.group(1)), raw[frame.end():].decode("utf-8", errors="replace").strip())
                continue
            if frame:
                key = (int(frame.group(1)), frame.group(2).decode())
                text = texts.get(key)
                if text is None:
                    raw_file = None
                    if output_files and key[0] < len(output_files):
                        stdout_file, stderr_file = output_files[key[0]]
                        raw_file = stderr_file if key[1] == "stderr" else stdout_file
                    text = texts[key] = _RankText(*key, raw_file, stamp)
                body = raw[frame.end():]
                body = body[:-1] if body.endswith(b"\n") else body
                text.add(stream, report, body if frame.group(3) else body + b"\n")
                continue
            line = raw.decode("utf-8", errors="replace")
            report.read(line)
            if verbose or not _HYDRA_LINE.match(line):
                write_console(stream, line if line.endswith("\n") else line + "\n")
    finally:
        for text in texts.values():
            end_line(stream, text.owner)
        pipe.close()
