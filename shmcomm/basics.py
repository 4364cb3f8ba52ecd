# SPDX-License-Identifier: Apache-2.0
"""init/shutdown and the questions about where this process sits in the job."""
import atexit

from shmcomm.startup import bootstrap, failure_reports, log, membership, session
from shmcomm import engine, env, process_sets
from shmcomm.vocabulary.exceptions import AbandonedError


def init(engine=None):
    """Joins the job described by the launcher's environment (a world of one without it). Idempotent.

    Every setting is read and checked here, so that a bad value fails at once, naming the variable.

    Args:
        engine: True starts the background engine now, on every rank, as Horovod does (shmcomm.torch.init() passes
            it). Without it, blocking calls go straight to the shared memory (the lowest latency) and the engine starts
            with the first asynchronous call, which every rank makes at the same point of the program. join() needs the
            engine from the start, since the ranks that call it and the ones that go on differ. SHMCOMM_ENGINE=1 sets
            the default, and so does a timeline (SHMCOMM_TIMELINE): the engine records what it runs, so every
            collective goes through it.

    Raises:
        ValueError: a setting's value is refused (the message names the variable).
        TimeoutError: a rank did not come within SHMCOMM_START_TIMEOUT (the error names it).
        MembershipError: in an elastic job, the launcher gave up or no membership came in time.
    """
    env.validate()
    if engine is None:
        engine = env.engine_requested() or env.timeline()[0] is not None
    state = session.state
    with state.lock:
        if state.comm is None:
            log.configure(env.log_level(), env.log_with_time())
            if env.elastic_driver():  # an elastic job: this world's identity comes from the launcher's membership
                state.generation = 0  # each membership has a token of its own: every member counts from 0
                state.comm = _newest_elastic_world()
            else:
                state.comm = bootstrap.build_world(state.generation)
            state.generation += 1
            log.joined(state.comm)
            if env.error_report_dir() and not env.launched_by_mpi():  # MPI's ranks have a hook that aborts the job
                failure_reports.report_uncaught_exceptions(state.comm.topology.rank, _mark_failed)
    session.changed()
    if engine:
        start_engine()


def _mark_failed():
    """This rank dies of an uncaught exception: its peers are to say that it failed (Communicator.mark_failed)."""
    comm = session.state.comm
    if comm is not None:
        comm.mark_failed()


def _newest_elastic_world():
    """Joins the launcher's newest membership and forms its world; when a newer one replaces it while it forms (a
    worker died or came meanwhile: the others went on to the newer one), joins that one instead. Ends with a
    MembershipError when the launcher gives up or no membership comes within SHMCOMM_ELASTIC_TIMEOUT."""
    while True:
        membership.join()
        try:
            return bootstrap.build_world(0)
        except AbandonedError as error:
            log.logger.info("%s: joining the newer membership", error)


def start_engine():
    """The running engine, started on the world communicator if needed (needs init())."""
    return engine.start(session.communicator(), process_sets.communicator_of)


def shutdown():
    """Leaves the job. Never blocks on other ranks beyond the collectives already started (shmcomm.jax's in flight,
    each bounded by SHMCOMM_TIMEOUT); init() may be called again afterwards."""
    if session.state.comm is not None:
        session.closing()
    engine.stop()  # first: it may be running collectives on the communicators closed below
    process_sets.close_all()
    state = session.state
    with state.lock:
        comm, state.comm = state.comm, None
    session.changed()  # before the close: nothing may point at the segment any longer
    if comm is not None:
        comm.close()


atexit.register(shutdown)

is_initialized = session.is_initialized
communicator = session.communicator
current = session.current
generation = session.generation


def _topology_question(field, doc):
    def question():
        return getattr(session.current().topology, field)
    question.__name__ = question.__qualname__ = field
    question.__doc__ = doc + "\n\nReturns:\n    An int.\n\nRaises:\n    NotInitializedError: before init()."
    return question


rank = _topology_question("rank", "This process's rank in the job.")
size = _topology_question("size", "The number of ranks in the job.")
local_rank = _topology_question("local_rank", "This process's rank among the ranks of its host.")
local_size = _topology_question("local_size", "The number of ranks on this host.")
cross_rank = _topology_question("cross_rank", "This host's index among the hosts.")
cross_size = _topology_question("cross_size", "The number of hosts.")
