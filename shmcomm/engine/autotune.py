# SPDX-License-Identifier: Apache-2.0
"""The autotuner (HOROVOD_AUTOTUNE, `shmcommrun --autotune`): while the job trains, it searches the engine's fusion
threshold, cycle time and bucket size, and across hosts the allreduce algorithm, for the most bytes reduced per
second; settings the user set are held constant.

Only rank 0 measures and decides; its decision travels in the engine's next negotiation message, so every rank
applies it in the same cycle, before that cycle's plan (fusion groups must be identical everywhere). It writes the
CSV log (one row per sample, the best last, as Horovod's) and prints the settings chosen, as flags a user can pin."""
import csv
import logging
import math
import sys
import time

import numpy as np

from shmcomm.vocabulary import ops
from shmcomm._native import lib
from shmcomm.transport import memory
from shmcomm.engine import bayes

log = logging.getLogger("shmcomm.engine")

MB = 1 << 20
# Each free setting on a log scale over the unit interval: name -> (low, high) in its own unit.
RANGES = {"fusion": (MB / 16, 128 * MB), "cycle": (0.1, 25.0), "bucket": (MB / 16, 128 * MB)}
_SPREAD = ((0.25, 0.25, 0.25), (0.75, 0.6, 0.75), (0.5, 0.9, 0.1))  # prior "none": Horovod starts from fixed points
PROBE_BYTES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)
HEADER = ("hierarchical_allreduce", "hierarchical_allgather", "cycle_time_ms", "tensor_fusion_threshold",
          "bucket_mb", "allreduce_algo", "score")


def to_unit(name, value):
    low, high = RANGES[name]
    return (math.log(min(max(value, low), high)) - math.log(low)) / (math.log(high) - math.log(low))


def from_unit(name, u):
    low, high = RANGES[name]
    value = math.exp(math.log(low) + float(u) * (math.log(high) - math.log(low)))
    return value if name == "cycle" else int(value)


def flags_text(settings):
    """The settings as what pins them: shmcommrun flags and, for the bucket, its variable."""
    text = "--fusion-threshold-mb %.4g --cycle-time-ms %.3g SHMCOMM_BUCKET_BYTES=%d" % (
        settings["fusion"] / MB, settings["cycle"], settings["bucket"])
    return text + (" --allreduce-algo %s" % settings["algorithm"] if settings.get("algorithm") else "")


