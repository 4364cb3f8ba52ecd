# SPDX-License-Identifier: Apache-2.0
"""What both distributed optimizers (optimizer.py, adasum_optimizer.py) check, as Horovod does."""
import collections


def parameter_names(param_groups, named_parameters):
    """{parameter: name}; names default to param.<i> numbered over all groups (unique with several groups)."""
    all_params = [p for group in param_groups for p in group["params"]]
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [("param.%d" % i, p) for i, p in enumerate(all_params)]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                         "by model.named_parameters().")
    counts = collections.Counter(str(k) for k, _ in named_parameters)
    dups = sorted(n for n, c in counts.items() if c > 1)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: %s"
                         % ", ".join(dups))
    unnamed = {id(p) for p in all_params} - {id(p) for _, p in named_parameters}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         "Python object ids: %s" % ", ".join(str(i) for i in sorted(unnamed)))
    return {p: str(k) for k, p in named_parameters}


class ZeroGradGuard:
    """zero_grad() while reductions are in flight would zero gradients they still read."""

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                                 "a race condition.")
        return super().zero_grad(*args, **kwargs)
