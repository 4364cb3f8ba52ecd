# SPDX-License-Identifier: Apache-2.0
"""The requests the numpy API's blocking and asynchronous calls build from their arguments, and running one: now, or
through the engine when it runs, so that both kinds of call keep one order on every rank.

A request on a CUDA tensor is served by the device communicator next to the world's (algorithms/device.py), on the
global process set only."""
import numpy as np

from shmcomm.engine import current as current_engine
from shmcomm.engine.request import Request, execute
from shmcomm.startup import session
from shmcomm.vocabulary import ops
from shmcomm.vocabulary.buffers import is_torch, wrap, wrap_device
from shmcomm.vocabulary.exceptions import InvalidArgumentError, NotSupportedError


def resolve_set(process_set):
    """The communicator and id of a process set (None or the global set: everyone)."""
    comm = session.communicator()
    if process_set is None or process_set.process_set_id == 0:
        return comm, 0
    return process_set.communicator(), process_set.process_set_id


def is_cuda(tensor):
    return is_torch(tensor) and tensor.is_cuda


def on_device(req):
    """Hands a request on a CUDA tensor to the device communicator, whose checks travel with it (Request.checked)."""
    if is_cuda(req.tensor):
        if req.set_id:
            req.checked(_no_device_sets, req.what)
        else:
            from shmcomm.algorithms import device

            req.comm = device.communicator(req.comm)
            req.checked(req.comm.prepare, req)
    return req


def _no_device_sets(what):
    raise NotSupportedError("%s: CUDA tensors are supported on the global process set only" % what)


def _name(kind, name):
    # Unnamed requests are named by the engine, which only they pass through when it runs.
    return None if name is None else "%s.%s" % (kind, name)


def run(req):
    """Runs a request now, or through the engine if it is running."""
    engine = current_engine()
    if engine is not None and not engine.in_engine_thread():
        return engine.submit(req, settle=True).wait()
    return execute(req)


def root_index(comm, root_rank, what):
    """Horovod's root_rank is a global rank; the core wants its index in the communicator."""
    if not isinstance(root_rank, (int, np.integer)) or int(root_rank) not in comm.ranks:
        raise InvalidArgumentError("%s: root rank %r is not one of the ranks %s" % (what, root_rank,
                                                                                 _ranks_text(comm.ranks)))
    return comm.ranks.index(int(root_rank))


def _ranks_text(ranks):
    return "0..%d" % (len(ranks) - 1) if ranks == list(range(len(ranks))) else str(ranks)


def splits_list(splits, rows, n, what):
    if splits is None:
        if rows % n:
            raise InvalidArgumentError("%s: the first dimension (%d) does not divide by the number of ranks (%d); pass "
                                       "splits" % (what, rows, n))
        return [rows // n] * n
    if hasattr(splits, "tolist"):
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        raise InvalidArgumentError("%s: splits %s must have %d non-negative entries that add up to the first "
                                   "dimension (%d)" % (what, splits, n, rows))
    return splits


def allreduce_request(tensor, output, op, average, prescale_factor, postscale_factor, name, process_set):
    comm, set_id = resolve_set(process_set)
    req = Request("allreduce", _name("allreduce", name), tensor, comm, set_id, output=output,
                  prescale=prescale_factor, postscale=postscale_factor)
    req.op = req.checked(ops.resolve, op, average, default=ops.Sum)
    return on_device(req)


def broadcast_request(tensor, output, root_rank, name, process_set):
    comm, set_id = resolve_set(process_set)
    req = Request("broadcast", _name("broadcast", name), tensor, comm, set_id, output=output)
    req.root = req.checked(root_index, comm, root_rank, req.what, default=0)
    return on_device(req)


def allgather_request(tensor, name, process_set, output=None):
    comm, set_id = resolve_set(process_set)
    return on_device(Request("allgather", _name("allgather", name), tensor, comm, set_id, output=output))


def reducescatter_op(op):
    resolved = ops.resolve(op)
    if resolved == ops.Adasum:
        raise InvalidArgumentError("reducescatter: Adasum is an allreduce op; use Sum or Average")
    return resolved


def reducescatter_request(tensor, op, name, prescale_factor, postscale_factor, process_set, output=None):
    comm, set_id = resolve_set(process_set)
    req = Request("reducescatter", _name("reducescatter", name), tensor, comm, set_id, output=output,
                  prescale=prescale_factor, postscale=postscale_factor)
    req.op = req.checked(reducescatter_op, op, default=ops.Sum)
    return on_device(req)


def alltoall_request(tensor, splits, name, process_set, output=None):
    comm, set_id = resolve_set(process_set)
    req = Request("alltoall", _name("alltoall", name), tensor, comm, set_id, output=output)
    req.splits = req.checked(rows_per_rank, tensor, splits, comm.size, req.what)
    return on_device(req)


def rows_per_rank(tensor, splits, n, what):
    if type(tensor) is np.ndarray:
        shape = tensor.shape
    else:
        shape = (wrap_device if is_cuda(tensor) else wrap)(tensor, what).shape  # checks the tensor before reading it
    return splits_list(splits, (tuple(shape) or (1,))[0], n, what)


def received_splits(tensor, got):
    """Rows received per rank, as Horovod returns them: int32, a torch tensor for torch input."""
    got = np.asarray(got, dtype=np.int32)
    if is_torch(tensor):
        import torch

        return torch.from_numpy(got)
    return got


def barrier_request(process_set):
    comm, set_id = resolve_set(process_set)
    return Request("barrier", None, None, comm, set_id)
