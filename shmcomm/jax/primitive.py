# SPDX-License-Identifier: Apache-2.0
"""One JAX primitive for every collective: its shapes, its lowering to the XLA FFI handler, its derivatives and its
batching.

Every collective carries one ordered effect (CollectiveEffect), so that XLA keeps all of them in program order, inside
loops and conditionals too, and every rank issues the same collectives in the same order. Derivatives and batched
(vmap) forms are collectives themselves, issued in the same order on every rank."""
import functools
import os

import numpy as np

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from shmcomm.vocabulary import description, dtypes, ops
from shmcomm.vocabulary.exceptions import InvalidArgumentError
from shmcomm.jax import context, native
from shmcomm.jax.internals import (EFFECT_SETS, Effect, TokenSet, abstract_token, apply_primitive,
                                   register_lowering)


class CollectiveEffect(Effect):
    """The ordered effect of every shmcomm collective (one effect: one token chain for all of them).

    JAX threads a token through every operation with an ordered effect, inside a jit function and from one jit call
    to the next; the lowering passes it into the custom call and takes the next one out of it. Each collective thus
    depends on the one before it as data: XLA can neither reorder two of them nor run them at once on its thread pool,
    and since the custom call is marked side-effecting it neither drops nor merges them. Inside lax.scan, fori_loop and
    while_loop the token is part of the loop carry, and lax.cond passes it into the branch taken; a rank that issues
    other collectives (say by taking the other branch) meets a mismatch or a timeout, as the core compares every
    call's description. jax.ffi.ffi_call(has_side_effect=True) alone would not do: its effect is unordered, which keeps
    the call alive but lets XLA schedule independent calls in any order, or concurrently."""

    def __str__(self):
        return "shmcomm"

    def __hash__(self):
        return hash("shmcomm.jax.CollectiveEffect")

    def __eq__(self, other):
        return isinstance(other, CollectiveEffect)


EFFECT = CollectiveEffect()
for _allowed in EFFECT_SETS:
    _allowed.add_type(CollectiveEffect)

collective_p = Primitive("shmcomm_collective")
collective_p.multiple_results = True
collective_p.def_impl(functools.partial(apply_primitive, collective_p))

REDUCING = ("allreduce", "reducescatter")
ROWS = ("allgather", "alltoall", "reducescatter")  # their shape's first dimension is rows, split between ranks


def bind(x, kind, *, op=ops.Sum, prescale=1.0, postscale=1.0, root=0, rows=None, sends=None, size=1, rank=0,
         name=None):
    """The collective on one array (none for a barrier): rows[r] is the number of rows rank r contributes
    (allgather), receives (alltoall) or gets (reducescatter); sends[r] the rows sent to rank r (alltoall)."""
    params = dict(kind=kind, op=int(op), prescale=float(prescale), postscale=float(postscale), root=int(root),
                  rows=None if rows is None else tuple(int(r) for r in rows),
                  sends=None if sends is None else tuple(int(s) for s in sends), size=int(size), rank=int(rank),
                  name=name or kind)
    if kind == "barrier":
        collective_p.bind(**params)
        return None
    (out,) = collective_p.bind(x, **params)
    return out


def _out_shape(shape, kind, rows, rank):
    if kind in ("allgather", "alltoall"):
        return (sum(rows),) + tuple(shape[1:])
    if kind == "reducescatter":
        return (rows[rank],) + tuple(shape[1:])
    return tuple(shape)


def _abstract_eval(*avals, kind, rows, rank, **_):
    if kind == "barrier":
        return [], {EFFECT}
    (x,) = avals
    return [jax.core.ShapedArray(_out_shape(x.shape, kind, rows, rank), x.dtype)], {EFFECT}


collective_p.def_effectful_abstract_eval(_abstract_eval)


def _dtype_code(dtype, kind, what):
    """The core's type code, or -1 for a type the core only moves (allowed where nothing is reduced)."""
    code = dtypes.numpy_code(np.dtype(dtype))
    if code is None:
        if kind in REDUCING:
            raise InvalidArgumentError("%s: dtype %s cannot be reduced (float16, bfloat16, float32, float64 and the "
                                       "signed integers and uint8 can)" % (what, np.dtype(dtype).name))
        return -1
    return code


def _tag(dtype, shape, kind):
    """The digest every rank must pass equal, as the numpy API computes it: the shape, or the trailing dimensions
    for the row-wise collectives whose first dimension may differ (the per-rank row counts are compared too)."""
    code = _dtype_code(dtype, "allgather", "")
    key = code if code >= 0 else dtypes.foreign_key(np.dtype(dtype).name)
    shape = tuple(shape)
    return description.tag(key, shape[1:] if kind in ("allgather", "alltoall") else shape)


