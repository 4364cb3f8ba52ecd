# SPDX-License-Identifier: Apache-2.0
"""shmcomm.sim: the alpha-beta-gamma cost model of all-reduce, for machines larger than the one at hand.

It predicts the time of one all-reduce of M bytes per rank for a flat ring, the 2D torus (reduce-scatter along
rows inside a host, all-reduce along columns across hosts, all-gather along rows), hierarchical all-reduce
(reduce to a root per host, ring across the roots, broadcast) and a parameter-server / Soft Memory Box star,
picks the torus grid, and fits the link parameters to measured times. Pure Python and numpy: no C core, no job.

    from shmcomm.sim import LinkModel, Machine, predict, best_grid, calibrate

    abci = Machine(ranks=1088, local=4,
                   intra=LinkModel.from_bandwidth(0.5e-6, 50e9),   # shared memory / NVLink inside a host
                   inter=LinkModel.from_bandwidth(2e-6, 12.5e9),   # one host's NIC, shared by its ranks
                   gamma_s_per_byte=0.1e-9)                        # cost of reducing one byte
    for algorithm, seconds, steps, inter_bytes in predict(abci, 100 * 2**20):
        print(algorithm, seconds, steps, inter_bytes)
    best_grid(abci, 100 * 2**20)                                   # (X, Y) with X * Y == 1088

    fit = calibrate([("ring", 1024, 3.1e-5), ("torus 2x4", 2**26, 0.021), ...], Machine(8, 4, ...))
    fit.intra, fit.inter, fit.gamma_s_per_byte, fit.relative_errors

From a shell, `python -m shmcomm.sim --ranks 1088 --local 4 --bytes 100M --inter-bw 12.5GB/s --inter-lat 2us`
prints the same table (`--grid XxY` adds a grid, `--servers K` stripes the star, `--json` for scripts; `--help`
lists the units). The assumptions behind each formula are in shmcomm/sim/model.py.
"""
from shmcomm.sim.calibrate import Calibration, calibrate
from shmcomm.sim.model import (ALGORITHMS, TERMS, LinkModel, Machine, Prediction, best_grid, cost_terms, default_grid,
                               hierarchical_time, inter_host_bytes, parse_algorithm, predict, ring_time, star_time,
                               steps, torus_time)

__all__ = ["ALGORITHMS", "TERMS", "Calibration", "LinkModel", "Machine", "Prediction", "best_grid", "calibrate",
           "cost_terms", "default_grid", "hierarchical_time", "inter_host_bytes", "parse_algorithm", "predict",
           "ring_time", "star_time", "steps", "torus_time"]
