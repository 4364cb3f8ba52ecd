# SPDX-License-Identifier: Apache-2.0
"""Soft Memory Boxes across simulated hosts, next to MPI one-sided operations and MPI's allreduce of the same wheel,
in one job (python -m benchmarks.smb --hosts 2 runs this).

    python -m benchmarks.smb --hosts 2 [--ranks-per-host 1] [-b 4K -e 64M -f 4] [--rounds 3]

Remote operations: a rank of host 1 on a box homed on host 0 (accumulate, read) against MPI_Accumulate (SUM) and
MPI_Get on a window of rank 0, each in a passive-target epoch (MPI_Win_lock .. MPI_Win_unlock), float32. Two
scenarios for the home host's ranks while the remote rank works:
    in sequence  they wait in MPI_Barrier (MPI progresses: the best case for one-sided MPI)
    overlapped   they compute (numpy steps of about --step-ms each) and poll MPI once per step (MPI_Iprobe), as a
                 training rank that calls MPI between steps; the box servers need no call at all
    in Python    the same, with steps of pure Python (the interpreter lock held, as a loop of small torch operations
                 holds it): the box servers never need that lock, MPI still progresses only in MPI_Iprobe
Parameter exchange of one step, every rank: the ElasticCentre's exchange (x goes to each stripe's host, d comes back
and the centre takes it, one atomic box exchange per stripe; box striped over the hosts) against MPI_Allreduce of the
same bytes; in sequence (nothing else running) and overlapped (the exchange, or MPI_Iallreduce, in flight during a
--step-ms compute step; time per step).

Times are medians over each measurement's iterations; the box and MPI take turns round by round (--rounds) and the
table shows the median over rounds; ratios are MPI's time over the box's (above 1: the box is faster)."""
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = "SMB_HOSTS "
BUDGET_S = 0.4   # per measurement, at most (iterations are cut to fit, at least MIN_ITERS)
MIN_ITERS = 3
MAX_ITERS = 200
REMOTE_SCENARIOS = ("in sequence", "overlapped", "in Python")


def _timed(run, budget_s=BUDGET_S):
    """Median seconds of `run` over as many calls as fit the budget (the first call estimates)."""
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    n = int(min(MAX_ITERS, max(MIN_ITERS, budget_s / max(first, 1e-6))))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


class Busy:
    """The home host's ranks' numpy steps; one MPI_Iprobe between steps (MPI's chance to progress)."""

    def __init__(self, step_ms):
        self.a = np.random.default_rng(0).standard_normal((128, 128))
        t0, k = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.05:
            self._one()
            k += 1
        self.repeat = max(1, int(step_ms / 1e3 / ((time.perf_counter() - t0) / k)))
        self.step_s = step_ms / 1e3

    def _one(self):
        self.a = np.tanh(self.a @ self.a)

    def step(self):
        for _ in range(self.repeat):
            self._one()

    def python_step(self):
        """About as long as step(), in bytecode: the interpreter lock is given up only at the switch interval."""
        deadline = time.perf_counter() + self.step_s
        while time.perf_counter() < deadline:
            total = 0
            for i in range(1000):
                total += i * i


def worker(sizes, rounds, step_ms):
    import shmcomm
    from mpi4py import MPI

    from shmcomm import basics
    from shmcomm.smb.averaging import ElasticCentre

    shmcomm.init()
    world = MPI.COMM_WORLD
    rank, net = world.Get_rank(), basics.communicator().box_network
    origin = net.host_ranks[1][0]
    largest = max(sizes) // 4
    box = shmcomm.SoftMemoryBox("bench.remote", shape=(largest,), dtype=np.float32, home=0)
    done = shmcomm.SoftMemoryBox("bench.done", shape=(1,), dtype=np.float32, home=0)
    win = MPI.Win.Allocate(largest * 4 if rank == 0 else 0, 4, comm=world)
    busy = Busy(step_ms)
    results = []

    def remote(op, count, data, out):
        if op == "smb accumulate":
            return lambda: box.accumulate(data[:count])
        if op == "smb read":
            return lambda: box.read(out=out[:count], count=count)
        if op == "mpi accumulate":
            def acc():
                win.Lock(0, MPI.LOCK_SHARED)
                win.Accumulate([data[:count], MPI.FLOAT], 0, op=MPI.SUM)
                win.Unlock(0)
            return acc

        def get():
            win.Lock(0, MPI.LOCK_SHARED)
            win.Get([out[:count], MPI.FLOAT], 0)
            win.Unlock(0)
        return get

    for size in sizes:
        count = size // 4
        data, out = np.ones(largest, np.float32), np.empty(largest, np.float32)
        for scenario in REMOTE_SCENARIOS:
            for rnd in range(rounds):
                for op in ("smb accumulate", "mpi accumulate", "smb read", "mpi read"):
                    world.Barrier()
                    seen = done.version
                    world.Barrier()
                    if rank == origin:
                        seconds = _timed(remote(op, count, data, out))
                        results.append({"kind": "remote", "op": op, "scenario": scenario, "bytes": size,
                                        "round": rnd, "seconds": seconds})
                        done.accumulate(np.zeros(1, np.float32))  # a new version: the home host stops computing
                    elif net.host == 0 and scenario != "in sequence":
                        while done.version == seen:
                            busy.step() if scenario == "overlapped" else busy.python_step()
                            world.Iprobe()
                    world.Barrier()
        results += _exchange(world, size, rounds, busy, ElasticCentre, net.hosts, rank)
    win.Free()
    # The remote rows are the origin's, the exchange rows every rank's (the slowest): each prints what it has.
    mine = [r for r in results if r["kind"] == "remote" or rank == 0]
    print(TAG + json.dumps({"results": mine, "mpi": " ".join(MPI.Get_library_version().splitlines()[0].split())}),
          flush=True)
    shmcomm.shutdown()