def _lowering(ctx, *operands, kind, op, prescale, postscale, root, rows, sends, size, rank, name):
    attrs = dict(context=np.int64(context.address()), pid=np.int64(os.getpid()), kind=np.int64(description.KIND[kind]),
                 dtype=np.int64(-1), op=np.int64(op), c_op=np.int64(0), divisor=np.int64(1), root=np.int64(root),
                 tag=np.int64(0), prescale=np.float64(prescale), postscale=np.float64(postscale),
                 itemsize=np.int64(1), name=name)
    if kind != "barrier":
        aval = ctx.avals_in[0]
        attrs["dtype"] = np.int64(_dtype_code(aval.dtype, kind, name))
        attrs["itemsize"] = np.int64(np.dtype(aval.dtype).itemsize)
        attrs["tag"] = np.uint64(_tag(aval.dtype, aval.shape, kind)).view(np.int64)
        if kind in REDUCING:
            attrs["c_op"] = np.int64(ops.C_OP[ops.ReduceOp(op)])
            attrs["divisor"] = np.int64(size if op == ops.Average else 1)
        if rows is not None:
            attrs["rows"] = np.asarray(rows, dtype=np.int64)
        if sends is not None:
            attrs["sends"] = np.asarray(sends, dtype=np.int64)
    token = ctx.tokens_in.get(EFFECT)
    with_token = ctx.replace(avals_in=(*ctx.avals_in, abstract_token), avals_out=(*ctx.avals_out, abstract_token))
    # Out of place: the core reads the operand and writes the result in one pass. Aliasing the result to the
    # operand would make XLA copy the operand first whenever it stays live (always for a jit argument that is not
    # donated): a second full pass over memory, into freshly faulted pages.
    results = list(jax.ffi.ffi_lowering(native.TARGET, has_side_effect=True)(with_token, *operands, token, **attrs))
    ctx.set_tokens_out(TokenSet({EFFECT: results.pop()}))
    return results


register_lowering(collective_p, _lowering, platform="cpu")


# ---- derivatives ----
def _linear(kind, op, what):
    if kind in REDUCING and op not in (ops.Sum, ops.Average):
        raise NotImplementedError("%s: only Sum and Average reductions are differentiable (op %s)"
                                  % (what, ops.ReduceOp(op).name))


def _jvp(primals, tangents, **params):
    kind = params["kind"]
    if kind == "barrier":
        return collective_p.bind(**params), []
    _linear(kind, params["op"], params["name"])
    (x,), (t,) = primals, tangents
    (out,) = collective_p.bind(x, **params)
    if type(t) is ad.Zero:
        return [out], [ad.Zero.from_primal_value(out)]
    (t_out,) = collective_p.bind(t, **params)
    return [out], [t_out]


def _transpose(cts, x, *, kind, op, prescale, postscale, root, rows, sends, size, rank, name):
    """Derivatives of the sum over ranks of each rank's loss: an allreduce's transpose is the same allreduce (Sum or
    Average), an allgather's a sum reduce-scatter of the cotangent into the same rows, a reduce-scatter's an
    allgather, a broadcast's a sum to the root, an alltoall's the alltoall back."""
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    shape = x.aval.shape
    back = dict(size=size, rank=rank, name=name + ".grad")
    scale = prescale * postscale
    if kind == "allreduce":
        got = bind(ct, "allreduce", op=op, prescale=prescale, postscale=postscale, **back)
    elif kind == "broadcast":
        summed = bind(ct, "allreduce", op=ops.Sum, **back)
        got = summed if rank == root else jnp.zeros_like(summed)
    elif kind == "allgather":
        got = bind(ct, "reducescatter", op=ops.Sum, rows=rows, **back)
    elif kind == "reducescatter":
        every = [rows[r] for r in range(size)]
        got = bind(ct, "allgather", rows=every, **back)
        factor = scale / (size if op == ops.Average else 1)
        if factor != 1.0:
            got = got * factor
    elif kind == "alltoall":
        got = bind(ct, "alltoall", rows=sends, sends=rows, **back)
    else:
        raise NotImplementedError("%s cannot be transposed" % kind)
    return [got.reshape(shape).astype(x.aval.dtype)]


ad.primitive_jvps[collective_p] = _jvp
ad.primitive_transposes[collective_p] = _transpose


# ---- batching ----
def _batch(args, dims, **params):
    """vmap: the reductions and the broadcast work elementwise, so they take the batched array as it is; the row-wise
    collectives work on the batch as the second axis."""
    kind = params["kind"]
    if kind == "barrier":
        return collective_p.bind(**params), []
    (x,), (d,) = args, dims
    if kind in ROWS:
        if x.ndim < 2:
            raise InvalidArgumentError("%s under vmap needs arrays of at least one dimension per example"
                                       % params["name"])
        x = jnp.moveaxis(x, d, 1)
        return collective_p.bind(x, **params), [1]
    return collective_p.bind(x, **params), [d]


batching.primitive_batchers[collective_p] = _batch
