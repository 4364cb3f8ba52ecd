# SPDX-License-Identifier: Apache-2.0
"""Horovod's PyTorch API over shmcomm: `import shmcomm.torch as hvd` and a Horovod training script runs unchanged on
CPU ranks, on one host or across hosts (shared memory within a host; MPI and the 2D-torus allreduce between hosts).

CUDA tensors go through every collective, the asynchronous handles and DistributedOptimizer: over NCCL when each rank
has a GPU of its own, through pinned host memory into the shared-memory collectives when ranks share one
(algorithms/device.py); these paths have not yet run on a GPU. op=Adasum works in allreduce and DistributedOptimizer
for float16/32/64 on power-of-two worlds (algorithms/adasum.py). Elastic training (`hvd.elastic.run`, `TorchState`,
`ElasticSampler`: torch/elastic.py) works under shmcommrun --min-np/--max-np, on one host or across hosts."""
import importlib as _importlib
import importlib.util as _importlib_util

from shmcomm import basics as _basics
from shmcomm import env as _env
from shmcomm import process_sets as _process_sets
from shmcomm.asynchronous import start_timeline, stop_timeline  # noqa: F401
from shmcomm.basics import cross_rank, cross_size, is_initialized, local_rank, local_size, rank, size
from shmcomm.process_sets import ProcessSet, global_process_set  # noqa: F401
from shmcomm.torch import handles as _handles
from shmcomm.torch.compression import Compression  # noqa: F401
from shmcomm.torch.batch_size import BatchSizeSchedule  # noqa: F401
from shmcomm.vocabulary.exceptions import HostsUpdatedInterrupt  # noqa: F401
from shmcomm.torch.ddp_hook import allreduce_hook  # noqa: F401
from shmcomm.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                     broadcast_parameters, sparse_allreduce_async)
from shmcomm.torch.mpi_ops import (Adasum, Average, HorovodInternalError, Max, Min, Product, Sum, allgather,
                                   allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_, barrier,
                                   broadcast, broadcast_, broadcast_async, broadcast_async_, grouped_allgather,
                                   grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                                   grouped_allreduce_async, grouped_allreduce_async_, is_homogeneous, join, poll,
                                   synchronize)
from shmcomm.torch.scatter_ops import (alltoall, alltoall_async, grouped_reducescatter, grouped_reducescatter_async,
                                       reducescatter, reducescatter_async)
from shmcomm.vocabulary.exceptions import PeerArgumentError  # noqa: F401
from shmcomm.torch.averaging import ElasticAveragingOptimizer  # noqa: F401
from shmcomm.torch.optimizer import DistributedOptimizer  # noqa: F401
from shmcomm.torch.sync_batch_norm import SyncBatchNorm  # noqa: F401
from shmcomm.torch import process_group as _process_group

_process_group.register()  # torch.distributed.init_process_group("shmcomm")


def init(comm=None, process_sets=None):
    """Joins the job the launcher started and starts the background engine on every rank; every collective, blocking
    ones included, then goes through the engine, and join() works.

    Args:
        comm: None, or a list of ranks naming every rank of the job (shmcomm's world is always every rank the launcher
            started; use add_process_set() for a subset).
        process_sets: None, "dynamic" (sets can always be added later), or a list of ProcessSet that every rank
            registers now, in order.

    Raises:
        ValueError: a `comm` that is not every rank, or `process_sets` of another kind; also the settings' errors, as
            shmcomm.init().
    """
    if comm is not None:
        _check_comm(comm)
    if not (process_sets is None or process_sets == "dynamic" or
            (isinstance(process_sets, (list, tuple)) and all(isinstance(p, ProcessSet) for p in process_sets))):
        raise ValueError("process_sets must be None, 'dynamic' or a list of ProcessSet, got %r" % (process_sets,))
    _basics.init(engine=True)
    _handles._handle_map.clear()
    if isinstance(process_sets, (list, tuple)):
        for ps in process_sets:
            if ps.process_set_id is None:
                _process_sets.add_process_set(ps)
        barrier()  # see add_process_set


def add_process_set(process_set):
    """Registers a process set; every rank calls it, in the same order, as in Horovod.

    It returns once every rank has registered the set, so that no rank's collectives on it reach a rank that does not
    know it yet.

    Args:
        process_set: a ProcessSet, or a list of global ranks.

    Returns:
        The registered ProcessSet.

    Raises:
        InvalidArgumentError: the ranks are empty or out of range, or a set of the same ranks exists already.
    """
    ps = _process_sets.add_process_set(process_set)
    barrier()
    return ps


