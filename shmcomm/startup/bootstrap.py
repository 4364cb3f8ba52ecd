# SPDX-License-Identifier: Apache-2.0
"""Builds the world communicator for the kind of job this process is in, from transports and algorithms.

- one host, the usual case: the host's shared-memory transport under algorithms.host.HostComm, and no MPI imported;
- one host with SHMCOMM_TORUS_GRID=XxY: the torus's rows and columns both on shared memory, to exercise it on one host;
- several hosts (launched by mpiexec, shmcommrun -H, srun): each host's shared memory for the rows, MPI for the
  columns and for the collectives that are not allreduce;
- several hosts without MPI (an elastic membership, which MPI could not shrink or grow, or ranks met through torch's
  store: startup/membership.py, rendezvous.py): each host's shared memory under a TCP mesh (transport/tcp.py)."""
import threading
import time

from shmcomm import _native, env
from shmcomm.startup import failure_reports, membership, rendezvous, topology
from shmcomm.algorithms.host import HostComm
from shmcomm.vocabulary.exceptions import RankFailure, TimeoutError
from shmcomm.startup.addresses import interface_addresses, listen_address
from shmcomm.startup.notices import LauncherNotices
from shmcomm.smb.rollcall import exit_without_finalize
from shmcomm.transport.shm import SharedMemory

# A RankFailure names the cause the failed rank saved (the loader of the core stays below start-up).
_native.explain_rank_failure = failure_reports.with_cause


def build_world(generation):
    env.job_secret()  # out of the environment, whichever path needs it: no child process inherits it
    if env.launched_by_mpi():
        return _across_hosts(generation)
    if membership.spans_hosts():
        return _mesh_across_hosts(generation, membership.joined(), membership.listener(), membership.superseded)
    if rendezvous.spans_hosts():
        return _mesh_across_hosts(generation, rendezvous.joined(), rendezvous.listener(), lambda: None)
    topo = env.topology()
    tuning = env.tuning(topo.local_size)
    if env.grid(topo.size) is None:  # the other path settings choose among cross-host paths: not read here
        return HostComm(_shm(topo, tuning, generation, arena=True))
    return _logical_grid(topo, tuning, generation, env.paths(topo.size))


def process_set(world, ranks, set_id, generation):
    """The communicator of a process set's members: a segment of their own among this host's ranks; for a set that
    spans hosts (why_no_sets_across_hosts), the world's transport across hosts for its members too (an MPI
    communicator, or TCP connections of their own), under the world's algorithms without a torus."""
    from dataclasses import replace

    groups = [g for g in ([r for r in group if r in ranks] for group in world.host_groups) if g]
    here = next(g for g in groups if world.topology.rank in g)
    # Each host's members meet in a segment of their own (hosts may share /dev/shm: simulated or pretend hosts).
    suffix = "_s%d" % set_id if len(groups) == 1 else "_s%d_h%d" % (set_id, groups.index(here))
    host = HostComm(_shm(world.topology, world.tuning, generation, ranks=here, suffix=suffix))
    if len(groups) == 1:
        return host
    from shmcomm.algorithms.world import WorldComm

    what = "process set %d across hosts" % set_id
    opened = [host]
    try:  # whatever fails, what was made so far goes
        if world.across.carrier == "mpi":  # MPI's waits have no deadline of their own
            across = _within(world.tuning.timeout_s, what, world.notices, world.across.subset, ranks, set_id, what)
        else:
            across = world.across.subset(ranks, set_id, what)
        opened.append(across)
        paths = env.paths(world.size)
        paths = replace(paths, grid=None, algorithm="auto" if paths.algorithm == "torus" else paths.algorithm)
        comm = WorldComm(world.topology, world.tuning, host, None, paths, across=across, host_groups=groups,
                         ranks=ranks)
    except BaseException as error:
        if not getattr(error, "thread_stuck", False):  # else that thread may still use the segment: left as is
            for transport in opened:
                transport.close()
        raise
    comm.closables.append(across)
    comm.roll_call = world.roll_call  # a timeout names the ranks holding the set up
    return comm


