# SPDX-License-Identifier: Apache-2.0
"""shmcomm.jax against mpi4jax: a jit-compiled allreduce (float32, Sum) of each size, and the example's training step.

    python -m benchmarks.jax -np 2 -b 4K -e 64M -f 4 --rounds 7 [--train] [--cpu-load N]

One job of -np ranks started by the MPI wheel's mpiexec (both libraries then share MPICH, and shmcomm learns its
places from MPI). Every rank compiles `jax.jit(lambda x: allreduce(x))` for each library, and shmcomm's also with
`shmcomm.jax.jit` (JAX's fast dispatch: "sealed"), and, per size, runs rounds in which each makes the same number of
calls, alternating which goes first; a call is timed until its result is ready, and a round's time per call is the
slowest rank's. The table gives the median (p90) over rounds of each, the bus bandwidth (2(n-1)/n x bytes / time, as
nccl-tests), the ratios to mpi4jax, and the numpy API's shmcomm.allreduce of the same array for reference, into an
output made once (as XLA's results come back to the same memory: jax/results_heap.py). Both
libraries run in one process, so mpi4jax's results gain from the glibc thresholds that importing shmcomm.jax raises
(jax/results_heap.py) as shmcomm's do; with SHMCOMM_JAX_HEAP_BYTES=0 both run on glibc's own, as an mpi4jax job does
by default. --train adds the example's jitted step (examples/jax_digits.py's MLP, batch
32 per rank): with DistributedOptimizer, without any collective, and the fused allreduce of its gradients alone, under
jax.jit and shmcomm.jax.jit. --cpu-load N runs it all beside N CPU-bound processes (a training machine is never idle).
mpi4jax must be installed (benchmarks/README.md says how to build it).

Across simulated hosts, where shmcomm's handler takes its Python path (the torus and MPI live in Python), the same
worker runs as a script of benchmarks.simhosts_bench:

    python -m benchmarks.simhosts_bench --hosts 2 --ranks-per-host 2 --script benchmarks/jax.py --bytes 4K,1M,16M
"""
import argparse
import os
import subprocess
import sys
import time

import numpy as np


def _sizes(args):
    from benchmarks.collectives import parse_size, sweep

    if args.bytes:
        return [parse_size(item) for item in args.bytes.split(",") if item.strip()]
    return sweep(parse_size(args.b), parse_size(args.e), args.f)


def _human(size):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return "%d%s" % (size >> shift, unit)
    return str(size)


def _median_rounds(comm, calls, rounds, budget_s):
    """{name: (median, p90) seconds per call} over `rounds` rounds of the same number of calls to each of `calls`
    ({name: fn}), the order alternating between rounds; each round's time is the slowest rank's."""
    from mpi4py import MPI

    names = list(calls)
    start = time.perf_counter()
    for fn in calls.values():
        fn()
    estimate = comm.allreduce((time.perf_counter() - start) / len(names), op=MPI.MAX)
    per_round = max(1, min(1000, int(budget_s / max(estimate, 1e-7) / len(names))))
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(per_round):
                calls[name]()
            elapsed = (time.perf_counter() - start) / per_round
            times[name].append(comm.allreduce(elapsed, op=MPI.MAX))
    return {name: (float(np.median(t)), float(np.percentile(t, 90))) for name, t in times.items()}


