# SPDX-License-Identifier: Apache-2.0
"""Elastic averaging over a job-wide Soft Memory Box: the numpy building blocks (the exchange's arithmetic, and
what every exchange conserves however stale its read), ElasticAveragingOptimizer's hybrid mode (a host's ranks stay
identical), bad inputs, the optimizer's schedule, alpha and host averages against a numpy reference (one rank, one
host of 2, 2 pretend hosts of 2), and digits reaching 95% asynchronously and in the hybrid mode on one host and on 2x2
simulated hosts."""
import itertools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import multiproc
from test_simhosts import MPIEXEC, job_env, open_hosts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _exchange_arithmetic(overlap):
    import shmcomm
    from shmcomm.smb.averaging import ElasticCentre

    shmcomm.init()
    centre = ElasticCentre("c", 4, overlap=overlap)
    centre.initialise(np.zeros(4, np.float32))
    centre.ready(timeout=5)
    x = np.array([2, 4, 6, 8], np.float32)
    centre.exchange(x, 0.5)  # d = (x - 0) / 2
    centre.flush()
    first = (x.tolist(), centre.pull().tolist())
    x[:] = [3, 4, 5, 6]
    centre.exchange(x, 0.5)  # d = (x - c) / 2 = 1
    centre.flush()
    second = (x.tolist(), centre.pull().tolist(), centre.box.version)
    errors = {}
    for name, call in {"alpha 0": lambda: centre.exchange(x, 0.0), "alpha above 1": lambda: centre.exchange(x, 1.5),
                       "float64 into float32": lambda: centre.exchange(x.astype(np.float64), 0.5),
                       "wrong size": lambda: centre.exchange(x[:3].copy(), 0.5)}.items():
        try:
            call()
        except shmcomm.InvalidArgumentError as error:
            errors[name] = str(error)
    centre.close()
    return first, second, errors


@pytest.mark.parametrize("overlap", [False, True])
def test_the_exchange_pulls_the_worker_and_pushes_the_centre(overlap):
    first, second, errors = multiproc.run(1, _exchange_arithmetic, overlap)[0]
    assert first == ([1, 2, 3, 4], [1, 2, 3, 4])
    assert second == ([2, 3, 4, 5], [2, 3, 4, 5], 3)  # initialise, then one accumulate per exchange
    assert sorted(errors) == ["alpha 0", "alpha above 1", "float64 into float32", "wrong size"], errors
    assert all("elastic centre 'c'" in text for text in errors.values())


def _optimizer_bad_inputs():
    import torch

    import shmcomm
    import shmcomm.torch as hvd

    hvd.init()
    model = torch.nn.Linear(3, 2)
    raised = {}
    for name, kwargs in {"alpha 0": {"alpha": 0.0}, "period 0": {"period": 0}, "period 1.5": {"period": 1.5}}.items():
        try:
            hvd.ElasticAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        except shmcomm.InvalidArgumentError as error:
            raised[name] = str(error)
    mixed = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2).double())
    try:
        hvd.ElasticAveragingOptimizer(torch.optim.SGD(mixed.parameters(), lr=0.1))
    except shmcomm.InvalidArgumentError as error:
        raised["mixed dtypes"] = str(error)
    return raised


def test_optimizer_bad_inputs_are_typed_errors():
    pytest.importorskip("torch")
    raised = multiproc.run(1, _optimizer_bad_inputs)[0]
    assert sorted(raised) == ["alpha 0", "mixed dtypes", "period 0", "period 1.5"], raised


# The optimizer's schedule and alpha, exactly: a float64 parameter vector, plain SGD on gradients given per step and
# per rank, against the same arithmetic in numpy (_reference). 10 steps of period 3 exchange at steps 3, 6 and 9 (a
# tenth step after the last); alpha 0.25 is not the default.
X0 = [1.0, -2.0, 3.0, 0.5]
ALPHA, PERIOD, STEPS, LR = 0.25, 3, 10, 0.125


def _gradient(step, rank):
    """Rank `rank`'s gradient at step `step` (from 0): dyadic, different at every step and on every rank."""
    return (step + 1) * np.array([1.0, -0.5, 0.25, 2.0]) + rank * np.array([0.5, 1.0, -1.5, 0.25])


def _host_gradient(ranks):
    """The average of `ranks`' gradients at a step: what every rank of a host steps on in the hybrid mode."""
    return lambda step: np.mean([_gradient(step, r) for r in ranks], axis=0)