def why_no_sets_across_hosts(world):
    """None where a process set may span this world's hosts (a world that met without MPI, or an MPI job whose MPI
    takes calls from several threads at once), else why not, in words."""
    across = getattr(world, "across", None)
    if across is None:
        return "this world has no transport across hosts"
    if across.carrier == "mpi" and not across.threads_multiple:
        return "MPI runs serialized (HOROVOD_MPI_THREADS_DISABLE), and such a set's MPI calls may come from threads"
    return None


def _shm(topo, tuning, generation, **where):
    """In an elastic job every shared-memory init watches membership's abandon word: a world that a newer membership
    replaces while it forms is given up at once (AbandonedError), not waited for until SHMCOMM_START_TIMEOUT."""
    return SharedMemory(topo, tuning, generation, abandon=membership.abandon_word(), **where)


def _logical_grid(topo, tuning, generation, paths):
    from shmcomm.algorithms.torus2d import ShmColumn, Torus
    from shmcomm.algorithms.world import WorldComm

    x, y = paths.grid
    row_index, column_index = topo.rank // x, topo.rank % x
    opened = []
    try:  # whatever fails, the segments opened so far are left
        host = HostComm(_shm(topo, tuning, generation, arena=True))
        opened.append(host)
        row = _shm(topo, tuning, generation, ranks=[row_index * x + i for i in range(x)],
                           suffix="_r%d" % row_index)
        opened.append(row)
        column = _shm(topo, tuning, generation, ranks=[j * x + column_index for j in range(y)],
                              suffix="_c%d" % column_index)
        opened.append(column)
        world = WorldComm(topo, tuning, host, Torus(row, ShmColumn(column), paths.torus_small_bytes,
                                                    world_rank=topo.rank), paths)
    except BaseException:
        for transport in opened:
            transport.close()
        raise
    world.closables = [row, column]
    return world


def _across_hosts(generation):
    from shmcomm.transport.mpi import choose_thread_level

    choose_thread_level(env.mpi_threads_disabled())
    # Which rank failed, while MPI cannot say; later, why a rank failed, where its saved report is on another host.
    notices = LauncherNotices(env.launcher_notices(), failure_reports.heard, env.job_secret())
    try:
        topo, ctx = _within(env.tuning(1).start_timeout_s, "MPI's start across hosts", notices, _start_mpi)
        tuning = env.tuning(topo.local_size)
        shm = SharedMemory(topo, tuning, generation, ranks=ctx.host_ranks, suffix="_h%d" % ctx.host_index,
                           arena=True)
        try:
            if ctx.hosts == 1 and env.grid(topo.size) is None:
                shm.ranks = list(range(topo.size))  # one host: the host communicator is the world
                world = HostComm(shm)
            else:
                paths = env.paths(topo.size)
                if paths.grid is not None and (paths.grid[0] != topo.local_size or not ctx.homogeneous):
                    raise ValueError("SHMCOMM_TORUS_GRID=%s: across hosts a row must be one host's %d ranks"
                                     % (paths.grid_text, topo.local_size))
                world = _within(tuning.start_timeout_s, "init across hosts", notices, _world_across_hosts,
                                topo, ctx, tuning, shm, paths)
        except BaseException as error:
            if not getattr(error, "thread_stuck", False):  # else that thread may still use the segment: left as is
                shm.close()
            raise
    except BaseException:
        notices.close()
        raise
    world.closables.append(notices)
    world.notices = notices  # process sets across hosts are made within their deadline, as MPI's start is
    return world


