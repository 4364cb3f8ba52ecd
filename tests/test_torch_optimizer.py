# SPDX-License-Identifier: Apache-2.0
"""DistributedOptimizer, broadcast_parameters and broadcast_optimizer_state against single-process training."""
import copy
import hashlib
import time
import warnings

import pytest

torch = pytest.importorskip("torch")
import multiproc  # noqa: E402

# torch.optim imports torch._dynamo on first use (a second or more): pay once here, not in every forked rank.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

ROWS = 4  # per rank and micro-batch


def _init():
    import shmcomm.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    return hvd


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)).double()


def _batch(step, n):
    """The global batch of a step (every rank can build all of it); rank r uses rows [r*ROWS, (r+1)*ROWS)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n * ROWS, 5, generator=g, dtype=torch.float64), torch.randn(n * ROWS, 2, generator=g,
                                                                                   dtype=torch.float64)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _digest(tensors):
    """sha256 of the bytes of these tensors: ranks return it, and the test compares them outside the library."""
    return hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes() for t in tensors)).hexdigest()


def _same_on_every_rank(results):
    """Each rank returned a list of digests: the same list on every rank."""
    assert all(r == results[0] for r in results), results


def _train(hvd, make_opt, steps=3, passes=1, reference_scale=1.0, **kwargs):
    """Trains a model under DistributedOptimizer and, on the side, a copy on the whole batch in one process;
    returns both models and the DistributedOptimizer."""
    n, me = hvd.size(), hvd.rank()
    model = _model(seed=me)  # different on purpose: broadcast_parameters must make them equal
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    reference = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kwargs)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    ref_opt = make_opt(reference.parameters())
    hvd.broadcast_optimizer_state(ref_opt, root_rank=0)  # the same state initialization (Adam counts that step)
    loss_fn = torch.nn.MSELoss()
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        for k in range(passes):
            x, y = _batch(step * passes + k, n)
            mine = slice(me * ROWS, (me + 1) * ROWS)
            loss_fn(model(x[mine]), y[mine]).backward()
            # The average over ranks of per-rank mean losses is the mean loss of the whole batch.
            (loss_fn(reference(x), y) * reference_scale).backward()
        opt.step()
        ref_opt.step()
    return model, reference, opt


def _matches_single_process():
    hvd = _init()
    digests = []
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    plain_sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    adam = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731
    for make_opt, options, atol in ((sgd, {}, 1e-12),
                                    (sgd, {"passes": 2}, 1e-12),  # two backward passes: one over both micro-batches
                                    (adam, {"gradient_predivide_factor": 2.0}, 1e-10),
                                    (sgd, {"groups": 2}, 1e-12),
                                    (sgd, {"op": hvd.Sum, "reference_scale": hvd.size()}, 1e-12)):
        model, reference, opt = _train(hvd, make_opt, **options)
        assert torch.allclose(_flat(model), _flat(reference), atol=atol), options
        digests.append(_digest([_flat(model)]))
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    model, reference = _train_fp16(hvd, plain_sgd)
    assert torch.equal(_flat(model), _flat(reference))
    digests.append(_digest([_flat(model)]))
    return digests


def _train_fp16(hvd, make_opt, steps=3):
    """DistributedOptimizer with Compression.fp16 against its exact emulation in one process: each rank's gradient
    rounded to float16, summed in float32, times 1/n (rounded to float32), rounded once to float16."""
    n, me = hvd.size(), hvd.rank()
    model = _model(seed=0)
    reference, unrounded = copy.deepcopy(model), copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    ref_opt, unrounded_opt = make_opt(reference.parameters()), make_opt(unrounded.parameters())
    loss_fn = torch.nn.MSELoss()
    shard = [slice(r * ROWS, (r + 1) * ROWS) for r in range(n)]
    factor = torch.tensor(1.0 / n, dtype=torch.float32)
    for step in range(steps):
        x, y = _batch(step, n)
        opt.zero_grad()
        loss_fn(model(x[shard[me]]), y[shard[me]]).backward()
        opt.step()
        for copy_, copy_opt, rounded in ((reference, ref_opt, True), (unrounded, unrounded_opt, False)):
            grads = []
            for r in range(n):  # every rank's own gradient, as that rank computes it
                copy_opt.zero_grad()
                loss_fn(copy_(x[shard[r]]), y[shard[r]]).backward()
                grads.append([p.grad.clone() for p in copy_.parameters()])
            for i, p in enumerate(copy_.parameters()):
                if rounded:
                    p.grad = (sum(g[i].half().float() for g in grads) * factor).half().double()
                else:
                    p.grad = sum(g[i] for g in grads) / n
            copy_opt.step()
    assert not torch.equal(_flat(reference), _flat(unrounded))  # the compression shows in the weights
    return model, reference


def test_step_equals_single_process_step():
    _same_on_every_rank(multiproc.run(2, _matches_single_process, timeout=90))


def _fresh(me):
    """A model of its own for each optimizer: every DistributedOptimizer hooks its parameters for good."""
    model = _model(seed=0)
    x, y = _batch(0, 2)
    mine = slice(me * ROWS, (me + 1) * ROWS)
    return model, list(model.parameters()), lambda: torch.nn.functional.mse_loss(model(x[mine]), y[mine])


def _guards_and_options():
    hvd = _init()
    me = hvd.rank()
    model, params, loss = _fresh(me)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=model.named_parameters())
    loss().backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    while not all(hvd.poll(h) for h, _ in opt._handles.values()):  # let the in-place reductions finish
        time.sleep(0.001)
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        loss().backward()  # a second gradient before step()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()

    # skip_synchronize: reduce, change the reduced gradients, then step without reducing again.
    loss().backward()
    opt.synchronize()
    reduced = [p.grad.clone() for p in params]
    for p in params:
        p.grad.mul_(0.5)
    before = _flat(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with opt.skip_synchronize():
            opt.step()
    expected = before - 0.1 * torch.cat([0.5 * g.reshape(-1) for g in reduced])
    assert torch.allclose(_flat(model), expected, atol=1e-14)
    opt.zero_grad()
    loss().backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()
    opt.zero_grad()

    # load_state_dict resets the accumulation counters and pending handles.
    model, params, loss = _fresh(me)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=model.named_parameters(),
                                    backward_passes_per_step=2)
    loss().backward()
    opt2.load_state_dict(opt2.state_dict())
    assert not opt2._handles and all(v == 2 for v in opt2._allreduce_delay.values())

    # Groups as a list of lists; the others form groups of one.
    model, params, loss = _fresh(me)
    opt3 = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=model.named_parameters(),
                                    groups=[[params[0], params[2]]])
    loss().backward()
    opt3.synchronize()
    digests = [_digest([p.grad for p in params])]  # reduced: the same on every rank
    with opt3.skip_synchronize():
        opt3.step()
    opt3.zero_grad()

    model, params, loss = _fresh(me)
    sgd = torch.optim.SGD(params, lr=0.1)
    named = list(model.named_parameters())
    for bad in (dict(named_parameters=[p for _, p in named]), dict(named_parameters=[("a", p) for _, p in named]),
                dict(named_parameters=named[:1]), dict(backward_passes_per_step=0),
                dict(op=hvd.Sum, gradient_predivide_factor=2.0), dict(groups=-1), dict(groups=[[1.0]]),
                dict(groups=[[params[0]], [params[0]]])):
        with pytest.raises(ValueError):
            hvd.DistributedOptimizer(sgd, **bad)
    with pytest.raises(ValueError):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(params), root_rank=0)

    # broadcast_optimizer_state: tensors, scalars and options from rank 0.
    adam = torch.optim.Adam(params, lr=0.01 * (me + 1))
    loss().backward()
    adam.step()  # local, different state on each rank
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    assert adam.param_groups[0]["lr"] == 0.01
    digests.append(_digest([adam.state[p][key] for p in params for key in ("exp_avg", "exp_avg_sq")]))
    return digests


def test_guards_validation_and_options():
    _same_on_every_rank(multiproc.run(2, _guards_and_options, timeout=60))


def _force_allreduce():
    hvd = _init()
    me = hvd.rank()
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 1).double(), torch.nn.Linear(3, 1).double()
    params = list(a.parameters()) + list(b.parameters())
    named = [("a." + k, v) for k, v in a.named_parameters()] + [("b." + k, v) for k, v in b.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=named)
    x = torch.ones(2, 3, dtype=torch.float64)
    loss = a(x).sum() + (b(x).sum() if me == 0 else 0)  # rank 1 never computes b's gradients
    loss.backward()
    opt.synchronize()
    # Rank 0's gradient of b.weight is 2 (two rows of ones); rank 1 contributed zeros.
    assert torch.equal(b.weight.grad, torch.ones(1, 3, dtype=torch.float64))
    assert torch.equal(b.bias.grad, torch.ones(1, dtype=torch.float64))
    with opt.skip_synchronize():
        opt.step()
    digests = [_digest(params)]

    # Sparse gradients: gathered as indices and values, or reduced as dense tensors.
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True).double()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(), sparse_as_dense=sparse_as_dense)
        (emb(torch.tensor([me, 3, 3, 7 + me])).sum() * (me + 1)).backward()
        local = emb.weight.grad.to_dense()
        opt.synchronize()
        assert emb.weight.grad.is_sparse
        assert torch.allclose(emb.weight.grad.to_dense(), hvd.allreduce(local))
    total = hvd.sparse_allreduce_async(torch.eye(3, dtype=torch.float64).to_sparse() * (me + 1), "s", hvd.Sum)()
    assert torch.equal(total.to_dense(), torch.eye(3, dtype=torch.float64) * 3)
    return digests


def test_force_allreduce_and_sparse_gradients():
    _same_on_every_rank(multiproc.run(2, _force_allreduce, timeout=60))


def test_distributed_optimizer_is_exported_at_top_level():
    import shmcomm
    import shmcomm.torch

    assert shmcomm.DistributedOptimizer is shmcomm.torch.DistributedOptimizer
