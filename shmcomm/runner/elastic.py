# SPDX-License-Identifier: Apache-2.0
"""shmcommrun's elastic mode (Horovod's --min-np, --max-np, --host-discovery-script, --elastic-timeout), on this host.

The launcher starts workers and publishes who is in the job (membership.py); the workers take their rank from it
at every init. When a worker dies, the launcher publishes a membership without it at once: the survivors' collectives
fail on the dead peer, they roll back to their last commit and re-form (shmcomm/elastic.py). A membership with fewer
than --min-np workers is never published: the workers wait for capacity instead. When the discovery
script reports more slots (or, without a script, when a worker was lost and -np says how many to keep), new
workers start and join at the survivors' next commit. With fewer workers than --min-np for --elastic-timeout
seconds, the job stops with an error naming why: it never waits for ever. The job succeeds once its workers have
all exited and at least one finished with code 0.

Across hosts this mode is refused: worlds that span hosts are formed by MPI, which cannot replace a lost rank."""
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from shmcomm import membership

from .cleanup import remove_job_segments
from .spawn import _forward_output, describe_exit, say

_POLL_S = 0.05
_DISCOVERY_PERIOD_S = 1.0
_FINISH_S = 5.0  # after a worker has finished, how long the others have to finish too


DEFAULT_TIMEOUT_S = 600.0  # --elastic-timeout, as horovodrun's


def requested(args):
    """--min-np, --max-np or a discovery script make a job elastic, as in horovodrun (flags.py parses them)."""
    return args.min_num_proc is not None or args.max_num_proc is not None or args.host_discovery_script is not None


def discover(script, is_this_host, timeout_s=10.0):
    """Slots on this host according to the discovery script; raises ValueError for other hosts or bad output."""
    run = subprocess.run([script], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
    if run.returncode != 0:
        raise ValueError("host discovery script %s exited with code %d: %s" % (script, run.returncode,
                                                                               run.stderr.strip()))
    slots = 0
    for line in run.stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        host, _, count = line.partition(":")
        if not is_this_host(host):
            raise ValueError("host discovery script names %r: elastic jobs run on this host only" % host)
        slots += int(count) if count else 1
    return slots


class Driver:
    def __init__(self, command, env, min_np, max_np, initial, script, elastic_timeout, grace_s):
        self.command, self.env = command, env
        self.min_np, self.max_np, self.initial, self.script = min_np, max_np, initial, script
        self.elastic_timeout, self.grace_s = elastic_timeout, grace_s
        self.directory = tempfile.mkdtemp(prefix="shmcomm-elastic-")
        self.token = secrets.token_hex(16)
        self.generation = 0
        self.members = []      # worker ids in rank order
        self.pending = []      # started, not yet waiting for a membership (importing their framework)
        self.workers = {}      # id -> Popen
        self.finished = set()
        self.readers = []
        self.signal_received = None
        self.stopped = set()   # workers the launcher stopped itself

    def spawn(self, count):
        for _ in range(count):
            wid = len(self.workers)
            env = dict(self.env, SHMCOMM_ELASTIC_DIR=self.directory, SHMCOMM_ELASTIC_WORKER=str(wid),
                       SHMCOMM_ELASTIC_TIMEOUT=str(self.elastic_timeout))
            process = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, start_new_session=True)
            self.workers[wid] = process
            (self.pending if self.generation else self.members).append(wid)
            for pipe, stream, label in ((process.stdout, sys.stdout, "stdout"), (process.stderr, sys.stderr,
                                                                                 "stderr")):
                reader = threading.Thread(target=_forward_output, args=("w%d" % wid, pipe, stream, label, None),
                                          daemon=True)
                reader.start()
                self.readers.append(reader)

    def _stop_pending(self):
        for wid in self.pending:
            self.stopped.add(wid)
            try:
                os.killpg(self.workers[wid].pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        self.pending = []

    def publish(self, abort=None):
        self.generation += 1
        membership.write(self.directory, self.generation, self.token, self.members, abort)

    def capacity(self):
        if self.script is None:
            return self.initial
        return discover(self.script, self.is_this_host)

    def run(self):
        """Supervises the job; returns its exit code."""
        start = min(self.initial, self.max_np)
        self.spawn(start)
        self.publish()
        say("elastic job: %d worker(s) (min %d, max %d)" % (start, self.min_np, self.max_np))
        handled, short_since, next_discovery, slots, finished_at = set(), None, 0.0, start, None
        unpublished = False
        while True:
            changed = False
            for wid, process in self.workers.items():
                code = process.poll()
                if code is None or wid in handled:
                    continue
                handled.add(wid)
                if code == 0:
                    self.finished.add(wid)
                    finished_at = finished_at or time.monotonic()
                    self._stop_pending()  # the training is over: workers still starting have nothing to join
                    continue
                if wid in self.stopped:
                    continue
                rank = self.members.index(wid) if wid in self.members else -1
                if wid in self.members:
                    self.members.remove(wid)
                    changed = True
                if wid in self.pending:
                    self.pending.remove(wid)
                say("worker %d (rank %d) %s; %d worker(s) go on" % (wid, rank, describe_exit(code),
                                                                     len(self.members)))
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
            wanted = min(slots, self.max_np) - len(self.members) - len(self.pending)
            if wanted > 0 and not self.finished:
                self.spawn(wanted)
                say("started %d worker(s)" % wanted)
            # The others go on training while a new worker starts; it joins at their first commit once it waits.
            ready = [w for w in self.pending if os.path.exists(os.path.join(self.directory, "ready.%d" % w))]
            for wid in ready if not self.finished else []:
                self.pending.remove(wid)
                self.members.append(wid)
                say("worker %d is ready; the job grows to %d at its next commit" % (wid, len(self.members)))
                changed = True
            unpublished = unpublished or changed
            if unpublished and len(self.members) >= self.min_np:  # below it, the workers wait for capacity
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
        """Tells waiting workers why (abort), then SIGTERM, SIGKILL after the grace period."""
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
        for reader in self.readers:
            reader.join(1.0)
        for generation in range(1, self.generation + 1):
            remove_job_segments("%sg%d" % (self.token, generation))
        shutil.rmtree(self.directory, ignore_errors=True)


def main(parser, args, command, base_env, flag_env, cores, is_this_host):
    """Checks the elastic flags and runs the job; returns the exit code."""
    if args.hosts or args.hostfile:
        parser.error("elastic jobs run on this host only: use --host-discovery-script instead of -H/--hostfile")
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
            discover(script, is_this_host)
        except (ValueError, OSError, subprocess.TimeoutExpired) as error:
            parser.error(str(error))
    initial = args.num_proc if args.num_proc is not None else max_np
    env = dict(base_env)
    env.update(flag_env)
    env.update({"SHMCOMM_ELASTIC": "1", "HOROVOD_ELASTIC": "1", "PYTHONUNBUFFERED": "1"})
    # A joining worker waits in init until the others reach their next commit.
    env.setdefault("SHMCOMM_START_TIMEOUT", str(timeout_s))
    if "OMP_NUM_THREADS" not in base_env:
        env["OMP_NUM_THREADS"] = str(max(1, cores // max_np))
    driver = Driver(command, env, min_np, max_np, initial, script, timeout_s, args.kill_grace_seconds)
    driver.is_this_host = is_this_host  # cli's: this module must not import cli, which imports it
    previous = {s: signal.signal(s, driver.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return driver.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if any(p.poll() is None for p in driver.workers.values()):
            driver.stop(1)
        driver.close()