def remove_process_set(process_set):
    """Unregisters a process set; every rank calls it, and it waits until every rank is done with the set's collectives.

    Args:
        process_set: a set add_process_set() returned.

    Returns:
        True, as Horovod returns on success.

    Raises:
        InvalidArgumentError: it is the global set.
    """
    barrier()
    _process_sets.remove_process_set(process_set)
    return True


def _check_comm(comm):
    if not isinstance(comm, (list, tuple, range)):
        raise ValueError(
            "init(comm=%s): a shmcomm job is every rank that shmcommrun or mpiexec started, so an MPI communicator "
            "cannot define it. Call init() with no comm (every rank the launcher started); for "
            "collectives over a subset of the ranks, use add_process_set(ranks)." % type(comm).__name__)
    world = _env.topology().size
    ranks = sorted({int(r) for r in comm})
    if ranks != list(range(world)):
        raise ValueError(
            "init(comm=%s): a job over a subset of the launched ranks is not supported; the job is every rank the "
            "launcher started (0..%d). Launch %d ranks instead, or call init() and use add_process_set(%s)."
            % (list(comm), world - 1, len(ranks), ranks))


def __getattr__(name):
    if name == "elastic":  # imported on first use, as `hvd.elastic`
        return _importlib.import_module("shmcomm.torch.elastic")
    raise AttributeError("module 'shmcomm.torch' has no attribute %r" % name)


def shutdown():
    """Stops the background engine and leaves the job; init() may be called again afterwards."""
    _basics.shutdown()
    _handles._handle_map.clear()


# What this build can do, truthfully: collectives on CPU tensors, over shared memory within a host and over MPI
# (mpi4py) between hosts; on CUDA tensors where torch sees a GPU (over NCCL, found at run time, or through host
# memory); never over Gloo, ROCm, DDL or oneCCL.

def mpi_built():
    """Whether mpi4py is installed (it is a dependency): a job that spans hosts then runs its cross-host steps over MPI.
    Looks for the package without importing it, since importing mpi4py.MPI starts MPI.

    Returns:
        True when mpi4py can be imported.
    """
    return _importlib_util.find_spec("mpi4py") is not None


def mpi_enabled():
    """Whether this job's collectives go over MPI: it was initialized and spans hosts. A job on one host meets only in
    shared memory, even when mpiexec started it, and an elastic job's hosts meet over TCP.

    Returns:
        True for an initialized job whose hosts meet over MPI.
    """
    if not _basics.is_initialized():
        return False
    across = _basics.current().across
    return across is not None and across.carrier == "mpi"


def mpi_threads_supported():
    """Whether scripts may call MPI from several threads beside shmcomm.

    Returns:
        False: shmcomm promises no MPI thread level to scripts that call MPI themselves (a job on one host does not
        start MPI at all).
    """
    return False


def gloo_built():
    """Horovod's question, for scripts that ask.

    Returns:
        False: shmcomm never runs over Gloo.
    """
    return False


def gloo_enabled():
    """Horovod's question, for scripts that ask.

    Returns:
        False: shmcomm never runs over Gloo.
    """
    return False


def nccl_built():
    """The version of the NCCL library shmcomm loads, as Horovod returns it.

    Returns:
        Its version code (23203 for 2.32.3); 0 when there is none, or no GPU to use it on.
    """
    if not cuda_built():
        return 0
    from shmcomm.transport import nccl_library

    try:
        major, minor, patch = nccl_library.load().version
    except nccl_library.NcclError:
        return 0
    return major * 10000 + minor * 100 + patch


def cuda_built():
    """Whether CUDA tensors go through every collective: this process's torch sees a GPU.

    Returns:
        torch.cuda.is_available().
    """
    import torch

    return torch.cuda.is_available()


def rocm_built():
    """Horovod's question, for scripts that ask.

    Returns:
        False: shmcomm has no ROCm path.
    """
    return False


def ddl_built():
    """Horovod's question, for scripts that ask.

    Returns:
        False: shmcomm has no IBM DDL path.
    """
    return False


def ccl_built():
    """Horovod's question, for scripts that ask.

    Returns:
        False: shmcomm has no oneCCL path.
    """
    return False
