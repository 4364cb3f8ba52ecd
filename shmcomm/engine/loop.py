# SPDX-License-Identifier: Apache-2.0
"""The engine's background thread.

Why a thread: a request must not run until every rank has submitted it, ranks submit in their own order (gradient
hooks fire as backward reaches each parameter), and the caller must get control back at once. So callers only queue
requests; this thread, once per cycle (SHMCOMM_CYCLE_TIME ms, default 1), publishes what is pending, agrees with the
other ranks on what is ready everywhere (negotiate.py), runs it in the agreed order, fusing small allreduces
(fusion.py), and completes the handles. Shutdown travels in the same messages, as does join()."""
import collections
import functools
import itertools
import logging
import os
import threading
import time

from shmcomm import env
from shmcomm.startup import failure_reports
from shmcomm.engine import autotune, fusion, timeline
from shmcomm.engine.negotiate import Negotiator, checked_signature, members_of, plan_text, refusal
from shmcomm.engine.request import Handle, execute, finish
from shmcomm.engine.stall import StallInspector
from shmcomm.vocabulary.exceptions import (BrokenCommunicatorError, InvalidArgumentError, MismatchError,
                                           PeerArgumentError, RankFailure, ShmCommError, TimeoutError)

log = logging.getLogger("shmcomm.engine")

_FATAL = (RankFailure, BrokenCommunicatorError, TimeoutError)
# The engine mostly waits for peers that are busy computing, and shares its rank's core with the training thread:
# poll briefly, then sleep. While a caller of its rank waits, yield first (Engine._waits).
_NEGOTIATION_SPIN_US = 5
_DATA_SPIN_US = 50
_CALLER_WAITS_YIELD_US = 1000
_IDLE_SLEEP_S = 0.1


