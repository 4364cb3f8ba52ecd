# SPDX-License-Identifier: Apache-2.0
"""Bayesian optimisation for the autotuner: a Gaussian process over the unit cube and expected improvement.

The process models the scores (after subtracting a prior mean, which is a constant or the cost model's prediction)
with a squared-exponential kernel on standardised values, plus `noise` on the diagonal: Horovod's regularisation
for noisy samples, in [0, 1]. The next point is the candidate of greatest expected improvement over the best score
seen, among random points and small steps around the best ones. Numpy only; a few dozen samples at most."""
import math

import numpy as np

_LENGTH_SCALE = 0.3  # of the unit cube: a setting tells about its neighbours within about a third of the range
_CANDIDATES = 1000


class GaussianProcess:
    def __init__(self, noise):
        self.noise = max(float(noise), 1e-6)

    def _kernel(self, a, b):
        distances = ((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=2)
        return np.exp(-0.5 * distances / _LENGTH_SCALE ** 2)

    def fit(self, points, values):
        self.points = np.asarray(points, dtype=float)
        values = np.asarray(values, dtype=float)
        self.mean = values.mean()
        self.scale = values.std() or 1.0
        kernel = self._kernel(self.points, self.points) + self.noise * np.eye(len(values))
        self.factor = np.linalg.cholesky(kernel)
        self.weights = np.linalg.solve(self.factor.T, np.linalg.solve(self.factor, (values - self.mean) / self.scale))
        return self

    def predict(self, points):
        """(mean, standard deviation) at each point, in the units of the values."""
        cross = self._kernel(np.asarray(points, dtype=float), self.points)
        mean = cross @ self.weights
        solved = np.linalg.solve(self.factor, cross.T)
        variance = np.maximum(1.0 - (solved ** 2).sum(axis=0), 1e-12)
        return self.mean + self.scale * mean, self.scale * np.sqrt(variance)


_erf = np.vectorize(math.erf)


def expected_improvement(mean, deviation, best, margin=0.0):
    """E[max(score - best - margin, 0)] under a normal belief about the score."""
    z = (mean - best - margin) / deviation
    cdf = 0.5 * (1.0 + _erf(z / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return (mean - best - margin) * cdf + deviation * pdf


def next_point(points, scores, prior, noise, rng):
    """The point of the unit cube to sample next: points and scores so far, prior(points) -> prior mean scores."""
    points = np.asarray(points, dtype=float)
    scores = np.asarray(scores, dtype=float)
    gp = GaussianProcess(noise).fit(points, scores - prior(points))
    best = points[np.argsort(scores)[-3:]]
    candidates = np.vstack([rng.random((_CANDIDATES, points.shape[1])),
                            np.clip(best[rng.integers(len(best), size=_CANDIDATES // 4)]
                                    + rng.normal(0, 0.08, (_CANDIDATES // 4, points.shape[1])), 0, 1)])
    mean, deviation = gp.predict(candidates)
    mean = mean + prior(candidates)
    gain = expected_improvement(mean, deviation, scores.max(), margin=0.01 * abs(scores.max()))
    return candidates[int(np.argmax(gain))]


def best_point(points, scores, prior, noise):
    """The sampled point the process believes best: noisy scores make the single highest one a poor guess."""
    points = np.asarray(points, dtype=float)
    scores = np.asarray(scores, dtype=float)
    gp = GaussianProcess(noise).fit(points, scores - prior(points))
    believed = gp.predict(points)[0] + prior(points)
    return int(np.argmax(believed))
