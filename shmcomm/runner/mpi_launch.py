# SPDX-License-Identifier: Apache-2.0
"""Multi-host launches: placement is handed to MPICH's process manager, hydra (`mpiexec` of the mpich wheel).

Hydra reaches every host with ssh (or the --launcher-agent given instead), starts the ranks there, forwards their
output, and kills the whole job when a rank dies (rank_guard.py makes every failure count as one). The ranks learn
their rank, size, local and cross ranks from MPI; this launcher only gives every rank what MPI cannot know: the job
token, the tuning variables of the flags and SHMCOMM_LAUNCHER=mpi. The launcher's own environment reaches the ranks
too (hydra's default), less any rank identity it carries from an enclosing job. Nothing here imports mpi4py: the
launcher stays a plain process.
"""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

from shmcomm.startup import failure_reports
from shmcomm import env as env_settings
from shmcomm.env import ERROR_REPORT_DIR

from .cleanup import remove_job_segments, remove_orphaned_mpi_segments
from . import guard_output
from .rank_guard import RANK_GUARD
from .console import write_console
from .spawn import FORWARDED_SIGNALS, exit_code_of, say, signal_name

_IDENTITY = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")
_VERSION_TIMEOUT_S = 10
_POLL_SECONDS = 0.1
_TEARDOWN_S = 10.0  # once a rank failed, hydra's time to stop the job beyond the guard's grace
_OUTPUT_DRAIN_S = 3.0
_MPI_LINGER_S = 2.0  # after a failed job, how long its MPICH segments may stay mapped by ranks still exiting

# What the launcher reads in the job's output to say, at the end, which rank failed first and which held it up.
_GUARD_LINE = re.compile(r"^\[\d+\]<stderr>: shmcommrun: (rank \d+ on \S+ .*); stopping the job")
_SILENT_LINE = re.compile(r"^\[\d+\]<stderr>: .*\b(ranks? [\d, ]+) do(?:es)? not answer at all")
_STOPPED_LINE = re.compile(r"^\[\d+\]<stderr>: shmcommrun: rank (\d+) \(pid \d+\) on (\S+) is stopped")
_FAILURE = re.compile(r"^rank (\d+) on (\S+) (.*)$")  # a guard line's failure: rank, host, how
_GONE_LINE = re.compile(r"^\[\d+\]<stderr>: .*\b(ranks? [\d, ]+) (?:is|are) gone")
_MPI_ABORT_LINE = re.compile(r"^\[(\d+)\]<stderr>: Abort\(\d+\) on node \d+: Fatal error")  # MPICH's own abort
_RANK_STDERR_LINE = re.compile(r"^\[(\d+)\]<stderr>: (.*?)\n?\Z", re.DOTALL)

# The directory, private to this launcher, where a rank that dies of an uncaught exception saves its traceback
# (shmcomm/startup/failure_reports.py) before MPI_Abort has hydra kill the job: the kill may cut off the
# traceback on its way through the guard, hydra's proxy and mpiexec, so the launcher prints the saved one when its
# text did not come through. On remote hosts the directory does not exist and the forwarded stderr is all there is.
_REPORT_RE = re.compile(r"rank(\d+)\Z")
_MAX_REPORT_BYTES = 1 << 20
_TAIL_LINES = 200  # of each rank's stderr, remembered to tell whether a saved report came through
_MATCHED_LINES = 20  # of a report's last lines, which must have come through, in a row


