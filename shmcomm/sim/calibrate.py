# SPDX-License-Identifier: Apache-2.0
"""Fit the model's alpha, beta (and gamma) to measured all-reduce times by least squares.

Each sample (algorithm, nbytes, seconds) gives one row: the model's coefficients for that run (model.cost_terms)
times the unknown parameters must equal the measured seconds. Rows are divided by the measured time, so the fit
minimises relative error and a 1 KiB run, which pins alpha, weighs as much as a 1 GiB run, which pins beta.
Parameters no sample depends on keep the machine's values.
"""
from typing import Iterable, List, NamedTuple, Tuple

import numpy as np

from shmcomm.sim.model import TERMS, LinkModel, Machine, cost_terms

GAMMA = TERMS.index("gamma")
# Columns scaled to unit length whose condition number exceeds this cannot be told apart from the samples.
_CONDITION_LIMIT = 1e8


class Calibration(NamedTuple):
    intra: LinkModel
    inter: LinkModel
    gamma_s_per_byte: float
    relative_errors: List[float]  # (predicted - measured) / measured, one per sample
    fitted: Tuple[str, ...]  # the TERMS the samples determined; the others kept the machine's values
    machine: Machine  # the input machine with the fitted links


def _coefficients(algorithm: str, machine: Machine, nbytes: float) -> np.ndarray:
    if algorithm.strip() == "reduce":  # a local reduction of nbytes, timed on its own: it pins gamma
        return np.array([0.0, 0.0, 0.0, 0.0, float(nbytes)])
    return cost_terms(algorithm, machine, nbytes)[0]


def _solvable(weighted: np.ndarray) -> bool:
    scaled = weighted / np.linalg.norm(weighted, axis=0)
    return weighted.shape[0] >= weighted.shape[1] and np.linalg.cond(scaled) < _CONDITION_LIMIT


def _fit_once(rows: np.ndarray, seconds: np.ndarray, start: np.ndarray, fit_gamma):
    """One weighted least-squares solve over the columns the samples use; returns parameters and fitted columns."""
    used = [term for term in range(len(TERMS)) if rows[:, term].any()]
    if fit_gamma is False or (fit_gamma is None and GAMMA in used
                              and not _solvable(rows[:, used] / seconds[:, None])):
        used = [term for term in used if term != GAMMA]  # too few or too alike samples: keep the given gamma
    fixed = [term for term in range(len(TERMS)) if term not in used]
    remaining = seconds - rows[:, fixed] @ start[fixed]
    weighted = rows[:, used] / seconds[:, None]
    if not used or not _solvable(weighted):
        raise ValueError("the samples cannot determine %s: add sizes from small (latency-bound) to large "
                         "(bandwidth-bound) and algorithms that use both links" % ", ".join(TERMS[t] for t in used))
    solution, *_ = np.linalg.lstsq(weighted, remaining / seconds, rcond=None)
    parameters = start.copy()
    parameters[used] = np.maximum(solution, 0.0)  # a negative latency or cost per byte is noise, not physics
    return parameters, used


def calibrate(samples: Iterable[Tuple[str, float, float]], machine: Machine, fit_gamma=None,
              max_iterations: int = 20) -> Calibration:
    """Fit the links of `machine` (ranks and local are the layout the samples were measured on).

    samples: (algorithm, nbytes, seconds), algorithm as model.parse_algorithm reads it ("ring", "torus 2x4", ...)
      or "reduce" for a local reduction.
    fit_gamma: None fits gamma when the samples separate it from beta, True insists, False keeps machine's gamma.

    A step that mixes intra and inter hops costs whichever is slower, so which coefficients apply depends on the
    parameters being fitted: the fit starts from the machine's links and refits until that choice stops changing.
    Gamma is weakly determined by all-reduce times alone (a bandwidth-optimal all-reduce reduces half the bytes it
    sends, whatever the algorithm, so gamma and beta move together). A ("reduce", nbytes, seconds) sample, the time
    of one local reduction of nbytes, separates them; without one, gamma is fitted only if the samples' matrix is
    well conditioned, and kept from the machine otherwise.

        fit = calibrate([("ring", 1024, 3.1e-5), ("torus 2x4", 2**26, 0.021), ...], Machine(8, 4, ...))
        fit.intra, fit.inter, fit.gamma_s_per_byte, fit.relative_errors
    """
    samples = list(samples)
    if not samples:
        raise ValueError("calibrate needs at least one (algorithm, nbytes, seconds) sample")
    seconds = np.array([float(sample[2]) for sample in samples])
    if (seconds <= 0).any():
        raise ValueError("measured seconds must be > 0")
    parameters = machine.parameters
    previous = None
    for _ in range(max_iterations):
        current = machine.with_parameters(parameters)
        rows = np.array([_coefficients(algorithm, current, nbytes) for algorithm, nbytes, _ in samples])
        if previous is not None and np.array_equal(rows, previous):
            break  # the slower link of every mixed step is the same as in the last solve
        parameters, used = _fit_once(rows, seconds, parameters, fit_gamma)
        previous = rows
    fitted_machine = machine.with_parameters(parameters)
    predicted = np.array([_coefficients(algorithm, fitted_machine, nbytes) @ parameters
                          for algorithm, nbytes, _ in samples])
    return Calibration(fitted_machine.intra, fitted_machine.inter, fitted_machine.gamma_s_per_byte,
                       list((predicted - seconds) / seconds), tuple(TERMS[term] for term in used), fitted_machine)