def worker(args):
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI
    try:
        import mpi4jax
    except ImportError as error:  # the table then shows shmcomm alone
        mpi4jax, missing = None, error

    import shmcomm
    import shmcomm.jax as sj
    from shmcomm.jax import context

    sj.init()
    comm = MPI.COMM_WORLD
    n = comm.size
    ours = jax.jit(lambda x: sj.allreduce(x, op=sj.Sum))
    sealed = sj.jit(lambda x: sj.allreduce(x, op=sj.Sum))
    theirs = jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM)) if mpi4jax is not None else None
    rows = []
    for size in _sizes(args):
        x = jnp.ones(size // 4, jnp.float32)
        numpy_x, numpy_out = np.ones(size // 4, np.float32), np.ones(size // 4, np.float32)
        calls = {"shmcomm": lambda: ours(x).block_until_ready(), "sealed": lambda: sealed(x).block_until_ready(),
                 "numpy": lambda: shmcomm.allreduce(numpy_x, op=shmcomm.Sum, output=numpy_out)}
        if theirs is not None:
            calls["mpi4jax"] = lambda: theirs(x).block_until_ready()
            assert float(theirs(x)[0]) == n
        assert float(ours(x)[0]) == n and float(sealed(x)[0]) == n
        rows.append((size, _median_rounds(comm, calls, args.rounds, args.budget)))
    if comm.rank == 0:
        print("# jit allreduce, float32 Sum, %d ranks, %s; shmcomm handler path: %s" % (
            n, type(shmcomm.basics.communicator()).__name__, "C core" if context.direct() else "Python"))
        print("# us per call, median (p90); busbw of the medians; x: mpi4jax's median over shmcomm's. jit: under "
              "jax.jit, sealed: under shmcomm.jax.jit")
        print("# %8s %17s %17s %17s %8s %8s %8s %8s %17s" % (
            "size", "jit", "sealed", "mpi4jax", "jit GB/s", "m4j GB/s", "x jit", "x sealed", "numpy API"))
        if theirs is None:
            print("# mpi4jax is not installed (%s): its columns are nan" % missing)
        factor = 2 * (n - 1) / n if n > 1 else 1.0
        nan = (float("nan"), float("nan"))
        for size, t in rows:
            t.setdefault("mpi4jax", nan)
            mine, peer = t["shmcomm"][0], t["mpi4jax"][0]
            cells = ["%7.1f (%7.1f)" % (t[k][0] * 1e6, t[k][1] * 1e6)
                     for k in ("shmcomm", "sealed", "mpi4jax", "numpy")]
            print("  %8s %17s %17s %17s %8.2f %8.2f %7.2fx %7.2fx %17s" % (
                _human(size), *cells[:3], factor * size / mine / 1e9, factor * size / peer / 1e9, peer / mine,
                peer / t["sealed"][0], cells[3]), flush=True)
    if args.train:
        _train(comm, args)
    sj.shutdown()


LOOP = 100


def _train(comm, args):
    """The example's step three ways, under jax.jit and shmcomm.jax.jit; the last lines say how far the distributed
    step is from the local step plus the allreduce alone."""
    import jax
    import optax

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import jax_digits
    import shmcomm.jax as sj
    from shmcomm.jax.optimizer import fused_allreduce

    params = jax_digits.init_params(jax.random.PRNGKey(0))
    x = np.random.default_rng(comm.rank).random((32, 64), np.float32)
    y = np.random.default_rng(comm.rank).integers(0, 10, 32).astype(np.int32)

    def stepper(tx, jit=jax.jit):
        def step(params, state):
            grads = jax.grad(jax_digits.loss_fn)(params, x, y)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state
        step = jit(step)
        state = tx.init(params)
        return lambda: jax.block_until_ready(step(params, state))

    def looper(tx):  # LOOP steps in one jitted call: the compiled step's own cost, without the per-call dispatch
        @jax.jit
        def steps(params, state):
            def body(_, carry):
                grads = jax.grad(jax_digits.loss_fn)(carry[0], x, y)
                updates, state = tx.update(grads, carry[1], carry[0])
                return optax.apply_updates(carry[0], updates), state
            return jax.lax.fori_loop(0, LOOP, body, (params, state))
        state = tx.init(params)
        return lambda: jax.block_until_ready(steps(params, state))

    grads = jax.grad(jax_digits.loss_fn)(params, x, y)
    reduce_only, reduce_sealed = jax.jit(fused_allreduce), sj.jit(fused_allreduce)
    reduce_loop = jax.jit(lambda g: jax.lax.fori_loop(0, LOOP, lambda _, g: fused_allreduce(g), g))
    calls = {"distributed": stepper(sj.DistributedOptimizer(optax.sgd(0.01))), "local": stepper(optax.sgd(0.01)),
             "allreduce": lambda: jax.block_until_ready(reduce_only(grads)),
             "distributed-sealed": stepper(sj.DistributedOptimizer(optax.sgd(0.01)), sj.jit),
             "allreduce-sealed": lambda: jax.block_until_ready(reduce_sealed(grads)),
             "distributed-loop": looper(sj.DistributedOptimizer(optax.sgd(0.01))),
             "local-loop": looper(optax.sgd(0.01)), "allreduce-loop": lambda: jax.block_until_ready(reduce_loop(grads))}
    t = _median_rounds(comm, calls, args.rounds, args.budget)
    if comm.rank == 0:
        nbytes = sum(np.asarray(g).nbytes for g in jax.tree_util.tree_leaves(grads))
        for what, names, scale in (
                ("one step per jax.jit call", ("distributed", "local", "allreduce"), 1),
                ("one step per shmcomm.jax.jit call", ("distributed-sealed", "local", "allreduce-sealed"), 1),
                ("%d steps per jax.jit call (fori_loop)" % LOOP, ("distributed-loop", "local-loop", "allreduce-loop"),
                 LOOP)):
            d, lo, ar = (t[name][0] / scale * 1e6 for name in names)
            print("# training step of examples/jax_digits.py (%d gradient bytes), %s, us per step: distributed %.1f, "
                  "local %.1f, allreduce alone %.1f; distributed / (local + allreduce) = %.3f" % (
                      nbytes, what, d, lo, ar, d / (lo + ar)), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", type=int, default=2)
    parser.add_argument("-b", default="4K")
    parser.add_argument("-e", default="64M")
    parser.add_argument("-f", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of calls per round and library")
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--cpu-load", type=int, default=0, help="CPU-bound processes beside the job")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # As a script of benchmarks.simhosts_bench: its sizes; its --iters are the rounds, and --warmup is not needed.
    parser.add_argument("--bytes", help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bytes:
        args.rounds = args.iters or args.rounds
    if args.worker or args.bytes:
        return worker(args)
    from shmcomm.runner.mpi_launch import find_mpiexec

    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise SystemExit("benchmarks.jax: no mpiexec beside %s or on PATH" % sys.executable)
    forwarded = ["-b", args.b, "-e", args.e, "-f", str(args.f), "--rounds", str(args.rounds), "--budget",
                 str(args.budget)] + (["--train"] if args.train else [])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    command = [mpiexec, "-n", str(args.np), sys.executable, "-m", "benchmarks.jax", "--worker"] + forwarded
    print("# %s" % " ".join(["python -m benchmarks.jax"] + sys.argv[1:]), flush=True)
    from shmcomm.testing import cpu_load

    with cpu_load.spinning(args.cpu_load):
        return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # run as a script: this file must not stand in for the jax package
    sys.exit(main())