def find_mpiexec():
    """The mpiexec beside this Python (the mpich wheel's), else the first on PATH; None if there is none."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


def hydra_problem(mpiexec):
    """None when `mpiexec` is MPICH's hydra, else why it cannot be used."""
    try:
        version = subprocess.run([mpiexec, "--version"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                 timeout=_VERSION_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot run {mpiexec} --version: {error}"
    if "HYDRA" not in version.stdout + version.stderr:
        return f"{mpiexec} is not MPICH's hydra (another MPI's mpiexec?); install the mpich wheel: pip install mpich"
    return None


def interface_settings(interfaces):
    """Hydra arguments that keep the job on the named network interfaces.

    Hydra's -iface takes one interface: it picks the address the hosts' proxies use to reach mpiexec. MPICH's
    ch4 network modules read their own variables: UCX may use every interface listed in UCX_NET_DEVICES;
    libfabric's tcp provider takes one in FI_TCP_IFACE. With several interfaces, the
    first carries hydra's and libfabric's traffic and UCX gets them all."""
    if not interfaces:
        return []
    return ["-iface", interfaces[0], "-genv", "UCX_NET_DEVICES", ",".join(interfaces),
            "-genv", "FI_TCP_IFACE", interfaces[0]]


def mpiexec_command(mpiexec, num_proc, hosts, job_env, command, launcher_agent=None, interfaces=(), mpi_args=(),
                    grace_s=5.0, stopped_limit_s=300.0):
    """The hydra command line; hosts is [(host, slots)], job_env what every rank gets on top of the launcher's
    environment. mpi_args come last among the options, so they can override the rest. grace_s: how long the other
    ranks have to report their errors once one failed; stopped_limit_s: how long a rank may stay stopped
    (RANK_GUARD)."""
    args = [mpiexec, "-launcher", "ssh"]
    if launcher_agent:
        args += ["-launcher-exec", launcher_agent]
    args += ["-hosts", ",".join(f"{host}:{slots}" for host, slots in hosts), "-n", str(num_proc)]
    args += interface_settings(list(interfaces))
    for name, value in job_env.items():
        args += ["-genv", name, value]
    # The job's secret goes from mpiexec's environment (launcher_environment), by name: never on a command line.
    # Hydra takes one -genvlist: a user's, in --mpi-args, gets the name added.
    mpi_args = list(mpi_args)
    if "-genvlist" in mpi_args[:-1]:
        where = mpi_args.index("-genvlist") + 1
        mpi_args[where] += "," + env_settings.SECRET
    else:
        args += ["-genvlist", env_settings.SECRET]
    firsts = ",".join(map(str, first_ranks(hosts, num_proc)))
    return args + mpi_args + [sys.executable, "-c", RANK_GUARD, "%g" % grace_s, "%g" % stopped_limit_s,
                                    firsts] + list(command)


def first_ranks(hosts, num_proc):
    """The first rank of each host that gets any of num_proc ranks: hydra fills the hosts [(host, slots)] in order."""
    firsts = [0]
    for _, slots in hosts[:-1]:
        firsts.append(firsts[-1] + slots)
    return [first for first in firsts if first < num_proc]


# --tcp: MPICH's network modules on TCP sockets only (UCX's and libfabric's spellings), as horovodrun's --tcp keeps
# Open MPI and NCCL off InfiniBand. A value the user set wins.
TCP_ONLY = {"UCX_TLS": "tcp,self,sm", "FI_PROVIDER": "tcp", "NCCL_IB_DISABLE": "1"}


def job_environment(token, flag_env, base_env, ranks_per_host, cores, tcp_only=False):
    """What every rank gets on top of the launcher's environment."""
    env = {name: value for name, value in TCP_ONLY.items() if name not in base_env} if tcp_only else {}
    env.update(flag_env)
    env["SHMCOMM_JOB_TOKEN"] = token  # one token for the whole job: it names the segments on every host
    env["SHMCOMM_LAUNCHER"] = "mpi"
    env["PYTHONUNBUFFERED"] = "1"
    if "OMP_NUM_THREADS" not in base_env:
        # As on one host: share the cores out among the ranks of a host. Only the remote hosts know their
        # cores, so this assumes they have as many as this one; set OMP_NUM_THREADS to say otherwise.
        env["OMP_NUM_THREADS"] = str(max(1, cores // max(1, ranks_per_host)))
    return env


def launcher_environment(base_env, ssh_port=None, ssh_identity_file=None, secret=None):
    """mpiexec's own environment: the launcher's without any rank identity of an enclosing job (the ranks take
    theirs from MPI), the ssh port and key for hydra's launcher, and the job's secret, which hydra passes on to
    the ranks (mpiexec_command's -genvlist)."""
    env = {name: value for name, value in base_env.items()
           if not any(name in (f"SHMCOMM_{key}", f"HOROVOD_{key}") for key in _IDENTITY)}
    # Hydra adds HYDRA_LAUNCHER_EXTRA_ARGS to every launcher call: `ssh -x -p PORT -i KEY HOST COMMAND`.
    extra = [env.get("HYDRA_LAUNCHER_EXTRA_ARGS")]
    if ssh_port is not None:
        extra.append(f"-p {int(ssh_port)}")
    if ssh_identity_file:
        extra.append(f"-i {shlex.quote(ssh_identity_file)}")
    if len(extra) > 1:
        env["HYDRA_LAUNCHER_EXTRA_ARGS"] = " ".join(filter(None, extra))
    if secret is not None:
        env[env_settings.SECRET] = secret
    return env


def run_mpi_job(mpiexec_args, env, token, kill_grace_seconds, verbose=False, notices=None, output_files=None,
                stamp=False):
    """Runs hydra and returns the job's exit code: hydra's, which is non-zero when any rank failed (hydra stops
    the others once the failed rank's guard is gone). A signal to the launcher goes to hydra, which passes it
    on to the ranks; a second signal, or hydra still running kill_grace_seconds after the first, kills it. Once a
    rank failed, hydra has the guard's grace (kill_grace_seconds) and _TEARDOWN_S more to stop the job, or is
    killed too. The job's output passes through here, so that the end can say which rank failed first and which
    ranks held the job up, and so that `notices` (a notice_server.NoticeServer, closed here) tells the ranks still
    starting which rank failed or is stopped. A rank's traceback that MPI_Abort cut off from the output is printed
    from the copy the rank saved in a private directory (ERROR_REPORT_DIR), removed at the end. output_files and
    stamp: --output-filename's files and --prefix-output-with-timestamp, as on one host (guard_output.relay)."""
    try:
        reports = tempfile.mkdtemp(prefix="shmcomm-errors-")  # mode 0700; its files 0600 (failure_reports.py)
    except OSError as error:
        say(f"note: cannot make a directory for the ranks' error reports ({error.strerror or error}): a traceback "
            f"that MPI_Abort cuts off is lost")
        return _run_mpi_job(mpiexec_args, env, token, kill_grace_seconds, verbose, notices, None, output_files, stamp)
    try:
        return _run_mpi_job([mpiexec_args[0], "-genv", ERROR_REPORT_DIR, reports] + list(mpiexec_args[1:]), env,
                            token, kill_grace_seconds, verbose, notices, reports, output_files, stamp)
    finally:
        shutil.rmtree(reports, ignore_errors=True)


def _run_mpi_job(mpiexec_args, env, token, kill_grace_seconds, verbose, notices, reports, output_files, stamp):
    if verbose:
        say("mpiexec command: " + shlex.join(mpiexec_args))
    started = time.time() - 1.0  # file times have coarse clocks: a margin, not a race
    try:
        # Its own session: a Ctrl-C in the terminal reaches only the launcher, which passes it on once.
        process = subprocess.Popen(mpiexec_args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True)
    except OSError as error:
        say(f"cannot run {mpiexec_args[0]!r}: {error.strerror or error}")
        return 127 if isinstance(error, FileNotFoundError) else 126
    received = []  # (signum, when)
    report = _Report(notices)
    relays = [threading.Thread(target=guard_output.relay, args=(pipe, stream, report, verbose, output_files, stamp),
                               daemon=True)
              for pipe, stream in ((process.stdout, sys.stdout), (process.stderr, sys.stderr))]
    for relay in relays:
        relay.start()

    def on_signal(signum, frame):
        received.append((signum, time.monotonic()))
        if len(received) == 1:
            say(f"received {signal_name(signum)}; passing it to mpiexec, which stops the ranks")
            try:
                process.send_signal(signum)
            except ProcessLookupError:
                pass
        else:
            say(f"received {signal_name(signum)} again; killing mpiexec")
            _signal_group(process, signal.SIGKILL)

    previous = {signum: signal.signal(signum, on_signal) for signum in FORWARDED_SIGNALS}
    try:
        while process.poll() is None:
            late = None
            if received and time.monotonic() - received[0][1] > kill_grace_seconds:
                late = f"{kill_grace_seconds:g} s after {signal_name(received[0][0])}"
            elif report.failed_at is not None and \
                    time.monotonic() - report.failed_at > kill_grace_seconds + _TEARDOWN_S:
                late = f"{kill_grace_seconds + _TEARDOWN_S:g} s after a rank failed"
            if late:
                say(f"mpiexec still running {late}; killing it")
                _signal_group(process, signal.SIGKILL)
                process.wait()
                break
            time.sleep(_POLL_SECONDS)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if process.poll() is None:  # an unexpected error in the launcher
            _signal_group(process, signal.SIGKILL)
            process.wait()
        deadline = time.monotonic() + _OUTPUT_DRAIN_S  # a process that outlived hydra may hold its pipes open
        for relay in relays:
            relay.join(max(0.0, deadline - time.monotonic()))
        if reports is not None:
            report.print_lost_reports(reports)
        # Ranks unlink their segments once all of them have attached; this removes what a failed job left on
        # this host. Simulated hosts share this host's /dev/shm, so it covers them all. On real hosts each
        # host's ranks unlink their own segments right after attaching; a crash before that leaves files there.
        if notices is not None:
            notices.close()
        removed = remove_job_segments(token) + remove_orphaned_mpi_segments(
            started, linger_s=_MPI_LINGER_S if received or process.returncode != 0 else 0.0)
        if verbose and removed:
            say(f"removed {len(removed)} shared-memory segment(s) the job left: {', '.join(removed)}")
    if received:
        return 128 + received[0][0]  # as on one host: the job was stopped, whatever hydra made of it
    code = exit_code_of(process.returncode)
    if code != 0:
        # A rank that raised an error of its own is the one to blame: by its saved report where its host shares this
        # file system, which tells the time it failed, else the first cause its guard passed on.
        cause = (failure_reports.first_cause(reports) if reports is not None else None) or report.first_cause()
        say(f"mpiexec exited with code {code}: " + (f"rank {cause[0]} failed first ({cause[1]})" if cause else
                                                    report.summary() or "a rank failed or could not be started"))
    return code


class _Report:
    """What the job's output said about its failure: the guards' lines, in order, the ranks errors named as not
    answering a roll call (shmcomm/smb/rollcall.py), and those the first such error named as gone (later ones
    also find the ranks that failed and ended meanwhile). Failures and stopped ranks go to `notices` as they come."""

    def __init__(self, notices=None):
        self.notices = notices
        self.failures = []
        self.failed_at = None  # time.monotonic() of the first guard line
        self.silent = set()
        self.gone = None
        self.aborted_by_mpi = set()  # ranks whose MPI aborted them itself (MPICH's "Abort(...): Fatal error")
        self.tails = {}  # rank: hashes of its last _TAIL_LINES stderr lines
        self.raised = {}  # rank: the last line of its saved report, for the summary
        self.causes = []  # (rank, cause) as the guards passed them on, first failure first

    def caused(self, rank, text):
        """A guard's frame: rank `rank` failed of its own error, `text`; the ranks hear it through the notices."""
        self.causes.append((rank, text))
        if self.notices is not None:
            self.notices.publish_cause(rank, text)

    def first_cause(self):
        """(rank, cause) of the first cause a guard passed on, or None."""
        return self.causes[0] if self.causes else None

    def read(self, line):
        found = _GUARD_LINE.match(line)
        if found:
            self.failures.append(found.group(1))
            if self.failed_at is None:
                self.failed_at = time.monotonic()
            parts = _FAILURE.match(found.group(1))
            if parts and self.notices is not None:
                self.notices.publish(int(parts.group(1)), parts.group(2), parts.group(3))
        found = _STOPPED_LINE.match(line)
        if found and self.notices is not None:
            self.notices.publish(int(found.group(1)), found.group(2), "is stopped (SIGSTOP, or a debugger)",
                                 stopped=True)
        found = _SILENT_LINE.match(line) or found
        if found:
            self.silent.update(int(r) for r in re.findall(r"\d+", found.group(1)))
        found = _MPI_ABORT_LINE.match(line)
        if found:
            self.aborted_by_mpi.add(int(found.group(1)))
        found = _GONE_LINE.match(line)
        if found and self.gone is None:
            self.gone = sorted(int(r) for r in re.findall(r"\d+", found.group(1)))
        found = _RANK_STDERR_LINE.match(line)
        if found:
            tail = self.tails.setdefault(int(found.group(1)), deque(maxlen=_TAIL_LINES))
            tail.append(hash(found.group(2)))

    def came_through(self, rank, lines):
        """Whether these lines of the rank's stderr came through: its last _MATCHED_LINES, in a row. One rank's
        stderr comes through in order, so the lines before them did too."""
        wanted = [hash(line) for line in lines[-_MATCHED_LINES:]]
        tail = list(self.tails.get(rank, ()))
        return any(tail[at:at + len(wanted)] == wanted for at in range(len(tail) - len(wanted) + 1))

    def print_lost_reports(self, directory):
        """Prints, prefixed with the rank as its own output would be, each traceback a rank saved in directory
        (shmcomm/startup/failure_reports.py) that did not come through the job's output."""
        try:
            names = os.listdir(directory)
        except OSError:
            return
        for rank, name in sorted((int(m.group(1)), m.group(0)) for m in map(_REPORT_RE.match, names) if m):
            try:
                with open(os.path.join(directory, name), "rb") as saved:
                    saved.seek(max(0, os.fstat(saved.fileno()).st_size - _MAX_REPORT_BYTES))  # the end says most
                    text = saved.read(_MAX_REPORT_BYTES).decode("utf-8", errors="replace")
            except OSError:
                continue
            if not text.strip():
                continue
            lines = text.rstrip("\n").split("\n")
            self.raised[rank] = next(line for line in reversed(lines) if line.strip())
            if self.came_through(rank, lines):
                continue
            say(f"rank {rank} died of an uncaught exception, whose traceback MPI_Abort cut off from the job's "
                f"output; the rank saved it:")
            write_console(sys.stderr, "".join(f"[{rank}]<stderr>: {line}\n" for line in lines))

    def summary(self):
        parts = [f"{self._first()} first"] if self.failures else []
        if not parts and self.raised:  # MPI_Abort killed the guards too: only the ranks' saved reports name them
            ranks = sorted(self.raised)
            parts.append(f"rank {ranks[0]} died of an uncaught exception: {self.raised[ranks[0]][:200]}"
                         if len(ranks) == 1 else f"{_ranks_text(ranks)} died of uncaught exceptions")
        if self.silent:
            ranks = sorted(self.silent)
            parts.append(f"{_ranks_text(ranks)} did not answer the others (stopped or hung): "
                         f"{'they' if len(ranks) > 1 else 'it'} held the job up")
        elif self.gone:
            parts.append(f"the first error found {_ranks_text(self.gone)} gone")
        return "; ".join(parts)

    def _first(self):
        """The first guard line's failure; but where MPI aborted that rank itself (MPICH's network module aborts a
        rank whose connection a dying peer reset) and a guard saw a rank killed by a signal, the killed one: the
        abort followed from it, and came out first only because that rank's guard is nearer."""
        first = self.failures[0]
        parts = _FAILURE.match(first)
        if parts and int(parts.group(1)) in self.aborted_by_mpi:
            killed = [f for f in self.failures[1:] if " was killed by signal " in f]
            if killed:
                return f"{killed[0]} (MPI aborted rank {parts.group(1)} after it)"
        return first


def _ranks_text(ranks):
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _signal_group(process, signum):
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # it ended in the meantime
