# SPDX-License-Identifier: Apache-2.0
"""Every flag of shmcommrun: horovodrun 0.28's, with Horovod's meaning, and shmcomm's own.

A flag either sets variables of the ranks' environment (ENV_FLAGS and SWITCHES, which the ranks read at init, so a
job started by hand with the same variables behaves the same), steers the launcher (hosts, output, multi-host
transport), or has no meaning here and earns a one-line note (notes()). Flags that --config-file can set default
to None, so the file fills in exactly those the command line left out.
"""

import argparse
import difflib
import sys

from shmcomm import __version__ as VERSION
from shmcomm.env import ALGORITHMS

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
ALLREDUCE_ALGORITHMS = ALGORITHMS  # env needs no C core: the launcher runs before it is built


def _number(text):
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return str(text).strip()  # the ranks parse it again; keep the user's spelling


def _fraction(text):
    value = float(_number(text))
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return str(text).strip()


def _megabytes_as_bytes(text):
    return str(int(float(_number(text)) * 1024 * 1024))


def _count(text, least=0):
    try:
        value = int(str(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
    return str(value)


def _positive(text):
    return _count(text, 1)


def _grid(text):
    columns, _, rows = str(text).strip().lower().partition("x")
    if not (columns.isdigit() and rows.isdigit() and int(columns) > 0 and int(rows) > 0):
        raise argparse.ArgumentTypeError(f"expected XxY (ranks per row x rows), e.g. 2x2, got {text!r}")
    return f"{int(columns)}x{int(rows)}"


def _algorithm(text):
    if str(text).strip().lower() not in ALLREDUCE_ALGORITHMS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(ALLREDUCE_ALGORITHMS)}, got {text!r}")
    return str(text).strip().lower()


def _log_level(text):
    level = str(text).strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def _cores(text):
    cores = str(text).replace(" ", "").split(",")
    if not all(core.isdigit() for core in cores):
        raise argparse.ArgumentTypeError(f"expected a core number, or one per local rank (0,1,2,3), got {text!r}")
    return ",".join(str(int(core)) for core in cores)


def _both(name):
    """The shmcomm variable and its Horovod twin, so Horovod scripts that read the latter see the same value."""
    return (f"SHMCOMM_{name}", f"HOROVOD_{name}")


# Flags with a value that only set variables: (flag, converter, variables, metavar, help).
ENV_FLAGS = (
    ("--start-timeout", _number, _both("START_TIMEOUT"), "S", "seconds init waits for every rank to attach"),
    ("--timeout", _number, ("SHMCOMM_TIMEOUT",), "S", "seconds any collective may wait while all peers are alive"),
    ("--gloo-timeout-seconds", _number, ("HOROVOD_GLOO_TIMEOUT_SECONDS",), "S",
     "Horovod's name for --timeout (used when --timeout is not given)"),
    ("--fusion-threshold-mb", _megabytes_as_bytes, _both("FUSION_THRESHOLD"), "MB",
     "tensor fusion buffer size in megabytes (0 disables fusion)"),
    ("--cycle-time-ms", _number, _both("CYCLE_TIME"), "MS", "milliseconds between background cycles"),
    ("--cache-capacity", _count, _both("CACHE_CAPACITY"), "N", "response cache entries (0 disables it)"),
    ("--autotune-log-file", str, _both("AUTOTUNE_LOG"), "FILE", "CSV of every autotuning sample; the last row is "
                                                                "the best"),
    ("--autotune-warmup-samples", _count, _both("AUTOTUNE_WARMUP_SAMPLES"), "N",
     "samples discarded before tuning starts (default 3)"),
    ("--autotune-steps-per-sample", _positive, _both("AUTOTUNE_STEPS_PER_SAMPLE"), "N",
     "training steps scored together as one sample (default 10)"),
    ("--autotune-bayes-opt-max-samples", _positive, _both("AUTOTUNE_BAYES_OPT_MAX_SAMPLES"), "N",
     "samples of the Bayesian search (default 20)"),
    ("--autotune-gaussian-process-noise", _fraction, _both("AUTOTUNE_GAUSSIAN_PROCESS_NOISE"), "X",
     "noise of the samples' scores, in [0, 1] (default 0.8)"),
    ("--timeline-filename", str, _both("TIMELINE"), "FILE", "write a timeline of the job to FILE"),
    ("--stall-check-warning-time-seconds", _number, _both("STALL_CHECK_TIME_SECONDS"), "S",
     "seconds before warning about a stalled tensor"),
    ("--stall-check-shutdown-time-seconds", _number, _both("STALL_SHUTDOWN_TIME_SECONDS"), "S",
     "seconds before shutting down a stalled job"),
    ("--thread-affinity", _cores, _both("THREAD_AFFINITY"), "CORE[,CORE...]",
     "pin each rank's background thread to this core (or one core per local rank)"),
    ("--num-nccl-streams", _count, ("HOROVOD_NUM_NCCL_STREAMS",), "N", "NCCL streams (one per rank here: noted)"),
    ("--log-level", _log_level, _both("LOG_LEVEL"), "LEVEL", "one of " + ", ".join(LOG_LEVELS)),
    ("--allreduce-algo", _algorithm, _both("ALLREDUCE_ALGO"), "ALGO",
     "allreduce across hosts: auto, torus, ring or mpi"),
    ("--torus-grid", _grid, _both("TORUS_GRID"), "XxY",
     "a logical 2D-torus grid of X ranks per row and Y rows (also on one host)"),
    ("--torus-small-bytes", _count, _both("TORUS_SMALL_BYTES"), "N",
     "bytes up to which the torus takes its single-exchange path"),
)

# On/off pairs, Horovod's: (dest, on flags, off flags, variables set to 1 or 0, help of the on flag). The variable
# is set only when a flag (or the config file) says so.
SWITCHES = (
    ("hierarchical_allreduce", ("--hierarchical-allreduce",), ("--no-hierarchical-allreduce",),
     _both("HIERARCHICAL_ALLREDUCE"), "across hosts: reduce in each host, across hosts, broadcast in each host "
                                      "(the torus on its default grid); --no-... takes MPI's flat allreduce"),
    ("torus_allreduce", ("--torus-allreduce",), ("--no-torus-allreduce",), _both("TORUS_ALLREDUCE"),
     "across hosts: the 2D-torus allreduce; --no-... holds the autotuner off it"),
    ("hierarchical_allgather", ("--hierarchical-allgather",), ("--no-hierarchical-allgather",),
     _both("HIERARCHICAL_ALLGATHER"), "accepted; allgather across hosts is MPI's own (noted)"),
    ("autotune", ("--autotune",), ("--no-autotune",), _both("AUTOTUNE"),
     "tune fusion threshold, cycle time, bucket size and the allreduce algorithm while the job trains"),
    ("timeline_mark_cycles", ("--timeline-mark-cycles",), ("--no-timeline-mark-cycles",),
     _both("TIMELINE_MARK_CYCLES"), "mark cycles in the timeline"),
    ("no_stall_check", ("--no-stall-check",), ("--stall-check",), _both("STALL_CHECK_DISABLE"),
     "disable the stall check"),
    ("mpi_threads_disable", ("--mpi-threads-disable",), ("--no-mpi-threads-disable",),
     _both("MPI_THREADS_DISABLE"), "initialise MPI with MPI_THREAD_SERIALIZED, not MULTIPLE (jobs across hosts)"),
    # Horovod's variable says the opposite of the flag's name.
    ("log_without_timestamp", ("--log-without-timestamp", "--log-hide-timestamp"),
     ("--log-with-timestamp", "--no-log-hide-timestamp"), ("HOROVOD_LOG_HIDE_TIME",),
     "log records without a timestamp (the default); --log-with-timestamp adds one"),
)

ELASTIC_FLAGS = (("min_num_proc", "--min-np"), ("max_num_proc", "--max-np"), ("slots", "--slots-per-host"),
                 ("elastic_timeout", "--elastic-timeout"), ("reset_limit", "--reset-limit"),
                 ("cooldown_range", "--blacklist-cooldown-range"))


def dest(flag):
    return flag.lstrip("-").replace("-", "_")


class _Help(argparse.Action):
    """-h/--help: every flag but the tuning ones, which --help-tuning lists (they are most of the flags)."""

    def __call__(self, parser, namespace, values, option_string=None):
        tuning = _tuning_actions(parser)
        saved = [action.help for action in tuning]
        for action in tuning:
            action.help = argparse.SUPPRESS
        try:
            parser.print_help()
        finally:
            for action, text in zip(tuning, saved):
                action.help = text
        parser.exit(0)


class _HelpTuning(argparse.Action):
    """--help-tuning: the tuning flags alone."""

    def __call__(self, parser, namespace, values, option_string=None):
        formatter = parser._get_formatter()
        formatter.start_section(TUNING)
        formatter.add_arguments(_tuning_actions(parser))
        formatter.end_section()
        parser._print_message(formatter.format_help(), sys.stdout)
        parser.exit(0)


def _tuning_actions(parser):
    return next(group for group in parser._action_groups if group.title == TUNING)._group_actions


class _Version(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        print(VERSION)
        parser.exit(0)


class _NetworkInterfaces(argparse.Action):
    """--network-interface may repeat; both spellings take a comma-separated list, the union is kept in order."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = list(getattr(namespace, self.dest, None) or [])
        for name in values.split(","):
            if name.strip() and name.strip() not in names:
                names.append(name.strip())
        setattr(namespace, self.dest, names)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, which names the closest flag when it meets one it does not know."""

    def error(self, message):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            known = [option for option in self._option_string_actions if option.startswith("--")]
            words = []
            for word in message[len(prefix):].split():
                close = difflib.get_close_matches(word.partition("=")[0], known, n=1)
                words.append("%s (did you mean %s?)" % (word, close[0]) if close else word)
            message = prefix + " ".join(words)
        super().error(message)


TUNING = "tuning (each flag only sets environment variables of the ranks, listed on the documentation's settings page)"
EXAMPLES = """%d tuning flags (fusion, autotuning, timeline, stall check, timeouts, algorithms): --help-tuning

examples:
  shmcommrun -np 4 python train.py                      4 ranks on this host
  shmcommrun -np 8 -H host1:4,host2:4 python train.py   8 ranks on 2 hosts (MPICH's mpiexec over ssh)
  shmcommrun -np 4 --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh python train.py
                                                        elastic: goes on with 2 to 8 ranks as hosts come and go"""


def build_parser(prog):
    parser = _Parser(
        prog=prog, allow_abbrev=False,
        description="Start N ranks of a command on this host (or, with -H/--hostfile, across hosts through MPICH's\n"
                    "mpiexec), prefix their output, and stop them all if one fails. Takes horovodrun's flags.",
        usage="%(prog)s -np N [options] command [args ...]", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES % (len(SWITCHES) + len(ENV_FLAGS)), add_help=False)
    parser.add_argument("-h", "--help", action=_Help, nargs=0, help="show this help and exit")
    parser.add_argument("--help-tuning", action=_HelpTuning, nargs=0, help="list the tuning flags and exit")
    parser.add_argument("-v", "--version", action=_Version, nargs=0, help="print shmcomm's version and exit")
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=int, metavar="N", help="number of ranks")
    parser.add_argument("-cb", "--check-build", action="store_true",
                        help="print what shmcomm can use here (frameworks, transports, tensor operations) and exit")
    parser.add_argument("--config-file", metavar="FILE",
                        help="YAML file in horovodrun's layout (params, autotune, timeline, stall_check, "
                             "library_options, logging); flags on the command line override it")
    parser.add_argument("--disable-cache", action="store_true",
                        help="accepted; shmcommrun keeps no cache of host checks")
    parser.add_argument("--output-filename", metavar="DIR",
                        help="also write each rank's raw output to DIR/rank.<r>/stdout and stderr")
    parser.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", action="store_true",
                        dest="prefix_output_with_timestamp", help="start each line of the ranks' output with the time")
    parser.add_argument("--kill-grace-seconds", type=float, default=5.0, metavar="S",
                        help="after a failure, seconds between SIGTERM and SIGKILL (default 5); across hosts, the "
                             "other ranks' time to report their errors before the job is stopped")
    parser.add_argument("--verbose", action="store_true", help="print the launch plan to stderr")
    parser.add_argument("--quiet", action="store_true", help="no line on stderr saying that the job started")

    hosts = parser.add_argument_group("hosts").add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="hosts to run on, with the ranks each takes (1 if left out); naming any host but this "
                            "one starts the job with MPICH's mpiexec")
    hosts.add_argument("-hostfile", "--hostfile", metavar="FILE",
                       help="file of 'host slots=N' lines ('#' comments), instead of -H")
    hosts.add_argument("--host-discovery-script", metavar="SCRIPT",
                       help="program printing 'host[:slots]' lines: makes the job elastic, as --min-np/--max-np do; "
                            "run every second (shmcomm/runner/elastic.py)")

    multi_host = parser.add_argument_group("multi-host jobs (started with MPICH's mpiexec, hydra)")
    multi_host.add_argument("-p", "--ssh-port", type=int, metavar="PORT", help="ssh port of the hosts")
    multi_host.add_argument("-i", "--ssh-identity-file", metavar="FILE", help="ssh private key for the hosts")
    for flag, text in (("--network-interfaces", "interfaces the job may use, comma-separated; the first carries "
                                                "mpiexec's own connections and libfabric's traffic, UCX uses all"),
                       ("--network-interface", "one interface (may repeat), as --network-interfaces")):
        multi_host.add_argument(flag, dest="network_interfaces", action=_NetworkInterfaces, metavar="IF", help=text)
    multi_host.add_argument("--mpi-args", metavar="ARGS", default="",
                            help="more arguments for mpiexec, split as a shell would (e.g. \"-genv UCX_TLS tcp\")")
    multi_host.add_argument("--binding-args", metavar="ARGS", default="",
                            help="process binding arguments for mpiexec (e.g. \"-bind-to core\")")
    multi_host.add_argument("--tcp", action="store_true", dest="tcp_flag",
                            help="use TCP only across hosts (UCX_TLS, FI_PROVIDER, NCCL_IB_DISABLE)")
    multi_host.add_argument("--launcher-agent", metavar="PATH",
                            help="program that hydra runs instead of ssh, as `PATH [ssh options] HOST COMMAND`")

    controller = parser.add_argument_group("controller (Horovod's choice; shmcomm has one)")
    choice = controller.add_mutually_exclusive_group()
    choice.add_argument("--gloo", action="store_true", dest="use_gloo", help="accepted (noted)")
    choice.add_argument("--mpi", action="store_true", dest="use_mpi", help="accepted (noted)")
    choice.add_argument("--jsrun", action="store_true", dest="use_jsrun", help="refused: no jsrun launcher")

    elastic = parser.add_argument_group("elastic jobs (workers may fail and be replaced, hosts may come and go "
                                        "while the job runs)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_num_proc", type=int, metavar="N",
                         help="fewest ranks the job goes on with; makes the job elastic")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_num_proc", type=int, metavar="N",
                         help="most ranks the job grows to when hosts come; makes the job elastic")
    elastic.add_argument("--slots-per-host", dest="slots", type=int, metavar="N",
                         help="slots of hosts the discovery script prints without a count")
    elastic.add_argument("--elastic-timeout", type=int, metavar="S", help="sets HOROVOD_ELASTIC_TIMEOUT")
    elastic.add_argument("--reset-limit", type=int, metavar="N",
                         help="accepted and checked, without effect: the world re-forms as often as it must")
    elastic.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=int, nargs=2,
                         metavar=("MIN", "MAX"), help="accepted and checked, without effect: a failed host is "
                                                      "tried again at the next discovery")

    tunables = parser.add_argument_group(TUNING)
    for name, on, off, names, text in SWITCHES:
        switch = tunables.add_mutually_exclusive_group()
        switch.add_argument(*on, dest=name, action="store_const", const=True, default=None,
                            help=f"{text} (sets {', '.join(names)})")
        switch.add_argument(*off, dest=name, action="store_const", const=False, help=argparse.SUPPRESS)
    for flag, convert, names, metavar, text in ENV_FLAGS:
        tunables.add_argument(flag, dest=dest(flag), type=convert, metavar=metavar,
                              help=f"{text} (sets {', '.join(names)})")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program each rank runs, and its arguments")
    return parser