def _reference(host_gradients, overlap, order, steps=STEPS):
    """Elastic averaging in numpy: every host steps x -= LR * g(step), and at every PERIOD-th step exchanges with the
    centre c: d = ALPHA (x - c); c += d; x -= d (with overlap, at the host's next exchange or at finish). `order`: the
    host of each exchange, in the order they reach the centre. Returns each host's (x, c, the centre's version) after
    every step and after finish(), and the final centre."""
    c = np.array(X0)
    hosts = [{"x": c.copy(), "step": 0, "pending": 0.0, "seen": []} for _ in host_gradients]
    versions = [1]  # initialise

    def run(h):  # host h's steps up to its next exchange, or to the end
        nonlocal c
        host = hosts[h]
        while host["step"] < steps:
            host["x"] = host["x"] - LR * host_gradients[h](host["step"])
            host["step"] += 1
            exchanged = host["step"] % PERIOD == 0
            if exchanged:
                host["x"] = host["x"] - host["pending"]
                d = ALPHA * (host["x"] - c)
                c = c + d
                versions[0] += 1
                host["pending"] = d if overlap else 0.0
                host["x"] = host["x"] - (0.0 if overlap else d)
            host["seen"].append((host["x"], c, versions[0]))
            if exchanged:
                return

    for h in list(order) + list(range(len(hosts))):
        run(h)
    for host in hosts:
        assert host["step"] == steps and len(host["seen"]) == steps, "order %s misses exchanges" % (order,)
        host["x"] = host["x"] - host["pending"]
        host["seen"].append((host["x"], c, versions[0]))
    return [host["seen"] for host in hosts], c


def _elastic_trajectory(overlap, hybrid):
    """Runs ElasticAveragingOptimizer for STEPS steps on X0 with this rank's _gradient; returns (x, c, version) after
    every step (c and the version once this rank's exchange in flight has reached the centre, without applying its d
    to x) and after finish() and a barrier. c and the version are None where this rank does not exchange."""
    import torch

    import shmcomm.torch as hvd

    hvd.init()
    rank = hvd.rank()
    x = torch.nn.Parameter(torch.tensor(X0, dtype=torch.float64))
    opt = hvd.ElasticAveragingOptimizer(torch.optim.SGD([x], lr=LR), named_parameters=[("x", x)], alpha=ALPHA,
                                        period=PERIOD, hybrid=hybrid, overlap=overlap)
    centre = opt._centre
    seen = []
    for step in range(STEPS):
        opt.zero_grad()
        x.grad = torch.from_numpy(_gradient(step, rank))
        opt.step()
        if centre._pending is not None:
            centre._pending[0].result()  # the centre has it; its d is still to land in x
        if opt._exchanger:
            seen.append((x.detach().tolist(), centre.pull().tolist(), centre.box.version))
        else:
            seen.append((x.detach().tolist(), None, None))
    opt.finish()
    hvd.barrier()
    seen.append((x.detach().tolist(), centre.pull().tolist(), centre.box.version))
    return seen


def _assert_trajectory(got, expected, what, centre=True):
    assert len(got) == len(expected), (what, len(got), len(expected))
    for step, ((x, c, version), (x_ref, c_ref, version_ref)) in enumerate(zip(got, expected)):
        where = "%s after %s" % (what, "finish()" if step == STEPS else "step %d" % (step + 1))
        np.testing.assert_allclose(x, x_ref, rtol=0, atol=1e-12, err_msg="x, " + where)
        if centre and c is not None:
            np.testing.assert_allclose(c, c_ref, rtol=0, atol=1e-12, err_msg="centre, " + where)
            assert version == version_ref, "centre version %d, expected %d, %s" % (version, version_ref, where)


