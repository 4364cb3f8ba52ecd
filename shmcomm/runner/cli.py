# SPDX-License-Identifier: Apache-2.0
"""Command line of shmcommrun: parses the flags and turns them into the environment of every rank.

Flags never change the launcher's behaviour towards the ranks beyond their environment: the ranks read
everything at init, so a job started by hand with the same variables behaves the same. A job on this host only
is started here (spawn.py); one naming other hosts is handed to MPICH's mpiexec (mpi_launch.py).
"""

import argparse
import os
import secrets
import shlex
import shutil
import socket
import sys

from shmcomm.env import ALGORITHMS

from . import elastic

PROG = "shmcommrun"
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
_LOCAL_HOST_NAMES = ("localhost", "127.0.0.1")


def _number(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return text.strip()  # the ranks parse it again; keep the user's spelling


def _megabytes_as_bytes(text):
    return str(int(float(_number(text)) * 1024 * 1024))


def _count(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return str(value)


def _grid(text):
    columns, _, rows = text.strip().lower().partition("x")
    if not (columns.isdigit() and rows.isdigit() and int(columns) > 0 and int(rows) > 0):
        raise argparse.ArgumentTypeError(f"expected XxY (ranks per row x rows), e.g. 2x2, got {text!r}")
    return f"{int(columns)}x{int(rows)}"


ALLREDUCE_ALGORITHMS = ALGORITHMS  # env needs no C core: the launcher runs before it is built


def _algorithm(text):
    if text.strip().lower() not in ALLREDUCE_ALGORITHMS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(ALLREDUCE_ALGORITHMS)}, got {text!r}")
    return text.strip().lower()


def _log_level(text):
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def _both(name):
    """The shmcomm variable and its Horovod twin, so Horovod scripts that read the latter see the same value."""
    return (f"SHMCOMM_{name}", f"HOROVOD_{name}")


# The one table of flags that only set environment variables: (flag, converter or None for a switch that
# sets "1", variables set, metavar, help).
ENV_FLAGS = (
    ("--start-timeout", _number, ("SHMCOMM_START_TIMEOUT",), "S",
     "seconds init waits for every rank to attach"),
    ("--timeout", _number, ("SHMCOMM_TIMEOUT",), "S",
     "seconds any collective may wait while all peers are alive"),
    ("--fusion-threshold-mb", _megabytes_as_bytes, _both("FUSION_THRESHOLD"), "MB",
     "tensor fusion buffer size in megabytes"),
    ("--cycle-time-ms", _number, _both("CYCLE_TIME"), "MS", "milliseconds between background cycles"),
    ("--cache-capacity", _count, _both("CACHE_CAPACITY"), "N", "response cache entries (0 disables it)"),
    ("--timeline-filename", str, _both("TIMELINE"), "FILE", "write a timeline of the job to FILE"),
    ("--timeline-mark-cycles", None, _both("TIMELINE_MARK_CYCLES"), None, "mark cycles in the timeline"),
    ("--no-stall-check", None, _both("STALL_CHECK_DISABLE"), None, "disable the stall check"),
    ("--stall-check-warning-time-seconds", _number, _both("STALL_CHECK_TIME_SECONDS"), "S",
     "seconds before warning about a stalled tensor"),
    ("--stall-check-shutdown-time-seconds", _number, _both("STALL_SHUTDOWN_TIME_SECONDS"), "S",
     "seconds before shutting down a stalled job"),
    ("--log-level", _log_level, _both("LOG_LEVEL"), "LEVEL", "one of " + ", ".join(LOG_LEVELS)),
    ("--allreduce-algo", _algorithm, _both("ALLREDUCE_ALGO"), "ALGO",
     "allreduce across hosts: auto, torus, ring or mpi"),
    ("--torus-grid", _grid, _both("TORUS_GRID"), "XxY",
     "a logical 2D-torus grid of X ranks per row and Y rows (also on one host)"),
    ("--torus-small-bytes", _count, _both("TORUS_SMALL_BYTES"), "N",
     "bytes up to which the torus takes its single-exchange path"),
)


def _dest(flag):
    return flag.lstrip("-").replace("-", "_")


def build_parser():
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Start N ranks of a command on this host (or, with -H/--hostfile, across hosts through "
                    "MPICH's mpiexec), prefix their output, and stop them all if one fails.",
        usage="%(prog)s -np N [options] command [args ...]")
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=int, metavar="N", help="number of ranks")
    parser.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                        help="hosts to run on, with the ranks each takes (1 if left out); naming any host but "
                             "this one starts the job with MPICH's mpiexec")
    parser.add_argument("--hostfile", metavar="FILE",
                        help="file of 'host slots=N' lines ('#' comments), instead of -H")
    multi_host = parser.add_argument_group("multi-host jobs (started with MPICH's mpiexec, hydra)")
    multi_host.add_argument("-p", "--ssh-port", type=int, metavar="PORT", help="ssh port of the hosts")
    multi_host.add_argument("--network-interfaces", metavar="IF,...",
                            help="interfaces the job may use; the first carries mpiexec's own connections and "
                                 "libfabric's traffic, UCX uses them all")
    multi_host.add_argument("--mpi-args", metavar="ARGS", default="",
                            help="more arguments for mpiexec, split as a shell would (e.g. \"-genv UCX_TLS tcp\")")
    multi_host.add_argument("--launcher-agent", metavar="PATH",
                            help="program that hydra runs instead of ssh, as `PATH [ssh options] HOST COMMAND`")
    parser.add_argument("--output-filename", metavar="DIR",
                        help="also write each rank's raw output to DIR/rank.<r>/stdout and stderr")
    parser.add_argument("--kill-grace-seconds", type=float, default=5.0, metavar="S",
                        help="after a failure, seconds between SIGTERM and SIGKILL (default 5)")
    parser.add_argument("--verbose", action="store_true", help="print the launch plan to stderr")
    parser.add_argument("--check-build", action="store_true",
                        help="print what shmcomm can use here (frameworks, transports, tensor operations) and exit")
    tunables = parser.add_argument_group("tunables (each only sets environment variables of the ranks)")
    for flag, convert, names, metavar, text in ENV_FLAGS:
        text = f"{text} (sets {', '.join(names)})"
        if convert is None:
            tunables.add_argument(flag, dest=_dest(flag), action="store_true", help=text)
        else:
            tunables.add_argument(flag, dest=_dest(flag), type=convert, metavar=metavar, help=text)
    elastic.add_arguments(parser)  # elastic mode: its own module
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program each rank runs, and its arguments")
    return parser