def env_from_flags(args):
    """The variables the flags set; flags not given leave the launcher's own environment as it is."""
    env = {}
    for flag, _, names, _, _ in ENV_FLAGS:
        value = getattr(args, dest(flag))
        if value is not None:
            env.update(dict.fromkeys(names, value))
    for name, _, _, names, _ in SWITCHES:
        value = getattr(args, name)
        if value is not None:
            env.update(dict.fromkeys(names, "1" if value else "0"))
    if args.elastic_timeout is not None:
        env["HOROVOD_ELASTIC_TIMEOUT"] = str(args.elastic_timeout)
    if args.tcp_flag:
        env["NCCL_IB_DISABLE"] = "1"
    return env


def check(parser, args):
    """Usage errors of values argparse cannot judge alone."""
    for name, flag in (("min_num_proc", "--min-np"), ("max_num_proc", "--max-np"), ("slots", "--slots-per-host"),
                       ("reset_limit", "--reset-limit")):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.elastic_timeout is not None and args.elastic_timeout < 0:
        parser.error(f"--elastic-timeout must be >= 0, got {args.elastic_timeout}")
    if args.cooldown_range and not 0 <= args.cooldown_range[0] <= args.cooldown_range[1]:
        parser.error(f"--blacklist-cooldown-range: expected 0 <= MIN <= MAX, got {args.cooldown_range}")
    if args.num_proc is not None:
        if args.min_num_proc is not None and args.min_num_proc > args.num_proc:
            parser.error(f"--min-np {args.min_num_proc} is more than -np {args.num_proc}")
        if args.max_num_proc is not None and args.max_num_proc < args.num_proc:
            parser.error(f"--max-np {args.max_num_proc} is less than -np {args.num_proc}")
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        parser.error(f"-p/--ssh-port must be a port number, got {args.ssh_port}")
    if args.use_jsrun:
        parser.error("--jsrun: shmcommrun cannot start jobs with IBM's jsrun; start them with shmcommrun -H/--hostfile "
                     "(MPICH's mpiexec), or have jsrun start the ranks and let them find each other through MPI")


