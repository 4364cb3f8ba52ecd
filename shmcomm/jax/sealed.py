# SPDX-License-Identifier: Apache-2.0
"""shmcomm.jax.jit: jax.jit whose calls take JAX's C++ dispatch path although the program holds collectives.

JAX dispatches a program with an ordered effect through Python (each call some hundred microseconds), and every
collective carries one (primitive.py). Here the traced function becomes one primitive whose abstract evaluation hides
that effect and whose lowering creates the token chain inside the program: the collectives keep program order inside
(loops, conditionals, derivatives as JAX threads them), the executable carries no effect, and PjRt's CPU client runs
one device's programs in the order they were dispatched. The programs still running are tracked (in_flight below)."""
import collections
import functools
import threading

import jax
import numpy as np
from jax.extend.core import Primitive

from shmcomm.startup import session
from shmcomm.jax import context
from shmcomm.jax.internals import (TokenSet, Tracer, core_call_lowering, dce_rules, register_lowering,
                                   trace_state_clean)
from shmcomm.jax.primitive import EFFECT

sealed_p = Primitive("shmcomm_sealed")
sealed_p.multiple_results = True
sealed_p.def_effectful_abstract_eval(lambda *avals, jaxpr: (jaxpr.out_avals, set()))  # the effect stays inside


def _lowering(ctx, *args, jaxpr):
    # A fresh chain for the program: its first collective waits on nothing inside it, the rest on the one before.
    inside = ctx.replace(tokens_in=TokenSet.create([EFFECT]), tokens_out=None)
    return core_call_lowering(inside, *args, name="shmcomm_sealed", call_jaxpr=jaxpr)


register_lowering(sealed_p, _lowering, platform="cpu")
# Kept whole even when no result is used: a program of barriers returns nothing its caller reads.
dce_rules[sealed_p] = lambda used_outputs, eqn: ([True] * len(eqn.invars), eqn)


class InFlight:
    """The sealed programs dispatched and maybe not finished, each known by a scalar it returns beside its results
    (PjRt makes every result of a program ready when the program ends). While there are any, the session is held
    (session.hold): the numpy API, the engine's start and shutdown wait for them before their next collective, since
    that one must come after theirs on every rank."""

    def __init__(self):
        self._lock = threading.Lock()
        self._markers = collections.deque()

    def add(self, marker):
        with self._lock:
            markers = self._markers
            while markers and markers[0].is_ready():
                markers.popleft()
            markers.append(marker)
            if session.state.in_flight is None:  # under the lock: a wait() on another thread cannot release it now
                session.hold(self.wait)

    def wait(self):
        """Waits for every program dispatched so far; a program's failure is left to the caller who uses its results
        (they raise it), so it is not raised here."""
        if context.in_handler():  # the handler's Python path, inside a program being waited for
            return
        while True:
            with self._lock:
                markers = list(self._markers)
                self._markers.clear()
                if not markers:
                    if session.state.in_flight is not None:
                        session.release()
                    return
            for marker in markers:
                try:
                    marker.block_until_ready()
                except Exception:
                    pass


in_flight = InFlight()


def _sealed(fun):
    """The function jax.jit traces: `fun` as one sealed primitive; the arguments jax.jit does not trace (the static
    ones) stay constants of the inner trace."""
    @functools.wraps(fun)
    def program(*args, **kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tracer)]

        def flat(*xs):
            filled = list(leaves)
            for i, x in zip(traced, xs):
                filled[i] = x
            a, k = jax.tree_util.tree_unflatten(tree, filled)
            return fun(*a, **k)

        inputs = [leaves[i] for i in traced]
        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.aval.weak_type) for x in inputs]
        jaxpr, shape = jax.make_jaxpr(flat, return_shape=True)(*avals)
        outs = sealed_p.bind(*inputs, jaxpr=jaxpr)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outs), np.int8(0)
    return program


def jit(fun, **jit_options):
    """jax.jit for functions that hold shmcomm collectives, dispatched through JAX's fast C++ path.

    Under plain jax.jit every call of a function holding a collective takes JAX's Python dispatch (the ordered effect
    that keeps collectives in order does that); here the effect stays inside the program, and a call costs what any
    jitted call costs. Called inside another trace (jax.jit, grad, vmap, another shmcomm.jax.jit), it runs `fun`
    inline, as part of that trace.

    Args:
        fun: the function, as for jax.jit.
        **jit_options: jax.jit's options (static_argnums, donate_argnums, ...).

    Returns:
        The jitted function. Its results are ready when used, as jax.jit's are; shmcomm's numpy API and shutdown()
        wait for its collectives by themselves.

    Raises:
        JaxRuntimeError: a collective failed, raised where its result is used; shmcomm.jax.original(error) gives the
            shmcomm exception (MismatchError, RankFailure...). The function's own errors raise at trace time.

    Example:
        `step = sj.jit(lambda g: sj.allreduce(g, op=sj.Sum))`, then `step(jnp.ones(3))` is `size()` everywhere.
    """
    compiled = jax.jit(_sealed(fun), **jit_options)

    @functools.wraps(fun)
    def call(*args, **kwargs):
        if not trace_state_clean():
            return fun(*args, **kwargs)
        try:
            results, marker = compiled(*args, **kwargs)
        except ValueError as error:  # a program run at once by the fast path fails as a ValueError: say it as jit does
            if context.original(error) is None:
                raise
            raise jax.errors.JaxRuntimeError(str(error)) from None
        in_flight.add(marker)
        return results

    return call
