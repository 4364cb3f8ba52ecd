# SPDX-License-Identifier: Apache-2.0
"""shmcommrun's elastic mode (Horovod's --min-np, --max-np, --host-discovery-script, --elastic-timeout), on one host or
across hosts.

The launcher owns the membership (who is in the job, in which order, on which host), serves it over TCP
(elastic_server.py; the workers' side is startup/membership.py), starts workers itself (here directly, on other hosts
through ssh or --launcher-agent) and publishes a new membership whenever the job changes: a world of its own, with new
segments and a new TCP mesh (transport/tcp.py). Not MPI: its world cannot lose or gain a process, and hydra stops the
job when one dies. Not a file: other hosts share none, and a closed connection tells each side the other is gone."""
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time

from shmcomm import env as env_settings

from .cleanup import remove_job_segments
from .elastic_server import MembershipServer
from .console import forward_output
from .spawn import describe_exit, say

_POLL_S = 0.05
_DISCOVERY_PERIOD_S = 1.0
_FINISH_S = 5.0  # after a worker has finished, how long the others have to finish too
_FIRST_WORLD_WAIT_S = 60.0  # how long the first membership waits for every worker started with it
DEFAULT_TIMEOUT_S = 600.0  # --elastic-timeout, as horovodrun's
# Not passed on to workers on other hosts: they describe the launcher's own session, not the job.
_LOCAL_ONLY = {"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK",
               "DISPLAY", "XAUTHORITY", "TERM", "TERMCAP", "LS_COLORS", "MAIL", "PS1", "PROMPT_COMMAND"}


def requested(args):
    """--min-np, --max-np or a discovery script make a job elastic, as in horovodrun (flags.py parses them)."""
    return args.min_num_proc is not None or args.max_num_proc is not None or args.host_discovery_script is not None