def notes(args, across_hosts):
    """One line for each flag given that has no effect here, and why."""
    lines = []
    if args.use_gloo or args.use_mpi:
        lines.append(f"--{'gloo' if args.use_gloo else 'mpi'} picks Horovod's controller; shmcomm has one: shared "
                     "memory inside a host, MPI (MPICH) across hosts")
    if args.disable_cache:
        lines.append("--disable-cache: shmcommrun keeps no cache of host checks, so there is nothing to disable")
    if args.num_nccl_streams is not None:
        lines.append("--num-nccl-streams: CUDA tensors use one NCCL stream per rank, the device communicator's own")
    if args.hierarchical_allgather is not None:
        lines.append("--[no-]hierarchical-allgather: allgather inside a host is shared memory and across hosts "
                     "MPI's own; there is no other to choose")
    given = [flag for name, flag in ELASTIC_FLAGS if getattr(args, name) is not None
             and name not in ("min_num_proc", "max_num_proc", "elastic_timeout")]
    if given:
        lines.append(f"{', '.join(given)}: accepted; shmcomm's elastic mode replaces every lost worker and needs "
                     f"no host blacklist")
    if not across_hosts:
        local = [flag for flag, given in (("-p/--ssh-port", args.ssh_port is not None),
                                          ("-i/--ssh-identity-file", args.ssh_identity_file),
                                          ("--network-interface(s)", args.network_interfaces),
                                          ("--mpi-args", args.mpi_args), ("--binding-args", args.binding_args),
                                          ("--tcp", args.tcp_flag), ("--launcher-agent", args.launcher_agent),
                                          ("--mpi-threads-disable", args.mpi_threads_disable)) if given]
        if local:
            lines.append(f"{', '.join(local)}: only jobs across hosts use them; this one runs on this host alone, "
                         "over shared memory")
        if args.hierarchical_allreduce is not None or args.torus_allreduce is not None:
            lines.append("--[no-]hierarchical-allreduce, --[no-]torus-allreduce: they choose among algorithms "
                         "across hosts; on one host every allreduce goes through shared memory (--torus-grid makes "
                         "a logical grid)")
    return lines
