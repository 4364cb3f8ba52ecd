# SPDX-License-Identifier: Apache-2.0
"""shmcomm.jax under the launcher: every check of tests/jax_checks.py at 2 ranks (1 and 3 in the second tier), on a
logical grid and across two simulated hosts (the handler's Python path), a killed rank under jit, the digits example,
and the package without jax. Skipped, with the reason, where jax or optax is not installed (pip install '.[jax]')."""
import importlib.util
import os
import secrets
import signal
import subprocess
import sys
import textwrap

import pytest

from report_gathered_weights import assert_same_on_every_rank
from test_multihost import two_hosts  # noqa: F401 (the fixture)
from test_simhosts import job_env, rank_lines

# Found, not imported: the jobs import them, and an import here would cost the whole run seconds of collection.
for _module, _what in (("jax", "shmcomm.jax"), ("optax", "shmcomm.jax's optimizer")):
    if importlib.util.find_spec(_module) is None:
        pytest.skip("%s needs %s: pip install -e '.[jax]'" % (_what, _module), allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = os.path.join(ROOT, "tests", "jax_checks.py")
ALL = ["collectives", "gradients", "large_results", "mismatches", "optimizer", "optimizer_eager", "ordered_hlo",
       "ordering", "sealed", "vmap", "with_engine"]
# The default run leaves out the eager optimizer: the eager collectives are checked, and eagerly the optimizer's step
# compiles each of its primitives apart, on every rank, for no path of its own.
DEFAULT = [name for name in ALL if name != "optimizer_eager"]


def _launch(args, timeout=400, **env):
    return subprocess.run([sys.executable, "-m", "shmcomm.runner"] + [str(a) for a in args], cwd=ROOT,
                          env=job_env(**env), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def _assert_all_ok(run, ranks, checks=ALL):
    assert run.returncode == 0, run.stdout + run.stderr
    lines = rank_lines(run.stdout)
    assert sorted(lines) == list(range(ranks)), run.stdout
    for r in range(ranks):
        # Every program ends with a jitted collective still running when it shuts down (jax_checks.py).
        done = sorted(line.split()[1] for line in lines[r] if line.startswith("ok "))
        assert done == sorted(list(checks) + ["in_flight_at_shutdown"]), lines[r]


# The default run takes 2 ranks: tests/jax_checks.py splits 5 rows, unevenly at 2 ranks as at 3. One rank (a
# collective over one rank is a copy) and three (more ranks than cores) run with -m long.
@pytest.mark.slow
@pytest.mark.timeout(600)  # under a minute at 2 ranks, slower beside other work
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.long), 2, pytest.param(3, marks=pytest.mark.long)])
def test_every_check_on_one_host(ranks):
    checks = DEFAULT if ranks == 2 else ALL
    _assert_all_ok(_launch(["-np", ranks, sys.executable, CHECKS] + checks), ranks, checks)


@pytest.mark.long
def test_on_a_logical_grid_the_handler_goes_through_python():
    """SHMCOMM_TORUS_GRID makes the world a WorldComm on one host: every collective takes the Python path (the torus
    for allreduce), as across hosts. The default run takes that path across two simulated hosts (below)."""
    checks = ["collectives", "mismatches", "ordering", "sealed", "with_engine"]
    _assert_all_ok(_launch(["-np", 4, sys.executable, CHECKS] + checks, SHMCOMM_TORUS_GRID="2x2"), 4, checks)


# The second tier: the torus and MPI's own allreduce under jit across hosts take the handler's Python path, which the
# 3-rank run on one host checks too; "torus+" adds the optimizer, the ordering (also under shmcomm.jax.jit), the
# gradients and the engine.
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(600)  # torus+ about a minute, slower beside other work
@pytest.mark.parametrize("algo", ["torus", "mpi", "torus+"])
def test_across_two_simulated_hosts(two_hosts, algo):  # noqa: F811 (the fixture)
    checks = ["collectives", "mismatches"] + (["optimizer", "ordering", "sealed", "gradients", "with_engine"]
                                              if algo == "torus+" else [])
    algo = algo.rstrip("+")
    run = _launch([*two_hosts.shmcommrun_args(2), sys.executable, CHECKS] + checks, SHMCOMM_ALLREDUCE_ALGO=algo,
                  SHMCOMM_TIMEOUT="60")
    _assert_all_ok(run, 4, checks)


KILLED = textwrap.dedent("""
    import os, signal, sys, time
    import jax, jax.numpy as jnp
    import shmcomm.jax as sj

    sj.init()
    step = (sj.jit if sys.argv[1] == "sealed" else jax.jit)(lambda x: sj.allreduce(x, op=sj.Sum) + 1)
    x = jnp.ones(1000)
    step(x).block_until_ready()
    if sj.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        while time.monotonic() - start < 60:
            step(x).block_until_ready()
    except jax.errors.JaxRuntimeError as error:
        cause = sj.original(error)
        print("raised", type(cause).__name__, cause.rank, "after %.1f s" % (time.monotonic() - start), flush=True)
        print("text", str(error).replace(chr(10), " "), flush=True)
        try:
            sj.allreduce(x)
        except sj.RankFailure as later:
            print("eager", later.rank, flush=True)
""")


