# SPDX-License-Identifier: Apache-2.0
"""ElasticAveragingOptimizer: ShmCaffe's asynchronous (elastic averaging against a centre in a job-wide Soft Memory
Box) and hybrid (synchronous inside a host, asynchronous between hosts) training, around any torch optimizer.

Asynchronous, each rank exchanges with the centre (shmcomm/smb/averaging.py) every `period` steps and never waits for
another rank, so a slow rank slows only itself. Hybrid, the gradients are averaged over the host's ranks every step
and the host's first rank exchanges for the host. The parameters are moved into one flat buffer (each parameter's
.data becomes a view of it), so that an exchange is one box exchange of the whole model; centre_state_dict() returns
the centre for evaluation and checkpoints (model.load_state_dict(..., strict=False))."""
import collections

import numpy as np
import torch

from shmcomm.smb import averaging
from shmcomm import basics
from shmcomm.vocabulary import ops
from shmcomm.vocabulary.exceptions import InvalidArgumentError
from shmcomm.smb.box import SoftMemoryBox
from shmcomm.torch.optimizer import DistributedOptimizer


class _ElasticAveraging:
    """Placed before the wrapped optimizer's class in a dynamic subclass; shares the wrapped optimizer's state."""

    def step(self, closure=None):
        if self._host_comm is not None:
            self._average_over_host()
        loss = super().step(closure)
        self._elastic_steps += 1
        if self._elastic_steps % self._period == 0:
            self.exchange()
        return loss

    def _average_over_host(self):
        """The hybrid mode across hosts: the gradients averaged over the host's ranks, one blocking allreduce in
        the host's shared memory (the host's process set, which the engine does not use meanwhile)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p, _ in self._layout]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._host_comm.allreduce(flat, flat, ops.Average, 1.0, 1.0, "ElasticAveragingOptimizer host gradients")
        for (_, p, at), g in zip(self._layout, grads):
            if p.grad is None:
                p.grad = g
            p.grad.copy_(flat[at:at + p.numel()].view_as(p))

    def exchange(self):
        """The exchange with the centre that step() makes every `period` steps. In the hybrid mode the host's root
        hands the result to the host's other ranks through a box of the host (shared memory, no engine round)."""
        with torch.no_grad():
            if self._exchanger:
                self._centre.exchange(self._flat_np, self._alpha)
            self._hand_to_host()

    def _hand_to_host(self):
        """In the hybrid mode, the host's root hands its parameters to the host's other ranks."""
        if self._host_box is not None:
            self._exchanges += 1
            if self._exchanger:
                self._host_box.write(self._flat_np)
            else:
                self._host_box.wait_version(self._exchanges)
                self._host_box.read(out=self._flat_np)

    def centre_state_dict(self):
        """The centre's parameters by name, as new tensors (pushes of this rank still in flight land first)."""
        self._centre.flush()
        flat = torch.from_numpy(self._centre.pull())
        out = collections.OrderedDict()
        for name, p, at in self._layout:
            out[name] = flat[at:at + p.numel()].view_as(p).clone()
        return out

    def finish(self):
        """Waits for this rank's last exchange with the centre and applies it (before evaluating or shutting
        down); in the hybrid mode every rank of a host calls it, and all of them get the result."""
        with torch.no_grad():
            self._centre.flush()
            self._hand_to_host()


def ElasticAveragingOptimizer(optimizer, named_parameters=None, alpha=0.2, period=1, hybrid=False, home=None,
                              stripes=1, overlap=True):
    """Wraps `optimizer` for elastic averaging against a centre in a job-wide Soft Memory Box (see the module).

    Every rank calls it at the same point, after broadcast_parameters: rank 0's parameters start the centre. Each
    rank steps on its own gradients and every `period` steps exchanges with the centre: x -= alpha (x - c) and
    c += alpha (x - c), one atomic box exchange; no rank waits for another.

    Args:
        optimizer: a torch.optim optimizer over the model's parameters (all of one floating dtype).
        named_parameters: model.named_parameters(), which names the tensors in errors.
        alpha: the moving rate, in (0, 1] (ShmCaffe uses 0.2).
        period: steps between exchanges (tau), a positive integer.
        hybrid: synchronous inside each host (gradients averaged over the host's ranks), asynchronous across hosts:
            the host's first rank exchanges for the host and hands the result to the others.
        home: the host whose memory holds the centre (as SoftMemoryBox).
        stripes: the centre's stripes across hosts (as SoftMemoryBox).
        overlap: exchange from a background thread while the next steps compute (the worker's pull then lands at
            its next exchange).

    Returns:
        An instance of a subclass of the optimizer's own class (of DistributedOptimizer's, with hybrid) sharing its
        state; finish() waits for an exchange in flight, centre_state_dict() reads the centre.

    Raises:
        InvalidArgumentError: alpha outside (0, 1], a period that is not a positive integer, mixed dtypes.

    Example:
        `opt = hvd.ElasticAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), alpha=0.2, period=4)`
    """
    if not isinstance(alpha, (int, float)) or not 0.0 < alpha <= 1.0:
        raise InvalidArgumentError("ElasticAveragingOptimizer: alpha must be in (0, 1], got %r" % (alpha,))
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise InvalidArgumentError("ElasticAveragingOptimizer: period must be a positive integer, got %r" % (period,))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = {id(p): "param.%d" % i for i, p in enumerate(params)}
    if named_parameters is not None:
        named_parameters = list(named_parameters)
        names.update({id(p): str(name) for name, p in named_parameters})
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or params[0].dtype not in (torch.float32, torch.float64) or any(p.is_sparse for p in params):
        raise InvalidArgumentError("ElasticAveragingOptimizer: the parameters must be dense and all float32 or all "
                                   "float64, got %s" % sorted(str(d) for d in dtypes))
    base, host_set, host_comm = optimizer, None, None
    if hybrid:
        host_set = averaging.host_process_set()
        if host_set.process_set_id == 0:  # one host: the engine's DistributedOptimizer over everyone
            base = DistributedOptimizer(optimizer, named_parameters=named_parameters, process_set=host_set)
        else:
            host_comm = host_set.communicator()
    cls = type(optimizer.__class__.__name__, (_ElasticAveraging, base.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = base.__dict__  # the same optimizer: its state, its param groups, its hooks

    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
    layout, at = [], 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            flat[at:at + n].copy_(p.data.reshape(-1))
            p.data = flat[at:at + n].view_as(p)
            layout.append((names[id(p)], p, at))
            at += n
    wrapped._flat, wrapped._flat_np, wrapped._layout = flat, flat.numpy(), layout
    wrapped._alpha, wrapped._period, wrapped._elastic_steps = float(alpha), period, 0
    wrapped._host_box, wrapped._exchanges, wrapped._host_comm = None, 0, host_comm
    wrapped._host_root = min(host_set.ranks) if hybrid and host_set.process_set_id != 0 else 0
    wrapped._exchanger = not hybrid or basics.rank() == wrapped._host_root
    centre = averaging.ElasticCentre(averaging.next_name("elastic.centre"), flat.numel(),
                                   dtype=np.dtype(str(flat.dtype).replace("torch.", "")), home=home,
                                   stripes=stripes, overlap=overlap)
    if basics.rank() == 0:
        centre.initialise(wrapped._flat_np)
    centre.ready()
    wrapped._centre = centre
    if hybrid and host_set.size() > 1:
        wrapped._host_box = SoftMemoryBox(centre.name + ".host", shape=(flat.numel(),), dtype=centre.dtype,
                                          local=True)
    return wrapped
