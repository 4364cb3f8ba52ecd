# SPDX-License-Identifier: Apache-2.0
"""Several "hosts" on one Linux machine: network namespaces on a private bridge, each with its own host name.

    with SimulatedHosts(2, rate="1gbit") as sim:
        subprocess.run([mpiexec, *sim.mpiexec_args(2), sys.executable, "job.py"])

Needs root, iproute2 (`ip`, `tc`) and util-linux (`unshare`); otherwise entering raises SimulatedHostsUnavailable with
the reason (missing_prerequisite() says it beforehand), so tests can skip. Where they are all there, any failure to
make the hosts raises too."""

import ipaddress
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading

NAME_PREFIX = "shsim"  # of every namespace, link and state file created here; cleanup_stale() goes by it
HOST_NAME_PREFIX = "simhost"
SUBNET_PREFIX = "10.213"
HOST_INTERFACE = "eth0"  # the veth end inside every simulated host
NETNS_CONFIG_DIR = "/etc/netns"  # `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts
STATE_DIR = "/run/shmcomm-simhosts"  # one file per live instance, holding its owner's pid
_COMMAND_TIMEOUT = 30

# What keeps MPICH's traffic between simulated hosts on the bridge, for either ch4 network module.
MPI_ENVIRONMENT = {
    "UCX_TLS": "tcp,self",  # UCX would otherwise pick sysv/cma: the "hosts" share one kernel
    "UCX_NET_DEVICES": HOST_INTERFACE,
    "FI_PROVIDER": "tcp",  # used when MPIR_CVAR_CH4_NETMOD=ofi
    "FI_TCP_IFACE": HOST_INTERFACE,
}

_RATE_UNITS = {"bit": 1, "kbit": 10 ** 3, "mbit": 10 ** 6, "gbit": 10 ** 9, "tbit": 10 ** 12}


class SimulatedHostsUnavailable(RuntimeError):
    """Namespaces, bridges or veth pairs cannot be created here; the message says why."""


def _run(args, check=True):
    result = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=_COMMAND_TIMEOUT)
    if check and result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, args, result.stdout, result.stderr)
    return result


def rate_bits_per_second(rate):
    """'1gbit' -> 10**9; tc's decimal bit units only, so the number given to tc and used here agree."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", str(rate).lower())
    if not match or match.group(2) not in _RATE_UNITS:
        raise ValueError(f"rate {rate!r}: expected a number and one of {', '.join(_RATE_UNITS)}, e.g. '1gbit'")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def missing_prerequisite():
    """Why this machine cannot make simulated hosts at all (not root; no `ip`, `tc` or `unshare`), or None. Where
    this is None, a failure to make them is a fault to report, not a reason to skip."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, a bridge, veth pairs)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"simulated hosts need the {tool!r} command, which is not on PATH"
    return None


def _check_available():
    missing = missing_prerequisite()
    if missing is not None:
        raise SimulatedHostsUnavailable(missing)


def _pid_alive(pid):
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _agent_script(targets, private_dir):
    """An ssh stand-in: `agent [ssh options] HOST COMMAND...` runs COMMAND in HOST's namespace and name, with an
    empty private_dir of its own, on HOST's CPUs when it has its own (empty: all of them).

    Like ssh, it joins the command words with spaces for the remote shell to parse again (hydra quotes the
    proxy's path with that in mind)."""
    cases = "".join(f"  {'|'.join(shlex.quote(k) for k in keys)}) ns={shlex.quote(ns)} "
                    f"name={shlex.quote(name)} cpus={shlex.quote(cpus)} ;;\n" for keys, ns, name, cpus in targets)
    return f"""#!/bin/sh
# Simulated-host agent, called like ssh: agent [ssh options] HOST COMMAND...
while [ $# -gt 0 ]; do
  case "$1" in
    -p|-o|-l|-i|-F|-J|-E|-b|-c|-m) shift 2 ;;  # ssh options with a value mean nothing here
    --) shift; break ;;
    -*) shift ;;
    *) break ;;
  esac
done
if [ $# -lt 2 ]; then echo "usage: $0 [ssh options] HOST COMMAND..." >&2; exit 255; fi
host=$1; shift
case "$host" in
{cases}  *) echo "$0: $host is not one of the simulated hosts" >&2; exit 255 ;;
esac
pin=
if [ -n "$cpus" ]; then pin="taskset -c $cpus"; fi
exec ip netns exec "$ns" unshare --uts --mount $pin \\
  sh -c 'mount -t tmpfs -o mode=0700 shsim-private "$1" && hostname "$2" && shift 2 && exec "$@"' \\
  -- {shlex.quote(private_dir)} "$name" sh -c "$*"
"""


