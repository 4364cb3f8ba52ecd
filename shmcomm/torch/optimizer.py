# SPDX-License-Identifier: Apache-2.0
"""DistributedOptimizer: averages gradients over the ranks while backward() still runs.

A hook on each parameter's gradient accumulator starts an asynchronous in-place allreduce as soon as that gradient
is final, so communication overlaps the rest of the backward pass; step() waits for them, then runs the wrapped
optimizer's step. Every tensor travels under its parameter's name, which is what the ranks agree on."""
import warnings
from contextlib import contextmanager

import torch

from shmcomm import asynchronous, basics, env
from shmcomm.process_sets import global_process_set
from shmcomm.torch import adasum_optimizer, handles
from shmcomm.torch.compression import Compression
from shmcomm.torch.functions import broadcast_object, sparse_allreduce_async
from shmcomm.torch.mpi_ops import Adasum, Average
from shmcomm.torch.optimizer_checks import ZeroGradGuard, parameter_names


class _DistributedOptimizer(ZeroGradGuard):
    """Placed before the wrapped optimizer's class in a dynamic subclass; super() is the wrapped optimizer."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set, average_aggregated_gradients=False):
        super().__init__(params)
        self._compression = compression
        self._parameter_names = parameter_names(self.param_groups, named_parameters)
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients
        self._allreduce_delay = {p: backward_passes_per_step for p in self._parameter_names}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._handles = {}          # parameter, or tuple of a group's parameters -> (handle or None, ctx)
        self._hook_handles = []
        self._requires_update = []  # parameters whose gradients this optimizer reduces, in a stable order
        self._synchronized = False
        self._should_synchronize = True
        self._groups = groups
        self._p_to_group = {}
        self._group_counts = {}
        if process_set.included() and (basics.size() > 1 or env.elastic() or average_aggregated_gradients):
            self._register_hooks()

    # ---- hooks ----
    def _register_hooks(self):
        p_list = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if self._groups is not None:
            self._form_groups(p_list)
        for p in p_list:
            self._requires_update.append(p)
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _form_groups(self, p_list):
        # Every rank must form the same groups: take rank 0's parameter order.
        root = self.process_set.ranks[0] if self.process_set.process_set_id else 0
        order = broadcast_object([self._parameter_names[p] for p in p_list], root_rank=root,
                                 name="DistributedOptimizer.order", process_set=self.process_set)
        position = {name: i for i, name in enumerate(order)}
        p_list = sorted(p_list, key=lambda p: position.get(self._parameter_names[p], len(position)))
        if isinstance(self._groups, list):
            ids = {id(p) for p in p_list}
            p_groups = [[p for p in group if id(p) in ids] for group in self._groups]
            grouped = {id(p) for group in p_groups for p in group}
            p_groups = [g for g in p_groups if g] + [[p] for p in p_list if id(p) not in grouped]
        else:
            n = min(self._groups, len(p_list)) or 1
            d, r = divmod(len(p_list), n)
            p_groups = [p_list[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]
        for group in map(tuple, p_groups):
            for p in group:
                self._p_to_group[p] = group
            self._group_counts[group] = 0

    def _make_hook(self, p):
        def hook(*_):
            if self._allreduce_delay[p] <= 0:  # its allreduce has started (or its group is counting it)
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                     "to step(). Increase backward_passes_per_step to accumulate gradients "
                                     "locally.")
            assert not p.grad.requires_grad
            handle, ctx = None, None
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                if self._groups is not None:
                    group = self._p_to_group[p]
                    self._group_counts[group] += 1
                    if self._group_counts[group] == len(group):
                        self._handles[group] = self._grouped_allreduce_grad_async(group)
                        for gp in group:
                            self._handles.pop(gp, None)
                        self._group_counts[group] = 0
                        return
                else:
                    handle, ctx = self._allreduce_grad_async(p)
            self._handles[p] = (handle, ctx)
        return hook

    def _reduce(self, tensors, names):
        # Average divides by the number of ranks at the end; gradient_predivide_factor moves part of it before.
        pre, post = (1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor) if self.op == Average \
            else (1.0, 1.0)
        if self.average_aggregated_gradients:  # the mean over the passes, not their sum
            pre /= self.backward_passes_per_step
        return handles._start(asynchronous.allreduce_async_, tensors, names, tuple, op=self.op, prescale_factor=pre,
                              postscale_factor=post, process_set=self.process_set)

    def _allreduce_grad_async(self, p):
        if p.grad is None:
            # This rank computed no gradient (a dynamic graph), but the others may have: contribute zeros.
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format).detach()
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return sparse_allreduce_async(tensor, name, self.op, self.process_set), "sparse"
            tensor = tensor.to_dense()
        compressed, ctx = self._compression.compress(tensor)
        return self._reduce([compressed], [name]), (ctx,)

    def _grouped_allreduce_grad_async(self, group):
        for p in group:
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format).detach()
        compressed, ctxs = zip(*[self._compression.compress(p.grad.to_dense() if p.grad.is_sparse else p.grad)
                                 for p in group])
        return self._reduce(compressed, [self._parameter_names.get(p) for p in group]), ctxs

    # ---- the public side ----
    def synchronize(self):
        """Waits for every gradient's allreduce (starting those whose hooks never fired) and writes the results
        into the gradients."""
        if not self.process_set.included():
            self._synchronized = True
            return
        done = set()
        for key in self._handles:
            done.update(key if isinstance(key, tuple) else (key,))
        for p in self._requires_update:
            if p not in done:
                self._handles[p] = self._allreduce_grad_async(p)
        for key, (handle, ctx) in list(self._handles.items()):
            if handle is None:
                self._handles[key] = self._allreduce_grad_async(key)
        error = None
        for key, (handle, ctxs) in self._handles.items():
            try:
                if ctxs == "sparse":
                    key.grad = handle()
                    self._allreduce_delay[key] = self.backward_passes_per_step
                    continue
                outputs = handles.synchronize(handle)
            except Exception as e:  # wait for the rest anyway: their tensors are in use
                error = error or e
                continue
            for p, out, ctx in zip(key if isinstance(key, tuple) else (key,), outputs, ctxs):
                self._allreduce_delay[p] = self.backward_passes_per_step
                out = self._compression.decompress(out, ctx)
                if p.grad.is_sparse:
                    p.grad = out.to_sparse()
                elif out is not p.grad:
                    p.grad.set_(out)
        self._handles.clear()
        for group in self._group_counts:  # a group left incomplete this step was reduced parameter by parameter
            self._group_counts[group] = 0
        self._synchronized = True
        if error is not None:
            raise error

    @contextmanager
    def skip_synchronize(self):
        """For step() after an explicit synchronize() (gradient clipping, AMP unscaling):

            optimizer.synchronize(); clip(...)
            with optimizer.skip_synchronize():
                optimizer.step()"""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
                              "code.")
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    step.hooked = True  # torch's step hooks run once, in the wrapped optimizer's step

    def _local_step(self, closure=None):
        """The wrapped optimizer's step alone, without any allreduce."""
        return super().step(closure)

    def set_backward_passes_per_step(self, passes):
        """Changes the passes accumulated per step (batch-size control, batch_size.py); between steps only."""
        if int(passes) != passes or passes < 1:
            raise ValueError("backward_passes_per_step must be a positive integer, got %r" % (passes,))
        if self._handles or any(d != self.backward_passes_per_step for d in self._allreduce_delay.values()):
            raise ValueError("set_backward_passes_per_step() was called in the middle of a step (gradients of "
                             "this step are accumulating); call it after step() and before the next backward()")
        passes = int(passes)
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        return super().load_state_dict(*args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, average_aggregated_gradients=False):
    """Wraps `optimizer` so that step() applies gradients averaged (op) over the ranks of `process_set`.

    Each gradient's allreduce starts as backward produces it (a hook per parameter), so communication overlaps the
    rest of the backward pass; step() waits for them, then steps the wrapped optimizer.

    Args:
        optimizer: a torch.optim optimizer over the model's parameters; its state carries over.
        named_parameters: model.named_parameters(), which names the tensors in errors, stall reports and timelines.
        compression: Compression.fp16 sends the gradients as float16.
        backward_passes_per_step: backward passes accumulated locally before one reduction
            (set_backward_passes_per_step changes it between steps).
        op: Average (the default), Sum or Adasum (Horovod's delta optimizer).
        gradient_predivide_factor: divides the gradients by this before the sum and by size/this after (op=Average
            only).
        num_groups: Horovod's older spelling of `groups` (deprecated).
        groups: an int (that many groups of parameters) or a list of lists of parameters reduced together.
        sparse_as_dense: reduces sparse gradients as dense tensors.
        process_set: the ranks that average (default: every rank).
        average_aggregated_gradients: with backward_passes_per_step > 1, divides the accumulated sum by their number
            (Horovod's TensorFlow option).

    Returns:
        An instance of a subclass of the optimizer's own class, sharing its state.

    Raises:
        ValueError: a bad combination of arguments (a non-positive backward_passes_per_step, a predivide factor
            with op other than Average, a parameter in two groups).
        MismatchError, RankFailure, TimeoutError: from the gradients' allreduces, raised by step() or
            synchronize().

    Example:
        `opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
        named_parameters=model.named_parameters())` after `hvd.broadcast_parameters(model.state_dict(), 0)`.
    """
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be a positive integer, got %r" % (backward_passes_per_step,))
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in a later version.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    if groups is not None:
        if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
            raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
        if isinstance(groups, list):
            seen = set()
            for group in groups:
                for p in group:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor.")
                    if id(p) in seen:
                        raise ValueError("A parameter can only appear once in groups.")
                    seen.add(id(p))
    if op == Adasum and basics.size() > 1:  # Horovod's delta optimizer (adasum_optimizer.py)
        if process_set is not global_process_set and process_set.process_set_id != 0:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        return adasum_optimizer.wrap(optimizer, named_parameters, compression, backward_passes_per_step)
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    wrapped = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
                  gradient_predivide_factor, groups, sparse_as_dense, process_set, average_aggregated_gradients)
    for p, state in optimizer.state.items():  # e.g. loaded from a checkpoint before wrapping
        wrapped.state[p] = state
    return wrapped