def env_from_flags(args):
    """The variables the tunable flags set; flags not given leave the launcher's own environment as it is."""
    env = {}
    for flag, convert, names, _, _ in ENV_FLAGS:
        value = getattr(args, _dest(flag))
        if value is None or value is False:
            continue
        for name in names:
            env[name] = "1" if value is True else value
    return env


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
    """[(host, slots)] from -H or --hostfile; raises ValueError for a malformed entry, OSError for the file."""
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
    return hosts


def is_this_host(host):
    hostname = socket.gethostname()
    return host in set(_LOCAL_HOST_NAMES) | {hostname, hostname.split(".")[0]}


def foreign_hosts(args):
    """The hosts named on the command line that are not this host."""
    return [host for host, _ in requested_hosts(args) if not is_this_host(host)]


def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def rank_environments(num_proc, token, hostname, base_env, flag_env):
    """The full environment of each rank: the launcher's, then the flags', then the rank's identity."""
    environments = []
    for rank in range(num_proc):
        env = dict(base_env)
        env.update(flag_env)
        identity = {"RANK": rank, "SIZE": num_proc, "LOCAL_RANK": rank, "LOCAL_SIZE": num_proc,
                    "CROSS_RANK": 0, "CROSS_SIZE": 1, "HOSTNAME": hostname}
        for key, value in identity.items():
            env[f"SHMCOMM_{key}"] = str(value)
            env[f"HOROVOD_{key}"] = str(value)
        env["SHMCOMM_JOB_TOKEN"] = token
        env["PYTHONUNBUFFERED"] = "1"  # Python ranks would otherwise hold their output back until exit
        if "OMP_NUM_THREADS" not in base_env:
            # Each rank's math library would start a thread per core and spin; N ranks would then fight over the
            # cores (10x slower training here). Share the cores out, as torchrun does; set it to override.
            env["OMP_NUM_THREADS"] = str(max(1, _cores() // num_proc))
        environments.append(env)
    return environments


def describe_plan(command, environments, base_env):
    """The launch plan for --verbose: what every rank gets on top of the launcher's environment."""
    added = [{k: v for k, v in env.items() if base_env.get(k) != v} for env in environments]
    common = {k: v for k, v in added[0].items() if all(extra.get(k) == v for extra in added)}
    lines = [f"launching {len(environments)} rank(s) of: {shlex.join(command)}",
             "environment of every rank, on top of the launcher's:"]
    lines += [f"    {k}={v}" for k, v in sorted(common.items())]
    for rank, extra in enumerate(added):
        own = " ".join(f"{k}={v}" for k, v in sorted(extra.items()) if k not in common)
        lines.append(f"rank {rank}: {own} {shlex.join(command)}")
    return lines


def main(argv=None):
    """Entry point of shmcommrun; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.check_build:
        from .check_build import print_build_report  # only here: it may import heavy packages
        print_build_report()
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if elastic.requested(args):  # elastic mode: its own module
        if not command:
            parser.error("no command given: shmcommrun --min-np N --max-np M command [args ...]")
        return elastic.main(parser, args, command, dict(os.environ), env_from_flags(args), _cores(), is_this_host)
    if args.num_proc is None:
        parser.error("the number of ranks is required: -np N")
    if args.num_proc < 1:
        parser.error(f"-np must be at least 1, got {args.num_proc}")
    if not command:
        parser.error("no command given: shmcommrun -np N command [args ...]")
    if args.kill_grace_seconds < 0:
        parser.error("--kill-grace-seconds must be >= 0")
    if args.hosts and args.hostfile:
        parser.error("give either -H or --hostfile, not both")
    try:
        hosts = requested_hosts(args)
    except OSError as error:
        parser.exit(2, f"{PROG}: error: cannot read the hostfile: {error}\n")
    except ValueError as error:
        parser.error(str(error))
    if any(not is_this_host(host) for host, _ in hosts):
        return launch_across_hosts(parser, args, command, hosts)

    from .cleanup import remove_job_segments
    from .spawn import run_job, say

    token = secrets.token_hex(16)
    base_env = dict(os.environ)
    environments = rank_environments(args.num_proc, token, socket.gethostname(), base_env,
                                     env_from_flags(args))
    if args.verbose:
        for line in describe_plan(command, environments, base_env):
            say(line)
    try:
        return run_job(command, environments, args.kill_grace_seconds, args.output_filename)
    finally:
        removed = remove_job_segments(token)
        if args.verbose and removed:
            say(f"removed {len(removed)} shared-memory segment(s) the job left: {', '.join(removed)}")


def launch_across_hosts(parser, args, command, hosts):
    """Starts the job on the named hosts with MPICH's mpiexec; returns the exit code."""
    from . import mpi_launch
    from .spawn import say

    slots = sum(count for _, count in hosts)
    if args.num_proc > slots:
        parser.error(f"-np {args.num_proc} needs more slots than the hosts offer ({slots})")
    if args.output_filename:
        parser.error("--output-filename is not supported for multi-host jobs yet (mpiexec forwards the output)")
    try:
        mpi_args = shlex.split(args.mpi_args)
    except ValueError as error:
        parser.error(f"--mpi-args: {error}")
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
    interfaces = [name.strip() for name in (args.network_interfaces or "").split(",") if name.strip()]

    token = secrets.token_hex(16)
    base_env = dict(os.environ)
    ranks_per_host = min(args.num_proc, max(count for _, count in hosts))
    job_env = mpi_launch.job_environment(token, env_from_flags(args), base_env, ranks_per_host, _cores())
    mpiexec_args = mpi_launch.mpiexec_command(mpiexec, args.num_proc, hosts, job_env, command, agent,
                                              interfaces, mpi_args)
    if args.verbose:
        say(f"launching {args.num_proc} rank(s) on {', '.join(f'{h}:{n}' for h, n in hosts)} with mpiexec")
    env = mpi_launch.launcher_environment(base_env, args.ssh_port)
    return mpi_launch.run_mpi_job(mpiexec_args, env, token, args.kill_grace_seconds, args.verbose)
