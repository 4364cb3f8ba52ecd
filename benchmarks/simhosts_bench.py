# SPDX-License-Identifier: Apache-2.0
"""Runs a Python script across simulated hosts (network namespaces, see shmcomm/testing/simhosts.py) and prints
its timings.

    python -m benchmarks.simhosts_bench --hosts 2 --ranks-per-host 2 [--rate 1gbit] [--bytes 64M,4K]

Without --script, every rank runs this module's built-in worker: an mpi4py Allreduce (in place, float32, Sum)
of each size, timed over --iters calls after --warmup, each call's time being the slowest rank's. A script of
your own gets `--bytes B1,B2,... --iters N --warmup W` and prints what it likes; lines it prints as
`SIMHOSTS_RESULT {json}` with keys size, min_s, median_s and max_s join the table. --mpi-env NAME=VALUE passes
MPICH/UCX/libfabric settings to every rank (e.g. MPIR_CVAR_CH4_NETMOD=ofi, MPIR_CVAR_CH4_PROGRESS_THROTTLE=1).
Each simulated host runs on its own share of this machine's CPUs, as separate machines would; --shared-cpus
lets every host's ranks run on all of them instead.
Needs root; one job at a time, as the ranks share this machine's cores.
"""
import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time

RESULT_TAG = "SIMHOSTS_RESULT "
SHARED_CORES = {"SHMCOMM_SPIN_US": "2"}  # see run_driver
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_sizes(text):
    from benchmarks.collectives import parse_size
    return [parse_size(item.strip()) for item in text.split(",") if item.strip()]


def human_size(size):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return str(size)


# --- worker: runs in every rank ---------------------------------------------------------------------------

