# SPDX-License-Identifier: Apache-2.0
"""Command line of shmcommrun: parses the flags and turns them into the environment of every rank.

Flags never change the launcher's behaviour towards the ranks beyond their environment: the ranks read
everything at init, so a job started by hand with the same variables behaves the same. A job on this host only
is started here (spawn.py); one naming other hosts is handed to MPICH's mpiexec (mpi_launch.py). An elastic job
(--min-np, --max-np, --host-discovery-script) is run by elastic.py, on this host or across hosts.
"""

import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys

from shmcomm import env

from . import config_file
from .notice_server import NoticeServer
from .flags import ALLREDUCE_ALGORITHMS, build_parser as _build_parser, check, env_from_flags, notes

from . import elastic

PROG = "shmcommrun"
_LOCAL_HOST_NAMES = ("localhost", "127.0.0.1")
_DISCOVERY_TIMEOUT_S = 60
__all__ = ["ALLREDUCE_ALGORITHMS", "env_from_flags", "main"]


def build_parser():
    return _build_parser(PROG)


def _slots(text, where):
    try:
        slots = int(text)
    except ValueError:
        slots = 0
    if slots < 1:
        raise ValueError(f"{where}: expected a number of slots >= 1, got {text!r}")
    return slots


def _host_entry(entry, where):
    """(host, slots) from 'host', 'host:N' or 'host slots=N'."""
    fields = entry.split()
    host, _, slots = fields[0].partition(":")
    for field in fields[1:]:
        key, _, value = field.partition("=")
        if key != "slots" or slots:
            raise ValueError(f"{where}: expected 'host slots=N', got {entry!r}")
        slots = value
    return host, _slots(slots, where) if slots else 1


def requested_hosts(args):
    """[(host, slots)] from -H, --hostfile or the discovery script; raises ValueError for a malformed entry or a
    failed script, OSError for the file."""
    hosts = []
    if args.hosts:
        for entry in args.hosts.split(","):
            if entry.strip():
                hosts.append(_host_entry(entry.strip(), "-H"))
    if args.hostfile:
        with open(args.hostfile) as hostfile:
            for number, line in enumerate(hostfile, 1):
                text = line.split("#")[0].strip()
                if text:
                    hosts.append(_host_entry(text, f"{args.hostfile} line {number}"))
    if args.host_discovery_script:
        hosts = discovered_hosts(args.host_discovery_script, args.slots or 1)
    return hosts


def discovered_hosts(script, default_slots):
    """The hosts a discovery script prints, one 'host[:slots]' a line, run once (the job does not resize)."""
    where = f"--host-discovery-script {script}"
    try:
        done = subprocess.run([script], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=_DISCOVERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"{where}: cannot run it: {getattr(error, 'strerror', None) or error}") from None
    if done.returncode != 0:
        raise ValueError(f"{where}: exited with code {done.returncode}: {done.stderr.strip()[-500:]}")
    hosts = []
    for line in done.stdout.splitlines():
        if line.strip():
            host, slots = _host_entry(line.strip(), where)
            hosts.append((host, slots if ":" in line else default_slots))
    if not hosts:
        raise ValueError(f"{where}: printed no hosts")
    return hosts


def is_this_host(host):
    hostname = socket.gethostname()
    return host in set(_LOCAL_HOST_NAMES) | {hostname, hostname.split(".")[0]}


def foreign_hosts(args):
    """The hosts named on the command line that are not this host."""
    return [host for host, _ in requested_hosts(args) if not is_this_host(host)]


