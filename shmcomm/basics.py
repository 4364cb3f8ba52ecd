# SPDX-License-Identifier: Apache-2.0
"""init/shutdown and the questions about where this process sits in the job.

The process holds at most one communicator at a time. `generation` counts inits so that init/shutdown/init in one
process (all ranks doing the same) meets a fresh segment."""
import atexit
import threading

from shmcomm import env, host_ops
from shmcomm._native import check, ffi, lib
from shmcomm.exceptions import NotInitializedError

_NOT_INITIALIZED = "shmcomm has not been initialized; use shmcomm.init()."


class Communicator:
    """A live communicator over some ranks of this host: all of them, or a process set.

    `ranks` are the global ranks it holds, in order; `rank` is this process's index among them."""

    def __init__(self, topo, tuning, generation, ranks=None, suffix="", arena=None):
        self.topology = topo
        self.tuning = tuning
        self.ranks = list(range(topo.size)) if ranks is None else list(ranks)
        self.rank = self.ranks.index(topo.rank)
        self.size = len(self.ranks)
        self._token = ffi.new("char[]", (topo.token + suffix).encode())
        cfg = ffi.new("smc_config_t *")
        cfg.token = self._token
        cfg.generation = generation
        cfg.rank = self.rank
        cfg.size = self.size
        cfg.start_timeout_s = tuning.start_timeout_s
        cfg.timeout_s = tuning.timeout_s
        cfg.liveness_s = tuning.liveness_s
        cfg.slot_bytes = tuning.slot_bytes
        cfg.small_bytes = tuning.small_bytes
        cfg.arena_bytes = tuning.arena_bytes if (ranks is None if arena is None else arena) else 0
        cfg.spin_us = tuning.spin_us
        job_ranks = ffi.new("int[]", self.ranks)  # messages name ranks as the job does; create copies the array
        cfg.job_ranks = job_ranks
        out = ffi.new("smc_comm_t **")
        check(lib.smc_comm_create(cfg, out))
        self.handle = out[0]

    # The operations every communicator offers (the multi-host one too): see host_ops for what each does.
    def allreduce(self, x, output, op, prescale, postscale, what):
        return host_ops.allreduce(self, x, output, op, prescale, postscale, what)

    def allreduce_raw(self, ptr, count, code, op, prescale, postscale, what):
        return host_ops.allreduce_raw(self, ptr, count, code, op, prescale, postscale, what)

    def broadcast(self, x, output, root, what):
        return host_ops.broadcast(self, x, output, root, what)

    def allgather(self, x, what):
        return host_ops.allgather(self, x, what)

    def reducescatter(self, x, op, prescale, postscale, what):
        return host_ops.reducescatter(self, x, op, prescale, postscale, what)

    def alltoall(self, x, splits, what):
        return host_ops.alltoall(self, x, splits, what)

    def barrier(self, what="barrier"):
        return host_ops.barrier(self, what)

    def allgather_bytes(self, payload):
        return host_ops.allgather_bytes(self, payload)

    def set_spin(self, spin_us):
        lib.smc_comm_set_spin(self.handle, spin_us)

    doorbell_reaches_all = True  # every rank of this communicator shares the segment

    def ring_doorbell(self, everyone=False):
        lib.smc_comm_doorbell_ring(self.handle, -1 if everyone else self.rank)

    def doorbell(self):
        return lib.smc_comm_doorbell_value(self.handle)

    def wait_doorbell(self, seen, timeout_s):
        return lib.smc_comm_doorbell_wait(self.handle, seen, timeout_s)

    def close(self):
        if self.handle is not None:
            lib.smc_comm_destroy(self.handle)
            self.handle = None


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.comm = None
        self.generation = 0


_state = _State()


def init(engine=None):
    """Joins the job described by the launcher's environment (a world of one without it). Idempotent.

    engine=True starts the background engine now, on every rank, as Horovod does; shmcomm.torch.init() passes it.
    Without it, blocking calls go straight to the shared memory (the lowest latency) and the engine starts with the
    first asynchronous call, which every rank makes at the same point of the program. join() needs the engine from
    the start, since the ranks that call it and the ones that go on differ. SHMCOMM_ENGINE=1 sets the default."""
    if engine is None:
        engine = env.engine_requested()
    with _state.lock:
        if _state.comm is not None:
            if engine:
                _start_engine()
            return
        from shmcomm.jobs import build_world

        comm = build_world(_state.generation)
        _state.generation += 1
        _state.comm = comm
    if engine:
        _start_engine()


def _start_engine():
    from shmcomm import engine

    engine.start()


def generation():
    """How many times this process has initialised; part of every segment name."""
    return _state.generation


_shutdown_hooks = []  # run before the communicator closes (process sets close theirs)


def on_shutdown(hook):
    _shutdown_hooks.append(hook)


def shutdown():
    """Leaves the job. Never blocks on other ranks; init() may be called again afterwards."""
    from shmcomm import engine

    engine.stop()  # first: it may be running collectives on the communicators closed below
    for hook in list(_shutdown_hooks):
        hook()
    with _state.lock:
        comm, _state.comm = _state.comm, None
    if comm is not None:
        comm.close()


atexit.register(shutdown)


def is_initialized():
    return _state.comm is not None


def communicator():
    comm = _state.comm
    if comm is None:
        raise NotInitializedError(_NOT_INITIALIZED)
    return comm


def rank():
    return communicator().topology.rank


def size():
    return communicator().topology.size


def local_rank():
    return communicator().topology.local_rank


def local_size():
    return communicator().topology.local_size


def cross_rank():
    return communicator().topology.cross_rank


def cross_size():
    return communicator().topology.cross_size
