# SPDX-License-Identifier: Apache-2.0
"""Broadcasting a model's parameters, an optimizer's state and arbitrary Python objects; gathering objects."""
import cloudpickle
import torch

from shmcomm import basics
from shmcomm.vocabulary.ops import Average, Sum, resolve
from shmcomm.process_sets import global_process_set
from shmcomm.torch.mpi_ops import allgather, allgather_async, broadcast_, broadcast_async_, synchronize


def broadcast_parameters(params, root_rank, process_set=global_process_set):
    """Overwrites every rank's tensors with root_rank's, in place, all broadcasts started at once.

    Args:
        params: a dict (model.state_dict(); its keys are sorted so that every rank pairs the same tensors), or an
            iterable of tensors or of (name, tensor) pairs (model.parameters(), model.named_parameters()).
        root_rank: the rank whose values everyone takes.
        process_set: the ranks that take part (default: every rank).

    Raises:
        ValueError: `params` is none of those.
        MismatchError, RankFailure, TimeoutError: from the broadcasts (the first one's, after every broadcast ended).

    Example:
        `hvd.broadcast_parameters(model.state_dict(), root_rank=0)` before the first step.
    """
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__next__"):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError("invalid params of type: %s" % type(params))
    # All broadcasts start at once and are waited for together: one negotiation round for the whole model.
    handles = [broadcast_async_(p, root_rank, None if name is None else str(name), process_set)
               for name, p in params]
    errors = []
    for handle in handles:
        try:
            synchronize(handle)
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set):
    """Makes every rank's optimizer state (tensors, scalars, and the param groups' options such as the learning
    rate) equal to root_rank's. An optimizer without state yet gets it first from a step on zero gradients, so that
    every rank holds the same structure.

    Args:
        optimizer: a torch.optim optimizer (not LBFGS), before or after DistributedOptimizer wraps it.
        root_rank: the rank whose state everyone takes.
        model: accepted for Horovod's signature and unused.
        process_set: the ranks that take part (default: every rank).

    Raises:
        ValueError: an LBFGS optimizer.
        MismatchError, RankFailure, TimeoutError: from the broadcasts.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format).detach()
                    if isinstance(optimizer, torch.optim.SparseAdam):
                        p.grad = p.grad.to_sparse()
        # A DistributedOptimizer's own step() would allreduce; only the wrapped optimizer's step is wanted here.
        local_step = getattr(optimizer, "_local_step", optimizer.step)
        local_step()
        state_dict = optimizer.state_dict()

    tensors, scalars = [], {}
    for index, group in enumerate(state_dict["param_groups"]):
        scalars["group.%d" % index] = {k: v for k, v in group.items() if k != "params"}
        for pid in group["params"]:
            for key, value in state_dict["state"].get(pid, {}).items():
                name = "optimizer_state.%d.%s.%s" % (index, pid, key)
                if torch.is_tensor(value):
                    tensors.append((name, value))
                else:
                    scalars[name] = (pid, key, value)
    broadcast_parameters(tensors, root_rank, process_set)
    scalars = broadcast_object(scalars, root_rank, "optimizer_state.scalars", process_set)
    for name, value in scalars.items():
        if name.startswith("group."):
            optimizer.param_groups[int(name[6:])].update(value)
        else:
            pid, key, v = value
            # state_dict()["state"][pid] is the optimizer's own per-parameter dict, so this updates the optimizer.
            state_dict["state"][pid][key] = v


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Rank `root_rank`'s `obj` on every rank, serialized with cloudpickle (its size first, then its bytes).

    Args:
        obj: any object cloudpickle can serialize; only the root's matters, so the others may pass None.
        root_rank: the rank whose object everyone receives.
        name: names the call (the default does not depend on `obj`).
        process_set: the ranks that take part (default: every rank).

    Returns:
        The root's object, unpickled on every rank (the root gets a copy too).

    Raises:
        ShmCommError: as broadcast().

    Example:
        `epoch = hvd.broadcast_object(epoch, root_rank=0)` after the root resumed from a checkpoint.
    """
    name = "broadcast_object" if name is None else str(name)
    root = basics.rank() == root_rank
    if root:
        payload = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank, name + ".sz", process_set)
    if not root:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, name + ".t", process_set)
    return obj if root else cloudpickle.loads(payload.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's `obj`, serialized with cloudpickle, gathered on every rank.

    Args:
        obj: any object cloudpickle can serialize.
        name: names the call.
        process_set: the ranks that take part (default: every rank).

    Returns:
        The list of the ranks' objects, in rank order.

    Raises:
        ShmCommError: as allgather().
    """
    name = "allgather_object" if name is None else str(name)
    payload = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64), name + ".sz", process_set).tolist()
    data = allgather(payload, name + ".t", process_set).numpy().tobytes()
    out, at = [], 0
    for n in sizes:
        out.append(cloudpickle.loads(data[at:at + n]))
        at += n
    return out


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Starts reducing a sparse COO tensor by gathering every rank's indices and values.

    Args:
        tensor: a sparse COO tensor of the same size on every rank.
        name: names the gathers.
        op: Sum or Average.
        process_set: the ranks that take part (default: every rank).

    Returns:
        A callable that waits and returns the sparse result (uncoalesced: indices may repeat).

    Raises:
        NotImplementedError: an op other than Sum and Average.
    """
    op = resolve(op)
    if op not in (Average, Sum):
        raise NotImplementedError("sparse allreduce supports Sum and Average only, not %s" % op.name)
    t = tensor.coalesce()
    base = None if name is None else str(name)
    indices = allgather_async(t.indices().t().contiguous(), None if base is None else base + ".indices", process_set)
    values = allgather_async(t.values().contiguous(), None if base is None else base + ".values", process_set)

    def wait():
        vals = synchronize(values)
        idx = synchronize(indices)
        if op == Average:
            vals = vals / (basics.size() if process_set is None else process_set.size())
        return torch.sparse_coo_tensor(idx.t(), vals, t.size(), check_invariants=False)  # indices of valid tensors

    return wait
