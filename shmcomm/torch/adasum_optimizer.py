# SPDX-License-Identifier: Apache-2.0
"""DistributedOptimizer(op=Adasum): Horovod's delta optimizer.

Adasum combines what each rank's optimizer would do, not raw gradients: once a parameter's gradient is final
(after backward_passes_per_step passes), the wrapped optimizer steps that parameter alone on this rank, the change it
made (delta = new - old) goes into an asynchronous Adasum allreduce while backward goes on, and step() sets the
parameter to old + Adasum(every rank's delta). So the learning rate is not scaled by the number of ranks, and the
optimizer's state (momentum, Adam's moments) is each rank's own, as in Horovod."""
from contextlib import contextmanager

import torch

from shmcomm import asynchronous
from shmcomm.torch import handles
from shmcomm.torch.mpi_ops import Adasum
from shmcomm.torch.optimizer_checks import ZeroGradGuard, parameter_names


class _DistributedAdasumOptimizer(ZeroGradGuard):
    """Placed before the wrapped optimizer's class in a dynamic subclass; super() is the wrapped optimizer."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step):
        super().__init__(params)
        self._compression = compression
        names = parameter_names(self.param_groups, named_parameters)
        self._parameter_names = {p: "adasum." + name for p, name in names.items()}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {p: backward_passes_per_step for p in names}
        self._handles = {}   # parameter -> (handle, start, compression ctx)
        self._requires_update = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(p))
                              for p in self._requires_update]

    def set_backward_passes_per_step(self, passes):
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be a positive integer, got %r" % (passes,))
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _make_hook(self, p):
        def hook(*_):
            if self._allreduce_delay[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                     "to step(). Increase backward_passes_per_step to accumulate gradients "
                                     "locally.")
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                self._handles[p] = self._start_delta(p)
        return hook

    def _start_delta(self, p):
        """Steps `p` alone with the wrapped optimizer and starts the Adasum of the change."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        start = p.detach().clone()
        kept = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [q for q in group["params"] if q is p]
            super().step()
        finally:
            for group, params in zip(self.param_groups, kept):
                group["params"] = params
        delta = (p.detach() - start).contiguous()
        compressed, ctx = self._compression.compress(delta)
        handle = handles._start(asynchronous.allreduce_async_, [compressed], [self._parameter_names[p]],
                                handles._first, op=Adasum)
        return handle, start, ctx

    def synchronize(self):
        pass  # the deltas are applied in step()

    @contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for p in self._requires_update:  # parameters whose hooks did not fire (yet) this step
            if p not in self._handles:
                self._handles[p] = self._start_delta(p)
        error = None
        for p, (handle, start, ctx) in self._handles.items():
            try:
                delta = self._compression.decompress(handles.synchronize(handle), ctx)
            except Exception as e:  # wait for the rest: their tensors are in use
                error = error or e
                continue
            with torch.no_grad():
                p.copy_(start + delta)
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        if error is not None:
            raise error
        return loss

    step.hooked = True



def wrap(optimizer, named_parameters, compression, backward_passes_per_step):
    cls = type(optimizer.__class__.__name__, (_DistributedAdasumOptimizer, optimizer.__class__), {})
    wrapped = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step)
    for p, state in optimizer.state.items():
        wrapped.state[p] = state
    return wrapped