def discover(script, default_slots=1, timeout_s=10.0):
    """{host: slots}, in the order the discovery script prints them ('host' or 'host:slots' lines); raises ValueError
    for a failed script or a bad line."""
    run = subprocess.run([script], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
    if run.returncode != 0:
        raise ValueError("host discovery script %s exited with code %d: %s" % (script, run.returncode,
                                                                               run.stderr.strip()))
    hosts = {}
    for line in run.stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        host, colon, count = line.partition(":")
        if not host or (colon and not count.isdigit()):
            raise ValueError("host discovery script %s printed %r: expected 'host' or 'host:slots'" % (script, line))
        hosts[host] = hosts.get(host, 0) + (int(count) if colon else default_slots)
    return hosts


def remote_command(env, command, cwd):
    """The shell command that starts a worker on another host: this directory, the job's environment (less what
    describes this session), the command. The job's secret is not in it (a command line is public on both hosts):
    the remote shell reads it from its standard input, one line, which the launcher writes (Driver.spawn)."""
    exports = [shlex.quote("%s=%s" % (k, v)) for k, v in sorted(env.items())
               if k not in _LOCAL_ONLY and k != env_settings.SECRET and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
    return "IFS= read -r %s && export %s && cd %s && exec env %s %s </dev/null" % (
        env_settings.SECRET, env_settings.SECRET, shlex.quote(cwd), " ".join(exports), shlex.join(command))


class Driver:
    """The launcher's side of an elastic job (see run).

    When a worker dies, the launcher publishes a membership without it at once: the survivors' collectives fail on the
    dead peer, they roll back to their last commit and re-form (shmcomm/elastic.py). A membership with fewer than
    --min-np workers is never published: the workers wait for capacity instead. The discovery script (run every
    second) says how many slots each host has; without one, this host has -np. Free slots get new workers (a
    replacement on the host that lost one, or the first workers of a new host), which join at the survivors' next
    commit and receive the state; a host that leaves the script's output (or fewer slots on one) has its newest
    workers retired at the next commit (HostsUpdatedInterrupt on every rank, as in Horovod), after which they exit.
    With fewer workers than --min-np for --elastic-timeout seconds, the job stops with an error naming why: it never
    waits for ever. The job succeeds once its workers have all exited and at least one finished with code 0."""

    def __init__(self, command, env, min_np, max_np, initial, script, elastic_timeout, grace_s, is_this_host,
                 agent=None, interfaces=None, default_slots=1):
        self.command, self.env = command, env
        self.min_np, self.max_np, self.initial, self.script = min_np, max_np, initial, script
        self.elastic_timeout, self.grace_s = elastic_timeout, grace_s
        self.is_this_host, self.agent, self.default_slots = is_this_host, agent, default_slots
        self.secret = env_settings.new_secret()
        # Without a discovery script every worker runs on this host: the launcher listens on loopback only.
        self.server = MembershipServer(bytes.fromhex(self.secret), interfaces, local_only=script is None)
        self.token = secrets.token_hex(16)
        self.generation = 0
        self.members = []      # worker ids in the job (published in rank order)
        self.pending = []      # started, not yet connected (importing their framework)
        self.workers = {}      # id -> Popen
        self.host_of = {}      # id -> the host it runs on
        self.finished = set()
        self.readers = []
        self.signal_received = None
        self.stopped = set()   # workers the launcher stopped itself
        self.retired = set()   # workers told to leave at their next commit (their host left)

    def spawn(self, host, count):
        for _ in range(count):
            wid = len(self.workers)
            env = dict(self.env, SHMCOMM_ELASTIC_DRIVER=",".join(self.server.addresses),
                       SHMCOMM_ELASTIC_WORKER=str(wid), SHMCOMM_ELASTIC_TIMEOUT=str(self.elastic_timeout))
            env[env_settings.SECRET] = self.secret
            local = self.is_this_host(host)
            if local:
                argv, process_env = self.command, env
            else:  # the environment travels in the command: ssh passes on none of it
                argv, process_env = self.agent + [host, remote_command(env, self.command, os.getcwd())], None
            process = subprocess.Popen(argv, env=process_env, stdin=subprocess.DEVNULL if local else subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            if not local:
                try:
                    process.stdin.write((self.secret + "\n").encode())
                    process.stdin.close()
                except OSError:  # the agent failed at once: its exit is reported like any worker's
                    pass
            self.workers[wid], self.host_of[wid] = process, host
            self.pending.append(wid)
            for pipe, stream, label in ((process.stdout, sys.stdout, "stdout"), (process.stderr, sys.stderr,
                                                                                 "stderr")):
                reader = threading.Thread(target=forward_output, args=("w%d" % wid, pipe, stream, label, None),
                                          daemon=True)
                reader.start()
                self.readers.append(reader)

    def _terminate(self, wid):
        self.stopped.add(wid)
        try:
            os.killpg(self.workers[wid].pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass

    def _stop_pending(self):
        for wid in self.pending:
            self._terminate(wid)
        self.pending = []

    def ranked(self):
        """The members in rank order: grouped by host, hosts in the order of their oldest worker, the oldest worker
        first within each (rank 0 is the oldest worker of all: one whose state is current)."""
        first = {}
        for wid in sorted(self.members):
            first.setdefault(self.host_of[wid], wid)
        return sorted(self.members, key=lambda w: (first[self.host_of[w]], w))

    def publish(self, abort=None):
        self.generation += 1
        members = self.ranked()
        self.server.publish({"generation": self.generation, "token": "%sg%d" % (self.token, self.generation),
                             "members": members, "hosts": [self.host_of[w] for w in members],
                             "addresses": [self.server.address_of(w) for w in members],
                             "retired": sorted(self.retired), "abort": abort})

    def capacity(self):
        """{host: slots}: the discovery script's, or -np on this host."""
        if self.script is None:
            return {"localhost": self.initial}
        return discover(self.script, self.default_slots)

    def place(self, slots):
        """Starts workers on hosts with free slots and retires the newest ones of hosts with too few; True if the
        membership changed. Workers stay where they run as long as their host has the slots; free slots are filled
        in the script's order, up to --max-np in all."""
        running = {}
        for wid in self.members + self.pending:
            running.setdefault(self.host_of[wid], []).append(wid)
        keep = {host: min(len(wids), slots.get(host, 0)) for host, wids in running.items()}
        budget = self.max_np - sum(keep.values())
        changed = False
        for host, wids in running.items():
            for wid in sorted(wids)[keep[host]:]:  # the newest go
                if wid in self.pending:
                    self.pending.remove(wid)
                    self._terminate(wid)
                else:
                    self.members.remove(wid)
                    self.retired.add(wid)
                    self.stopped.add(wid)
                    changed = True
                say("worker %d on %s is retired: its host has %d slot(s) now" % (wid, host, slots.get(host, 0)))
        for host, count in slots.items():
            extra = min(count - keep.get(host, 0), budget)
            if extra > 0:
                self.spawn(host, extra)
                budget -= extra
                say("started %d worker(s) on %s" % (extra, host))
        return changed

    def run(self):
        """Supervises the job; returns its exit code."""
        try:
            slots = self.capacity()
        except (OSError, ValueError, subprocess.TimeoutExpired) as error:
            say("host discovery failed: %s" % error)
            return 1
        self.place(slots)
        say("elastic job: %d worker(s) on %s (min %d, max %d)" % (
            len(self.pending), ", ".join("%s:%d" % hs for hs in slots.items()), self.min_np, self.max_np))
        handled, short_since, next_discovery, finished_at = set(), None, time.monotonic() + _DISCOVERY_PERIOD_S, None
        # The first world waits for all its workers (or --min-np of them at most this long), so that the job does not
        # start with a few and re-form as soon as the others are ready.
        first_world_by = time.monotonic() + min(_FIRST_WORLD_WAIT_S, self.elastic_timeout)
        unpublished = False
        while True:
            changed = False
            for wid, process in list(self.workers.items()):
                code = process.poll()
                if code is None or wid in handled:
                    continue
                handled.add(wid)
                if wid in self.stopped:
                    continue
                if code == 0:
                    self.finished.add(wid)
                    finished_at = finished_at or time.monotonic()
                    self._stop_pending()  # the training is over: workers still starting have nothing to join
                    continue
                rank = self.ranked().index(wid) if wid in self.members else -1
                if wid in self.members:
                    self.members.remove(wid)
                    changed = True
                if wid in self.pending:
                    self.pending.remove(wid)
                say("worker %d (rank %d) %s on %s; %d worker(s) go on" % (wid, rank, describe_exit(code),
                                                                           self.host_of[wid], len(self.members)))
                if not self.members and not self.finished:  # nobody left to hand the state on: a crash loop
                    say("every worker has failed; stopping the job")
                    self.stop(1, "every worker failed")
                    return code if 0 < code < 256 else 128 - code
            if len(handled) == len(self.workers):
                return 0 if self.finished else 1
            if self.signal_received is not None:
                return self.stop(128 + self.signal_received)
            if finished_at is not None and time.monotonic() - finished_at > max(self.grace_s, _FINISH_S):
                # The training is over; what is left are workers that were starting and will find no one to join.
                say("the job has finished; stopping %d worker(s) that were joining"
                    % sum(p.poll() is None for p in self.workers.values()))
                return self.stop(0, "the job has finished")
            now = time.monotonic()
            if changed:
                next_discovery = 0.0  # a worker was lost: ask for the slots now, not after a stale answer
            if not self.finished and now >= next_discovery:
                next_discovery = now + _DISCOVERY_PERIOD_S
                try:
                    slots = self.capacity()
                except (OSError, ValueError, subprocess.TimeoutExpired) as error:
                    say("host discovery failed: %s" % error)
                    return self.stop(1, str(error))
                changed = self.place(slots) or changed
            # The others go on training while a new worker starts; it joins at their first commit once it waits.
            ready = [w for w in self.pending if self.server.ready(w)]
            for wid in ready if not self.finished else []:
                self.pending.remove(wid)
                self.members.append(wid)
                say("worker %d on %s is ready; the job grows to %d at its next commit" % (wid, self.host_of[wid],
                                                                                         len(self.members)))
                changed = True
            unpublished = unpublished or changed
            first_ready = self.generation > 0 or not self.pending or now > first_world_by
            if unpublished and len(self.members) >= self.min_np and first_ready:  # below it, the workers wait
                self.publish()
                unpublished = False
            if len(self.members) < self.min_np and not self.finished:
                short_since = short_since or now
                if now - short_since > self.elastic_timeout:
                    reason = ("%d worker(s) left, fewer than --min-np %d, for %g s (--elastic-timeout)"
                              % (len(self.members), self.min_np, self.elastic_timeout))
                    say("stopping the job: " + reason)
                    return self.stop(1, reason)
            else:
                short_since = None
            time.sleep(_POLL_S)

    def stop(self, code, reason="the launcher was stopped"):
        """Tells the workers why (abort: they stop themselves, wherever they run), then SIGTERM to the processes
        this launcher started, SIGKILL after the grace period."""
        self.publish(abort=reason)
        running = [p for p in self.workers.values() if p.poll() is None]
        for signum in (signal.SIGTERM, signal.SIGKILL):
            for process in running:
                try:
                    os.killpg(process.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + self.grace_s
            while any(p.poll() is None for p in running) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
        return code

    def on_signal(self, signum, frame):
        self.signal_received = signum

    def close(self):
        self.server.close()
        for reader in self.readers:
            reader.join(1.0)
        # Hosts of simulated clusters share this host's /dev/shm; on real hosts each worker unlinks its segments
        # once every rank of its host has attached.
        for generation in range(1, self.generation + 1):
            remove_job_segments("%sg%d" % (self.token, generation))


def agent_command(args):
    """How workers start on other hosts: --launcher-agent, or ssh with -p and -i, as `AGENT [options] HOST CMD`."""
    if args.launcher_agent:
        return [args.launcher_agent]
    agent = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"]
    if args.ssh_port is not None:
        agent += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        agent += ["-i", args.ssh_identity_file]
    return agent


def main(parser, args, command, base_env, flag_env, cores, is_this_host):
    """Checks the elastic flags and runs the job; returns the exit code."""
    if args.hosts or args.hostfile:
        parser.error("elastic jobs take their hosts from --host-discovery-script, not -H/--hostfile")
    min_np = args.min_num_proc if args.min_num_proc is not None else (args.num_proc or 1)
    max_np = args.max_num_proc if args.max_num_proc is not None else max(args.num_proc or min_np, min_np)
    if min_np < 1 or max_np < min_np:
        parser.error("need 1 <= --min-np <= --max-np, got %d and %d" % (min_np, max_np))
    timeout_s = float(args.elastic_timeout) if args.elastic_timeout is not None else DEFAULT_TIMEOUT_S
    if timeout_s <= 0:
        parser.error("--elastic-timeout must be > 0")
    script = args.host_discovery_script
    if script is not None and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        parser.error("--host-discovery-script %r is not an executable file" % script)
    if script is not None:  # a script that fails now is a usage error, not a job that waits for capacity
        try:
            discover(script, args.slots or 1)
        except (ValueError, OSError, subprocess.TimeoutExpired) as error:
            parser.error(str(error))
    if args.launcher_agent and not os.access(args.launcher_agent, os.X_OK):
        parser.error("--launcher-agent %r is not an executable" % args.launcher_agent)
    initial = args.num_proc if args.num_proc is not None else max_np
    env = dict(base_env)
    env.update(flag_env)
    env.update({"SHMCOMM_ELASTIC": "1", "HOROVOD_ELASTIC": "1", "PYTHONUNBUFFERED": "1"})
    # A joining worker waits in init until the others reach their next commit.
    env.setdefault("SHMCOMM_START_TIMEOUT", str(timeout_s))
    if "OMP_NUM_THREADS" not in base_env:
        env["OMP_NUM_THREADS"] = str(max(1, cores // max_np))
    driver = Driver(command, env, min_np, max_np, initial, script, timeout_s, args.kill_grace_seconds, is_this_host,
                    agent_command(args), args.network_interfaces, args.slots or 1)
    previous = {s: signal.signal(s, driver.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return driver.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if any(p.poll() is None for p in driver.workers.values()):
            driver.stop(1)
        driver.close()
