# SPDX-License-Identifier: Apache-2.0
"""Data-parallel training with optax: DistributedOptimizer averages the gradients across ranks before the wrapped
transformation, and broadcast_parameters makes every rank start from the same parameters."""
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shmcomm.vocabulary import ops
from shmcomm.vocabulary.exceptions import InvalidArgumentError
from shmcomm.jax.collectives import allreduce, broadcast, waited
from shmcomm.jax.internals import trace_state_clean
from shmcomm.jax.sealed import jit


class NoneCompressor:
    """Sends gradients as they are."""

    @staticmethod
    def compress(x):
        return x

    @staticmethod
    def decompress(x, dtype):
        return x


class FP16Compressor:
    """Sends floating-point gradients as float16 (half the bytes of float32); the reduction accumulates in float32
    and rounds once, so only the inputs and the result are rounded."""

    @staticmethod
    def compress(x):
        return x.astype(jnp.float16) if jnp.issubdtype(x.dtype, jnp.floating) else x

    @staticmethod
    def decompress(x, dtype):
        return x.astype(dtype)


class Compression:
    """Compression.none and Compression.fp16, as Horovod names them."""

    none = NoneCompressor
    fp16 = FP16Compressor


def broadcast_parameters(params, root_rank=0):
    """root_rank's parameters (any pytree of arrays: parameters, optimizer state) on every rank.

    Args:
        params: a pytree of arrays of the same structure, shapes and dtypes on every rank.
        root_rank: the rank whose values everyone takes.

    Outside jit all leaves go in one shmcomm.jax.jit program, which this call waits for.

    Returns:
        The pytree with root_rank's values.
    """
    if not trace_state_clean():
        return broadcast(params, root_rank, name="broadcast_parameters")
    # Outside jit: every leaf in one program on JAX's fast dispatch, waited for as an eager call is.
    return waited(_broadcast_program, params, root_rank)


_broadcast_program = jit(lambda params, root_rank: broadcast(params, root_rank, name="broadcast_parameters"),
                         static_argnums=1)


def fused_allreduce(tree, op=ops.Average, compression=Compression.none, name="gradients"):
    """The allreduce of every leaf, in one collective per dtype: the leaves (compressed) are flattened into one
    buffer, reduced, and split back. One large collective costs far less than many small ones."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    sent = [compression.compress(jnp.asarray(leaf)) for leaf in leaves]
    groups = {}
    for i, leaf in enumerate(sent):
        groups.setdefault(np.dtype(leaf.dtype).name, []).append(i)
    out = [None] * len(leaves)
    for dtype in sorted(groups):  # the same order on every rank
        members = groups[dtype]
        flat = jnp.concatenate([sent[i].reshape(-1) for i in members])
        reduced = allreduce(flat, op=op, name="%s.%s" % (name, dtype))
        at = 0
        for i in members:
            n = sent[i].size
            out[i] = compression.decompress(reduced[at:at + n].reshape(sent[i].shape), leaves[i].dtype)
            at += n
    return jax.tree_util.tree_unflatten(treedef, out)


class DistributedState(NamedTuple):
    inner: Any          # the wrapped transformation's state
    accumulated: Any    # the sum of this rank's gradients since the last step (None for backward_passes_per_step=1)
    passes: Any         # how many are in it (None likewise)


def DistributedOptimizer(tx, op=ops.Average, backward_passes_per_step=1, compression=Compression.none,
                         name="DistributedOptimizer"):
    """An optax GradientTransformation that reduces the gradients across ranks (default: Average), fused into one
    buffer per dtype, and hands them to `tx`; usable as an element of optax.chain and inside jit.

    With backward_passes_per_step=k, each rank accumulates k gradients locally and the reduction and `tx`'s update
    happen on every k-th call, with the mean of the k gradients (as optax.MultiSteps); the calls in between return
    zero updates. Every rank must make the same number of calls. Called outside jit, `update` runs as one
    shmcomm.jax.jit program and returns when it has finished.

    Args:
        tx: the optax GradientTransformation to hand the reduced gradients to.
        op: Average (the default) or Sum.
        backward_passes_per_step: gradients accumulated locally per reduction, a positive int.
        compression: Compression.fp16 sends floating-point gradients as float16.
        name: names the reductions in errors.

    Returns:
        An optax GradientTransformation (init, update).

    Raises:
        InvalidArgumentError: another op, or a backward_passes_per_step that is not a positive int.

    Example:
        `tx = sj.DistributedOptimizer(optax.adam(1e-3))`, then `updates, state = tx.update(grads, state, params)`
        inside the jitted step.
    """
    op = ops.resolve(op)
    if op not in (ops.Average, ops.Sum):
        raise InvalidArgumentError("%s: op must be Average or Sum, not %s" % (name, op.name))
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise InvalidArgumentError("%s: backward_passes_per_step must be a positive int, not %r"
                                   % (name, backward_passes_per_step))
    passes = backward_passes_per_step

    def init(params):
        if passes == 1:  # nothing to count: no extra argument and result for every jitted step to pass around
            return DistributedState(tx.init(params), None, None)
        return DistributedState(tx.init(params), jax.tree_util.tree_map(jnp.zeros_like, params),
                                jnp.zeros((), jnp.int32))

    def apply(grads, inner, params):
        reduced = fused_allreduce(grads, op, compression, name)
        return tx.update(reduced, inner, params)

    def update_traced(grads, state, params=None):
        if passes == 1:
            updates, inner = apply(grads, state.inner, params)
            return updates, state._replace(inner=inner)
        accumulated = jax.tree_util.tree_map(jnp.add, state.accumulated, grads)
        count = state.passes + 1

        def step(_):
            mean = jax.tree_util.tree_map(lambda g: g / passes, accumulated)
            updates, inner = apply(mean, state.inner, params)
            return updates, inner, jax.tree_util.tree_map(jnp.zeros_like, accumulated), jnp.zeros((), jnp.int32)

        def wait(_):
            return jax.tree_util.tree_map(jnp.zeros_like, grads), state.inner, accumulated, count

        # Every rank counts alike, so every rank takes the same branch: the collectives inside stay matched.
        updates, inner, accumulated, count = jax.lax.cond(count >= passes, step, wait, None)
        return updates, DistributedState(inner, accumulated, count)

    update_program = jit(update_traced)

    def update(grads, state, params=None):
        if not trace_state_clean():
            return update_traced(grads, state, params)
        # Called eagerly: the whole update as one program on JAX's fast dispatch, waited for as an eager call is.
        return waited(update_program, grads, state, params)

    return optax.GradientTransformation(init, update)