class Engine:
    """Serves the communicator `comm`; communicator_of(set_id) gives a process set's (process_sets.communicator_of)."""

    def __init__(self, comm, communicator_of):
        settings = env.engine()
        self.comm = comm
        self.communicator_of = communicator_of
        self.cycle_s = settings.cycle_s
        self.fusion_threshold = settings.fusion_threshold
        self.negotiator = Negotiator(comm, settings.cache_capacity)
        self.stall = StallInspector(comm.rank, settings.stall_check_s, settings.stall_shutdown_s, settings.stall_check)
        self.timeline = timeline.started(comm.rank, *env.timeline())
        self.fusion = fusion.FusionBuffer()
        self._cond = threading.Condition()
        self._queue = []
        self._in_flight = set()   # names submitted and not completed: a second one is a caller error
        self._pending = {}        # name -> (request, signature), submitted to the negotiation
        self._join = None         # this rank's join handle while it has joined
        self._join_cycle = 0
        self._stopping = False
        self._fatal = None
        self._cycle = 0
        self._last_start = 0.0
        self._waited = False      # a caller of this rank waits for a request still pending
        self._someone_waits = True  # some rank's caller waited in the last cycle: cycle on until it is served
        self._someone_joined = False   # some rank has called join() and submits nothing: wake it for every request
        # Bucketing: queued requests wait until a caller waits for one (or polls), until SHMCOMM_BUCKET_BYTES have
        # gathered, or until the idle timer (0.1 s) fires. Gradients then travel in a few fused allreduces per step
        # instead of one negotiation per gradient, each of which would take every rank's core from its computation.
        self.bucket_bytes = settings.bucket_bytes
        self._unflushed_bytes = 0
        self._flush = False
        self._flush_waits = False  # the flush came from a caller that waits, not from a full bucket
        self._noname = collections.defaultdict(itertools.count)
        self.core = env.thread_affinity(comm.topology.local_rank)
        if self.core is not None and self.core not in os.sched_getaffinity(0):
            raise ValueError("SHMCOMM_THREAD_AFFINITY: core %d is not one this rank may run on (%s)"
                             % (self.core, sorted(os.sched_getaffinity(0))))
        self.tuner = self._autotuner(env.autotune())
        self.tuning_applied = []
        self._thread = threading.Thread(target=self._run, name="shmcomm-engine", daemon=True)
        self._thread.start()

    # ---- the callers' side ----
    def in_engine_thread(self):
        return threading.current_thread() is self._thread

    def submit(self, req, settle=False):
        """Queues a request and returns its Handle. Checks the arguments now, so bad input raises in the caller; the
        request is still negotiated, as a refusal (negotiate.refusal), so that the other ranks' requests of that
        name fail at once, naming this rank and its error. `settle`: a blocking caller's, whose error is raised
        once the other ranks have heard of it (so that it may submit the same name again at once)."""
        if req.name is None:
            # Counted per process set: only the members submit to a set, and they must all count alike.
            req.name = "%s.noname.%d" % (req.kind, next(self._noname[req.set_id]))
        if req.set_id:
            req.name = "%s[set %d]" % (req.name, req.set_id)  # each process set has a namespace of its own
        refused = None
        try:
            sig = checked_signature(req)
        except InvalidArgumentError as error:
            refused, req.buffer = error, None
            sig = refusal(req, str(error))
        handle = Handle(req)
        req.handle = handle
        with self._cond:
            if self._fatal is not None:
                # This rank's own bad argument is what its caller must fix, whatever became of the engine meanwhile
                # (a peer that raised for its own bad argument of this call and then shut down, among others).
                raise self._fatal if refused is None else refused
            if req.name in self._in_flight:
                raise ValueError("%s: a tensor of this name is already being processed; names must be unique among "
                                 "the operations in flight" % req.what)
            self._in_flight.add(req.name)
            req.submitted = time.monotonic()
            self._queue.append((req, sig))
            self._unflushed_bytes += req.buffer.nbytes if req.buffer is not None else 0
            ring = self._unflushed_bytes >= self.bucket_bytes or self._someone_joined
        handle.wake = self.flush
        if ring:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s: %s, negotiating now", req.name, "a rank has joined" if self._someone_joined else
                          "bucket full (SHMCOMM_BUCKET_BYTES=%d)" % self.bucket_bytes)
            self.flush(waiting=False)
        if self.timeline.active:
            self.timeline.begin([req.name], "NEGOTIATE_" + req.kind.upper())
        if refused is not None:
            refused.told_peers = True
            self.flush(waiting=settle)
            if settle:
                try:
                    handle.wait(self.comm.tuning.timeout_s)
                except ShmCommError:
                    pass  # the verdict on this rank's own refusal, or the engine's end: its own error says more
            raise refused
        return handle

    def flush(self, waiting=True):
        """Someone waits for a result (or a bucket is full): negotiate now. Wakes this rank's engine only (the others
        wake when their callers wait for the same request), every rank's when a rank has joined and will never wait.
        Only a waiting caller keeps the engines cycling until it is served."""
        with self._cond:
            self._flush = True
            self._flush_waits = self._flush_waits or waiting
        self.comm.ring_doorbell(everyone=self._someone_joined)

    def join(self):
        """Marks this rank as out of data; returns a handle whose result is the last rank to join."""
        handle = Handle(None)
        with self._cond:
            if self._fatal is not None:
                raise self._fatal
            self._join = handle
        self.comm.ring_doorbell(everyone=True)
        return handle

    def stop(self):
        with self._cond:
            self._stopping = True
        self.comm.ring_doorbell(everyone=True)
        if not self.in_engine_thread():
            self._thread.join(timeout=self.comm.tuning.timeout_s)
        self.timeline.stop()
        if self.tuner is not None:
            self.tuner.close()

    # ---- autotuning ----
    def _autotuner(self, settings):
        if not settings.enabled:
            return None
        from shmcomm.sim.step import StepModel

        topo = self.comm.topology
        algorithm = getattr(self.comm, "algorithm", None)  # only a communicator across hosts (or a grid) has one
        choices = []
        if algorithm is not None:
            choices = [a for a, possible in (("torus", getattr(self.comm, "torus", None) is not None),
                                             ("ring", getattr(self.comm, "across", None) is not None),
                                             ("mpi", getattr(self.comm, "across", None) is not None)) if possible]
            algorithm = "torus" if algorithm == "auto" and "torus" in choices else algorithm
        start = {"fusion": self.fusion_threshold, "cycle": self.cycle_s * 1000.0, "bucket": self.bucket_bytes,
                 "algorithm": algorithm}
        # A rank's engine sleeps out its cycle while a peer is not ready, so each round waits half a cycle on average.
        model = functools.partial(StepModel, topo.size, topo.local_size, self.comm.tuning.small_bytes, 0.5)
        return autotune.Autotuner(self.comm.rank, settings, start, choices, model)

    def _apply_tuning(self, decision):
        """Rank 0's decision, applied by every rank in the same cycle, before its plan."""
        self.tuning_applied.append((self._cycle, decision))  # the same list on every rank
        if "probe" in decision:
            timings = autotune.probe(self.comm, decision["probe"])
            self.tuner.probed(timings)
        if "fusion" in decision:
            if decision["fusion"] != self.fusion_threshold:
                self.negotiator.plans.clear()  # their fusion groups were made for the old threshold
            self.fusion_threshold = decision["fusion"]
            self.cycle_s = decision["cycle"] / 1000.0
            self.bucket_bytes = decision["bucket"]
            if decision.get("algorithm"):
                self.comm.algorithm = decision["algorithm"]
        self.tuner.applied(decision)

    # ---- the thread ----
    def _run(self):
        if self.core is not None:
            os.sched_setaffinity(0, {self.core})  # 0: this thread only
        try:
            while self._cycle_once():
                pass
        except BaseException as error:  # anything unexpected must still release the callers
            self._fail_everything(error if isinstance(error, ShmCommError) else
                                  ShmCommError("shmcomm engine failed: %r" % (error,)))

    def _wait_for_work(self, started):
        """Sleeps on the doorbell until the cycle time is up or a request is queued on any rank of the host."""
        seen = self.comm.doorbell()  # read first: a ring after this point ends the sleep at once
        with self._cond:
            idle = not self._flush and not self._stopping
        # While no caller waits, nothing needs to happen until one does, which rings the doorbell: sleep long instead
        # of negotiating half-submitted steps a thousand times a second, on the cores the training needs. Across
        # hosts the doorbell does not reach the other hosts' engines, so the cycle time stays the bound there.
        period = self.cycle_s if (self._someone_waits or not self.comm.doorbell_reaches_all) else _IDLE_SLEEP_S
        left = period - (time.monotonic() - started)
        if idle and left > 0:
            self.comm.wait_doorbell(seen, left)
        with self._cond:
            queued, self._queue = self._queue, []
            self._waited = self._waited or self._flush_waits
            self._flush, self._flush_waits, self._unflushed_bytes = False, False, 0
            return queued, self._stopping, self._join

    def _cycle_once(self):
        queued, stopping, join = self._wait_for_work(self._last_start)
        self._last_start = time.monotonic()
        for req, sig in queued:
            self._pending[req.name] = (req, sig)
        self._cycle += 1
        self.timeline.cycle()
        if join is not None and self._join_cycle == 0:
            self._join_cycle = self._cycle
        flags = {"shutdown": stopping, "join": self._join_cycle, "waits": self._waited}
        if stopping and failure_reports.own_cause() is not None:
            # A rank that dies of an exception may shut down on its way out (MPI_Abort exits through the interpreter's
            # exit handlers): its peers learn why from here, before any report of it can reach them.
            flags["cause"] = failure_reports.own_cause()
        if self.tuner is not None:
            flags["tune"] = self.tuner.outgoing()
        waits = self._waited
        self.comm.set_spin(*self._waits(waits, _NEGOTIATION_SPIN_US))
        try:
            everyone = self.negotiator.exchange([(name, sig) for name, (_, sig) in self._pending.items()], flags)
        finally:
            self.comm.set_spin(*self._waits(waits, _DATA_SPIN_US))
        leaving = [r for r, (_, f) in enumerate(everyone) if f["shutdown"]]
        if leaving:
            self._leave(leaving, everyone[leaving[0]][1].get("cause"))
            return False
        if self.tuner is not None and everyone[0][1].get("tune"):
            self._apply_tuning(everyone[0][1]["tune"])
        joined = {r: f["join"] for r, (_, f) in enumerate(everyone) if f["join"]}
        self._someone_joined = bool(joined)
        plan, waiting = self.negotiator.agree(everyone, joined)
        self._execute(plan)
        # The same on every rank: cycling while nobody waits would take the core a peer computes on.
        self._someone_waits = any(f["waits"] for _, f in everyone)
        self._waited = self._waited and bool(self._pending)
        for name, message in self.stall.check(waiting).items():
            self._complete(name, error=ShmCommError(message))
        if len(joined) == self.comm.size:
            last = max(joined, key=lambda r: (joined[r], r))
            handle, self._join, self._join_cycle = self._join, None, 0
            handle.set_result(last)
        return True

    def _waits(self, caller_waits, spin_us):
        """(spin, yield) in us for this cycle's waits: poll for at most spin_us, then sleep, to leave the core to the
        training thread. While a caller of this rank waits for a result, its thread computes nothing, and a sleep
        that ends in a wake-up costs a scheduler round trip, several times per fused allreduce: the waits then yield
        the core first, so that they catch the peer at once and still let a thread that shares the core run (polling
        instead starved those). A peer's caller that waits is no reason: this rank's may still be computing."""
        spin, yield_us = min(self.comm.tuning.spin_us, spin_us), self.comm.tuning.yield_us
        return (spin, max(yield_us, _CALLER_WAITS_YIELD_US)) if caller_waits else (spin, yield_us)

    def _leave(self, leaving, its_cause):
        """Fails every request: the ranks `leaving` shut down, the first for `its_cause` if it failed."""
        first = leaving[0]
        if self.comm.rank in leaving:
            error = ShmCommError("shmcomm has been shut down on this rank")
        else:
            why = its_cause or failure_reports.cause(first)
            error = RankFailure("rank %d failed (%s)" % (first, why) if why else
                                "rank %d has shut down; the ranks did not run the same collectives" % first, first)
        self._fail_everything(error)

    def _execute(self, plan):
        if plan.steps is None:
            plan.steps = self._steps(plan.responses)
        if plan.steps and log.isEnabledFor(logging.DEBUG):
            log.debug("cycle %d runs %s", self._cycle, plan_text(plan.steps))
        me = self.comm.topology.rank
        for kind, item in plan.steps:
            if kind == "fused":
                self._execute_allreduces(item)
            elif me not in members_of(item.sig.set_key, self.comm.size):
                continue
            elif kind == "error":
                self._complete(item.name, error=MismatchError(item.error) if item.refused_by is None else
                               PeerArgumentError(item.error, item.refused_by))
            else:
                self._run_one(item.name)

    def _steps(self, responses):
        """[("fused", fusion groups) | ("error", response) | ("one", response)] in response order. Groups come from
        the full, identical-everywhere list; a group belongs to one process set, so each rank then runs exactly the
        groups of its sets, in the same order as the other members."""
        steps, run = [], []
        for resp in responses + [None]:
            if resp is not None and resp.error is None and resp.sig.collective.kind == "allreduce":
                run.append(resp)
                continue
            if run:
                steps.append(("fused", fusion.groups(run, max(self.fusion_threshold, 1), fusion.itemsize)))
                run = []
            if resp is not None:
                steps.append(("error" if resp.error is not None else "one", resp))
        return steps

    def _run_one(self, name):
        req, _ = self._pending[name]
        self.timeline.end([name], "NEGOTIATE_" + req.kind.upper())
        self.timeline.begin([name], req.kind.upper())
        try:
            result = execute(req)
        except ShmCommError as error:
            self.timeline.end([name], req.kind.upper())
            self._complete(name, error=error)
            if isinstance(error, _FATAL):
                raise
            return
        self.timeline.end([name], req.kind.upper())
        self._complete(name, result=result)

    def _execute_allreduces(self, groups):
        me = self.comm.topology.rank
        for group in groups:
            if me not in members_of(group[0].sig.set_key, self.comm.size):
                continue
            started = time.monotonic()
            self._execute_group(group)
            if self.tuner is not None:
                itemsize = fusion.itemsize(group[0].sig.collective.dtype)
                self.tuner.record([(r.name, fusion.nbytes(r.sig, itemsize)) for r in group],
                                  time.monotonic() - started)

    def _execute_group(self, group):
        if len(group) == 1 and not group[0].joined and group[0].name in self._pending:
            self._run_one(group[0].name)
            return
        requests = {r.name: self._pending[r.name][0] for r in group if r.name in self._pending}
        self.timeline.end(list(requests), "NEGOTIATE_ALLREDUCE")
        sig = group[0].sig
        comm = self.comm if sig.set_key == 0 else self.communicator_of(sig.set_key[0])
        try:
            if fusion.on_device(group):
                results = fusion.run_device_group(group, requests, self.timeline)
            else:
                results = fusion.run_group(comm, group, requests, self.fusion, fusion.itemsize(sig.collective.dtype),
                                           self.timeline)
        except ShmCommError as error:
            self._complete_many([(name, None, error) for name in requests])
            if isinstance(error, _FATAL):
                raise
            return
        self._complete_many([(name, result, None) for name, result in results.items()])

    def _complete(self, name, result=None, error=None):
        self._complete_many([(name, result, error)])

    def _complete_many(self, outcomes):
        """[(name, result, error)]: one lock and one wake-up for a whole fused group."""
        done = []
        with self._cond:
            for name, result, error in outcomes:
                entry = self._pending.pop(name, None)
                if entry is not None:
                    self._in_flight.discard(name)
                    done.append((entry[0].handle, result, error))
        finish(done)

    def _fail_everything(self, error):
        with self._cond:
            self._fatal = error
            queued, self._queue = self._queue, []
            self._in_flight.clear()
        for req, _ in list(self._pending.values()) + queued:
            req.handle.set_error(error)
        self._pending.clear()
        if self._join is not None:
            self._join.set_error(error)
            self._join = None

