# SPDX-License-Identifier: Apache-2.0
"""The private parts of JAX that shmcomm.jax uses, in one place: a JAX release that moves one fails here, at import,
with one message naming it, instead of somewhere inside a trace. The [jax] extra allows the versions the JAX tests
pass on (pyproject.toml); tests/test_jax.py imports this module on the installed version."""
import jax

try:
    from jax._src import dispatch, effects
    from jax._src.core import Tracer, abstract_token, trace_state_clean
    from jax._src.interpreters import mlir
    from jax._src.interpreters.partial_eval import dce_rules

    apply_primitive = dispatch.apply_primitive
    Effect = effects.Effect
    # Where an ordered effect must be allowed: lowering, ordering, loops and conditionals, custom derivatives, remat.
    EFFECT_SETS = (effects.lowerable_effects, effects.ordered_effects, effects.control_flow_allowed_effects,
                   effects.custom_derivatives_allowed_effects, effects.remat_allowed_effects)
    TokenSet = mlir.TokenSet
    TokenSet.create  # noqa: B018 (looked up to fail here)
    register_lowering = mlir.register_lowering
    core_call_lowering = mlir.core_call_lowering
except (ImportError, AttributeError) as _error:
    raise ImportError("shmcomm.jax: jax %s no longer has a private part that shmcomm.jax uses (%s); install a version "
                      "that the [jax] extra allows: pip install 'shmcomm[jax]'" % (jax.__version__, _error)) from _error

__all__ = ["EFFECT_SETS", "Effect", "TokenSet", "Tracer", "abstract_token", "apply_primitive", "core_call_lowering",
           "dce_rules", "register_lowering", "trace_state_clean"]
