# SPDX-License-Identifier: Apache-2.0
"""Starts the ranks of a job, forwards their output, and supervises them.

Every rank runs in its own session (so its own process group): a signal to the group reaches the rank and any
children it started, and a Ctrl-C in the terminal reaches only the launcher, which decides what the ranks get.
When one rank fails, the others are stopped with SIGTERM, then SIGKILL after a grace period: peers of a dead
rank would otherwise wait on it until their collective timeout. A rank stopped (SIGSTOP, a debugger) once every
other rank has ended is waited for SHMCOMM_TIMEOUT, the bound of every wait on a rank, and then killed as failed:
nothing else is left to time out on it.
"""

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from shmcomm.startup import failure_reports
from shmcomm.env import ERROR_REPORT_DIR

from .console import forward_output, write_console

PROG = "shmcommrun"
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_OUTPUT_DRAIN_SECONDS = 3.0  # after the ranks exit; a grandchild may keep a pipe open forever
_POLL_SECONDS = 0.1

def say(message):
    """Prints one of the launcher's own messages to stderr."""
    write_console(sys.stderr, f"{PROG}: {message}\n")


def signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code_of(returncode):
    """The shell's convention: 128 + signum for a process killed by a signal."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode):
    if returncode < 0:
        return f"was killed by signal {-returncode} ({signal_name(-returncode)})"
    return f"exited with code {returncode}"


def plural(count, noun):
    """'1 rank', '2 ranks'."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def open_output_files(output_dir, num_proc):
    """Creates DIR/rank.<r>/{stdout,stderr}, r zero-padded to the width of the largest rank."""
    width = len(str(num_proc - 1))
    files = []
    for rank in range(num_proc):
        rank_dir = os.path.join(output_dir, f"rank.{rank:0{width}d}")
        os.makedirs(rank_dir, exist_ok=True)
        files.append((open(os.path.join(rank_dir, "stdout"), "wb"), open(os.path.join(rank_dir, "stderr"), "wb")))
    return files


class _Job:
    def __init__(self, kill_grace_seconds, stamp=False, stopped_limit_s=300.0, reports=None):
        self.kill_grace_seconds = kill_grace_seconds
        self.reports = reports  # the ranks' failure reports (shmcomm/startup/failure_reports.py), None without
        self.stopped_limit_s = stopped_limit_s
        self.stopped_since = {}  # rank: when it was first seen stopped, since every running rank has been stopped
        self.stamp = stamp
        self.processes = []  # index = rank
        self.readers = []
        self.exits = queue.Queue()  # (rank, returncode), in the order the ranks ended
        self.stopping = False
        self.stop_deadline = None
        self.killed = False
        self.signal_received = None

    def start(self, command, environments, output_files):
        for rank, env in enumerate(environments):
            if self.stopping:
                break  # interrupted while starting: do not start more ranks
            process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, start_new_session=True)
            self.processes.append(process)
            raw_out, raw_err = output_files[rank] if output_files else (None, None)
            for pipe, stream, label, raw in ((process.stdout, sys.stdout, "stdout", raw_out),
                                             (process.stderr, sys.stderr, "stderr", raw_err)):
                reader = threading.Thread(target=forward_output, args=(rank, pipe, stream, label, raw, self.stamp),
                                          name=f"rank{rank}-{label}", daemon=True)
                reader.start()
                self.readers.append(reader)
            threading.Thread(target=self._wait_for, args=(rank, process), name=f"rank{rank}-wait",
                             daemon=True).start()

    def _wait_for(self, rank, process):
        process.wait()
        self.exits.put((rank, process.returncode))

    def running(self):
        return [rank for rank, process in enumerate(self.processes) if process.returncode is None]

    def signal_running(self, signum):
        for rank in self.running():
            try:
                os.killpg(self.processes[rank].pid, signum)
            except (ProcessLookupError, PermissionError):
                pass  # it ended in the meantime

    def stop(self, signum=signal.SIGTERM):
        """Sends signum to every running rank; SIGKILL follows once the grace period is over."""
        self.stopping = True
        self.signal_running(signum)
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.kill_grace_seconds

    def kill(self):
        self.stopping = True
        self.killed = True
        self.signal_running(signal.SIGKILL)

    def on_signal(self, signum, frame):
        if self.signal_received is None:
            self.signal_received = signum
            say(f"received {signal_name(signum)}; forwarding it to {plural(len(self.running()), 'rank')}")
            self.stop(signum)
        else:
            say(f"received {signal_name(signum)} again; killing the ranks now")
            self.kill()

    def _kill_after_grace(self):
        if self.killed or self.stop_deadline is None or time.monotonic() < self.stop_deadline:
            return
        left = self.running()
        if left:
            say(f"{plural(len(left), 'rank')} still running {self.kill_grace_seconds:g} s after being told to "
                f"stop ({', '.join(map(str, left))}); sending SIGKILL")
            self.kill()

    def _stopped_too_long(self):
        """The rank that has been stopped for stopped_limit_s while no running rank was not (None if none): no rank
        is left that could time out on it."""
        if self.stopping:
            return None
        states = {rank: _state(self.processes[rank].pid) for rank in self.running()}
        if not states or any(state not in ("T", "t") for state in states.values()):
            self.stopped_since.clear()
            return None
        now = time.monotonic()
        for rank in states:
            self.stopped_since.setdefault(rank, now)
        rank = min(states, key=self.stopped_since.get)
        return rank if now - self.stopped_since[rank] >= self.stopped_limit_s else None

    def _explained_by_stop(self, returncode):
        sent = {signal.SIGTERM, signal.SIGKILL, self.signal_received}
        return any(returncode in (-signum, 128 + signum) for signum in sent if signum is not None)

    def supervise(self):
        """Waits for every started rank and its output; returns the job's exit code."""
        left = len(self.processes)
        first_failure = None
        blamed = None
        other_failures = []
        while left:
            try:
                rank, returncode = self.exits.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                self._kill_after_grace()
                stopped = self._stopped_too_long()
                if stopped is not None:
                    first_failure = (stopped, -signal.SIGKILL)
                    say(f"rank {stopped} (pid {self.processes[stopped].pid}) is stopped (SIGSTOP, or a debugger) and "
                        f"has been for {self.stopped_limit_s:g} s (SHMCOMM_TIMEOUT) since the other ranks ended or "
                        f"stopped; killing it")
                    self.kill()
                continue
            left -= 1
            if returncode == 0:
                continue
            if not self.stopping:
                first_failure = (rank, returncode)
                pid, exit_text = self.processes[rank].pid, describe_exit(returncode)
                # The first to exit is often a rank that raised because another failed: that one is named.
                cause = failure_reports.first_cause(self.reports) if self.reports else None
                if cause is not None and cause[0] == rank:
                    message = f"rank {rank} (pid {pid}) failed ({cause[1]}) and {exit_text}"
                elif cause is not None:
                    message = f"rank {cause[0]} failed ({cause[1]}); then rank {rank} (pid {pid}) {exit_text}"
                    blamed = cause[0]  # its own exit, to come, is no further failure
                else:
                    message = f"rank {rank} (pid {pid}) {exit_text}"
                running = len(self.running())
                say(f"{message}; stopping the other {plural(running, 'rank')}" if running else message)
                self.stop()
            elif not self._explained_by_stop(returncode) and rank != blamed:
                other_failures.append(f"rank {rank} {describe_exit(returncode)}")
        self.drain_output()  # the ranks' last lines come before the launcher's verdict, which ends the output
        if other_failures:
            say("also failed: " + "; ".join(other_failures))
        if first_failure is not None:
            cause = failure_reports.first_cause(self.reports) if self.reports else None
            rank, returncode = first_failure
            say(f"the job failed: rank {cause[0]} failed first ({cause[1]})" if cause else
                f"the job failed: rank {rank} {describe_exit(returncode)} first")
            return exit_code_of(returncode)
        if self.signal_received is not None:
            return 128 + self.signal_received
        return 0

    def drain_output(self):
        deadline = time.monotonic() + _OUTPUT_DRAIN_SECONDS
        for reader in self.readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        if any(reader.is_alive() for reader in self.readers):
            say("some rank output is still open after the ranks exited (a child process of a rank holds it); "
                "not waiting for it")