@pytest.mark.parametrize("overlap", [False, True])
def test_asynchronous_schedule_and_alpha_are_exact(overlap):
    """One rank, asynchronous: x and the centre after every step and after finish() equal the numpy reference, so
    the steps at which it exchanges (every PERIOD-th), the alpha it passes, and (with overlap) its d landing in x one
    exchange late are as documented; the centre's version is 1 + the exchanges so far."""
    pytest.importorskip("torch")
    got = multiproc.run(1, _elastic_trajectory, overlap, False)[0]
    (expected,), _ = _reference([_host_gradient([0])], overlap, [0] * (STEPS // PERIOD))
    _assert_trajectory(got, expected, "rank 0")


@pytest.mark.parametrize("overlap", [pytest.param(False, marks=pytest.mark.long), True])
def test_hybrid_schedule_alpha_and_host_average_are_exact_on_one_host(overlap):
    """Hybrid on one host of 2 ranks with different gradients: both ranks' x after every step equal the reference
    on the ranks' average gradient, and rank 0's centre and its version (1 + exchanges) after every step too."""
    pytest.importorskip("torch")
    got = multiproc.run(2, _elastic_trajectory, overlap, True)
    (expected,), _ = _reference([_host_gradient([0, 1])], overlap, [0] * (STEPS // PERIOD))
    _assert_trajectory(got[0], expected, "rank 0")
    _assert_trajectory(got[1][:STEPS], expected[:STEPS], "rank 1")
    assert got[1][STEPS][1:] == got[0][STEPS][1:]
    np.testing.assert_allclose(got[1][STEPS][0], expected[STEPS][0], rtol=0, atol=1e-12, err_msg="rank 1 finish()")


# Two pretend hosts of 2 ranks (an MPI job, SHMCOMM_RANKS_PER_HOST=2): the hosts' exchanges reach the centre in an
# order that varies from run to run, so the run must match the reference of one of the 20 orders of 3 + 3 exchanges.
ACROSS = ("import json, pathlib, sys; sys.path.insert(0, 'tests'); import test_averaging, shmcomm.torch as hvd; "
          "seen = test_averaging._elastic_trajectory(False, True); "
          "pathlib.Path(sys.argv[1], 'rank%d.json' % hvd.rank()).write_text(json.dumps(seen))")


def test_hybrid_across_pretend_hosts_averages_each_hosts_gradients(tmp_path):
    """Hybrid on 2 pretend hosts of 2 ranks: every rank's x after every step and the final centre equal the
    reference on its own host's average gradient for one order of the hosts' exchanges; the centre's version is 1 +
    both hosts' exchanges."""
    pytest.importorskip("torch")
    run = subprocess.run([MPIEXEC, "-n", "4", sys.executable, "-c", ACROSS, str(tmp_path)], cwd=ROOT,
                         env=job_env(SHMCOMM_RANKS_PER_HOST="2"), stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    got = {rank: json.loads((tmp_path / ("rank%d.json" % rank)).read_text()) for rank in range(4)}
    hosts, exchanges = [_host_gradient([0, 1]), _host_gradient([2, 3])], STEPS // PERIOD
    before, _ = _reference(hosts, False, [], steps=PERIOD - 1)  # no exchange yet: no other host involved
    for rank, seen in got.items():
        _assert_trajectory(seen[:PERIOD - 1], before[rank // 2][:PERIOD - 1], "rank %d" % rank, centre=False)
        assert seen[STEPS][1:] == got[0][STEPS][1:], "the final centre as ranks 0 and %d read it" % rank
    assert got[0][STEPS][2] == 1 + 2 * exchanges, "centre version %d after finish()" % got[0][STEPS][2]
    orders = []
    for firsts in itertools.combinations(range(2 * exchanges), exchanges):
        order = [0 if i in firsts else 1 for i in range(2 * exchanges)]
        expected, c = _reference(hosts, False, order)
        if np.allclose(got[0][STEPS][1], c, rtol=0, atol=1e-12) and all(
                np.allclose([x for x, _, _ in seen], [x for x, _, _ in expected[rank // 2]], rtol=0, atol=1e-12)
                for rank, seen in got.items()):
            orders.append(order)
    assert len(orders) == 1, (orders, got)


# Every exchange moves d from the worker to the centre: the sum of every worker and the centre never changes,
# however stale the centre a worker read (a lost update would break it). alpha 1 keeps every value an integer, so
# the sums are exact in float64 whatever the interleaving (with alpha 0.5 the halvings chain across ranks and
# outgrow the 53-bit mantissa after a few dozen exchanges, and the sum drifts by rounding alone).
CONSERVED = """
import socket, numpy as np, shmcomm, torch
import shmcomm.torch as hvd
from shmcomm.smb.averaging import ElasticCentre
hvd.init()
r, n = hvd.rank(), hvd.size()
centre = ElasticCentre("centre", 64, dtype=np.float64, stripes=hvd.cross_size())
if r == 0:
    centre.initialise(np.zeros(64))
centre.ready()
x = np.full(64, 8.0 * (r + 1))
for i in range(20):
    x += r
    centre.exchange(x, 1.0)
centre.flush()
hvd.barrier()
total = hvd.allreduce(torch.from_numpy(x), op=hvd.Sum).numpy() + centre.pull()
expected = sum(8.0 * (q + 1) + 20 * q for q in range(n))
print("conserved", bool((total == expected).all()), "off by", float(np.abs(total - expected).max()), flush=True)

# Hybrid: the ranks of a host stay identical; hosts differ; the centre comes back by parameter name.
torch.manual_seed(r)
model = torch.nn.Linear(5, 3)
hvd.broadcast_parameters(model.state_dict(), 0)
opt = hvd.ElasticAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), alpha=0.5, period=2, hybrid=True)
for i in range(7):
    opt.zero_grad()
    model(torch.randn(4, 5) * (r + 1)).pow(2).sum().backward()
    opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
every = hvd.allgather_object((socket.gethostname(), flat.tolist()))
same = all(a[1] == b[1] for a in every for b in every if a[0] == b[0])
differ = hvd.cross_size() == 1 or len({tuple(e[1]) for e in every}) == hvd.cross_size()
keys = sorted(opt.centre_state_dict())
opt.finish()
hvd.barrier()
print("hybrid same within hosts", same, "differ across hosts", differ, "keys", keys, flush=True)
"""

EXPECTED_HYBRID = "hybrid same within hosts True differ across hosts True keys ['bias', 'weight']"


def _launch(launcher, *args, timeout=300):
    return subprocess.run(launcher + list(args), cwd=ROOT, env=job_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def _time_to_target(run):
    assert run.returncode == 0, run.stdout + run.stderr
    line = [ln for ln in run.stdout.splitlines() if "time to 95%" in ln]
    assert line, run.stdout
    assert "not reached" not in line[0], line[0]
    return line[0]


ONE_HOST = [sys.executable, "-m", "shmcomm.runner", "-np", "2"]


@pytest.mark.long
def test_conservation_and_hybrid_on_one_host():
    pytest.importorskip("torch")
    run = _launch(ONE_HOST, sys.executable, "-c", CONSERVED)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("conserved True") == 2, run.stdout
    assert run.stdout.count(EXPECTED_HYBRID) == 2, run.stdout


# The default run trains to 95% once (async on one host; the hybrid mode and the exchange across hosts are checked
# by the conservation tests); -m long runs hybrid on one host and both modes across two hosts.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", pytest.param("hybrid", marks=pytest.mark.long)])
@pytest.mark.long
def test_digits_reach_95_percent_on_one_host(mode):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    line = _time_to_target(_launch(ONE_HOST, sys.executable, "examples/torch_elastic.py", "--mode", mode))
    assert ("mode %s, ranks 2, hosts 1" % mode) in line


@pytest.mark.slow
@pytest.mark.long
def test_step_rates_in_phases_with_and_without_the_slow_rank():
    """--duration: the job trains for that long, the slow rank sleeps in every other phase only, and every rank
    reports its rate in both kinds of phase (what benchmarks.elastic compares). A rank that sleeps twice its step
    in one kind of phase steps less often there: that checks the phases alternate, with a margin of 3x."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    run = _launch(ONE_HOST, sys.executable, "examples/torch_elastic.py", "--mode", "async", "--slow-rank", "1",
                  "--slow-factor", "3", "--duration", "3", "--phase-seconds", "1")
    assert run.returncode == 0, run.stdout + run.stderr
    rates = {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in re.finditer(
        r"rank (\d+) phases: ([0-9.]+) steps/s unslowed, ([0-9.]+) steps/s with rank 1 slowed", run.stdout)}
    assert sorted(rates) == [0, 1], run.stdout
    assert all(plain > 0 and slowed > 0 for plain, slowed in rates.values()), rates
    assert rates[1][1] < rates[1][0], rates
    assert "time to 95%: not measured (step rates over 3 s)" in run.stdout, run.stdout


@pytest.fixture(scope="module")
def hosts():
    sim = open_hosts(2)
    try:
        yield sim
    finally:
        sim.close()


def _across(sim):
    return [sys.executable, "-m", "shmcomm.runner", *sim.shmcommrun_args(2)]


@pytest.mark.long
def test_conservation_and_hybrid_on_two_hosts(hosts):
    pytest.importorskip("torch")
    run = _launch(_across(hosts), sys.executable, "-c", CONSERVED)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("conserved True") == 4, run.stdout
    assert run.stdout.count(EXPECTED_HYBRID) == 4, run.stdout


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("mode", ["async", "hybrid"])
def test_digits_reach_95_percent_on_two_hosts_of_two(hosts, mode):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    line = _time_to_target(_launch(_across(hosts), sys.executable, "examples/torch_elastic.py", "--mode", mode))
    assert ("mode %s, ranks 4, hosts 2" % mode) in line
