# SPDX-License-Identifier: Apache-2.0
"""op=Adasum against a direct numpy implementation of the formula, applied pairwise up a binary tree of the ranks:
on one host (2, 4, 8 ranks), on logical grids (the hierarchical stages over shared memory), across pretend hosts
(the levels between hosts over MPI), for float16/32/64, single tensors and fused buffers whose tensors each keep
their own coefficients; Horovod's refusals (non-power-of-two worlds, non-float tensors, reducescatter)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import multiproc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [1000, 1, 37, 0, 4096, 5]  # tensor 5 is zero on rank 0 (the 1e-8 norm floor keeps its coefficient 1)


def inputs(rank, sizes=SIZES, seed=7):
    """Each rank's tensors (float64): a shared direction plus a rank's own part, so the dot products matter."""
    out = []
    for t, size in enumerate(sizes):
        shared = np.random.default_rng([seed, t]).standard_normal(size)
        own = np.random.default_rng([seed, t, rank + 1]).standard_normal(size)
        x = shared * (1 + t % 3) + own * (0.3 + 0.2 * rank)
        if t == 5 and rank == 0:
            x[:] = 0
        out.append(x)
    return out


def adasum_pair(a, b):
    dot, aa, bb = np.vdot(a, b), np.vdot(a, a), np.vdot(b, b)
    a_coeff = 1 - dot / aa * 0.5 if aa >= 1e-8 else 1.0
    b_coeff = 1 - dot / bb * 0.5 if bb >= 1e-8 else 1.0
    return a_coeff * a + b_coeff * b


def reference(per_rank):
    """per_rank[r][t]: the formula, tensor by tensor, rank r with r ^ 1, then pairs with pairs."""
    level = [list(tensors) for tensors in per_rank]
    while len(level) > 1:
        level = [[adasum_pair(a, b) for a, b in zip(level[i], level[i + 1])] for i in range(0, len(level), 2)]
    return level[0]


TOLERANCE = {"float64": (1e-10, 1e-12), "float32": (2e-5, 2e-5), "float16": (2e-3, 4e-3)}


def assert_matches(results, n, dtype, sizes=SIZES, seed=7, scale=1.0):
    want = reference([[x.astype(dtype).astype(np.float64) for x in inputs(r, sizes, seed)] for r in range(n)])
    rtol, atol = TOLERANCE[dtype]
    for r, got in enumerate(results):
        assert len(got) == len(want)
        for t, (g, w) in enumerate(zip(got, want)):
            assert g.dtype == np.dtype(dtype)
            np.testing.assert_allclose(g.astype(np.float64), w * scale, rtol=rtol,
                                       atol=atol * max(1.0, float(np.abs(w).max(initial=0))),
                                       err_msg="rank %d tensor %d" % (r, t))
        for other in results[1:]:  # every rank holds the same bits
            assert all(np.array_equal(a, b) for a, b in zip(results[0], other))


def _one_by_one(dtype, postscale=1.0):
    import shmcomm

    shmcomm.init()
    out = []
    for x in inputs(shmcomm.rank()):
        x = x.astype(dtype)
        kept = x.copy()
        out.append(shmcomm.allreduce(x, op=shmcomm.Adasum, postscale_factor=postscale))
        assert np.array_equal(x, kept)  # the input is untouched
    return out


def _fused(dtype):
    """The engine's path: several tensors in flight at once, fused into one buffer."""
    import shmcomm

    shmcomm.init(engine=True)
    tensors = [x.astype(dtype) for x in inputs(shmcomm.rank())]
    handles = [shmcomm.allreduce_async_(x, op=shmcomm.Adasum, name="t%d" % i) for i, x in enumerate(tensors)]
    for h in handles:
        shmcomm.synchronize(h)
    return tensors


def _packed(dtype):
    """One buffer holding every tensor, reduced in one call with their sizes: per-layer coefficients."""
    import shmcomm
    from shmcomm import basics
    from shmcomm.vocabulary import dtypes
    from shmcomm._native import ffi

    shmcomm.init()
    flat = np.concatenate(inputs(shmcomm.rank())).astype(dtype)
    ptr = ffi.from_buffer(flat)
    basics.communicator().adasum(ptr, ptr, flat.size, dtypes.numpy_code(flat.dtype), SIZES, 1.0, 1.0, "packed")
    return np.split(flat, np.cumsum(SIZES)[:-1])


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_adasum_matches_the_formula_on_one_host(n, dtype):
    assert_matches(multiproc.run(n, _one_by_one, dtype, timeout=120), n, dtype)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fused_tensors_keep_their_own_coefficients(n):
    assert_matches(multiproc.run(n, _packed, "float32", timeout=120), n, "float32")
    assert_matches(multiproc.run(n, _fused, "float32", timeout=120), n, "float32")


def test_postscale_applies_to_the_result():
    assert_matches(multiproc.run(4, _one_by_one, "float64", 0.5, timeout=120), 4, "float64", scale=0.5)


@pytest.mark.parametrize("grid", ["2x2", "4x2", "2x4"])
def test_hierarchical_stages_on_a_logical_grid(grid):
    x, y = (int(v) for v in grid.split("x"))
    env = {"SHMCOMM_TORUS_GRID": grid}
    assert_matches(multiproc.run(x * y, _one_by_one, "float32", env=env, timeout=120), x * y, "float32")
    assert_matches(multiproc.run(x * y, _packed, "float64", env=env, timeout=120), x * y, "float64")