def _state(pid):
    """A process's state letter (/proc/PID/stat: R, S, T stopped, t stopped by a tracer, ...), "" if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(") ")[2][:1]
    except OSError:
        return ""


def _start_failure_message(command, error):
    if isinstance(error, FileNotFoundError):
        return f"cannot run {command[0]!r}: command not found", 127
    if isinstance(error, PermissionError):
        return f"cannot run {command[0]!r}: permission denied", 126
    return f"cannot run {command[0]!r}: {error.strerror or error}", 126


def run_job(command, environments, kill_grace_seconds, output_dir=None, stamp=False, stopped_limit_s=300.0):
    """Runs len(environments) ranks of command, rank r with environments[r]; returns the job's exit code. `stamp`
    starts every forwarded line with the time; a rank stopped for stopped_limit_s once no other is running is
    killed as failed."""
    try:
        output_files = open_output_files(output_dir, len(environments)) if output_dir else None
    except OSError as error:
        say(f"cannot create the output files under {output_dir!r}: {error}")
        return 1
    try:
        reports = tempfile.mkdtemp(prefix="shmcomm-errors-")  # 0700, its files 0600: the ranks' failure reports
    except OSError as error:
        say(f"note: cannot make a directory for the ranks' failure reports ({error.strerror or error}): a failure "
            f"is blamed on the first rank to exit")
        reports = None
    else:
        environments = [dict(environ, **{ERROR_REPORT_DIR: reports}) for environ in environments]
    job = _Job(kill_grace_seconds, stamp, stopped_limit_s, reports)
    previous_handlers = {signum: signal.signal(signum, job.on_signal) for signum in FORWARDED_SIGNALS}
    try:
        try:
            job.start(command, environments, output_files)
        except OSError as error:
            message, code = _start_failure_message(command, error)
            say(message)
            job.stop()
            job.supervise()
            return code
        return job.supervise()
    finally:
        job.kill()  # only reaches ranks still running, i.e. after an unexpected error in the launcher
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        if output_files:
            for files in output_files[len(job.processes):]:  # those of ranks never started
                for unused in files:
                    unused.close()
        if reports:
            shutil.rmtree(reports, ignore_errors=True)
