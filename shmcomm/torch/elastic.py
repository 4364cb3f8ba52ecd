# SPDX-License-Identifier: Apache-2.0
"""Elastic training for PyTorch, Horovod's horovod.torch.elastic: run, TorchState, ElasticSampler (run shows them).

Run it with shmcommrun --min-np/--max-np (and --host-discovery-script): the launcher replaces workers that die and
adds those the script makes room for (runner/elastic.py); shmcomm/elastic.py says what happens on each rank."""
import copy
import math

import numpy as np
import torch

from shmcomm import basics, process_sets
from shmcomm.elastic import ObjectState, allreduce_max_with, run_fn
from shmcomm.vocabulary.exceptions import HostsUpdatedInterrupt  # noqa: F401  (Horovod's names live here too)
from shmcomm.torch import mpi_ops
from shmcomm.torch.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from shmcomm.torch.mpi_ops import HorovodInternalError  # noqa: F401


def _reset():
    """Leaves the world and joins the next one (startup/membership.py), then registers the process sets again with the
    ranks that still exist, in the same order (their ids stay the same). Returns the new size."""
    import shmcomm.torch as hvd

    sets = process_sets.registered()
    hvd.shutdown()
    hvd.init()
    for ps in sets:
        ranks = [r for r in ps.ranks if r < hvd.size()]
        if ranks:
            ps.ranks = ranks
            hvd.add_process_set(ps)
    return hvd.size()


def run(func):
    """Horovod's decorator: func(state, ...) runs until it returns, re-forming the world whenever a worker is lost
    (rolling back to state's last commit) or added (at the next commit).

        import shmcomm.torch as hvd
        hvd.init()
        sampler = hvd.elastic.ElasticSampler(dataset)
        state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

        @hvd.elastic.run
        def train(state):
            for state.epoch in range(state.epoch, epochs):
                for i, batch in enumerate(state.sampler.batches(batch_size)):
                    ...one step on `batch` (a list of dataset indices; it may be empty at an epoch's end)...
                    state.sampler.record_batch(i, batch_size)
                    state.commit()
                state.epoch += 1  # committed as the next epoch, as in Horovod's examples
                state.sampler.set_epoch(state.epoch)
                state.commit()
        train(state)
    """
    return run_fn(func, _reset)


class ElasticSampler(torch.utils.data.Sampler):
    """Shards a dataset's indices over the ranks and remembers which ones this epoch has processed (record_batch /
    record_indices). After the world changes, reset() shards the indices not yet processed over the new ranks:
    within an epoch no sample is processed twice (as part of a committed step) and none is skipped. Shards are not
    padded: ranks may hold one sample fewer, so batches() gives every rank the same number of batches, the last one
    possibly short or empty."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices = set()
        self.reset()

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def reset(self):
        """Shards the epoch's unprocessed indices over the current world."""
        order = np.arange(len(self.dataset))
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
        self.remaining = [int(i) for i in order if int(i) not in self.processed_indices]
        size = basics.size() if basics.is_initialized() else 1
        rank = basics.rank() if basics.is_initialized() else 0
        self.num_replicas, self.rank = size, rank
        self.indices = self.remaining[rank::size]
        self.num_samples = math.ceil(len(self.remaining) / size)

    def get_indices(self, batch_idx, batch_size):
        return self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def record_batch(self, batch_idx, batch_size):
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices):
        self.processed_indices.update(int(i) for i in indices)

    def batches(self, batch_size):
        """This rank's batches of the epoch's rest: the same count on every rank."""
        return [self.get_indices(b, batch_size) for b in range(math.ceil(self.num_samples / batch_size))]

    def state_dict(self):
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return self.num_samples


class TorchState(ObjectState):
    """The model's and optimizer's state, the ElasticSamplers' progress and any other keyword values (epoch, batch),
    as attributes: commit() saves them, a failure restores them, sync() gives everyone rank 0's.

    A commit gathers every rank's processed sample indices (a collective), so that a worker lost after a commit
    takes none of what it processed with it."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model, self.optimizer = model, optimizer
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        for name, sampler in self._samplers.items():
            setattr(self, name, sampler)
        values = {k: v for k, v in kwargs.items() if k not in self._samplers}
        super().__init__(allreduce_max_with(lambda a: mpi_ops.allreduce(torch.from_numpy(a), op=mpi_ops.Max,
                                                                        name="elastic.generation").numpy()),
                         basics.rank, lambda obj: broadcast_object(obj, 0, name="elastic.state"), **values)
        self._saved_model = self._saved_optimizer = None
        self._saved_samplers = {}
        self._save(gather=False)  # no collective here: a joining worker builds its state while the others sync

    def save(self):
        self._save(gather=True)

    def _save(self, gather):
        if self.model is not None:
            self._saved_model = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())
        for name, sampler in self._samplers.items():
            if gather and basics.is_initialized() and basics.size() > 1:
                every = allgather_object(sorted(sampler.processed_indices), name="elastic.sampler." + name)
                sampler.processed_indices = set().union(*map(set, every))
            self._saved_samplers[name] = sampler.state_dict()
        ObjectState.save(self)

    def restore(self):
        if self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)
        if self._saved_optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        for name, sampler in self._samplers.items():
            sampler.load_state_dict(self._saved_samplers[name])
        super().restore()

    def sync(self):
        if self.optimizer is not None:  # first: a rank without optimizer state makes it with a local step
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        for name, sampler in self._samplers.items():
            sampler.load_state_dict(broadcast_object(sampler.state_dict(), 0, name="elastic.sampler." + name))
        self.sync_values()
        self.save()

    def reset(self):
        for sampler in self._samplers.values():
            sampler.reset()


__all__ = ["run", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt", "HorovodInternalError"]