class Autotuner:
    """`start`: the engine's settings {fusion, cycle, bucket, algorithm}; `algorithms`: those the world communicator
    can switch to (empty on one host); `model`: (probe timings, step sizes, step seconds, settings) -> a
    shmcomm.sim.step.StepModel, or None.

    A sample is `steps_per_sample` training steps: from the start of one tensor's allreduce to the start of its
    allreduce that many steps later, so it spans whole steps, compute included; its score is the bytes allreduced per
    second in that time. The first `warmup_samples` are discarded. Then the search: the starting settings, a Bayesian
    optimisation (bayes.py) of the free settings on a log scale, across hosts each other algorithm once with the best
    settings found, and last the best against the starting settings in five back-to-back pairs: it replaces them
    only if it wins four of the pairs and the median.

    The prior (HOROVOD_AUTOTUNE_PRIOR / SHMCOMM_AUTOTUNE_PRIOR): `model` fits shmcomm.sim's alpha-beta model to a
    probe of a few allreduces timed on this machine and lets the Gaussian process learn only where the measurements
    differ from its predictions; `none` starts from a constant and three spread-out settings, as Horovod does."""

    def __init__(self, rank, settings, start, algorithms, model=None, clock=time.monotonic):
        self.root = rank == 0
        self.clock = clock
        self.settings = settings
        self.current = dict(start)
        self.start = dict(start)
        self.confirming = None  # the last phase: [settings] to sample, the best alternating with the start's
        self.confirm_scores = []
        self.free = [name for name in RANGES if name not in settings.pinned]
        self.algorithms = [] if "algorithm" in settings.pinned else [a for a in algorithms if a != start["algorithm"]]
        self.model_factory = model if settings.prior == "model" else None
        self.model = None
        self.rng = np.random.default_rng(0)
        self.points, self.scores, self.tried = [], [], []  # search samples; (algorithm, score) of the last phase
        self.samples = 0        # every sample taken, warm-up included
        self.default_score = None
        self.decision = None    # waiting to be sent in the next negotiation
        self.done = not (self.free or self.algorithms)
        self.waiting = False    # a decision is on its way: measurements would mix settings
        self.step_sizes = {}
        self._reset()
        self.log = None
        if self.root and settings.log_file:
            self.log = open(settings.log_file, "w", newline="")
            self.writer = csv.writer(self.log)
            self.writer.writerow(HEADER)
            self.log.flush()

    # ---- what the engine calls ----
    def outgoing(self):
        decision, self.decision = self.decision, None
        return decision

    def applied(self, decision):
        """Every rank has just applied `decision` (from rank 0)."""
        self.current.update({k: v for k, v in decision.items() if k in self.current})
        self.done = decision.get("done", self.done)
        self.waiting = False
        self._reset()

    def record(self, sizes, seconds):
        """One allreduce (of a fused group) this rank ran: [(name, bytes)], how long it took."""
        if not self.root or self.done or self.waiting:
            return
        now = self.clock()
        names = [name for name, _ in sizes]
        if self.ref is None:
            self.ref, self.started, self.seen = names[0], now - seconds, 0
        if self.ref in names:
            self.seen += 1
            if self.seen > self.settings.steps_per_sample:
                self._sample_done(self.bytes / max(now - seconds - self.started, 1e-9),
                                  (now - seconds - self.started) / self.settings.steps_per_sample)
                return
        self.bytes += sum(size for _, size in sizes)
        if self.samples < self.settings.warmup_samples:
            for name, size in sizes:
                self.step_sizes.setdefault(name, size)

    def probed(self, timings):
        """[(bytes, seconds)] of the probe every rank ran: the cost model's calibration."""
        if self.root and self.model_factory is not None:
            try:
                self.model = self.model_factory(timings, list(self.step_sizes.values()), self.step_seconds,
                                                self.current)
            except ValueError as error:
                log.warning("autotune: the cost model cannot be fitted (%s); searching without it", error)

    def close(self):
        """At shutdown: says where the search stands if it did not finish."""
        if self.root and not self.done and (self.points or self.tried):
            best = self._best_settings()[0]
            _say("autotune: stopped before the end after %d samples; best so far: %s" % (self.samples,
                                                                                        flags_text(best)))
        if self.log is not None:
            self.log.close()
            self.log = None

    # ---- the search (rank 0) ----
    def _reset(self):
        self.ref, self.started, self.seen, self.bytes = None, 0.0, 0, 0

    def _decide(self, decision):
        self.decision = decision
        self.waiting = True

    def _sample_done(self, score, step_seconds):
        self.samples += 1
        warmup = self.settings.warmup_samples
        if self.samples <= warmup:
            log.info("autotune: warming up (%d of %d samples discarded)", self.samples, warmup)
            self.step_seconds = step_seconds
            if self.samples == warmup and self.model_factory is not None:
                self._decide({"probe": PROBE_BYTES})
            else:
                self._reset()
            return
        self._write(self.current, score)
        if self.default_score is None:
            self.default_score = score
            self.step_seconds = step_seconds
        if self.confirming is not None:
            self.confirm_scores.append(score)
        elif self.free and len(self.points) < self.settings.max_samples and not self.tried:
            self.points.append([to_unit(name, self.current[name]) for name in self.free])
            self.scores.append(score)
        else:
            self.tried.append((self.current["algorithm"], score))
        self._decide(self._next())

    def _prior(self, points):
        if self.model is None:
            return np.zeros(len(points))
        return np.array([self.model.score(self._settings_at(point)) for point in points])

    def _settings_at(self, point):
        settings = dict(self.current)
        settings.update({name: from_unit(name, u) for name, u in zip(self.free, point)})
        return settings

    def _best_search_point(self):
        """(settings, measured score) of the search's best sample."""
        if not self.points:
            return dict(self.current), self.default_score or 0.0
        index = bayes.best_point(self.points, self.scores, self._prior, self.settings.noise)
        return self._settings_at(self.points[index]), self.scores[index]

    def _best_settings(self):
        best, score = self._best_search_point()
        if self.tried:
            best["algorithm"], score = max(self.tried, key=lambda tried: tried[1])
        return best, score

    def _next(self):
        count = len(self.points)
        if self.free and count < self.settings.max_samples and not self.tried:
            if self.model is not None and count == 1:
                candidates = self.rng.random((500, len(self.free)))
                point = candidates[int(np.argmax(self._prior(candidates)))]
            elif self.model is None and count <= len(_SPREAD):
                point = [_SPREAD[count - 1][RANGES_INDEX[name]] for name in self.free]
            else:
                point = bayes.next_point(self.points, self.scores, self._prior, self.settings.noise, self.rng)
            return self._settings_at(point)
        best, score = self._best_settings()
        if self.algorithms:
            if not self.tried and self.points:
                return best  # measured again on the algorithm it was found with, beside the others
            left = [a for a in [self.current["algorithm"]] + self.algorithms if a not in [t[0] for t in self.tried]]
            if left:
                best["algorithm"] = left[0]
                return best
        # One sample is noisy (other processes, the machine's drift, both of which change from run to run), and a
        # search's best among 20 noisy samples is biased upwards. So the best replaces the start only if it beats
        # it in at least CONFIRM_WINS of CONFIRM back-to-back pairs (the order inside a pair alternating, so drift
        # favours neither) and in the median: a sign test, whatever the machine's noise level. Where the start is
        # already right, the start stays.
        if self.confirming is None:
            self.candidate = best
            pairs = [[best, self.start] if i % 2 == 0 else [self.start, best] for i in range(CONFIRM)]
            self.confirming = [] if _same(best, self.start) else [s for pair in pairs for s in pair]
        if len(self.confirm_scores) < len(self.confirming):
            return dict(self.confirming[len(self.confirm_scores)])
        ratio, wins = 1.0, 0
        if self.confirming:
            candidate = [score for score, s in zip(self.confirm_scores, self.confirming) if s is self.candidate]
            start = [score for score, s in zip(self.confirm_scores, self.confirming) if s is not self.candidate]
            ratio = _median(candidate) / _median(start)
            wins = sum(c > s for c, s in zip(candidate, start))
            best, score = (self.candidate, _median(candidate)) if ratio > 1 and wins >= CONFIRM_WINS else \
                (dict(self.start), _median(start))
        best["done"] = True
        self._write(best, score)
        _say("autotune: done after %d samples (%d warm-up); chosen: %s (the search's best scored %.2fx the starting "
             "settings, median of %d samples each, ahead in %d of %d pairs%s)" % (
                 self.samples, self.settings.warmup_samples, flags_text(best), ratio, CONFIRM, wins, CONFIRM,
                 "" if best is self.candidate else ": the starting settings stay"))
        return best

    def _write(self, settings, score):
        log.info("autotune: %s -> %.4g bytes/s", flags_text(settings), score)
        if self.log is not None:
            self.writer.writerow([int(settings.get("algorithm") == "torus"), 0, "%.4g" % settings["cycle"],
                                  "%.4g" % (settings["fusion"] / MB), "%.4g" % (settings["bucket"] / MB),
                                  settings.get("algorithm") or "", "%.6g" % score])
            self.log.flush()


RANGES_INDEX = {name: index for index, name in enumerate(RANGES)}
CONFIRM = 5  # pairs of confirmation samples: the search's best and the start
CONFIRM_WINS = 4  # pairs the best must win; 5 of 5 would let one outlier veto a real gain


def probe(comm, sizes):
    """[(bytes, seconds)]: the fastest of three allreduces of each size on `comm`, run by every rank alike (the
    engine's thread, when the tuner asks)."""
    buf = np.zeros(max(sizes) // 4, dtype=np.float32)
    ptr = memory.address(buf)
    timings = []
    for nbytes in sizes:
        fastest = float("inf")
        for _ in range(3):
            started = time.monotonic()
            comm.allreduce_raw(ptr, nbytes // 4, lib.SMC_FLOAT32, ops.Sum, 1.0, 1.0, "autotune probe")
            fastest = min(fastest, time.monotonic() - started)
        timings.append((nbytes, fastest))
    return timings


def _median(values):
    return float(np.median(values))


def _same(a, b):
    return all(a.get(key) == b.get(key) for key in ("fusion", "cycle", "bucket", "algorithm"))


def _say(message):
    print("shmcomm " + message, file=sys.stderr, flush=True)
    log.info(message)
