# SPDX-License-Identifier: Apache-2.0
"""shmcomm across simulated hosts (network namespaces with their own host names, MPI over a private bridge):
every allreduce algorithm and dtype, the other collectives, a DistributedOptimizer run, and a rank killed on one
host. Skipped with the reason where this machine lacks what namespaces need (tests/test_simhosts.py: open_hosts)."""
import functools
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from report_gathered_weights import assert_same_on_every_rank
from test_simhosts import job_env, open_hosts, rank_lines
from test_torus import CHECKS, MISMATCHES, run_checks_job

from shmcomm.testing import exact, mpi_segments, outcomes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shmcommrun(sim, ranks_per_host, args, timeout=240, **env):
    return subprocess.run([sys.executable, "-m", "shmcomm.runner", *sim.shmcommrun_args(ranks_per_host)] + args,
                          cwd=ROOT, env=job_env(**env), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def two_hosts():
    sim = open_hosts(2)
    try:
        yield sim
    finally:
        sim.close()


@functools.lru_cache(maxsize=None)
def _two_host_reports(sim, algo):
    """Every rank's exact.run_checks report (bfloat16 included) and what each rank says of itself; run once for the
    tests that read them."""
    program = CHECKS + textwrap.dedent("""
        import socket, shmcomm
        from shmcomm import basics
        world = basics.communicator()
        hosts = str(world.host_groups).replace(" ", "")  # each host once, in rank order
        print("ok", socket.gethostname(), type(world).__name__, shmcomm.local_size(), shmcomm.cross_size(), hosts,
              flush=True)
    """)
    return run_checks_job(lambda script, out: _shmcommrun(sim, 2, [sys.executable, script, out, "bf16"],
                                                           SHMCOMM_ALLREDUCE_ALGO=algo), 4, program)


# The ring (taken only when SHMCOMM_ALLREDUCE_ALGO=ring asks for it) runs the same checks across pretend hosts
# (test_torus.py) and exactly across simulated hosts under the autotuner (test_autotune.py); here with -m long. So
# does MPI's own allreduce, whose calls are the same across pretend hosts (test_torus.py, test_paths.py), where only
# MPI's transport differs.
ALGOS = ["torus", pytest.param("ring", marks=pytest.mark.long), pytest.param("mpi", marks=pytest.mark.long)]


@pytest.mark.parametrize("algo", ALGOS)
def test_collectives_across_two_hosts(two_hosts, algo):
    reports, stdout = _two_host_reports(two_hosts, algo)
    exact.assert_identical(reports)
    lines = rank_lines(stdout)
    assert sorted(lines) == [0, 1, 2, 3]
    seen = {tuple(lines[r][-1].split()[1:]) for r in lines}
    assert seen == {("simhost0", "WorldComm", "2", "2", "[[0,1],[2,3]]"),
                    ("simhost1", "WorldComm", "2", "2", "[[0,1],[2,3]]")}


@pytest.mark.parametrize("algo", ALGOS)
def test_16_bit_sums_round_once_across_two_hosts(two_hosts, algo):
    exact.assert_rounds_once(_two_host_reports(two_hosts, algo)[0])


def test_mismatches_across_two_hosts(two_hosts, tmp_path):
    """Ranks that disagree, across hosts or inside one, all raise MismatchError naming what each passed; the job
    goes on."""
    script = tmp_path / "job.py"
    script.write_text(MISMATCHES + "\nassert check_mismatches()\nprint('ok', flush=True)\n")
    run = _shmcommrun(two_hosts, 2, [sys.executable, str(script)], SHMCOMM_TIMEOUT="60")
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(rank_lines(run.stdout)) == [0, 1, 2, 3]


@pytest.mark.long  # the same script runs across pretend hosts in the default run (test_torus.py)
def test_process_sets_across_two_hosts(two_hosts, tmp_path):
    """Sets of ranks on both hosts (and one host's) run every collective, through the engine too, over an MPI
    communicator of their members; a mismatch raises on every member and the set goes on."""
    from test_torus import PROCESS_SETS_ACROSS_HOSTS

    script = tmp_path / "job.py"
    script.write_text(PROCESS_SETS_ACROSS_HOSTS)
    run = _shmcommrun(two_hosts, 2, [sys.executable, str(script)], SHMCOMM_TIMEOUT="60")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("sets ok") == 4, run.stdout + run.stderr


@pytest.mark.long
def test_three_hosts(tmp_path):
    sim = open_hosts(3)
    try:
        script = tmp_path / "job.py"
        script.write_text(CHECKS)
        run = _shmcommrun(sim, 2, [sys.executable, str(script), str(tmp_path)])
        assert run.returncode == 0, run.stdout + run.stderr
        exact.assert_identical(exact.read_reports(tmp_path, 6))
    finally:
        sim.close()


@pytest.mark.long
def test_distributed_optimizer_across_hosts(two_hosts):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    report = os.path.join(ROOT, "tests", "report_gathered_weights.py")  # each rank's digest of the final weights
    # One rank per host: shmcomm.torch's allreduce across the network (the torus's rows on shared memory are the
    # numpy tests' business, test_collectives_across_two_hosts), at half the cost of importing torch.
    run = _shmcommrun(two_hosts, 1, [sys.executable, report, os.path.join(ROOT, "examples", "torch_digits.py"),
                                     "--epochs", "1", "--no-progress"])
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ranks 2, weights identical on all ranks: True" in run.stdout
    assert_same_on_every_rank(run.stdout, 2)


SHARED_ACROSS_HOSTS = """
    import numpy as np, shmcomm
    from shmcomm.startup import session
    from shmcomm._native import lib
    shmcomm.init()
    me, n = shmcomm.rank(), shmcomm.size()
    shm = session.communicator().host.shm  # the host's transport, which the torus's rows run on
    count = 1 << 21  # 4 MiB per rank of a row: the three-phase path, and the row's allgather by single copy
    try:
        shmcomm.shared_empty(count + (me >= 2))  # the hosts disagree, each host's ranks agree among themselves
        raised = "nothing"
    except shmcomm.MismatchError as error:
        raised = "MismatchError" if "shared buffer" in str(error) else str(error)
    x = shmcomm.shared_empty(count, np.float32)
    before = shm.shared_calls()
    for k in range(3):
        x[:] = me + k
        shmcomm.allreduce_(x, op=shmcomm.Sum)
        assert (x == sum(range(n)) + n * k).all(), (k, x[:4])
    taken = shm.shared_calls() - before
    single = lib.smc_comm_single_copy_from(shm.handle, 0)
    expected = 3 * (1 + (0 < single <= count * 4 // 2))  # the reduce-scatter; the allgather where single copy takes it
    before = shm.shared_calls()
    parts = [np.full(1 << 19, me + i, np.float32) for i in range(4)]  # fused by the engine, in its fusion buffer
    handles = [shmcomm.allreduce_async(p, op=shmcomm.Sum, name="p%d" % i) for i, p in enumerate(parts)]
    for i, handle in enumerate(handles):
        assert (shmcomm.synchronize(handle) == sum(range(n)) + n * i).all()
    print("ok", raised, shmcomm.is_shared(x), taken == expected, shm.shared_calls() > before, flush=True)
"""


def test_shared_arrays_across_hosts(two_hosts):
    """Across hosts, shared_empty's arrays and the engine's fusion buffer are memory every rank of a host maps: the
    torus's row steps take the shared buffers' paths, with the same sums. A shape that differs between hosts alone
    (which each host's own check cannot see) raises MismatchError on every rank, and the job goes on."""
    run = _shmcommrun(two_hosts, 2, [sys.executable, "-c", textwrap.dedent(SHARED_ACROSS_HOSTS)],
                      SHMCOMM_ALLREDUCE_ALGO="torus")
    assert run.returncode == 0, run.stdout + run.stderr
    assert rank_lines(run.stdout) == {r: ["ok MismatchError True True True"] for r in range(4)}, run.stdout


KILLED = """
    import os, signal, threading, numpy as np, shmcomm
    from shmcomm.testing import mpi_segments
    shmcomm.init()
    print("token", os.environ["SHMCOMM_JOB_TOKEN"], "mpi", *mpi_segments.worlds(), flush=True)
    if shmcomm.rank() == 3:
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    x = np.ones(1 << 18, np.float32)
    while True:
        shmcomm.allreduce_(x)
"""


def test_rank_killed_on_one_host_stops_the_job(two_hosts):
    run = _shmcommrun(two_hosts, 2, [sys.executable, "-c", textwrap.dedent(KILLED)], timeout=120)
    assert run.returncode != 0
    said = [line.split("token ")[1].split() for line in run.stdout.splitlines() if "token " in line]
    assert not [n for n in os.listdir("/dev/shm") if said[0][0] in n]
    # MPICH's too, by the worlds the ranks named (other jobs on the machine make and leave their own).
    worlds = {world for words in said for world in words[2:]}
    assert worlds and not mpi_segments.left(worlds), said




SURVIVORS = """
    import os, signal, sys, time, numpy as np, shmcomm
    from shmcomm.testing import mpi_segments, outcomes
    shmcomm.init()
    me = shmcomm.rank()
    if me == 0:
        with open(os.path.join(sys.argv[1], "token"), "w") as f:
            f.write(os.environ["SHMCOMM_JOB_TOKEN"])
    with open(os.path.join(sys.argv[1], "mpi.%d" % me), "w") as f:
        f.write(" ".join(mpi_segments.worlds()))
    x = np.ones(1 << 18, np.float32)  # past the torus's small-message size: rows and columns all take part
    shmcomm.allreduce_(x)
    shmcomm.barrier()
    if me == 3:
        # Rank 3 dies between two collectives. Its launcher-side guard (its parent) is stopped first: it would have
        # hydra kill the whole job at once, before the others can say what they raised.
        os.kill(os.getppid(), signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        shmcomm.allreduce_(x)
    except shmcomm.ShmCommError as error:
        outcomes.record(sys.argv[1], me, error, started)
    # A survivor's exit has hydra stop the job: first every survivor says what it raised.
    outcomes.wait_for(sys.argv[1], [0, 1, 2], timeout=60)
    os._exit(1)  # without MPI_Finalize, which would wait for rank 3
"""


@pytest.mark.long
def test_survivors_of_a_rank_killed_on_another_host_name_it(two_hosts, tmp_path):
    run = _shmcommrun(two_hosts, 2, [sys.executable, "-c", textwrap.dedent(SURVIVORS), str(tmp_path)], timeout=120,
                      SHMCOMM_TIMEOUT="3")
    assert run.returncode != 0, run.stdout + run.stderr
    raised = outcomes.read(tmp_path)
    assert sorted(raised) == [0, 1, 2], run.stdout + run.stderr
    # Rank 3's row partner sees it die in shared memory; its column partner waits for it over MPI until the column's
    # deadline (80% of SHMCOMM_TIMEOUT); rank 0 hears from its column that rank 2's step failed.
    assert raised[2]["type"] == "RankFailure" and raised[2]["rank"] == 3, raised
    assert "rank 3" in raised[2]["message"] and "died" in raised[2]["message"], raised
    assert raised[1]["type"] == "TimeoutError" and "waiting for rank 3" in raised[1]["message"], raised
    assert raised[0]["type"] == "ShmCommError" and "failed on rank 2" in raised[0]["message"], raised
    assert all(r["seconds"] < 3 * 3 for r in raised.values()), raised  # the deadline, with room for a busy machine
    token = (tmp_path / "token").read_text()
    assert not [n for n in os.listdir("/dev/shm") if token in n]
    # MPICH's too, by the worlds the ranks named (other jobs on the machine make and leave their own).
    worlds = {w for r in range(4) for w in (tmp_path / ("mpi.%d" % r)).read_text().split()}
    assert worlds and not mpi_segments.left(worlds), worlds


KILLED_BEFORE_MPI = """
    import os, signal, sys, time, shmcomm
    from shmcomm.testing import outcomes
    me = int(os.environ["PMI_RANK"])
    if me == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # before MPI has started anywhere: MPI cannot say who is missing
    started = time.monotonic()
    try:
        shmcomm.init()
    except shmcomm.ShmCommError as error:
        outcomes.record(sys.argv[1], me, error, started)
    outcomes.wait_for(sys.argv[1], [0, 1, 2], timeout=60)
    os._exit(1)  # the MPI thread is still in MPI's start
"""


@pytest.mark.long
def test_survivors_of_a_rank_killed_before_mpi_started_name_it(two_hosts, tmp_path):
    """The launcher's notice (runner/notice_server.py) names the rank its guard saw killed, to ranks that wait in
    MPI's start for it: each raises RankFailure naming it at once, not a TimeoutError after SHMCOMM_START_TIMEOUT
    (60 s here) that cannot say which rank is missing."""
    run = _shmcommrun(two_hosts, 2, ["--kill-grace-seconds", "10", sys.executable, "-c",
                                     textwrap.dedent(KILLED_BEFORE_MPI), str(tmp_path)], timeout=120,
                      SHMCOMM_START_TIMEOUT="60")
    assert run.returncode != 0, run.stdout + run.stderr
    raised = outcomes.read(tmp_path)
    assert sorted(raised) == [0, 1, 2], run.stdout + run.stderr
    for got in raised.values():
        assert got["type"] == "RankFailure" and got["rank"] == 3, raised
        assert "rank 3 on " in got["message"] and "killed by signal 9" in got["message"], raised
        assert got["seconds"] < 30, raised  # far from the start timeout, with room for a busy machine


@pytest.mark.parametrize("engine", ["0", "1"])
def test_a_bad_argument_on_one_host_fails_every_rank_across_hosts(two_hosts, tmp_path, engine):
    """One rank's bad argument: it raises its own error, every other rank, on its host and the other, raises
    PeerArgumentError naming it at once (SHMCOMM_TIMEOUT=5 makes a regression a TimeoutError), and the job goes on."""
    from test_refusals import REFUSALS

    script = tmp_path / "job.py"
    script.write_text(REFUSALS + textwrap.dedent("""
        import os, sys
        shmcomm.init()
        seen = check_refusals(numpy_cases(shmcomm.size()), [3, 0])
        with open(os.path.join(sys.argv[1], "rank%d" % shmcomm.rank()), "w") as f:
            f.write("".join(o[2][0] for o in seen))
    """))
    run = _shmcommrun(two_hosts, 2, [sys.executable, str(script), str(tmp_path)], SHMCOMM_TIMEOUT="5",
                      SHMCOMM_ENGINE=engine)
    assert run.returncode == 0, run.stdout + run.stderr
    expected = {3: "o" * 10 + "p" * 10, 0: "p" * 10 + "o" * 10, 1: "p" * 20, 2: "p" * 20}
    assert {r: (tmp_path / ("rank%d" % r)).read_text() for r in range(4)} == expected


@pytest.mark.parametrize("device, set_before, chosen", [
    ("MPICH Device:       ch4:ucx ofi", None, "ofi"),   # the mpich wheel: both network modules
    ("MPICH Device:       ch4:ucx ofi", "ucx", "ucx"),  # the user's choice stands
    ("MPICH Device:       ch4:ucx", None, None),        # no ofi to choose
    ("Open MPI v5.0.3", None, None),
])
def test_mpich_is_asked_for_its_ofi_network_module(monkeypatch, device, set_before, chosen):
    """A rank killed while UCX connects to it crashes its peers in UCX (SIGSEGV) or aborts their MPI_Init; with
    libfabric's module they live to name it (topology._prefer_ofi; tests/README.md, chaos across hosts)."""
    from shmcomm.startup import topology

    if set_before is None:
        monkeypatch.delenv("MPIR_CVAR_CH4_NETMOD", raising=False)
    else:
        monkeypatch.setenv("MPIR_CVAR_CH4_NETMOD", set_before)
    topology._prefer_ofi("MPICH Version:      5.0.2\n%s\nMPICH configure:    --with-device=ch4:ucx,ofi\n" % device)
    assert os.environ.get("MPIR_CVAR_CH4_NETMOD") == chosen


@pytest.mark.long
def test_a_plain_torch_distributed_script_runs_across_hosts(two_hosts):
    from test_runner import TORCH_DISTRIBUTED

    result = _shmcommrun(two_hosts, 2, [sys.executable, "-c", textwrap.dedent(TORCH_DISTRIBUTED)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = {rank: json.loads(lines[-1]) for rank, lines in rank_lines(result.stdout).items()}
    assert sorted(reports) == [0, 1, 2, 3]
    for rank, report in reports.items():
        assert report["sum"] == [10.0, 10.0, 10.0]
        assert report["env"] == {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
                                 "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2),
                                 "MASTER_ADDR": report["env"]["MASTER_ADDR"]}


SHMCOMM_BACKEND = """
    import json, torch, torch.distributed as dist
    import shmcomm, shmcomm.torch
    torch.set_num_threads(1)
    dist.init_process_group("shmcomm")
    me, n = dist.get_rank(), dist.get_world_size()
    x = torch.full((3,), float(me)); dist.all_reduce(x)
    whole = torch.empty(2 * n); dist.all_gather_into_tensor(whole, torch.full((2,), float(me)))
    share = torch.empty(2); dist.reduce_scatter_tensor(share, torch.arange(2.0 * n))
    got = torch.empty(n); dist.all_to_all_single(got, torch.arange(float(n)) + 10 * me)
    b = torch.full((2,), float(me)); dist.broadcast(b, src=3)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2).double()
    model = torch.nn.parallel.DistributedDataParallel(net)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(4 * n, 4, generator=g, dtype=torch.float64)
    model(data[4 * me:4 * me + 4]).pow(2).mean().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    reference = torch.nn.Linear(4, 2).double(); reference.load_state_dict(net.state_dict())
    reference(data).pow(2).mean().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    on_this_host = dist.new_group([0, 1]), dist.new_group([2, 3])
    local = on_this_host[me // 2]
    y = torch.ones(1); dist.all_reduce(y, group=local)
    errors, pair = [], None
    # Across the hosts: an MPI communicator of the group's ranks carries it, or TCP connections of its own.
    group, trio = dist.new_group([1, 2]), dist.new_group([0, 2, 3])
    if me in (1, 2):
        z = torch.ones(1); dist.all_reduce(z, group=group)
        m = torch.full((3,), 7.0) if me == 1 else torch.empty(3)
        (dist.send if me == 1 else dist.recv)(m, 3 - me)
        errors += [z.item() == 2.0, m.tolist() == [7.0] * 3]
        pair = "ran"
    if me != 1:
        w = torch.empty(3); dist.all_gather_into_tensor(w, torch.full((1,), float(me)), group=trio)
        v = torch.empty(3); dist.all_to_all_single(v, torch.arange(3.0) + 10 * me, group=trio)
        errors += [w.tolist() == [0.0, 2.0, 3.0], v.tolist() == [10.0 * r + trio.rank() for r in (0, 2, 3)]]
    if me in (0, 1):  # point to point on one host
        t = torch.full((2,), 5.0) if me == 0 else torch.empty(2)
        (dist.send if me == 0 else dist.recv)(t, 1 - me)
        errors.append(t.tolist() == [5.0, 5.0])
    across = type(shmcomm.basics.communicator().across).__name__
    print(json.dumps({"rank": me, "hosts": shmcomm.cross_size(), "across": across, "sum": x.tolist(), "whole": whole.tolist(), "share": share.tolist(), "got": got.tolist(),
                      "b": b.tolist(), "ddp": torch.allclose(grads, expected, rtol=1e-12, atol=1e-14),
                      "local": y.item(), "errors": errors, "pair": pair}), flush=True)
    dist.destroy_process_group()
"""


# What a plain mpiexec gives: MPI's numbers and none of torch's variables (torch/mpi_rendezvous.py then serves env://).
WITHOUT_TORCHS_VARIABLES = """
    import os
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(name, None)
"""


@pytest.mark.long  # the backend's one-host tests run in the default run (test_torch_distributed.py)
@pytest.mark.parametrize("torchs", ["given", "removed"])
def test_the_shmcomm_backend_across_hosts(two_hosts, torchs):
    """Under shmcommrun -H (MPI), with torch's rendezvous variables as shmcommrun sets them, and without them, as under
    a plain mpiexec: rank 0's store is then found across the hosts through shmcomm's collectives."""
    pytest.importorskip("torch")
    script = textwrap.dedent(WITHOUT_TORCHS_VARIABLES if torchs == "removed" else "") + textwrap.dedent(SHMCOMM_BACKEND)
    result = _shmcommrun(two_hosts, 2, [sys.executable, "-c", script])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = {rank: json.loads(lines[-1]) for rank, lines in rank_lines(result.stdout).items()}
    _check_backend_reports(reports)
    assert {report["across"] for report in reports.values()} == {"Mpi"}
    assert [reports[r]["pair"] for r in range(4)] == [None, "ran", "ran", None]


@pytest.mark.long
def test_torchrun_starts_the_shmcomm_backend_across_hosts(two_hosts, tmp_path):
    """One torchrun per simulated host (static rendezvous on the first host's address): the ranks meet through
    torch's store, each host's ranks in shared memory and the hosts over the TCP mesh."""
    pytest.importorskip("torch")
    returncodes, outputs = _torchrun_on_each_host(two_hosts, tmp_path, SHMCOMM_BACKEND)
    assert returncodes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    # The ranks of a host share torchrun's stdout, whose lines may run together: each report read where it starts.
    decoder = json.JSONDecoder()
    reports = [decoder.raw_decode(out, m.start())[0] for out in outputs for m in re.finditer(r'\{"rank": ', out)]
    _check_backend_reports({report["rank"]: report for report in reports})
    assert {report["across"] for report in reports} == {"Tcp"}
    assert sorted((report["rank"], report["pair"]) for report in reports if report["pair"]) == [(1, "ran"), (2, "ran")]


KILLED_UNDER_TORCHRUN = """
    import datetime, os, sys, torch, torch.distributed as dist
    import shmcomm.torch
    dist.init_process_group("shmcomm", timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1000)
    dist.all_reduce(t)
    if dist.get_rank() == 3:
        os._exit(9)
    try:
        while True:
            dist.all_reduce(t)
    except shmcomm.RankFailure as error:
        print("rank %d: %s" % (dist.get_rank(), error), flush=True)
        sys.exit(3)
"""


@pytest.mark.long
def test_a_rank_killed_under_torchrun_is_named_across_hosts(two_hosts, tmp_path):
    """Rank 3 (on the second host) dies: the ranks that see it first name it (torchrun stops its host's other rank,
    whom the first host's ranks may hear of first), and both torchruns exit non-zero."""
    pytest.importorskip("torch")
    returncodes, outputs = _torchrun_on_each_host(two_hosts, tmp_path, KILLED_UNDER_TORCHRUN, timeout=120)
    assert 0 not in returncodes
    named = re.findall(r"rank \d: across hosts: rank (\d) on (\w+) closed its connection", "".join(outputs))
    assert "3" in {rank for rank, _ in named} and {(rank, host) for rank, host in named} <= {
        ("2", "simhost1"), ("3", "simhost1")}, "".join(o[-3000:] for o in outputs)


def _torchrun_on_each_host(sim, tmp_path, program, timeout=240):
    """Runs `program` under one torchrun of 2 ranks per simulated host (static rendezvous on the first host's
    address): the return codes and outputs (stdout, then stderr) of the torchruns."""
    import socket

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(program))
    with socket.socket() as s:
        s.bind(("", 0))
        port = str(s.getsockname()[1])
    runs = [subprocess.Popen([sim.agent, host, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                              "--node-rank", str(i), "--nproc-per-node", "2", "--master-addr", sim.addresses[0],
                              "--master-port", port, str(script)],
                             cwd=ROOT, env=job_env(OMP_NUM_THREADS="1"), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i, host in enumerate(sim.hosts)]
    try:
        outputs = ["\n".join(run.communicate(timeout=timeout)) for run in runs]
    finally:
        for run in runs:
            run.kill()
    return [run.returncode for run in runs], outputs


def _check_backend_reports(reports):
    """What every rank of SHMCOMM_BACKEND says, on 2 hosts of 2 ranks."""
    assert sorted(reports) == [0, 1, 2, 3]
    for me, report in reports.items():
        assert report["hosts"] == 2 and report["sum"] == [6.0] * 3 and report["whole"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
        assert report["share"] == [8.0 * me, 8.0 * me + 4] and report["b"] == [3.0, 3.0]
        assert report["got"] == [10.0 * r + me for r in range(4)]
        assert report["ddp"] and report["local"] == 2.0
        # groups across the hosts: ranks 1 and 2 (all_reduce, send/recv), ranks 0, 2 and 3; ranks 0 and 1 on a host
        assert report["errors"] == [True] * {0: 3, 1: 3, 2: 4, 3: 2}[me]


def _blamed_across_hosts(sim, api, runs, first=0):
    """Rank 1 (on the second host) raises at its fourth step: the launcher's last line names it and its exception,
    and so does rank 0's error where rank 0 raised before the job was stopped. Every other run, counting from
    `first`, keeps the launcher's report directory off the hosts (TMPDIR in the hosts' private folder), as on hosts
    without a shared file system: the cause then comes through rank 1's guard and the engine or the launcher's
    notices."""
    from test_launch_failure import RAISES

    if api != "numpy":
        pytest.importorskip(api)
    seen = 'import os; print("reports seen", os.path.isdir(os.environ["SHMCOMM_ERROR_REPORT_DIR"]), flush=True)\n'
    for run in range(first, first + runs):
        private = run % 2 == 1
        result = _shmcommrun(sim, 1, [sys.executable, "-c", seen + textwrap.dedent(RAISES[api])],
                             **({"TMPDIR": sim.private_dir} if private else {}))
        assert result.returncode != 0
        assert f"[1]<stdout>: reports seen {not private}" in result.stdout, result.stdout[-3000:]
        assert result.stderr.splitlines()[-1].endswith(
            "rank 1 failed first (ValueError: bad batch at step 3)"), result.stderr[-3000:]
        for line in result.stderr.splitlines():
            if line.startswith("[0]<stderr>: shmcomm.vocabulary.exceptions."):
                assert line.endswith("failed (ValueError: bad batch at step 3)"), line
            # Nothing but the ranks' lines and the launcher's own: a guard's error would show here.
            assert line.startswith(("[", "shmcommrun: ")), result.stderr[-3000:]


# The default run takes both kinds of run with numpy; the second tier adds torch's and jax's slower jobs, which take
# the one only the guard serves (their blame on one host stays in the default run: test_launch_failure.py), and
# repeats each 20 times.
@pytest.mark.parametrize("api", ["numpy", pytest.param("torch", marks=pytest.mark.long),
                                 pytest.param("jax", marks=pytest.mark.long)])
def test_the_rank_that_raised_is_named_across_hosts(two_hosts, api):
    if api == "numpy":
        _blamed_across_hosts(two_hosts, api, 2)
    else:
        _blamed_across_hosts(two_hosts, api, 1, first=1)


@pytest.mark.long
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("api", ["numpy", "torch", "jax"])
def test_the_rank_that_raised_is_named_across_hosts_20_times(two_hosts, api):
    _blamed_across_hosts(two_hosts, api, 20)
