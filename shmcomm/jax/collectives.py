# SPDX-License-Identifier: Apache-2.0
"""The collectives of shmcomm.jax on jax arrays and pytrees of them, eagerly and inside jax.jit.

Each leaf of a pytree is one collective, issued in the order of jax.tree_util's flattening (the same on every rank).
Eager calls wait for their result, so a failure raises the shmcomm exception itself (MismatchError, RankFailure...)
in the call that caused it. Inside jit a failure surfaces where the result is used, as jax's JaxRuntimeError whose
text starts with the shmcomm exception's name; shmcomm.jax.original(error) gives the exception. Shapes under jit are
fixed at trace time, so there allgather needs the same first dimension on every rank and alltoall equal splits (ranks
that differ all raise MismatchError); eager calls exchange the counts first and allow both to differ."""
import jax
import jax.numpy as jnp
import numpy as np

from shmcomm.engine import calls
from shmcomm.vocabulary import description, ops
from shmcomm.startup import session
from shmcomm.vocabulary.exceptions import InvalidArgumentError
from shmcomm.jax import context
from shmcomm.jax.internals import trace_state_clean
from shmcomm.jax.primitive import bind


def _world():
    comm = session.current()  # read at trace time: a jitted program still running is no reason to wait
    return comm.size, comm.rank


def _tracing(x):
    return isinstance(x, jax.core.Tracer)


def waited(fn, *args, **kwargs):
    """fn(*args, **kwargs) run to the end: its results ready, and a collective's failure raised as the shmcomm
    exception itself (MismatchError, RankFailure...), as eager calls raise it."""
    try:
        return jax.block_until_ready(fn(*args, **kwargs))
    except jax.errors.JaxRuntimeError as error:
        cause = context.original(error)
        if cause is None:
            raise
        raise cause.with_traceback(None) from None