def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def free_port(address="127.0.0.1"):
    """A TCP port nothing listens on now at `address` (the kernel's pick): torch.distributed's store binds it."""
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def rank_environments(num_proc, token, hostname, base_env, flag_env, secret=None):
    """The full environment of each rank: the launcher's, then the flags', then the rank's identity, also under
    torchrun's names, so that a torch.distributed script runs unchanged, and the job's secret (a fresh one unless
    given)."""
    secret = secret or env.new_secret()
    environments = []
    master_port = str(free_port())
    for rank in range(num_proc):
        environ = dict(base_env)
        environ.update(flag_env)
        identity = {"RANK": rank, "SIZE": num_proc, "LOCAL_RANK": rank, "LOCAL_SIZE": num_proc,
                    "CROSS_RANK": 0, "CROSS_SIZE": 1, "HOSTNAME": hostname}
        for key, value in identity.items():
            environ[f"SHMCOMM_{key}"] = str(value)
            environ[f"HOROVOD_{key}"] = str(value)
        environ.update(RANK=str(rank), WORLD_SIZE=str(num_proc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(num_proc),
                       GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=master_port)
        environ["SHMCOMM_JOB_TOKEN"] = token
        environ[env.SECRET] = secret
        environ["PYTHONUNBUFFERED"] = "1"  # Python ranks would otherwise hold their output back until exit
        if "OMP_NUM_THREADS" not in base_env:
            # Each rank's math library would start a thread per core and spin; N ranks would then fight over the
            # cores, which slows training badly. Share the cores out, as torchrun does; set it to override.
            environ["OMP_NUM_THREADS"] = str(max(1, _cores() // num_proc))
        environments.append(environ)
    return environments


def describe_plan(command, environments, base_env):
    """The launch plan for --verbose: what every rank gets on top of the launcher's environment."""
    # Never the job's secret: the ranks' proof that a connection is the job's.
    added = [{k: v for k, v in environ.items() if base_env.get(k) != v and k != env.SECRET}
             for environ in environments]
    common = {k: v for k, v in added[0].items() if all(extra.get(k) == v for extra in added)}
    lines = [f"launching {len(environments)} rank(s) of: {shlex.join(command)}",
             "environment of every rank, on top of the launcher's:"]
    lines += [f"    {k}={v}" for k, v in sorted(common.items())]
    for rank, extra in enumerate(added):
        own = " ".join(f"{k}={v}" for k, v in sorted(extra.items()) if k not in common)
        lines.append(f"rank {rank}: {own} {shlex.join(command)}")
    return lines


def parse(argv=None):
    """(parser, args) with the config file applied and every usage error reported (exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config_file:
        try:
            config_file.apply(args, config_file.load(args.config_file))
        except ValueError as error:
            parser.error(f"--config-file {args.config_file}: {error}")
    check(parser, args)
    return parser, args


def main(argv=None):
    """Entry point of shmcommrun; returns the exit code."""
    parser, args = parse(argv)
    if args.check_build:
        from .check_build import print_build_report  # only here: it may import heavy packages
        print_build_report()
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    _check_settings(parser, args)
    if elastic.requested(args):  # elastic mode: its own module
        if not command:
            parser.error("no command given: shmcommrun --min-np N --max-np M command [args ...]")
        return elastic.main(parser, args, command, env.environment(), env_from_flags(args), _cores(), is_this_host)
    if args.num_proc is None:
        parser.error("the number of ranks is required: -np N")
    if args.num_proc < 1:
        parser.error(f"-np must be at least 1, got {args.num_proc}")
    if not command:
        parser.error("no command given: shmcommrun -np N command [args ...]")
    if args.kill_grace_seconds < 0:
        parser.error("--kill-grace-seconds must be >= 0")
    try:
        hosts = requested_hosts(args)
    except OSError as error:
        parser.exit(2, f"{PROG}: error: cannot read the hostfile: {error}\n")
    except ValueError as error:
        parser.error(str(error))
    across_hosts = any(not is_this_host(host) for host, _ in hosts)

    from .cleanup import remove_job_segments
    from .spawn import plural, run_job, say

    for line in notes(args, across_hosts):
        say("note: " + line)
    if across_hosts:
        return launch_across_hosts(parser, args, command, hosts)
    if hosts and args.num_proc > sum(slots for _, slots in hosts):
        parser.error(f"-np {args.num_proc} needs more slots than the hosts offer ({sum(s for _, s in hosts)})")

    token = secrets.token_hex(16)
    base_env = env.environment()
    environments = rank_environments(args.num_proc, token, socket.gethostname(), base_env,
                                     env_from_flags(args))
    if not args.quiet:
        say(f"{plural(args.num_proc, 'rank')} on this host, job {token[:8]}")
    if args.verbose:
        for line in describe_plan(command, environments, base_env):
            say(line)
    try:
        return run_job(command, environments, args.kill_grace_seconds, args.output_filename,
                       args.prefix_output_with_timestamp, _timeout_s(environments[0]))
    finally:
        removed = remove_job_segments(token)
        if args.verbose and removed:
            say(f"removed {len(removed)} shared-memory segment(s) the job left: {', '.join(removed)}")


def _check_settings(parser, args):
    """Refuses a bad SHMCOMM_*/HOROVOD_* value (or flag) before any rank starts, in one line naming it, exit code 2:
    otherwise every rank would print the same traceback. The ranks check again at init (a job started by hand)."""
    environ = {**env.environment(), **env_from_flags(args)}
    try:
        env.validate(environ)
        if args.num_proc and not elastic.requested(args):
            env.paths(args.num_proc, environ)
    except ValueError as error:
        parser.exit(2, f"{PROG}: error: {error}\n")


def _timeout_s(environ):
    """The ranks' SHMCOMM_TIMEOUT; a bad value is theirs to refuse, naming it (init checks every setting)."""
    try:
        return env.timeout_s(environ)
    except ValueError:
        return env.timeout_s({})


def launch_across_hosts(parser, args, command, hosts):
    """Starts the job on the named hosts with MPICH's mpiexec; returns the exit code."""
    from . import mpi_launch, reach
    from .spawn import open_output_files, plural, say

    slots = sum(count for _, count in hosts)
    if args.num_proc > slots:
        parser.error(f"-np {args.num_proc} needs more slots than the hosts offer ({slots})")
    mpi_args = []
    for flag, text in (("--binding-args", args.binding_args), ("--mpi-args", args.mpi_args)):
        try:
            mpi_args += shlex.split(text)
        except ValueError as error:
            parser.error(f"{flag}: {error}")
    agent = None
    if args.launcher_agent:
        agent = shutil.which(args.launcher_agent)
        if agent is None:
            parser.exit(2, f"{PROG}: error: --launcher-agent {args.launcher_agent!r} is not an executable\n")
    mpiexec = mpi_launch.find_mpiexec()
    if mpiexec is None:
        parser.exit(127, f"{PROG}: error: multi-host jobs need MPICH's mpiexec, and there is none beside "
                         f"{sys.executable} or on PATH; install it with: pip install mpich\n")
    problem = mpi_launch.hydra_problem(mpiexec)
    if problem:
        parser.exit(127, f"{PROG}: error: {problem}\n")
    interfaces = args.network_interfaces or []
    remote = sorted({h for h, _ in hosts if not is_this_host(h)})
    unreachable = reach.unreachable_host(remote, agent, args.ssh_port, args.ssh_identity_file)
    if unreachable:
        parser.exit(1, f"{PROG}: error: cannot reach host {unreachable[0]}: {unreachable[1]}\n")

    token = secrets.token_hex(16)
    secret = env.new_secret()
    base_env = env.environment()
    ranks_per_host = min(args.num_proc, max(count for _, count in hosts))
    job_env = mpi_launch.job_environment(token, env_from_flags(args), base_env, ranks_per_host, _cores(),
                                         args.tcp_flag)
    # Tells ranks still in MPI's start which rank failed; listens where the other hosts reach this one.
    notices = NoticeServer(bytes.fromhex(secret), interfaces, remote)
    job_env["SHMCOMM_LAUNCHER_NOTICES"] = ",".join(notices.addresses)
    # torch.distributed's store on the first host; the port is free here, which is all this host can know of it.
    first = socket.gethostname() if hosts[0][0] in _LOCAL_HOST_NAMES else hosts[0][0]
    job_env.update(MASTER_ADDR=first, MASTER_PORT=str(free_port("0.0.0.0")))
    mpiexec_args = mpi_launch.mpiexec_command(mpiexec, args.num_proc, hosts, job_env, command, agent,
                                              interfaces, mpi_args, args.kill_grace_seconds,
                                              _timeout_s({**base_env, **job_env}))
    if not args.quiet:
        used = len(mpi_launch.first_ranks(hosts, args.num_proc))
        say(f"{plural(args.num_proc, 'rank')} on {plural(used, 'host')}, job {token[:8]}")
    if args.verbose:
        say(f"launching {args.num_proc} rank(s) on {', '.join(f'{h}:{n}' for h, n in hosts)} with mpiexec")
    launcher_env = mpi_launch.launcher_environment(base_env, args.ssh_port, args.ssh_identity_file, secret)
    try:
        output_files = open_output_files(args.output_filename, args.num_proc) if args.output_filename else None
    except OSError as error:
        say(f"cannot create the output files under {args.output_filename!r}: {error}")
        return 1
    try:
        return mpi_launch.run_mpi_job(mpiexec_args, launcher_env, token, args.kill_grace_seconds, args.verbose,
                                      notices, output_files, args.prefix_output_with_timestamp)
    finally:
        for files in output_files or ():
            for file in files:
                file.close()