def _exchange(world, size, rounds, busy, ElasticCentre, hosts, rank):
    from mpi4py import MPI

    count = size // 4
    # In sequence nothing runs beside the exchange: the push goes in line (no hand-over to a thread).
    centres = {"in sequence": ElasticCentre("bench.centre.%d" % size, count, stripes=hosts, overlap=False),
               "overlapped": ElasticCentre("bench.centre.%d" % size, count, stripes=hosts)}
    if rank == 0:
        centres["in sequence"].initialise(np.zeros(count, np.float32))
    for centre in centres.values():
        centre.ready()
    x, buf = np.ones(count, np.float32), np.ones(count, np.float32)
    rows = []

    def slowest(seconds):
        # A buffer call: mpi4py's pickle-based calls keep the GIL while they wait, and the box servers of this
        # process would wait for it.
        out = np.array([seconds])
        world.Allreduce(MPI.IN_PLACE, out, op=MPI.MAX)
        return float(out[0])

    for rnd in range(rounds):
        for scenario in ("in sequence", "overlapped"):
            centre = centres[scenario]
            for op in ("smb exchange", "mpi allreduce"):
                world.Barrier()
                steps = 5
                t0 = time.perf_counter()
                for _ in range(steps):
                    if scenario == "overlapped":
                        if op == "smb exchange":
                            centre.exchange(x, 0.5)  # the push leaves in the background during the step
                            busy.step()
                        else:
                            request = world.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                            busy.step()
                            request.Wait()
                    elif op == "smb exchange":
                        centre.exchange(x, 0.5)
                        centre.flush()
                    else:
                        world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                centre.flush()
                rows.append({"kind": "exchange", "op": op, "scenario": scenario, "bytes": size, "round": rnd,
                             "seconds": slowest((time.perf_counter() - t0) / steps)})
    world.Barrier()
    for centre in centres.values():
        centre.close()
    return rows


def report(results, step_s):
    by = {}
    for r in results:
        by.setdefault((r["kind"], r["op"], r["scenario"], r["bytes"]), []).append(r["seconds"])
    med = {k: float(np.median(v)) for k, v in by.items()}
    sizes = sorted({k[3] for k in med})
    lines = ["Remote operations, host 1 -> box/window on host 0, float32; ms per operation (median); "
             "ratio = MPI / box"]
    lines.append("%10s  %-12s  %10s %10s %7s  %10s %10s %7s" % ("bytes", "scenario", "smb acc", "MPI_Acc", "ratio",
                                                                 "smb read", "MPI_Get", "ratio"))
    for scenario in REMOTE_SCENARIOS:
        for size in sizes:
            a, b = med[("remote", "smb accumulate", scenario, size)], med[("remote", "mpi accumulate", scenario, size)]
            c, d = med[("remote", "smb read", scenario, size)], med[("remote", "mpi read", scenario, size)]
            lines.append("%10d  %-12s  %10.3f %10.3f %7.2f  %10.3f %10.3f %7.2f" % (size, scenario, a * 1e3, b * 1e3,
                                                                                   b / a, c * 1e3, d * 1e3, d / c))
    lines.append("")
    lines.append("Parameter exchange of one step (x out, d back, box striped over the hosts) vs "
                 "MPI_Allreduce of the same bytes; ms per step, slowest rank; overlapped: inside a %.1f ms compute "
                 "step" % (step_s * 1e3))
    lines.append("%10s  %-12s  %10s %10s %7s" % ("bytes", "scenario", "smb", "MPI", "ratio"))
    for scenario in ("in sequence", "overlapped"):
        for size in sizes:
            a, b = med[("exchange", "smb exchange", scenario, size)], med[("exchange", "mpi allreduce", scenario,
                                                                            size)]
            lines.append("%10d  %-12s  %10.3f %10.3f %7.2f" % (size, scenario, a * 1e3, b * 1e3, b / a))
    return lines


def main(options, argv):
    from shmcomm.testing.simhosts import SimulatedHosts

    sizes = [s for s in _sweep(options.min_bytes, options.max_bytes, options.factor)]
    with SimulatedHosts(options.hosts, own_cpus=True) as sim:
        cmd = [sys.executable, "-m", "shmcomm.runner", *sim.shmcommrun_args(options.ranks_per_host),
               sys.executable, "-m", "benchmarks.smb_hosts", ",".join(map(str, sizes)), str(options.rounds),
               str(options.step_ms)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SHMCOMM_", "HOROVOD_"))}
        env["PYTHONPATH"] = ROOT
        env["SHMCOMM_SMB_BYTES"] = str(max(256 << 20, 3 * options.max_bytes + (8 << 20)))
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=options.timeout or 1800)
    if run.returncode != 0:
        sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
        raise SystemExit("benchmarks.smb --hosts: the job failed")
    parts = [json.loads(ln.split(TAG, 1)[1]) for ln in run.stdout.splitlines() if TAG in ln]
    found = {"mpi": parts[0]["mpi"], "results": [r for part in parts for r in part["results"]]}
    print("# python -m benchmarks.smb %s | %s | %d hosts x %d ranks, %s" % (
        " ".join(argv), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), options.hosts, options.ranks_per_host,
        found["mpi"]))
    print("\n".join(report(found["results"], options.step_ms / 1e3)))
    if options.json:
        with open(options.json, "w") as f:
            json.dump(found, f)
    return 0


def _sweep(lo, hi, factor):
    size = lo
    while size <= hi:
        yield size
        size *= factor


if __name__ == "__main__":
    worker([int(s) for s in sys.argv[1].split(",")], int(sys.argv[2]), float(sys.argv[3]))