def host_cpus(n_hosts, cpus=None):
    """Each host's share of this machine's CPUs (taskset lists): contiguous parts as equal as they can be; with more
    hosts than CPUs, one CPU each in turn, so some hosts share one."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if not cpus:
        raise ValueError("no CPUs to share out")
    if n_hosts > len(cpus):
        return [str(cpus[i % len(cpus)]) for i in range(n_hosts)]
    shares, at = [], 0
    for i in range(n_hosts):
        take = len(cpus) // n_hosts + (1 if i < len(cpus) % n_hosts else 0)
        shares.append(",".join(str(c) for c in cpus[at:at + take]))
        at += take
    return shares


class SimulatedHosts:
    """Context manager creating `n_hosts` simulated hosts; `rate` (tc syntax, e.g. "1gbit") caps each host's
    link in both directions; `own_cpus` gives each host its own CPUs (host_cpus). Everything is removed on exit, on
    SIGTERM (when entered in the main thread) and by close(); cleanup_stale() removes what a killed process left.

    Each simulated host is a network namespace with a veth pair whose other end sits on a bridge in the root
    namespace (10.213.X.1/24 on the bridge, 10.213.X.(10+i)/24 in host i). Nothing routes beyond the bridge: the
    namespaces have no default route and the root namespace's forwarding is left as it is. Hosts still share the
    file system, /dev/shm and the process table; only the network, the host name and `private_dir` (an empty folder
    of its own in each host, as a host's own /tmp is: TMPDIR for a launcher whose files the hosts must not see) are
    their own.

    MPI (MPICH from the PyPI wheel, started by hydra) reaches the hosts through `agent`, an ssh stand-in that runs
    the proxy command inside the host's namespace under a fresh UTS namespace carrying the host's name. MPICH groups
    ranks into nodes by host name, so ranks of one simulated host meet in shared memory and ranks of different hosts
    go through the network module, which must not take shortcuts: UCX (the wheel's default) sees one machine and
    would move every byte through shared memory and cross-memory attach, so `MPI_ENVIRONMENT` limits it to TCP on
    the veth; libfabric (MPIR_CVAR_CH4_NETMOD=ofi) is pinned the same way."""

    def __init__(self, n_hosts, rate=None, own_cpus=False):
        if not 1 <= n_hosts <= 200:
            raise ValueError(f"n_hosts must be between 1 and 200, got {n_hosts}")
        self.n_hosts = n_hosts
        self.rate = rate
        # Real hosts do not share CPUs: with own_cpus each host's processes run on its own part of this machine's.
        self.cpus = host_cpus(n_hosts) if own_cpus else [""] * n_hosts
        if rate is not None:
            rate_bits_per_second(rate)  # refuse a bad rate before creating anything
        self.suffix = secrets.token_hex(3)
        self.bridge = f"{NAME_PREFIX}b{self.suffix}"
        self.namespaces = [f"{NAME_PREFIX}-{self.suffix}-{i}" for i in range(n_hosts)]
        self.veths = [f"{NAME_PREFIX}v{self.suffix}{i}" for i in range(n_hosts)]  # root-side ends
        self.hosts = [f"{HOST_NAME_PREFIX}{i}" for i in range(n_hosts)]
        self.addresses = []
        self.bridge_address = None
        self.agent = None
        self.private_dir = None
        self._state_file = os.path.join(STATE_DIR, self.suffix)
        self._previous_sigterm = None
        self._closed = False
        self._lock = threading.RLock()

    # --- life cycle -------------------------------------------------------------------------------------

    def __enter__(self):
        _check_available()
        try:
            self._create()
        except BaseException as error:
            self.close()
            if isinstance(error, subprocess.CalledProcessError):
                raise SimulatedHostsUnavailable(
                    f"cannot create simulated hosts: {shlex.join(error.cmd)} failed: "
                    f"{(error.stderr or '').strip() or error.returncode}") from error
            raise
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False

    def _on_sigterm(self, signum, frame):
        self.close()
        raise SystemExit(128 + signum)

    def _create(self):
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(self._state_file, "w") as state:
            state.write(str(os.getpid()))  # lets cleanup_stale() tell a live instance from a killed one
        network = ipaddress.ip_network(f"{SUBNET_PREFIX}.{self._free_third_octet()}.0/24")
        self.bridge_address = str(network[1])
        self.addresses = [str(network[10 + i]) for i in range(self.n_hosts)]
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        hosts_file = "".join(f"{addr} {name}\n" for addr, name in zip(self.addresses, self.hosts))
        hosts_file = "127.0.0.1 localhost\n" + hosts_file
        for ns, veth, address in zip(self.namespaces, self.veths, self.addresses):
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", HOST_INTERFACE, "netns", ns])
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", HOST_INTERFACE])
            _run(["ip", "-n", ns, "link", "set", HOST_INTERFACE, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # Host names resolve inside every simulated host, as on a real cluster.
            os.makedirs(os.path.join(NETNS_CONFIG_DIR, ns), exist_ok=True)
            with open(os.path.join(NETNS_CONFIG_DIR, ns, "hosts"), "w") as hosts:
                hosts.write(hosts_file)
            if self.rate is not None:
                self._limit_rate(ns, veth)
        self.agent = os.path.join(tempfile.mkdtemp(prefix=f"{NAME_PREFIX}-{self.suffix}-"), "agent")
        targets = [((name, addr), ns, name, cpus)
                   for name, addr, ns, cpus in zip(self.hosts, self.addresses, self.namespaces, self.cpus)]
        self.private_dir = os.path.join(os.path.dirname(self.agent), "private")
        os.mkdir(self.private_dir, 0o700)
        with open(self.agent, "w") as agent:
            agent.write(_agent_script(targets, self.private_dir))
        os.chmod(self.agent, 0o755)

    def _free_third_octet(self):
        used = set(re.findall(rf"inet {re.escape(SUBNET_PREFIX)}\.(\d+)\.", _run(["ip", "-o", "-4", "addr"]).stdout))
        free = [octet for octet in range(256) if str(octet) not in used]
        if not free:
            raise SimulatedHostsUnavailable(f"every {SUBNET_PREFIX}.X.0/24 is in use on this machine")
        return free[secrets.randbelow(len(free))]

    def _limit_rate(self, ns, veth):
        # A qdisc shapes only what leaves an interface, so each direction is shaped where it leaves: the host's
        # end for its outgoing traffic, the bridge's end for its incoming traffic (a full-duplex link).
        bytes_per_second = rate_bits_per_second(self.rate) / 8
        burst = str(max(64 * 1024, int(bytes_per_second / 250)))  # >= one GSO packet and one timer tick
        shaping = ["root", "tbf", "rate", str(self.rate), "burst", burst, "latency", "50ms"]
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", HOST_INTERFACE] + shaping)
        _run(["tc", "qdisc", "replace", "dev", veth] + shaping)

    def close(self):
        """Removes everything this instance created; safe to call more than once, and after a failed start."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _remove_instance(self.suffix, self.namespaces)
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None

    # --- use --------------------------------------------------------------------------------------------

    def host_list(self, ranks_per_host):
        """'simhost0:2,simhost1:2': hydra's -hosts and shmcommrun's -H."""
        return ",".join(f"{host}:{ranks_per_host}" for host in self.hosts)

    def mpiexec_args(self, ranks_per_host, extra_env=None):
        """Hydra's arguments for ranks_per_host ranks on every host; append the command to run."""
        env = dict(MPI_ENVIRONMENT, **(extra_env or {}))
        args = ["-launcher", "ssh", "-launcher-exec", self.agent,
                # Hydra's proxies connect back to mpiexec; its own host name resolves to 127.0.0.1, which inside
                # a namespace is that namespace's loopback, so give them the bridge's address instead.
                "-localhost", self.bridge_address,
                "-hosts", self.host_list(ranks_per_host), "-n", str(ranks_per_host * self.n_hosts)]
        for name, value in env.items():
            args += ["-genv", name, str(value)]
        return args

    def threads_per_rank(self, ranks_per_host):
        """The cores each rank may use: its host's own CPUs shared among its ranks, or, where the hosts share this
        machine's CPUs, those shared among every rank of every host."""
        if all(self.cpus):
            return max(1, min(len(cpus.split(",")) for cpus in self.cpus) // ranks_per_host)
        return max(1, len(os.sched_getaffinity(0)) // (ranks_per_host * self.n_hosts))

    def shmcommrun_args(self, ranks_per_host, extra_env=None):
        """shmcommrun's arguments for the same placement; append the command to run.

        OMP_NUM_THREADS is threads_per_rank unless extra_env says otherwise. shmcommrun gives the ranks of a
        multi-host job this host's cores over the ranks per host (it cannot see a remote host's cores), which here
        would give every simulated host all of this machine's cores: the ranks' torch threads would then outnumber
        the cores, and their spinning barriers slow a training step badly."""
        env = dict(MPI_ENVIRONMENT, OMP_NUM_THREADS=self.threads_per_rank(ranks_per_host), **(extra_env or {}))
        mpi_args = ["-localhost", self.bridge_address]
        for name, value in env.items():
            mpi_args += ["-genv", name, str(value)]
        return ["-np", str(ranks_per_host * self.n_hosts), "-H", self.host_list(ranks_per_host),
                "--launcher-agent", self.agent, "--mpi-args", shlex.join(mpi_args)]

    def link_bytes(self):
        """Bytes each host has sent and received on its link so far: [(sent, received)] by host."""
        counters = []
        for veth in self.veths:
            base = f"/sys/class/net/{veth}/statistics/"
            with open(base + "rx_bytes") as rx, open(base + "tx_bytes") as tx:
                counters.append((int(rx.read()), int(tx.read())))  # the bridge end sees them mirrored
        return counters


def _remove_instance(suffix, known_namespaces=()):
    """Kills what still runs in the instance's namespaces, then removes them, its links, its /etc/netns entries,
    its agent and its state file. Killing comes first: a namespace with processes inside outlives `ip netns del`."""
    listed = _run(["ip", "netns", "list"], check=False).stdout
    namespaces = set(known_namespaces) | set(re.findall(rf"^({NAME_PREFIX}-{suffix}-\d+)", listed, re.MULTILINE))
    for ns in sorted(namespaces):
        for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run(["ip", "netns", "del", ns], check=False)
    for link in _links_of(suffix):  # a veth whose namespace lives on still goes with its root-side end
        _run(["ip", "link", "del", link], check=False)
    for directory in (NETNS_CONFIG_DIR, tempfile.gettempdir()):
        if os.path.isdir(directory):
            for name in os.listdir(directory):
                if name.startswith(f"{NAME_PREFIX}-{suffix}-"):
                    shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    try:
        os.unlink(os.path.join(STATE_DIR, suffix))
    except FileNotFoundError:
        pass
    for directory in (NETNS_CONFIG_DIR, STATE_DIR):
        try:
            os.rmdir(directory)  # only when nothing else is left in it
        except OSError:
            pass


def _links_of(suffix):
    names = re.findall(r"^\d+: ([^:@\s]+)", _run(["ip", "-o", "link"], check=False).stdout, re.MULTILINE)
    pattern = re.compile(rf"{NAME_PREFIX}[bv]{re.escape(suffix)}\d*\Z")
    return [name for name in names if pattern.match(name)]


def cleanup_stale():
    """Removes the namespaces, links and files of instances whose process is gone (a killed run); returns the
    suffixes removed. Instances whose owner still runs are left alone."""
    _check_available()
    suffixes = set(re.findall(rf"^{NAME_PREFIX}-([0-9a-f]+)-\d+", _run(["ip", "netns", "list"]).stdout, re.MULTILINE))
    suffixes |= set(re.findall(rf"\d+: {NAME_PREFIX}[bv]([0-9a-f]{{6}})", _run(["ip", "-o", "link"]).stdout))
    for directory, pattern in ((STATE_DIR, r"([0-9a-f]{6})\Z"), (NETNS_CONFIG_DIR, rf"{NAME_PREFIX}-([0-9a-f]{{6}})-"),
                               (tempfile.gettempdir(), rf"{NAME_PREFIX}-([0-9a-f]{{6}})-")):
        if os.path.isdir(directory):
            suffixes |= {m.group(1) for m in map(re.compile(pattern).match, os.listdir(directory)) if m}
    removed = []
    for suffix in sorted(suffixes):
        try:
            with open(os.path.join(STATE_DIR, suffix)) as state:
                if _pid_alive(int(state.read().strip() or 0)):
                    continue
        except (FileNotFoundError, ValueError):
            pass
        _remove_instance(suffix)
        removed.append(suffix)
    return removed