def run_worker(sizes, iters, warmup):
    import socket
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    placement = comm.gather({"rank": comm.rank, "processor": MPI.Get_processor_name(),
                             "hostname": socket.gethostname(), "local_size": local.size}, root=0)
    if comm.rank == 0:
        print(RESULT_TAG + json.dumps({"placement": placement}), flush=True)
    expected = comm.size * (comm.size + 1) / 2  # rank r contributes r + 1 everywhere
    for size in sizes:
        template = np.full(max(1, size // 4), comm.rank + 1, dtype=np.float32)
        buffer = template.copy()
        times = []
        for iteration in range(warmup + iters):
            np.copyto(buffer, template)  # outside the timed part: the next call starts from the same data
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, buffer, MPI.SUM)
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if iteration >= warmup:
                times.append(elapsed)
        wrong = int(comm.allreduce(int(np.count_nonzero(buffer != expected)), op=MPI.SUM))
        if comm.rank == 0:
            times.sort()
            print(RESULT_TAG + json.dumps({"size": buffer.nbytes, "min_s": times[0], "median_s": times[len(times) // 2],
                                           "max_s": times[-1], "wrong": wrong}), flush=True)
    local.Free()


# --- driver: sets up the hosts and starts the job ---------------------------------------------------------

def find_mpiexec():
    from shmcomm.runner.mpi_launch import find_mpiexec as find
    return find()


def job_command(args):
    worker_args = ["--bytes", args.bytes, "--iters", str(args.iters), "--warmup", str(args.warmup)]
    if args.script:
        return [sys.executable, os.path.abspath(args.script)] + worker_args + shlex.split(args.script_args)
    return [sys.executable, "-m", "benchmarks.simhosts_bench", "--worker"] + worker_args


def _children_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def print_report(results, wall_s, cpu_s, link_bytes, rate):
    for result in results:
        if "placement" in result:
            for rank in result["placement"]:
                print(f"rank {rank['rank']}: processor {rank['processor']}, hostname {rank['hostname']}, "
                      f"{rank['local_size']} rank(s) on its host")
    rows = [r for r in results if "size" in r]
    if rows:
        print(f"{'size':>8} {'min s':>10} {'median s':>10} {'max s':>10} {'GB/s':>8} {'wrong':>6}"
              + (f"   (links capped at {rate})" if rate else ""))
        for row in rows:
            gbps = row["size"] / row["median_s"] / 1e9 if row["median_s"] > 0 else float("inf")
            print(f"{human_size(row['size']):>8} {row['min_s']:10.4f} {row['median_s']:10.4f} {row['max_s']:10.4f} "
                  f"{gbps:8.3f} {row.get('wrong', '-'):>6}")
    print(f"job wall time {wall_s:.2f} s, CPU time {cpu_s:.2f} s; bytes sent/received per host link: "
          + ", ".join(f"{sent / 2**20:.1f}/{received / 2**20:.1f} MiB" for sent, received in link_bytes))


def run_driver(args):
    from shmcomm.testing.simhosts import SimulatedHosts, SimulatedHostsUnavailable

    # As in benchmarks.multihost: by default each simulated host runs on its own share of the CPUs, as separate
    # machines would. With --shared-cpus every host's ranks share all of them, which no rank can tell from its local
    # size and CPU set: shmcomm's waits must then yield the core at once (they would spin for a millisecond on a host
    # that seems to have a core per rank, holding the core another host's rank needs).
    extra_env = dict(SHARED_CORES if args.shared_cpus else {})
    extra_env.update(item.split("=", 1) for item in args.mpi_env)
    mpiexec = find_mpiexec()
    if mpiexec is None:
        print("no mpiexec beside %s or on PATH (pip install mpich)" % sys.executable, file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    try:
        with SimulatedHosts(args.hosts, rate=args.rate, own_cpus=not args.shared_cpus) as sim:
            command = [mpiexec] + sim.mpiexec_args(args.ranks_per_host, extra_env) + job_command(args)
            print("$ " + shlex.join(command), flush=True)
            before = sim.link_bytes()
            cpu_before = _children_cpu_seconds()
            start = time.perf_counter()
            try:
                job = subprocess.run(command, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired as expired:
                sys.stdout.write(expired.stdout or "")
                print(f"the job ran past --timeout {args.timeout} s and was stopped", file=sys.stderr)
                return 124
            wall_s = time.perf_counter() - start
            cpu_s = _children_cpu_seconds() - cpu_before  # ranks, proxies and mpiexec: spinning shows here
            link_bytes = [(s1 - s0, r1 - r0) for (s0, r0), (s1, r1) in zip(before, sim.link_bytes())]
    except SimulatedHostsUnavailable as error:
        print(f"simulated hosts unavailable: {error}", file=sys.stderr)
        return 2
    results = []
    for line in job.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            results.append(json.loads(line[len(RESULT_TAG):]))
        else:
            print(line)
    print_report(results, wall_s, cpu_s, link_bytes, args.rate)
    if job.returncode != 0:
        print(f"the job exited with code {job.returncode}", file=sys.stderr)
    return job.returncode


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.simhosts_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="simulated hosts (default 2)")
    parser.add_argument("--ranks-per-host", type=int, default=2, help="ranks on each host (default 2)")
    parser.add_argument("--rate", help="cap each host's link in both directions, tc syntax: 1gbit, 100mbit")
    parser.add_argument("--shared-cpus", action="store_true",
                        help="let every simulated host run on every CPU (by default each has its own)")
    parser.add_argument("--bytes", default="64M,4K", help="comma-separated sizes, K/M/G = powers of 1024")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per size (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    parser.add_argument("--script", help="a Python script every rank runs instead of the built-in worker")
    parser.add_argument("--script-args", default="", metavar="ARGS", help="more arguments for --script, one string")
    parser.add_argument("--mpi-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for every rank (repeatable)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds the job may take (default 300)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = parse_sizes(args.bytes)
    if args.worker:
        run_worker(sizes, args.iters, args.warmup)
        return 0
    if args.hosts < 1 or args.ranks_per_host < 1 or args.iters < 1 or args.warmup < 0:
        parser.error("--hosts, --ranks-per-host and --iters must be >= 1, --warmup >= 0")
    bad = [item for item in args.mpi_env if "=" not in item]
    if bad:
        parser.error(f"--mpi-env takes NAME=VALUE, got {bad[0]!r}")
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