def _each(tree, one, what):
    """one(leaf, name) over the leaves; eagerly, each leaf is waited for (so that an error names its call)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for i, leaf in enumerate(leaves):
        name = what if len(leaves) == 1 else "%s.%d" % (what, i)
        leaf = jnp.asarray(leaf)
        out.append(one(leaf, name) if _tracing(leaf) else waited(one, leaf, name))
    return jax.tree_util.tree_unflatten(treedef, out)


def allreduce(x, op=ops.Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    """The reduction over all ranks of every leaf (default op: Average): postscale * op(prescale * x) / (size for
    Average). 16-bit floats are reduced in float32 and rounded once. Works eagerly and under jit (a custom call, in
    program order); differentiable for Sum and Average.

    Args:
        x: a jax or numpy array, or any pytree of them; every rank passes the same structure, shapes and dtypes.
        op: Average (the default), Sum, Min, Max or Product.
        prescale_factor: multiplies each rank's input before the reduction.
        postscale_factor: multiplies the result.
        name: names the call in errors.

    Returns:
        The same pytree of reduced arrays, equal on every rank.

    Raises:
        InvalidArgumentError: this rank's arguments are wrong. MismatchError: the ranks disagree (every rank raises;
            under jit, a JaxRuntimeError whose original is it). RankFailure: a rank died or left. TimeoutError: a
            rank did not come within SHMCOMM_TIMEOUT.

    Example:
        `jax.jit(lambda g: sj.allreduce(g, op=sj.Sum))(jnp.ones(3))` is `size()` in every element.
    """
    op = ops.resolve(op)
    size, rank = _world()
    return _each(x, lambda leaf, what: bind(leaf, "allreduce", op=op, prescale=prescale_factor,
                                            postscale=postscale_factor, size=size, rank=rank, name=what),
                 name or "allreduce")


def broadcast(x, root_rank, name=None):
    """Rank `root_rank`'s value of every leaf, on every rank; eagerly and under jit.

    Args:
        x: a jax or numpy array, or any pytree of them; every rank passes the same structure, shapes and dtypes.
        root_rank: the rank whose values everyone receives.
        name: names the call in errors.

    Returns:
        The same pytree, holding the root's values.

    Raises:
        InvalidArgumentError: `root_rank` is not a rank of the job; other errors as allreduce().
    """
    size, rank = _world()
    what = name or "broadcast"
    root = calls.root_index(session.current(), root_rank, what)
    return _each(x, lambda leaf, w: bind(leaf, "broadcast", root=root, size=size, rank=rank, name=w), what)


def _rows_of(x):
    return x if x.ndim else x.reshape(1)


def allgather(x, name=None):
    """Every rank's leaf concatenated along the first dimension (scalars count as one row), in rank order.

    Under jit every rank must have the same first dimension; eagerly they may differ (the counts are exchanged first).

    Args:
        x: a jax or numpy array, or any pytree of them; the ranks agree on the dimensions after the first and the dtype.
        name: names the call in errors.

    Returns:
        The same pytree of concatenated arrays, equal on every rank.

    Raises:
        MismatchError: the ranks' other dimensions or dtypes differ (under jit also the first); other errors as
            allreduce().
    """
    size, rank = _world()

    def one(leaf, what):
        leaf = _rows_of(leaf)
        rows = [leaf.shape[0]] * size
        if not _tracing(leaf) and size > 1:
            counts = bind(jnp.asarray([leaf.shape[0]], jnp.int64 if jax.config.jax_enable_x64 else jnp.int32),
                          "allgather", rows=[1] * size, size=size, rank=rank, name=what + ".rows")
            rows = [int(c) for c in np.asarray(counts)]
        return bind(leaf, "allgather", rows=rows, size=size, rank=rank, name=what)
    return _each(x, one, name or "allgather")


def reducescatter(x, op=ops.Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    """Rank r's rows of the reduction of every leaf along its first dimension.

    With rows that do not divide evenly, the first (rows % size) ranks get one more (Horovod's rule).

    Args:
        x: a jax or numpy array of at least one dimension, or any pytree of them; the same on every rank.
        op, prescale_factor, postscale_factor, name: as allreduce().

    Returns:
        The same pytree, each leaf this rank's rows of its reduction.

    Raises:
        InvalidArgumentError: a leaf with no dimension; other errors as allreduce().
    """
    op = ops.resolve(op)
    size, rank = _world()

    def one(leaf, what):
        if leaf.ndim == 0:
            raise InvalidArgumentError("%s: a tensor with at least one dimension is required" % what)
        return bind(leaf, "reducescatter", op=op, prescale=prescale_factor, postscale=postscale_factor,
                    rows=description.shares(leaf.shape[0], size), size=size, rank=rank, name=what)
    return _each(x, one, name or "reducescatter")


def alltoall(x, splits=None, name=None):
    """Sends `splits[j]` rows of every leaf, in order, to rank j and returns the rows received, in rank order.

    Args:
        x: a jax or numpy array, or any pytree of them; the ranks agree on the dimensions after the first and the dtype.
        splits: one row count per rank, adding up to the first dimension (eager only); None splits it evenly.
        name: names the call in errors.

    Returns:
        The same pytree of received rows; with `splits`, the pair of it and a matching pytree of int32 arrays saying
        how many rows came from each rank (as Horovod returns).

    Raises:
        InvalidArgumentError: `splits` inside jit (the rows received must be known at trace time: pad to equal splits),
            or splits that do not add up; other errors as allreduce().
    """
    size, rank = _world()
    received = []

    def one(leaf, what):
        leaf = _rows_of(leaf)
        sends = calls.splits_list(splits, leaf.shape[0], size, what)
        if splits is None:
            return bind(leaf, "alltoall", rows=sends, sends=sends, size=size, rank=rank, name=what)
        if _tracing(leaf):
            raise InvalidArgumentError("%s: explicit splits need eager mode (under jit the rows received must be "
                                       "known at trace time); pad to equal splits inside jit" % what)
        got = bind(jnp.asarray(np.asarray(sends, np.int32)), "alltoall", rows=[1] * size, sends=[1] * size,
                   size=size, rank=rank, name=what + ".splits")
        got = [int(g) for g in np.asarray(got)]
        received.append(jnp.asarray(got, jnp.int32))
        return bind(leaf, "alltoall", rows=got, sends=sends, size=size, rank=rank, name=what)
    out = _each(x, one, name or "alltoall")
    if splits is None:
        return out
    return out, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(x), received)


def barrier():
    """Returns once every rank has called it (inside jit: once every rank's program reaches it)."""
    size, rank = _world()
    try:
        bind(None, "barrier", size=size, rank=rank, name="barrier")
        if trace_state_clean():  # eager: wait for it (it returns nothing that could be waited on)
            jax.effects_barrier()
    except jax.errors.JaxRuntimeError as error:
        cause = context.original(error)
        if cause is None:
            raise
        raise cause.with_traceback(None) from None

