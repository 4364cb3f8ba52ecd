# SPDX-License-Identifier: Apache-2.0
"""shmcomm.sim: the alpha-beta-gamma cost model of all-reduce, for machines larger than the one at hand.

It predicts the time of one all-reduce of M bytes per rank for a flat ring, the 2D torus, hierarchical all-reduce and
a parameter-server / Soft Memory Box star (predict), picks the torus grid (best_grid), and fits the link parameters
to measured times (calibrate). Pure Python and numpy: no C core, no job. From a shell,
`python -m shmcomm.sim --ranks 1088 --local 4 --bytes 100M --inter-bw 12.5GB/s --inter-lat 2us` prints the same table
(`--grid XxY`, `--servers K`, `--json`; `--help` lists the units). The assumptions behind each formula are in
shmcomm/sim/model.py.
"""
from shmcomm.sim.calibrate import Calibration, calibrate
from shmcomm.sim.model import (ALGORITHMS, TERMS, LinkModel, Machine, Prediction, best_grid, cost_terms, default_grid,
                               hierarchical_time, inter_host_bytes, parse_algorithm, predict, ring_time, star_time,
                               steps, torus_time)

__all__ = ["ALGORITHMS", "TERMS", "Calibration", "LinkModel", "Machine", "Prediction", "best_grid", "calibrate",
           "cost_terms", "default_grid", "hierarchical_time", "inter_host_bytes", "parse_algorithm", "predict",
           "ring_time", "star_time", "steps", "torus_time"]