def _refusals():
    import shmcomm

    shmcomm.init()
    n = shmcomm.size()
    if n & (n - 1):
        with pytest.raises(NotImplementedError, match="non-power-of-two"):
            shmcomm.allreduce(np.ones(4, np.float32), op=shmcomm.Adasum)
    else:
        with pytest.raises(shmcomm.InvalidArgumentError, match="floating-point"):
            shmcomm.allreduce(np.ones(4, np.int32), op=shmcomm.Adasum)
        # Ranks that disagree all raise, and the job goes on.
        with pytest.raises(shmcomm.MismatchError):
            shmcomm.allreduce(np.ones(4 + shmcomm.rank(), np.float32), op=shmcomm.Adasum)
    with pytest.raises(shmcomm.InvalidArgumentError, match="Adasum"):
        shmcomm.reducescatter(np.ones(4, np.float32), op=shmcomm.Adasum)
    return shmcomm.allreduce(np.ones(3, np.float32), op=shmcomm.Sum).tolist()


@pytest.mark.parametrize("n", [3, 4])
def test_refusals_as_horovod_and_mismatches(n):
    assert multiproc.run(n, _refusals, env={"SHMCOMM_TIMEOUT": "30"}, timeout=90) == [[float(n)] * 3] * n


ACROSS = textwrap.dedent("""
    import sys, pickle, numpy as np, shmcomm
    sys.path.insert(0, %r)
    from test_adasum import inputs
    shmcomm.init()
    r = shmcomm.rank()
    out = [shmcomm.allreduce(x.astype(sys.argv[2]), op=shmcomm.Adasum) for x in inputs(r)]
    with open("%%s/%%d.pkl" %% (sys.argv[1], r), "wb") as f:
        pickle.dump((type(shmcomm.basics.communicator()).__name__, shmcomm.cross_size(), out), f)
""" % os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("n,per_host,algo", [(4, "2", "torus"), pytest.param(8, "2", "torus", marks=pytest.mark.long),
                                             pytest.param(8, "4", "mpi", marks=pytest.mark.long),
                                             pytest.param(8, "1", "ring", marks=pytest.mark.long)])
def test_across_pretend_hosts(tmp_path, n, per_host, algo):
    """The levels between hosts over MPI (the torus's column); the allreduce algorithm setting does not matter."""
    import pickle

    from test_torus import _mpiexec

    script = tmp_path / "job.py"
    script.write_text(ACROSS)
    run = _mpiexec([script, tmp_path, "float32"], n, SHMCOMM_RANKS_PER_HOST=per_host, SHMCOMM_ALLREDUCE_ALGO=algo,
                   SHMCOMM_TIMEOUT="60")
    assert run.returncode == 0, run.stdout + run.stderr
    reports = [pickle.loads((tmp_path / ("%d.pkl" % r)).read_bytes()) for r in range(n)]
    assert {(kind, hosts) for kind, hosts, _ in reports} == {("WorldComm", n // int(per_host))}
    assert_matches([out for _, _, out in reports], n, "float32")


@pytest.mark.long
def test_synthetic_benchmark_with_adasum():
    run = subprocess.run([sys.executable, "-m", "shmcomm.runner", "-np", "2", sys.executable,
                          "examples/torch_synthetic_benchmark.py", "--use-adasum", "--num-iters", "2",
                          "--num-warmup-batches", "1", "--num-batches-per-iter", "1", "--batch-size", "4",
                          "--model", "resnet_tiny", "--image-size", "16"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Adasum" in run.stdout, run.stdout


def _model(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _batch(rank, step):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def _loss(model, rank, step):
    x, y = _batch(rank, step)
    return ((model(x) - y) ** 2).mean()


def _adasum_training(steps):
    import torch

    import shmcomm.torch as hvd

    hvd.init()
    model = _model(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    for step in range(steps):
        opt.zero_grad()
        _loss(model, hvd.rank(), step).backward()
        opt.step()
    return [p.detach().double().numpy() for p in model.parameters()]


def _adasum_training_by_hand(n, steps):
    """Every rank's optimizer (its own momentum) steps its own copy; the model moves by the Adasum of the changes."""
    import torch

    model = _model(0)
    replicas = [_model(0) for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in replicas]
    for step in range(steps):
        deltas = []
        for r, (m, opt) in enumerate(zip(replicas, opts)):
            with torch.no_grad():
                for q, p in zip(m.parameters(), model.parameters()):
                    q.copy_(p)
            opt.zero_grad()
            _loss(m, r, step).backward()
            opt.step()
            deltas.append([(q.detach() - p.detach()).double().numpy() for q, p in zip(m.parameters(),
                                                                                        model.parameters())])
        combined = reference(deltas)
        with torch.no_grad():
            for p, d in zip(model.parameters(), combined):
                p.add_(torch.from_numpy(d).to(p.dtype))
    return [p.detach().double().numpy() for p in model.parameters()]


@pytest.mark.parametrize("n", [2, 4])
def test_distributed_optimizer_with_adasum_is_horovods_delta_optimizer(n):
    pytest.importorskip("torch")
    got = multiproc.run(n, _adasum_training, 4, timeout=120)
    want = _adasum_training_by_hand(n, 4)
    for r in range(n):
        for g, w in zip(got[r], want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