def _mesh_across_hosts(generation, record, listener, superseded):
    """The world of ranks on several hosts that met without MPI (`record`: their hosts and listening addresses by
    rank, and the world's token): this host's ranks meet in shared memory, every rank reaches every other over TCP
    (no torus: the cross-host collectives are the TCP transport's own). `superseded()` says why the world will not
    form, while it forms."""
    from shmcomm.algorithms.world import WorldComm
    from shmcomm.transport.tcp import Tcp
    from shmcomm.transport.tcp_connect import SetDoor, connect_mesh

    topo = env.topology()
    tuning = env.tuning(topo.local_size)
    paths = env.paths(topo.size)
    if paths.grid is not None:
        raise ValueError("SHMCOMM_TORUS_GRID=%s: a job across hosts without MPI has no torus" % paths.grid_text)
    hosts = record["hosts"]
    groups = [[r for r in range(topo.size) if hosts[r] == h] for h in dict.fromkeys(hosts)]
    shm = _shm(topo, tuning, generation, ranks=groups[topo.cross_rank], suffix="_h%d" % topo.cross_rank, arena=True)
    mesh = None
    try:
        sockets = connect_mesh(listener, record["addresses"], topo.rank, record["token"], env.job_secret(),
                               tuning.start_timeout_s, superseded)
        door = SetDoor(listener, record["addresses"], record["token"], env.job_secret())
        mesh = Tcp(sockets, topo.rank, range(topo.size), hosts, tuning.timeout_s, door=door)
        world = WorldComm(topo, tuning, HostComm(shm), None, paths, across=mesh, host_groups=groups)
    except BaseException:
        shm.close()
        if mesh is not None:
            mesh.close()
        raise
    world.closables += [mesh, mesh.door]
    return world


def _start_mpi():
    topo, ctx = topology.from_mpi()
    _require_same_settings(ctx.world)
    return topo, ctx


def _world_across_hosts(topo, ctx, tuning, shm, paths):
    from shmcomm.algorithms.torus2d import MpiColumn, Torus
    from shmcomm.algorithms.world import WorldComm
    from shmcomm.transport.mpi import Mpi
    from shmcomm.smb.rollcall import RollCall

    # The column gives up a little before the host's own waits do, so that the rest of the host hears why.
    column = Mpi(ctx.cross, 0.8 * tuning.timeout_s, "torus column") if ctx.homogeneous else None
    torus = Torus(shm, MpiColumn(column, paths.torus_small_bytes), paths.torus_small_bytes,
                  world_rank=topo.rank) if column is not None else None
    every = ctx.world.allgather(ctx.host_ranks)  # each rank's host's ranks: a host once per rank of it
    across = Mpi(ctx.world, tuning.timeout_s)
    if across.threads_multiple:
        across.groups = ctx.world.Dup()
    world = WorldComm(topo, tuning, HostComm(shm), torus, paths, across=across,
                      host_groups=[list(g) for g in dict.fromkeys(tuple(g) for g in every)])
    world.box_network = _box_network(ctx, topo, tuning, shm)
    world.closables.append(world.box_network)
    # Names the ranks that hold the job up when a wait across hosts times out or a box's home host fails.
    world.roll_call = world.box_network.roll_call = RollCall(world.box_network, topo.rank)
    exit_without_finalize(world.roll_call.why_not_finalize)
    return world


_STOP_NOTICE_S = 2.5  # how long after a rank stopped its guard says so (runner/rank_guard.py), and a margin


def _within(timeout_s, what, notices, fn, *args):
    """fn(*args), in a thread, within timeout_s: MPI's start and its first collectives have no deadline of their own,
    and wait for ever for a rank that is stopped, hung or never starts. The launcher's `notices` name that rank:
    RankFailure as soon as one died, or a TimeoutError naming the stopped one. Either way the thread is left in MPI,
    and the process will exit without MPI_Finalize."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn(*args)
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="shmcomm-start", daemon=True)
    thread.start()
    started = time.monotonic()
    deadline = started + timeout_s
    while thread.is_alive() and notices.failed is None and time.monotonic() < deadline:
        thread.join(min(0.1, max(0.0, deadline - time.monotonic())))
    # A guard reports its rank stopped after 2 s of it: one stopped just now is named if the wait goes on that long.
    deadline += _STOP_NOTICE_S if notices.listening else 0.0
    while thread.is_alive() and notices.failed is None and notices.stopped is None and time.monotonic() < deadline:
        thread.join(min(0.1, max(0.0, deadline - time.monotonic())))
    if thread.is_alive():
        error = _held_up(what, time.monotonic() - started, notices)
        exit_without_finalize(lambda: str(error))
        error.thread_stuck = True
        raise error
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _held_up(what, waited_s, notices):
    """The error for a start that is not done: the rank that the launcher's notices say holds it up."""
    if notices.stopped is not None:  # it holds up everyone: a rank that failed meanwhile gave up waiting for it
        failed = ", and %s meanwhile" % notices.failed[1] if notices.failed is not None else ""
        return TimeoutError("%s: not done after %.0f s: %s%s (the launcher says)" % (what, waited_s, notices.stopped[1],
                                                                                     failed))
    if notices.failed is not None:
        rank, text = notices.failed
        return RankFailure("%s: %s (the launcher says), and MPI cannot go on without it" % (what, text), rank)
    return TimeoutError("%s: not done after %.0f s (SHMCOMM_START_TIMEOUT): a rank of the job is stopped, hung or did "
                        "not start (MPI cannot say which; shmcommrun names a stopped rank)" % (what, waited_s))


