# SPDX-License-Identifier: Apache-2.0
"""A training step's communication under the engine's settings, from the alpha-beta model: the autotuner's prior.

The engine gathers a step's gradients into negotiation rounds (a round closes once `bucket` bytes are queued),
packs each round's tensors, in order, into fused allreduces of at most `fusion` bytes, and waits on average half a
cycle per round for the others (an engine whose peers are not ready sleeps out its cycle). Each fused allreduce
costs what model.cost_terms says for the path the library takes at that size (the torus's small-message path up to
`small_bytes`, else the torus on the hosts' grid), with the links fitted (calibrate.py) to allreduces timed on the
machine at run time. Overlap with computation is left out: the autotuner's measurements correct for it."""
from shmcomm.sim.calibrate import calibrate
from shmcomm.sim.model import LinkModel, Machine, cost_terms


class StepModel:
    """timings: [(bytes, seconds)] of single allreduces on this job's ranks; sizes: the bytes of a step's tensors in
    the order they are reduced; start: the settings ({fusion, bucket, cycle ms}) step_seconds was measured under. The
    step's computation is what the measured step time leaves over at the starting settings."""

    def __init__(self, ranks, local, small_bytes, cycle_weight, timings, sizes, step_seconds, start):
        if not sizes:
            raise ValueError("no allreduce was seen during the warm-up")
        self.small_bytes = small_bytes
        self.hosts = ranks // local
        self.local = local
        guess = Machine(ranks, local, LinkModel(1e-6, 1e-10), LinkModel(1e-5, 1e-9), 1e-10)
        self.machine = calibrate([(self._label(b), b, s) for b, s in timings], guess).machine
        # Each path's time is affine in the size (within a layout): fixed and per-byte parts, computed once, since
        # the autotuner asks for thousands of settings.
        self.affine = {}
        for label in {self._label(0), self._label(small_bytes + 1)}:
            fixed = self._exact(label, 0)
            self.affine[label] = (fixed, (self._exact(label, 1 << 20) - fixed) / (1 << 20))
        self.sizes = list(sizes)
        self.step_bytes = float(sum(sizes))
        self.cycle_weight = cycle_weight
        self.compute_s = max(step_seconds - self.comm_seconds(start), 0.2 * step_seconds)

    def _label(self, nbytes):
        return "torus-small" if nbytes <= self.small_bytes else "torus %dx%d" % (self.local, self.hosts)

    def _exact(self, label, nbytes):
        return float(cost_terms(label, self.machine, nbytes)[0] @ self.machine.parameters)

    def allreduce_seconds(self, nbytes):
        fixed, per_byte = self.affine[self._label(nbytes)]
        return fixed + per_byte * nbytes

    def comm_seconds(self, settings):
        """Predicted communication seconds of one step."""
        fusion, bucket = max(int(settings["fusion"]), 1), max(int(settings["bucket"]), 1)
        rounds, current, queued = [], [], 0
        for size in self.sizes:
            current.append(size)
            queued += size
            if queued >= bucket:
                rounds.append(current)
                current, queued = [], 0
        if current:
            rounds.append(current)
        seconds = 0.0
        for sizes in rounds:
            # the negotiation: an allgather of a few bytes per tensor, then the fused allreduces
            seconds += self.allreduce_seconds(16 * len(sizes)) + self.cycle_weight * settings["cycle"] / 1000.0
            used = 0
            for size in sizes:
                if used and used + size > fusion:
                    seconds += self.allreduce_seconds(used)
                    used = 0
                used += size
            seconds += self.allreduce_seconds(used)
        return seconds

    def score(self, settings):
        """Predicted bytes reduced per second, the autotuner's score."""
        return self.step_bytes / (self.compute_s + self.comm_seconds(settings))