def _spawn_job(script, ranks, args=()):
    """The ranks as plain processes with the launcher's environment contract: unlike the launcher, nothing stops the
    survivors when one dies, so they can say what they saw."""
    token = secrets.token_hex(16)
    procs = []
    for rank in range(ranks):
        env = job_env(SHMCOMM_RANK=str(rank), SHMCOMM_SIZE=str(ranks), SHMCOMM_LOCAL_RANK=str(rank),
                      SHMCOMM_LOCAL_SIZE=str(ranks), SHMCOMM_CROSS_RANK="0", SHMCOMM_CROSS_SIZE="1",
                      SHMCOMM_JOB_TOKEN=token, SHMCOMM_TIMEOUT="30")
        procs.append(subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        outputs.append((proc.returncode, out, err))
    return outputs


@pytest.mark.long
@pytest.mark.parametrize("jit", ["jit", "sealed"])
def test_a_killed_rank_is_named_under_jit(tmp_path, jit):
    """The survivors' jitted allreduce (jax.jit and shmcomm.jax.jit) raises, naming rank 1, within seconds; later
    calls say the same; under the launcher the job stops with a non-zero exit naming it."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    outputs = _spawn_job(script, 3, [jit])
    assert outputs[1][0] == -signal.SIGKILL
    for r in (0, 2):
        code, out, err = outputs[r]
        assert code == 0, out + err
        lines = out.splitlines()
        raised = [line.split() for line in lines if line.startswith("raised")]
        assert raised and raised[0][1:3] == ["RankFailure", "1"], out + err
        assert float(raised[0][4]) < 15
        text = [line for line in lines if line.startswith("text")][0]
        assert "rank 1" in text and "RankFailure" in text, text
        assert "eager 1" in lines, lines
    run = _launch(["-np", 3, sys.executable, script, jit], timeout=120)
    assert run.returncode != 0 and "rank 1" in run.stderr and "SIGKILL" in run.stderr, run.stderr


@pytest.mark.slow
@pytest.mark.long
def test_digits_example_trains_to_95_percent_with_identical_parameters():
    pytest.importorskip("sklearn")
    report = os.path.join(ROOT, "tests", "report_gathered_weights.py")
    run = _launch(["-np", 2, sys.executable, report, "examples/jax_digits.py", "--epochs", "10"])
    assert run.returncode == 0, run.stdout + run.stderr
    assert "weights identical on all ranks: True" in run.stdout
    assert_same_on_every_rank(run.stdout, 2)
    accuracy = float(run.stdout.split("test accuracy ")[1].split("%")[0])
    assert accuracy >= 95, run.stdout


def test_without_jax_the_package_works_and_shmcomm_jax_says_what_is_missing():
    program = textwrap.dedent("""
        import sys
        sys.modules["jax"] = None  # as if jax were not installed
        import numpy as np, shmcomm
        shmcomm.init()
        assert shmcomm.allreduce(np.ones(2), op=shmcomm.Sum).tolist() == [1.0, 1.0]
        try:
            import shmcomm.jax
        except ImportError as error:
            print("ImportError:", error)
    """)
    run = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=job_env(), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert "ImportError: shmcomm.jax needs jax" in run.stdout, run.stdout


def test_a_jax_without_the_internals_in_use_fails_at_import_naming_the_missing_part():
    """shmcomm.jax/internals.py holds every private part of JAX in use: it imports on the jax installed, and a
    release that lacks one (here deleted before the import) fails there, naming it and saying what to install."""
    program = textwrap.dedent("""
        import sys
        import shmcomm.jax.internals
        print("present")
        del sys.modules["shmcomm.jax.internals"]
        from jax._src.interpreters import mlir
        del mlir.core_call_lowering
        try:
            import shmcomm.jax.internals
        except ImportError as error:
            print("ImportError:", error)
    """)
    run = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=job_env(), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("present\nImportError: shmcomm.jax: jax "), run.stdout + \
        run.stderr
    assert "core_call_lowering" in run.stdout and "pip install 'shmcomm[jax]'" in run.stdout, run.stdout


@pytest.mark.long
def test_the_handler_is_built_once_into_the_build_directory(tmp_path):
    """A fresh build directory gets the compiled handler on first import; a second import loads it unchanged."""
    program = "import shmcomm.jax, shmcomm.jax.native as n; print(sorted(p.name for p in n.build_dir().iterdir()))"
    env = dict(SHMCOMM_BUILD_DIR=str(tmp_path))
    first = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=job_env(**env), capture_output=True,
                           text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    (built,) = [p for p in (tmp_path / "jax-ffi").iterdir() if not p.name.startswith(".")]
    (module,) = built.iterdir()
    stamp = module.stat().st_mtime_ns
    second = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=job_env(**env), capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert module.stat().st_mtime_ns == stamp
    assert not [p for p in (tmp_path / "jax-ffi").iterdir() if p.name.startswith(".build-")]  # no leftovers



@pytest.mark.long
def test_results_memory_stays_mapped_between_calls():
    """shmcomm.jax raises glibc's mmap and trim thresholds (jax/results_heap.py): a 64 MiB block freed and taken
    again, as XLA does with a jitted call's result, keeps its pages; with SHMCOMM_JAX_HEAP_BYTES=0 (glibc's own
    thresholds) every page faults in again."""
    program = textwrap.dedent("""
        import ctypes, resource, sys
        import shmcomm.jax.context
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
        libc.free.argtypes = (ctypes.c_void_p,)
        size = 64 << 20
        for round in range(2):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            block = libc.malloc(size)
            ctypes.memset(block, 1, size)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            libc.free(block)
        print("faults", faults)
    """)
    faults = {}
    for setting in ("", "0"):
        run = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env=job_env(SHMCOMM_JAX_HEAP_BYTES=setting) if setting else job_env())
        assert run.returncode == 0, run.stderr
        faults[setting] = int(run.stdout.split("faults")[1])
    # Mapped afresh: 16384 pages of 4 KiB, or 32 of 2 MiB where the kernel gives every mapping huge pages.
    assert faults["0"] >= 32 and faults[""] * 4 <= faults["0"], faults