def _box_network(ctx, topo, tuning, shm):
    """Every rank serves its host's boxes to the other hosts (smb/server.py), on the address of its host that
    routes to them, to the ranks that prove they hold the job's secret; where each server listens is exchanged here,
    once, over MPI."""
    import socket

    from shmcomm.smb.client import BoxNetwork
    from shmcomm.smb.server import BoxServer

    reachable = [a for a in interface_addresses() if not a.startswith("127.")]
    every = ctx.world.allgather((ctx.host_index, reachable, env.job_secret() is not None))
    others = {host: addresses for host, addresses, _ in every if host != ctx.host_index}
    secret = _agreed_secret(ctx.world, [rank for rank, e in enumerate(every) if e[2]])
    server = BoxServer(shm, tuning.timeout_s, secret, listen_address(list(others.values())), reachable)
    try:
        every = ctx.world.allgather((ctx.host_index, topo.local_rank, server.address, socket.gethostname()))
    except BaseException:
        server.close()
        raise
    servers = [[None] * n for n in (sum(1 for e in every if e[0] == h) for h in range(ctx.hosts))]
    names, ranks = [None] * ctx.hosts, [[] for _ in range(ctx.hosts)]
    for rank, (host, local_rank, address, name) in enumerate(every):
        servers[host][local_rank] = address
        names[host] = name
        ranks[host].append(rank)
    return BoxNetwork(server, ctx.host_index, topo.local_rank, servers, names, ranks, tuning.timeout_s, secret)


def _agreed_secret(world, holding):
    """The job's secret: every rank's SHMCOMM_SECRET (shmcommrun's), or, where no rank has one (mpiexec run by
    hand), one that rank 0 makes and sends over MPI. `holding`: the ranks that have one; some but not all is a
    mismatch every rank raises alike."""
    if len(holding) == world.size:
        return env.job_secret()
    if holding:
        missing = sorted(set(range(world.size)) - set(holding))
        raise ValueError("%s is set on rank(s) %s but not on rank(s) %s: every rank of a job needs the same one "
                         "(shmcommrun sets it), or none" % (env.SECRET, _listed(holding), _listed(missing)))
    return bytes.fromhex(world.bcast(env.new_secret() if world.rank == 0 else None, root=0))


def _listed(ranks):
    return ", ".join(map(str, ranks))


def _require_same_settings(mpi):
    """Every rank must set the path settings alike; compared as they are set, before anything parses them, so that
    one rank's bad value fails every rank alike."""
    names = ["%s%s" % (prefix, name) for name in env.PATH_SETTINGS for prefix in ("SHMCOMM_", "HOROVOD_")]
    mine = env.path_settings_as_set()
    every = mpi.allgather(mine)
    if any(e != mine for e in every):
        differ = "; ".join("rank %d: %s" % (r, ", ".join("%s=%s" % (n, v) for n, v in zip(names, e) if v))
                           for r, e in enumerate(every) if r == 0 or e != every[0])
        raise ValueError("%s (or their HOROVOD_ names) must be the same on every rank (%s)"
                         % (", ".join("SHMCOMM_" + n for n in env.PATH_SETTINGS), differ))
