# SPDX-License-Identifier: Apache-2.0
"""torch.distributed's backend "shmcomm": `import shmcomm.torch` registers it, and `init_process_group("shmcomm")`
runs DDP, FSDP, DTensor and plain torch.distributed calls on shmcomm's collectives.

Each operation hands its tensors, as views, to the numpy-level API of shmcomm/collectives.py on the group's process
set and returns a finished Work; send and recv run on channels of their own (torch/point_to_point.py)."""
import functools
import math
import sys

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions,
                                        AllToAllOptions, BarrierOptions, BroadcastOptions, GatherOptions,
                                        ReduceOptions, ReduceScatterOptions, ScatterOptions)

from shmcomm import basics, collectives, env, process_sets
from shmcomm.startup import rendezvous
from shmcomm.torch import mpi_rendezvous, tensor_views as views
from shmcomm.torch.point_to_point import Channels
from shmcomm.torch.work import finished, under_way
from shmcomm.vocabulary.exceptions import InvalidArgumentError, NotSupportedError


def _refusing(kind):
    """Makes an operation whose own checks fail on this rank fail collective `kind` (what the other ranks run for it)
    on every rank at once, rather than leave them waiting for this one until the timeout."""
    def wrap(method):
        @functools.wraps(method)
        def checked(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except InvalidArgumentError as error:
                raise collectives.refused(kind, error, process_set=self._set) from None
        return checked
    return wrap


class ShmcommProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose operations run on shmcomm (CPU tensors; CUDA tensors in the world
    group's collectives).

    Made by `dist.init_process_group("shmcomm")` and `dist.new_group(..., backend="shmcomm")`, not directly.

    Args:
        rank: this rank's index in the group.
        ranks: the group's global ranks, in group order.
        process_set: shmcomm's process set of those ranks (None for every rank of the job).
        key: a name of the group that every member derives alike (its point-to-point channels' names start with it).
    """

    def __init__(self, rank, ranks, process_set, key):
        super().__init__(rank, len(ranks))
        self._me, self._n = rank, len(ranks)  # torch's rank() and size() cost a microsecond a call
        self._ranks = ranks
        self._set = process_set
        self._channels = Channels(key, ranks)
        self._name = self._description = ""
        self._views = views.HostViews()

    def getBackendName(self):
        """The backend's name, "shmcomm"."""
        return "shmcomm"

    # torch names its groups through these (a process group written in Python keeps them itself).

    def setGroupName(self, name):
        """Keeps the name torch gives the group."""
        self._name = name

    def getGroupName(self):
        """The name torch gave the group."""
        return self._name

    def setGroupDesc(self, description):
        """Keeps the description torch gives the group."""
        self._description = description

    def getGroupDesc(self):
        """The description torch gave the group."""
        return self._description

    def _root(self, root, what):
        if not 0 <= root < self._n:
            raise InvalidArgumentError("%s: root %r is not a rank of this group of %d" % (what, root, self._n))
        return self._ranks[root]

    # ---- reductions ----

    def _reduce(self, tensor, op, what, into=None):
        """Reduces `tensor` over the group into `into` (default: in place)."""
        source, shmcomm_op, factor = self._views.reduction(tensor, op, what)
        target = tensor if into is None else into
        if shmcomm_op is None:
            gathered = collectives.allgather(self._views.data(tensor, what).reshape(1, -1), name=what,
                                             process_set=self._set)
            views.movable(target).copy_(views.bitwise(torch.as_tensor(gathered), op))
            return
        out = source if into is None else self._views.reduction(into, op, what)[0]
        collectives.allreduce(source, op=shmcomm_op, prescale_factor=factor, name=what, output=out,
                              process_set=self._set)

    def allreduce(self, tensors, opts=AllreduceOptions()):
        """dist.all_reduce: every tensor of the list reduced over the group, in place."""
        plain = self._views.plain(tensors[0], opts.reduceOp) if len(tensors) == 1 else None
        if plain is None:
            return self._allreduce_each(tensors, opts)
        # DDP's call, in as few Python frames as it takes: none of this group's own checks can fail here.
        collectives.allreduce_(plain[0], op=plain[1], name="all_reduce", process_set=self._set)
        return finished(tensors)

    @_refusing("allreduce")
    def _allreduce_each(self, tensors, opts):
        for tensor in tensors:
            self._reduce(tensor, opts.reduceOp, "all_reduce")
        return finished(tensors)

    @_refusing("allreduce")
    def allreduce_coalesced(self, tensors, opts=AllreduceCoalescedOptions()):
        """dist.all_reduce_coalesced and the coalescing manager's all_reduce: one flat reduction per dtype."""
        by_dtype = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for group in by_dtype.values():
            if len(group) == 1:
                self._reduce(group[0], opts.reduceOp, "all_reduce_coalesced")
                continue
            joined = torch.cat([views.flat(t) for t in group])
            self._reduce(joined, opts.reduceOp, "all_reduce_coalesced")
            for tensor, part in zip(group, joined.split([t.numel() for t in group])):
                views.movable(tensor).copy_(views.movable(part))
        return finished(tensors)

    @_refusing("allreduce")
    def reduce(self, tensors, opts=ReduceOptions()):
        """dist.reduce: the reduction lands in the root's tensor; the others' tensors are left as they were."""
        root = self._root(opts.rootRank, "reduce")
        for tensor in tensors:
            mine = root == self._ranks[self._me]
            self._reduce(tensor, opts.reduceOp, "reduce", into=None if mine else torch.empty_like(tensor))
        return finished(tensors)

    @_refusing("reducescatter")
    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        """dist.reduce_scatter_tensor: this rank's equal share of the reduction of `input`."""
        n = self._n
        what = "reduce_scatter_tensor"
        if input.numel() != n * output.numel() or input.dtype != output.dtype:
            raise InvalidArgumentError("%s: the input must hold %d times the output's %d elements of %s, got %d of %s"
                                       % (what, n, output.numel(), output.dtype, input.numel(), input.dtype))
        source, shmcomm_op, factor = self._views.reduction(input, opts.reduceOp, what)
        if shmcomm_op is None:
            whole = input.clone()
            self._reduce(whole, opts.reduceOp, what)
            views.movable(output).copy_(views.rows(views.movable(whole), n)[self._me])
        else:
            share = self._views.reduction(output, opts.reduceOp, what)[0]
            # Flat: the first dimension splits into equal shares, rank order, as the rows of (n, -1) would.
            collectives.reducescatter(source, op=shmcomm_op, prescale_factor=factor, name=what,
                                      process_set=self._set, output=share)
        return finished([output])

    def reduce_scatter(self, outputs, inputs, opts=ReduceScatterOptions()):
        """dist.reduce_scatter: this rank's tensor of the reduction of every rank's list."""
        return _each(lambda output, pieces: self.reduce_scatter_single(
            output, torch.cat([views.flat(p) for p in pieces]), opts), outputs, inputs)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=ReduceScatterOptions()):
        """The coalescing manager's reduce_scatter_tensor, one after the other."""
        return _each(lambda output, tensor: self.reduce_scatter_single(output, tensor, opts), outputs, inputs)

    # ---- data movement ----

    @_refusing("broadcast")
    def broadcast(self, tensors, opts=BroadcastOptions()):
        """dist.broadcast: the root's tensors on every rank."""
        root = self._root(opts.rootRank, "broadcast")
        for tensor in tensors:
            data = self._views.data(tensor, "broadcast")
            collectives.broadcast_(data, root, name="broadcast", process_set=self._set)
        return finished(tensors)

    @_refusing("allgather")
    def all_gather_single(self, output, input, opts=AllgatherOptions()):
        """dist.all_gather_into_tensor: every rank's `input`, in rank order, in `output`."""
        what = "all_gather_into_tensor"
        if output.numel() != self._n * input.numel() or input.dtype != output.dtype:
            raise InvalidArgumentError("%s: the output must hold %d times the input's %d elements of %s, got %d of %s"
                                       % (what, self._n, input.numel(), input.dtype, output.numel(), output.dtype))
        data = self._views.data(input, what)
        collectives.allgather(data, name=what, process_set=self._set, output=self._views.data(output, what))
        return finished([output])

    @_refusing("allgather")
    def allgather(self, outputs, inputs, opts=AllgatherOptions()):
        """dist.all_gather: every rank's tensor, in rank order, in the list of outputs (sizes may differ by rank)."""
        for output_list, tensor in zip(outputs, inputs):
            if len(output_list) != self._n:
                raise InvalidArgumentError("all_gather: %d output tensors for a group of %d"
                                           % (len(output_list), self._n))
            data = self._views.data(tensor, "all_gather")
            got = collectives.allgather(data, name="all_gather", process_set=self._set)
            _scatter_into(output_list, got, "all_gather")
        return finished(outputs)

    def allgather_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        """dist.all_gather_coalesced: all_gather of each tensor of the list."""
        return _each(lambda output_list, tensor: self.allgather([output_list], [tensor], opts), outputs, inputs)

    def all_gather_single_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        """The coalescing manager's all_gather_into_tensor, one after the other."""
        return _each(lambda output, tensor: self.all_gather_single(output, tensor, opts), outputs, inputs)

    @_refusing("alltoall")
    def all_to_all_single(self, output, input, output_splits, input_splits, opts=AllToAllOptions()):
        """dist.all_to_all_single: rows of `input` to each rank by `input_splits` (equal parts when empty), the
        rows received in `output`, by `output_splits`."""
        what = "all_to_all_single"
        n = self._n
        rows = input.shape[0] if input.dim() else 1
        if not input_splits and rows % n:
            raise InvalidArgumentError("%s: %d rows do not split evenly over %d ranks; pass input_split_sizes"
                                       % (what, rows, n))
        sent = self._views.data(input, what)
        out = self._views.data(output, what)
        if not input_splits and not output_splits and len(out) == len(sent) and output.dtype == input.dtype:
            # Equal parts both ways, as the numpy API's alltoall without splits: a rank whose parts differ in size
            # makes the call fail on every rank.
            collectives.alltoall(sent, name=what, process_set=self._set, output=out)
            return finished([output])
        width = math.prod(input.shape[1:]) * input.element_size() // sent.itemsize  # of a row, as moved
        received = sum(output_splits) if output_splits else output.shape[0] if output.dim() else 1
        expected = list(output_splits) if output_splits else [received // n] * n  # equal parts without splits
        if len(out) != received * width or output.dtype != input.dtype:
            raise InvalidArgumentError("%s: the output must hold %d rows of %s like the input's, got %s of %s"
                                       % (what, received, tuple(input.shape[1:]), tuple(output.shape), output.dtype))
        splits = list(input_splits) if input_splits else [rows // n] * n
        _, counts = collectives.alltoall(sent.reshape(rows, width), splits=splits, name=what, process_set=self._set,
                                         output=out.reshape(received, width))
        if counts.tolist() != expected:
            raise InvalidArgumentError("%s: the output expects %s rows from the ranks, but they sent %s"
                                       % (what, expected, counts.tolist()))
        return finished([output])

    @_refusing("alltoall")
    def alltoall(self, outputs, inputs, opts=AllToAllOptions()):
        """dist.all_to_all: inputs[j] to rank j, outputs[j] from rank j (any sizes that agree pairwise)."""
        what = "all_to_all"
        if len(inputs) != self._n or len(outputs) != self._n:
            raise InvalidArgumentError("%s: %d inputs and %d outputs for a group of %d"
                                       % (what, len(inputs), len(outputs), self._n))
        pieces = [views.movable(t) for t in inputs]
        received, _ = collectives.alltoall(views.data(torch.cat(pieces), what), splits=[len(p) for p in pieces],
                                           name=what, process_set=self._set)
        _scatter_into(outputs, received, what)
        return finished(outputs)

    @_refusing("alltoall")
    def gather(self, outputs, inputs, opts=GatherOptions()):
        """dist.gather: every rank's tensor in the root's list."""
        root = self._root(opts.rootRank, "gather")
        sent = self._views.data(inputs[0], "gather")
        splits = [len(sent) if r == root else 0 for r in self._ranks]
        received, _ = collectives.alltoall(sent, splits=splits, name="gather", process_set=self._set)
        if outputs:
            _scatter_into(outputs[0], received, "gather")
        return finished(outputs)

    @_refusing("alltoall")
    def scatter(self, outputs, inputs, opts=ScatterOptions()):
        """dist.scatter: the root's list, one tensor to each rank."""
        root = self._root(opts.rootRank, "scatter")
        output = outputs[0]
        if inputs:
            pieces = [views.movable(t) for t in inputs[0]]
            sent, splits = views.data(torch.cat(pieces), "scatter"), [len(p) for p in pieces]
        else:
            sent, splits = self._views.data(output, "scatter")[:0], [0] * self._n
        received, _ = collectives.alltoall(sent, splits=splits, name="scatter", process_set=self._set)
        _scatter_into([output], received, "scatter")
        return finished(outputs)

    def barrier(self, opts=BarrierOptions()):
        """dist.barrier: returns once every rank of the group has come."""
        collectives.barrier(process_set=self._set)
        return finished([])

    # ---- point to point ----

    def send(self, tensors, dst, tag):
        """dist.send and isend: the tensor to group rank `dst`; the Work completes once it has gone."""
        return under_way(self._channels.transfer(tensors[0], self._me, dst, tag, "send"))

    def recv(self, tensors, src, tag):
        """dist.recv and irecv: the tensor from group rank `src`; the Work completes once it has arrived."""
        return under_way(self._channels.transfer(tensors[0], src, self._me, tag, "recv"))

    def recv_anysource(self, tensors, tag):
        """dist.recv without a source: refused; name the sender."""
        raise NotSupportedError("recv from any source: the shmcomm backend needs the sender's rank")

    def start_coalescing(self, device):
        """The coalescing manager's start: each operation runs as it comes."""

    def end_coalescing(self, device):
        """The coalescing manager's end: the operations are done already."""
        return finished([])

    def shutdown(self):
        """dist.destroy_process_group: closes the group's channels and process set."""
        self._channels.close()
        if self._set is not None:
            process_sets.remove_process_set(self._set)
            self._set = None


def _each(operation, outputs, inputs):
    """Runs `operation(output, input)` on each pair, in order: the coalesced forms."""
    for output, tensor in zip(outputs, inputs):
        operation(output, tensor)
    return finished(outputs)


def _scatter_into(outputs, flat, what):
    """Copies consecutive parts of `flat` (shmcomm's view of a concatenation) into the tensors of `outputs`."""
    sizes = [views.movable(t).numel() for t in outputs]
    flat = torch.as_tensor(flat).reshape(-1)
    if sum(sizes) != flat.numel():
        raise InvalidArgumentError("%s: the outputs hold %d elements, %d arrived" % (what, sum(sizes), flat.numel()))
    for tensor, part in zip(outputs, flat.split(sizes)):
        views.movable(tensor).copy_(part)


def create(options, backend_options=None):
    """torch's maker of the backend (registered with extended_api): the group's process group on shmcomm.

    Raises:
        ValueError: torch's rank or world size is not shmcomm's (the job was started by neither shmcommrun nor
            mpiexec, or with other numbers).
    """
    if not basics.is_initialized():
        env.bound_timeout(options.timeout.total_seconds())
        if env.job_token() is None and not env.launched_by_mpi() and not options.global_ranks_in_group:
            rendezvous.take_place(options.store, options.group_rank, options.group_size)
    basics.init()
    world = basics.size()
    ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
    me = basics.rank()
    if not options.global_ranks_in_group and (options.group_size, options.group_rank) != (world, me):
        raise ValueError("init_process_group('shmcomm') as rank %d of %d, but shmcomm's job has this process as rank "
                         "%d of %d: start the job with shmcommrun or mpiexec, and let torch read RANK and WORLD_SIZE "
                         "from them" % (options.group_rank, options.group_size, me, world))
    key = "torch/%s" % options.group_id  # torch names every group alike on its members; its channels take the name
    if ranks == list(range(world)):
        return ShmcommProcessGroup(options.group_rank, ranks, None, key)
    return ShmcommProcessGroup(options.group_rank, ranks, process_sets.members_only(ranks, key), key)


def register():
    """Registers the backend under the name "shmcomm" for CPU and CUDA tensors, and the env:// rendezvous of a job
    that a plain mpiexec started (torch/mpi_rendezvous.py; idempotent)."""
    if "shmcomm" not in dist.Backend.backend_list:
        dist.Backend.register_backend("shmcomm", create, extended_api=True, devices=["cpu", "cuda"])
    handlers = getattr(sys.modules.get("torch.distributed.rendezvous"), "_rendezvous_handlers", None)
    if isinstance(handlers, dict) and "env" in handlers:  # else torch moved it: pass an init_method under mpiexec
        mpi_rendezvous.install(handlers)

