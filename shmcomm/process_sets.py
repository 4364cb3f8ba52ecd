# SPDX-License-Identifier: Apache-2.0
"""Process sets: collectives over a subset of the ranks (Horovod's ProcessSet).

add_process_set is called by every rank, in the same order on all of them, so every rank numbers the sets alike;
the members then meet in a segment of their own. Non-members keep the id but hold no communicator."""
import threading
import zlib

from shmcomm.startup import bootstrap, session
from shmcomm.vocabulary.exceptions import InvalidArgumentError, NotSupportedError

_lock = threading.Lock()
_registry = {}  # id -> ProcessSet
_next_id = [1]
_MEMBERS_ONLY_IDS = 1 << 30  # members_only's ids lie in [2**30, 2**31)


class ProcessSet:
    """A set of global ranks that collectives may run on alone (Horovod's ProcessSet).

    Register it with add_process_set() on every rank, then pass it as any collective's `process_set`; only its members
    call those collectives.

    Args:
        ranks: the global ranks of the set (any order; repeats are dropped).

    Example:
        `evens = shmcomm.add_process_set([0, 2])`; then on ranks 0 and 2, `shmcomm.allreduce(x, process_set=evens)`.
    """

    def __init__(self, ranks):
        self.ranks = sorted({int(r) for r in ranks})
        self.process_set_id = None
        self._comm = None

    def size(self):
        """The number of ranks in the set.

        Returns:
            An int: the set's ranks, or every rank for the global set.
        """
        return len(self.ranks) if self.process_set_id != 0 else session.current().topology.size

    def rank(self):
        """This rank's index within the set.

        Returns:
            An int, or -1 when this rank is not a member.
        """
        if self.process_set_id == 0:
            return _my_rank()
        me = _my_rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self):
        """Whether this rank is a member of the set.

        Returns:
            True for a member (every rank is one of the global set).
        """
        return self.process_set_id == 0 or _my_rank() in self.ranks

    def communicator(self):
        """The communicator the set's collectives run on, on this rank.

        Returns:
            The set's communicator (what the collectives hand their calls to).

        Raises:
            InvalidArgumentError: the set was never added (add_process_set), or this rank is not a member.
        """
        if self.process_set_id is None:
            raise InvalidArgumentError("process set %s was never added (add_process_set)" % self.ranks)
        if self._comm is None:
            raise InvalidArgumentError("rank %d is not in process set %d %s" % (_my_rank(), self.process_set_id,
                                                                               self.ranks))
        return self._comm

    def __repr__(self):
        return "ProcessSet(process_set_id=%s, ranks=%s)" % (self.process_set_id,
                                                             "all" if self.process_set_id == 0 else self.ranks)


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def add_process_set(process_set):
    """Registers a set; every rank calls it, in the same order, so that every rank numbers the sets
    alike. The members then meet in a segment of their own.

    Args:
        process_set: a ProcessSet, or a list of global ranks.

    Returns:
        The registered ProcessSet (with its `process_set_id`).

    Raises:
        InvalidArgumentError: the ranks are empty or out of range, or a set of the same ranks exists already.
        NotSupportedError: the ranks are on more than one host of an MPI job whose MPI runs serialized
            (HOROVOD_MPI_THREADS_DISABLE; every rank raises it alike).
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    comm = session.communicator()
    if not ps.ranks or any(r < 0 or r >= comm.size for r in ps.ranks):
        raise InvalidArgumentError("process set ranks %s must be a non-empty subset of 0..%d" % (ps.ranks,
                                                                                             comm.size - 1))
    _refuse_across_hosts(comm, ps.ranks)
    with _lock:
        for other in _registry.values():
            if other.ranks == ps.ranks and other.process_set_id < _MEMBERS_ONLY_IDS:
                raise InvalidArgumentError("a process set with ranks %s exists already (id %d)"
                                           % (ps.ranks, other.process_set_id))
        ps.process_set_id = _next_id[0]
        _next_id[0] += 1
        _registry[ps.process_set_id] = ps
    if comm.topology.rank in ps.ranks:
        ps._comm = bootstrap.process_set(comm, ps.ranks, ps.process_set_id, session.generation())
    return ps


def members_only(ranks, key):
    """A set that only its members create, in any order among sets (torch.distributed's groups: non-members never
    hear of them). Its id comes from `key`, a text every member derives alike, in a range add_process_set() never
    reaches, so that the members' segment names agree without the other ranks.

    Args:
        ranks: the set's global ranks; this rank must be one of them.
        key: the same text on every member, naming this set among the job's members-only sets.

    Returns:
        The registered ProcessSet, with this rank's communicator.

    Raises:
        InvalidArgumentError: the ranks are out of range or do not include this rank, or the key names a set of other
            ranks already.
        NotSupportedError: the ranks are on more than one host of an MPI job whose MPI runs serialized.
    """
    ps = ProcessSet(ranks)
    comm = session.communicator()
    if not ps.ranks or any(r < 0 or r >= comm.size for r in ps.ranks) or comm.topology.rank not in ps.ranks:
        raise InvalidArgumentError("a members-only process set %s must hold rank %d, within 0..%d"
                                   % (ps.ranks, comm.topology.rank, comm.size - 1))
    _refuse_across_hosts(comm, ps.ranks)
    ps.process_set_id = _MEMBERS_ONLY_IDS + zlib.crc32(key.encode()) % _MEMBERS_ONLY_IDS
    with _lock:
        other = _registry.get(ps.process_set_id)
        if other is not None:
            raise InvalidArgumentError("process set key %r names set %d of ranks %s already"
                                       % (key, ps.process_set_id, other.ranks))
        _registry[ps.process_set_id] = ps
    try:
        ps._comm = bootstrap.process_set(comm, ps.ranks, ps.process_set_id, session.generation())
    except BaseException:
        with _lock:
            _registry.pop(ps.process_set_id, None)
        raise
    return ps


def remove_process_set(process_set):
    """Unregisters a set and closes its communicator; every rank calls it.

    Args:
        process_set: a set add_process_set() returned.

    Raises:
        InvalidArgumentError: it is the global set, which cannot be removed.
    """
    if process_set.process_set_id in (None, 0):
        raise InvalidArgumentError("the global process set cannot be removed")
    with _lock:
        _registry.pop(process_set.process_set_id, None)
    if process_set._comm is not None:
        process_set._comm.close()
        process_set._comm = None
    process_set.process_set_id = None


def communicator_of(set_id):
    """This rank's communicator of a registered set (the engine runs a fused group of the set on it)."""
    ps = _registry.get(set_id)
    if ps is None:
        raise InvalidArgumentError("process set %d is not registered on rank %d" % (set_id, _my_rank()))
    return ps.communicator()


def registered():
    """The sets add_process_set() registered (not the global one, nor members-only sets), in the order they were
    added."""
    with _lock:
        return [_registry[i] for i in sorted(_registry) if i < _MEMBERS_ONLY_IDS]


def close_all():
    """At shutdown: every set's communicator closes and the numbering starts again."""
    with _lock:
        sets = list(_registry.values())
        _registry.clear()
        _next_id[0] = 1
    for ps in sets:
        if ps._comm is not None:
            ps._comm.close()
            ps._comm = None
        ps.process_set_id = None


def _refuse_across_hosts(comm, ranks):
    """NotSupportedError, alike on every rank, where `ranks` span hosts that cannot hold such a set
    (bootstrap.why_no_sets_across_hosts)."""
    on_hosts = [sorted(set(group) & set(ranks)) for group in comm.host_groups if set(group) & set(ranks)]
    why = bootstrap.why_no_sets_across_hosts(comm) if len(on_hosts) > 1 else None
    if why:
        raise NotSupportedError("process set %s spans hosts (ranks %s), but %s" % (ranks, " | ".join(map(str, on_hosts)),
                                                                                   why))


def _my_rank():
    return session.current().topology.rank
