# SPDX-License-Identifier: Apache-2.0
"""The checks of shmcomm.jax that run on every rank of a job (tests/test_jax.py launches it with shmcommrun):
`python tests/jax_checks.py [check ...]`. Each check asserts exact expectations, computed here with numpy from what
every rank contributes, and prints "ok <check>"; any failure exits non-zero."""
import os
import sys

import jax

jax.config.update("jax_enable_x64", True)  # float64 finite differences; the checks name every dtype they use

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import shmcomm.jax as sj  # noqa: E402

BF16 = ml_dtypes.bfloat16


def tree_of(r):
    """Rank r's pytree of mixed dtypes."""
    return {"f32": (np.arange(6, dtype=np.float32).reshape(2, 3) + r) * 0.5,
            "bf16": (np.arange(4) + r).astype(BF16),
            "i32": [np.arange(3, dtype=np.int32) * (r + 1), np.int32(r)]}


def leaves(tree):
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(tree)]


def same(got, want):
    got, want = leaves(got), leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        assert np.array_equal(g.astype(np.float64), w.astype(np.float64)), (g, w)


def modes():
    return (("eager", lambda f: f), ("jit", jax.jit), ("sealed", sj.jit))


def check_collectives(rank, size):
    every = [tree_of(r) for r in range(size)]
    mine = tree_of(rank)
    total = jax.tree_util.tree_map(lambda *xs: np.sum(np.stack([np.asarray(x).astype(np.float64) for x in xs]), 0)
                                   .astype(np.asarray(xs[0]).dtype), *every)
    for mode, wrap in modes():
        same(wrap(lambda t: sj.allreduce(t, op=sj.Sum))(mine), total)
        same(wrap(lambda t: sj.broadcast(t, root_rank=size - 1))(mine), every[-1])
        gathered = jax.tree_util.tree_map(lambda *xs: np.concatenate([np.asarray(x).reshape((-1,) + np.shape(x)[1:])
                                                                      for x in xs]), *every)
        same(wrap(lambda t: sj.allgather(t))(mine), gathered)
        x = np.arange(15.0, dtype=np.float32).reshape(5, 3) * (rank + 1)
        rows = [5 // size + (1 if r < 5 % size else 0) for r in range(size)]
        start = sum(rows[:rank])
        reduced = np.arange(15.0, dtype=np.float32).reshape(5, 3) * sum(r + 1 for r in range(size))
        same(wrap(lambda a: sj.reducescatter(a, op=sj.Sum))(x), reduced[start:start + rows[rank]])
        same(wrap(lambda a: sj.reducescatter(a))(x), reduced[start:start + rows[rank]] / size)
        y = (np.arange(2 * size, dtype=np.int32) + 100 * rank).reshape(2 * size, 1)
        want = np.concatenate([(np.arange(2 * size, dtype=np.int32) + 100 * r)[2 * rank:2 * rank + 2] for r in
                               range(size)]).reshape(-1, 1)
        same(wrap(lambda a: sj.alltoall(a))(y), want)
        f = np.array([1.5, -2.0, 3.0], np.float32) + rank
        stack = np.stack([np.array([1.5, -2.0, 3.0], np.float32) + r for r in range(size)])
        same(wrap(lambda a: sj.allreduce(a))(f), stack.mean(0).astype(np.float32))
        same(wrap(lambda a: sj.allreduce(a, op=sj.Min))(f), stack.min(0))
        same(wrap(lambda a: sj.allreduce(a, op=sj.Max))(f), stack.max(0))
        same(wrap(lambda a: sj.allreduce(a, op=sj.Product))(f), np.prod(stack, 0).astype(np.float32))
        same(wrap(lambda a: sj.allreduce(a, op=sj.Sum, prescale_factor=2.0, postscale_factor=0.25))(f),
             (stack.sum(0) * 0.5).astype(np.float32))
        wrap(lambda: sj.barrier())()
    # Eager only: different first dimensions and explicit splits.
    got = sj.allgather(np.full((rank + 1, 2), rank, np.float32))
    same(got, np.concatenate([np.full((r + 1, 2), r, np.float32) for r in range(size)]))
    splits = [(rank + j) % 2 + 1 for j in range(size)]
    data = np.arange(sum(splits), dtype=np.float32) + 10 * rank
    out, received = sj.alltoall(data, splits=splits)
    expect, counts = [], []
    for r in range(size):
        theirs = [(r + j) % 2 + 1 for j in range(size)]
        at = sum(theirs[:rank])
        expect.append(np.arange(sum(theirs), dtype=np.float32)[at:at + theirs[rank]] + 10 * r)
        counts.append(theirs[rank])
    same(out, np.concatenate(expect))
    same(received, np.array(counts, np.int32))


def check_ordering(rank, size):
    """Collectives in loops and branches, alternating kinds and shapes: a reordering would meet a mismatch."""
    def body(carry, x):
        carry = carry + sj.allreduce(x, op=sj.Sum)
        return carry, sj.allgather(x[:1] * (rank + 1))

    xs = np.ones((6, 2)) * (rank + 1)
    carry, gathered = jax.jit(lambda v: jax.lax.scan(body, jnp.zeros(2), v))(xs)
    tri = size * (size + 1) / 2
    same(carry, np.full(2, 6 * tri))
    same(gathered, np.tile(np.array([(r + 1.0) ** 2 for r in range(size)]), (6, 1)))

    def branches(pred, v):
        return jax.lax.cond(pred, lambda a: sj.allreduce(a, op=sj.Sum) + sj.broadcast(a, 0),
                            lambda a: sj.allgather(a)[:2] * sj.allreduce(a, op=sj.Max), v)
    step = jax.jit(branches)
    v = jnp.ones(2) * (rank + 1)
    for pred in (True, False, True):
        want = np.full(2, tri + 1.0) if pred else np.full(2, 1.0 * size)
        same(step(pred, v), want)
    total = jax.jit(lambda v: jax.lax.fori_loop(0, 4, lambda i, c: c + sj.allreduce(c, op=sj.Sum), v))(v)
    values = [r + 1.0 for r in range(size)]
    for _ in range(4):
        values = [c + sum(values) for c in values]
    same(total, np.full(2, values[rank]))
    # Many independent collectives in one function: no data dependence between them, only the token.
    many = jax.jit(lambda vs: [sj.allreduce(a, op=sj.Sum) for a in vs])([jnp.ones(k + 1) * (rank + 1)
                                                                       for k in range(12)])
    for k, got in enumerate(many):
        same(got, np.full(k + 1, tri))


def _loss_weights(rank, n):
    return np.cos(np.arange(n) + 3.0 * rank)


def check_gradients(rank, size):
    """jax.grad of each rank's loss through every collective, against central finite differences of the sum of all
    ranks' losses."""
    rows = 2 * size
    cases = {
        "allreduce_sum": (lambda x: sj.allreduce(x, op=sj.Sum), (3,)),
        "allreduce_average": (lambda x: sj.allreduce(x, prescale_factor=1.5), (3,)),
        "allgather": (lambda x: sj.allgather(x), (2, 2)),
        "reducescatter": (lambda x: sj.reducescatter(x, op=sj.Average), (rows + 1, 2)),
        "broadcast": (lambda x: sj.broadcast(x, size - 1), (3,)),
        "alltoall": (lambda x: sj.alltoall(x), (rows,)),
    }
    for name, (collective, shape) in cases.items():
        def local(x):
            y = collective(x)
            return jnp.sum(jnp.sin(y) * _loss_weights(rank, y.size).reshape(y.shape))

        def total(x):
            return sj.allreduce(local(x), op=sj.Sum)

        x = np.random.default_rng(rank + 7).standard_normal(shape)
        grad = np.asarray(jax.jit(jax.grad(local))(x))
        evaluate = jax.jit(total)
        eps = 1e-6
        for s in range(size):
            for i in range(x.size):
                bump = np.zeros(x.size)
                if rank == s:
                    bump[i] = eps
                bump = bump.reshape(shape)
                fd = (float(evaluate(x + bump)) - float(evaluate(x - bump))) / (2 * eps)
                if rank == s:
                    assert abs(fd - grad.reshape(-1)[i]) < 1e-6, (name, s, i, fd, grad.reshape(-1)[i])


def check_vmap(rank, size):
    batch = np.arange(12.0).reshape(4, 3) + rank
    summed = sum(np.arange(12.0).reshape(4, 3) + r for r in range(size))
    same(jax.vmap(lambda a: sj.allreduce(a, op=sj.Sum))(batch), summed)
    same(jax.jit(jax.vmap(lambda a: sj.allreduce(a, op=sj.Sum), in_axes=1, out_axes=1))(batch), summed)
    per = np.arange(8.0).reshape(4, 2, 1) + 10 * rank  # 4 examples of 2 rows
    got = jax.jit(jax.vmap(sj.allgather))(per)
    same(got, np.concatenate([np.arange(8.0).reshape(4, 2, 1) + 10 * r for r in range(size)], axis=1))
    scalars = jax.vmap(sj.allgather)(np.arange(3.0) + 10 * rank)  # a scalar example gathers as one row
    same(scalars, np.stack([np.arange(3.0) + 10 * r for r in range(size)], axis=1))
    same(jax.vmap(lambda a: sj.reducescatter(a, op=sj.Sum))(per),
         sum(np.arange(8.0).reshape(4, 2, 1) + 10 * r for r in range(size))[:, _share(2, size, rank)])


def _share(rows, size, rank):
    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
    return slice(sum(counts[:rank]), sum(counts[:rank + 1]))


def _mlp(params, x):
    return jnp.tanh(x @ params["w"] + params["b"]) @ params["v"]


def _optimizer_steps_match(rank, size, wanted):
    """Two steps of DistributedOptimizer (sgd with momentum; adam over two backward passes, under jit only) taken
    `wanted` ("eager" or "jit") on each rank's shard equal the same steps on the concatenated batch; returns the
    parameters they started from."""
    key = jax.random.PRNGKey(3)
    params = {"w": jax.random.normal(key, (4, 5)), "b": jnp.zeros(5), "v": jax.random.normal(key, (5, 2))}
    mine = sj.broadcast_parameters(jax.tree_util.tree_map(lambda p: p + rank, params))
    same(mine, params)
    x = np.random.default_rng(0).standard_normal((8 * size, 4))
    y = np.random.default_rng(1).standard_normal((8 * size, 2))

    def loss(p, a, b):
        return jnp.mean((_mlp(p, a) - b) ** 2)

    # Each optimizer once, with one and with two backward passes per step: the accumulation over passes comes before
    # the optimizer and does not depend on it. With two passes the step runs under lax.cond, which traces its
    # branches even when called eagerly, so only jit takes it: eagerly it would add compilations, not a path.
    for inner, passes in ((optax.sgd(0.1, momentum=0.9), 1), (optax.adam(0.01), 2)):
        taken = [m for m in modes()[passes - 1:] if m[0] == wanted]
        if not taken:
            continue  # no reference to compile for a step not taken
        tx = sj.DistributedOptimizer(inner, backward_passes_per_step=passes)

        @jax.jit
        def reference_step(p, state):
            updates, state = inner.update(jax.grad(loss)(p, x, y), state, p)
            return optax.apply_updates(p, updates), state
        reference, ref_state = params, inner.init(params)
        for _ in range(2):  # two optimizer steps, so that momentum and adam's moments matter
            reference, ref_state = reference_step(reference, ref_state)
        for mode, wrap in taken:
            @wrap
            def step(p, state, a, b):
                updates, state = tx.update(jax.grad(loss)(p, a, b), state, p)
                return optax.apply_updates(p, updates), state
            p, state = params, tx.init(params)
            for _ in range(2):
                for k in range(passes):
                    part = slice(8 * rank + 8 * k // passes, 8 * rank + 8 * (k + 1) // passes)
                    p, state = step(p, state, x[part], y[part])
            for got, want in zip(leaves(p), leaves(reference)):
                assert np.allclose(got, want, rtol=1e-9, atol=1e-12), (mode, passes, np.abs(got - want).max())
    return params


def check_optimizer(rank, size):
    """DistributedOptimizer's step on each rank's shard, under jit, equals one step on the concatenated batch; so does
    its update as an element of optax.chain and with fp16 compression."""
    params = _optimizer_steps_match(rank, size, "jit")
    # As an element of optax.chain: averaging first, then any transformation.
    chained = optax.chain(sj.DistributedOptimizer(optax.identity()), optax.sgd(0.1))
    local = jax.tree_util.tree_map(lambda p: p * (rank + 1), params)
    got, _ = jax.jit(chained.update)(local, chained.init(params), params)
    want = jax.tree_util.tree_map(lambda p: -0.1 * p * (size + 1) / 2, params)
    for g, w in zip(leaves(got), leaves(want)):
        assert np.allclose(g, w, rtol=1e-12, atol=1e-12), np.abs(g - w).max()
    tx = sj.DistributedOptimizer(optax.sgd(0.1), compression=sj.Compression.fp16)
    g = jax.tree_util.tree_map(lambda p: p * (rank + 1), params)
    updates, _ = jax.jit(tx.update)(g, tx.init(params), params)
    mean = jax.tree_util.tree_map(lambda p: -0.1 * p * (size + 1) / 2, params)
    for got, want in zip(leaves(updates), leaves(mean)):
        assert got.dtype == want.dtype and np.allclose(got, want, rtol=2e-3, atol=1e-3)


def check_optimizer_eager(rank, size):
    """DistributedOptimizer's step called outside jit, each primitive dispatched on its own (compilations more than
    a path: the second tier's)."""
    _optimizer_steps_match(rank, size, "eager")


def check_mismatches(rank, size):
    """Ranks that disagree all raise, eagerly (the shmcomm exception) and under jit (JaxRuntimeError whose
    original is it); the job goes on."""
    import shmcomm

    if size == 1:
        return
    one_host = type(shmcomm.basics.communicator()).__name__ == "HostComm"
    cases = [
        ("shape", lambda: sj.allreduce(np.ones(3 + rank, np.float32))),
        ("dtype", lambda: sj.allreduce(np.ones(3, np.float32 if rank else np.int32))),
        ("op", lambda: sj.allreduce(np.ones(3, np.float32), op=sj.Sum if rank else sj.Max)),
        ("kind", lambda: sj.allreduce(np.ones(3, np.float32)) if rank else sj.broadcast(np.ones(3, np.float32), 0)),
        ("rows", lambda: sj.allgather(np.ones((2 + rank, 2), np.float32))),
    ]
    for field, call in cases:
        for mode, wrap in modes():
            if mode == "eager" and field == "rows":
                continue  # eagerly, different rows are allowed
            # On one host rank 0's broadcast returns once it has published: every rank hears at the next collective.
            later = field == "kind" and one_host
            try:
                jax.block_until_ready(wrap(call)())
            except sj.MismatchError as error:
                assert mode == "eager", (field, error)
            except jax.errors.JaxRuntimeError as error:
                assert mode != "eager" and "MismatchError" in str(error), (field, error)
                assert isinstance(sj.original(error), sj.MismatchError), (field, error)
            else:
                if not (later and rank == 0):
                    raise AssertionError("%s %s mismatch did not raise" % (mode, field))
            if later:
                try:
                    sj.allreduce(np.ones(2, np.float32))
                except sj.MismatchError as error:
                    assert "the broadcast before this allreduce (which no rank ran)" in str(error), (mode, error)
                else:
                    raise AssertionError("%s: the collective after a failed broadcast ran" % mode)
            same(sj.allreduce(np.ones(2, np.float32), op=sj.Sum), np.full(2, size, np.float32))


def check_ordered_hlo(rank, size):
    """The compiled program chains the collectives by their token: each takes the one the previous returned."""
    import re

    def f(a, b, c):
        return sj.allreduce(a), sj.allgather(b), sj.allreduce(c, op=sj.Max), sj.broadcast(a, 0)

    text = jax.jit(f).lower(jnp.ones(3), jnp.ones(4), jnp.ones(5)).compile().as_text()
    calls = re.findall(r"%(\S+) = \([^)]*token\[\]\) custom-call\([^,]+, %(\S+)\), custom_call_target="
                       r"\"shmcomm_collective\"", text)
    tokens = dict(re.findall(r"%(\S+) = token\[\] get-tuple-element\(%(\S+)\), index=1", text))
    assert len(calls) == 4, text
    previous = None
    for call, token_in in calls:
        if previous is not None:
            assert tokens[token_in] == previous, (call, token_in, previous)
        previous = call


def _thp_eligible(address):
    """Whether the kernel may back the page at `address` with a transparent huge page (smaps' THPeligible)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    raise AssertionError("no mapping holds %#x" % address)


def check_large_results(rank, size):
    """A jitted reduction of a jit argument is written out of place, straight into XLA's result (no copy of the
    argument first), and a large result's whole huge pages (of the size the kernel reports) are offered to
    transparent huge pages, where the kernel grants them on request."""
    import tempfile

    from shmcomm.jax import context

    with tempfile.TemporaryDirectory() as fake:  # the size is the kernel's, and none where none are granted
        def sysfs(mode, size_text):
            for name, text in (("enabled", mode), ("hpage_pmd_size", size_text)):
                with open(os.path.join(fake, name), "w") as f:
                    f.write(text + "\n")
            return context.huge_page_size(fake)
        assert sysfs("always [madvise] never", "524288") == 512 << 10
        assert sysfs("always madvise [never]", "2097152") == 0
        assert sysfs("[always] madvise never", "3000") == 0  # not a power of two
        assert context.huge_page_size(os.path.join(fake, "missing")) == 0
    huge = context.huge_page_size()
    assert context._context.huge_page == huge
    big = np.full(2 << 20, rank + 1.0, np.float32)  # 8 MiB
    fn = jax.jit(lambda a: sj.allreduce(a, op=sj.Sum))
    text = fn.lower(big).compile().as_text()
    assert " copy(" not in text, text
    out = fn(big)
    same(out, np.full(2 << 20, size * (size + 1) / 2, np.float32))
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as mode:
            on_request = "[madvise]" in mode.read()
    except OSError:
        on_request = False
    if on_request and 0 < huge <= big.nbytes // 2:
        start = out.unsafe_buffer_pointer()
        assert _thp_eligible((start + huge - 1) // huge * huge + huge), hex(start)


def check_with_engine(rank, size):
    """With the background engine running (asynchronous numpy collectives started it), jitted collectives go through
    its queue: both kinds keep one order on every rank; it starts after a sealed call in flight. Last: the engine runs
    until shutdown."""
    import shmcomm
    from shmcomm.jax import context

    one_host = type(shmcomm.basics.communicator()).__name__ == "HostComm"
    assert context.direct() == one_host
    # The engine starts right behind a shmcomm.jax.jit call still in flight: its first collective comes after it.
    sealed = sj.jit(lambda a: sj.allreduce(a, op=sj.Sum))
    late = sealed(np.full(2, rank + 1.0))
    handle = shmcomm.allreduce_async(np.full(3, rank + 1.0), op=shmcomm.Sum, name="numpy.before")
    assert not context.direct()
    got = jax.jit(lambda a: sj.allreduce(a, op=sj.Sum) * 2)(np.full(2, rank + 1.0))
    after = shmcomm.allreduce_async(np.full(1, rank + 1.0), op=shmcomm.Sum, name="numpy.after")
    tri = size * (size + 1) / 2
    same(late, np.full(2, tri))
    same(sealed(np.full(2, rank + 1.0)), np.full(2, tri))  # through the engine's queue now
    same(got, np.full(2, 2 * tri))
    same(shmcomm.synchronize(handle), np.full(3, tri))
    same(shmcomm.synchronize(after), np.full(1, tri))
    same(sj.allgather(np.full((1, 2), rank, np.int32)), np.repeat(np.arange(size, dtype=np.int32), 2).reshape(-1, 2))


def _busy(x):
    """Work that leaves x as it is (max(x, sin(x) - 10) is x here) and keeps a collective after it pending."""
    return jax.lax.fori_loop(0, 400, lambda i, y: jnp.maximum(y, jnp.sin(y) - 10), x)


def _python_frames(fn, *args):
    """The names of the Python functions a call of fn runs (JAX's C++ dispatch runs none of its own)."""
    names = []

    def profile(frame, event, arg):
        if event == "call":
            names.append(frame.f_code.co_name)
    sys.setprofile(profile)
    try:
        jax.block_until_ready(fn(*args))
    finally:
        sys.setprofile(None)
    return names


def check_sealed(rank, size):
    """shmcomm.jax.jit: its calls skip JAX's Python dispatch (plain jit's do not); its collectives stay in order on
    every rank through Python loops of calls never waited for, scan, fori_loop, both branches of cond, grad, remat,
    unused results, nested calls and static arguments; the numpy API, called right after, comes after them on every
    rank without any barrier (check_with_engine: the engine's start too)."""
    import shmcomm

    tri = size * (size + 1) / 2
    mine = jnp.full(3, rank + 1.0)
    step = sj.jit(lambda x: sj.allreduce(x, op=sj.Sum))
    plain = jax.jit(lambda x: sj.allreduce(x, op=sj.Sum))
    for fn in (step, plain):
        fn(mine)
    assert "cache_miss" in _python_frames(plain, mine)
    assert "cache_miss" not in _python_frames(step, mine), "shmcomm.jax.jit took JAX's Python dispatch"
    # 50 calls of alternating kinds and shapes, none waited for, the first slowed by work before its collective,
    # then a numpy collective right away.
    gather = sj.jit(lambda x: sj.allgather(x[:1] * (rank + 1)))
    slow = sj.jit(lambda x: sj.allreduce(_busy(x), op=sj.Sum))
    pending = [slow(np.full(1 << 16, rank + 1.0, np.float32))]
    pending += [step(mine * k) if k % 2 else gather(jnp.full(k % 5 + 1, 1.0)) for k in range(1, 50)]
    same(shmcomm.allreduce(np.full(2, rank + 1.0), op=shmcomm.Sum), np.full(2, tri))
    same(pending[0], np.full(1 << 16, tri, np.float32))
    for k, got in enumerate(pending[1:], 1):
        same(got, np.full(3, k * tri) if k % 2 else np.arange(1.0, size + 1))
    values = [r + 1.0 for r in range(size)]
    for _ in range(4):
        values = [c + sum(values) for c in values]

    def loops(v):
        carry, gathered = jax.lax.scan(lambda c, x: (c + sj.allreduce(x, op=sj.Sum), sj.allgather(x[:1])),
                                       jnp.zeros(2), jnp.stack([v] * 3))
        total = jax.lax.fori_loop(0, 4, lambda i, c: c + sj.allreduce(c, op=sj.Sum), v)
        return carry, gathered, total
    carry, gathered, total = sj.jit(loops)(jnp.full(2, rank + 1.0))
    same(carry, np.full(2, 3 * tri))
    same(gathered, np.tile(np.arange(1.0, size + 1), (3, 1)))
    same(total, np.full(2, values[rank]))
    branches = sj.jit(lambda pred, v: jax.lax.cond(pred, lambda a: sj.allreduce(a, op=sj.Sum) + sj.broadcast(a, 0),
                                                   lambda a: sj.allgather(a)[:2] * sj.allreduce(a, op=sj.Max), v))
    for pred in (True, False, False, True):
        same(branches(pred, jnp.full(2, rank + 1.0)), np.full(2, tri + 1.0) if pred else np.full(2, 1.0 * size))
    # grad through remat: the backward pass recomputes the allreduce, on every rank alike.
    loss = lambda w: jnp.sum(jax.checkpoint(lambda u: sj.allreduce(u * u, op=sj.Sum))(w))  # noqa: E731
    same(sj.jit(jax.grad(loss))(jnp.full(3, rank + 1.0)), np.full(3, 2.0 * size * (rank + 1)))
    # Unused results, a function of barriers alone, nested calls (inline in the outer trace), static arguments.
    sj.jit(lambda x: (sj.allreduce(x), sj.barrier(), x + 1)[2])(mine)
    sj.jit(lambda: [sj.barrier() for _ in range(3)])()
    nested = sj.jit(lambda x: step(x) + jax.jit(lambda y: step(2 * y))(x))
    same(nested(mine), np.full(3, 3 * tri))
    scaled = sj.jit(lambda x, k: sj.allreduce(x * k, op=sj.Sum), static_argnums=1)
    same(scaled(mine, 3), np.full(3, 3 * tri))


CHECKS = {name[len("check_"):]: fn for name, fn in dict(globals()).items() if name.startswith("check_")}

if __name__ == "__main__":
    sj.init()
    rank, size = sj.rank(), sj.size()
    for name in sys.argv[1:] or sorted(CHECKS):
        CHECKS[name](rank, size)
        print("ok", name, flush=True)
    # JAX returns before a jitted call has run: shutdown waits for the collective, whose result is then complete.
    # In a fresh world, without the engine that with_engine started: on one host the handler calls the core itself.
    sj.shutdown()
    sj.init()
    # Work before the collective keeps it pending at shutdown.
    pending = jax.jit(lambda a: sj.allreduce(_busy(a), op=sj.Sum))(np.full(1 << 16, rank + 1.0, np.float32))
    sealed = sj.jit(lambda a: sj.allreduce(_busy(a), op=sj.Sum))(np.full(1 << 16, rank + 2.0, np.float32))
    sj.shutdown()
    same(pending, np.full(1 << 16, size * (size + 1) / 2, np.float32))
    same(sealed, np.full(1 << 16, size * (size + 3) / 2, np.float32))
    print("ok in_flight_at_shutdown", flush=True)
