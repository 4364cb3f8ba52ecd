# SPDX-License-Identifier: Apache-2.0
"""The autotuner: its Gaussian process and search on known objectives, its cost-model prior, and a job under
shmcommrun --autotune whose ranks apply every decision in the same cycle and still reduce exactly."""
import csv
import json
import math

import numpy as np
import pytest

from shmcomm.engine import autotune, bayes
from shmcomm.env import AutotuneSettings
from shmcomm.sim.step import StepModel
from test_runner import launch, rank_lines, rank_program

MB = 1 << 20


def test_gaussian_process_interpolates_and_is_unsure_away_from_samples():
    points = np.array([[0.1], [0.5], [0.9]])
    gp = bayes.GaussianProcess(noise=1e-6).fit(points, np.array([1.0, 3.0, 2.0]))
    mean, deviation = gp.predict(points)
    assert np.allclose(mean, [1.0, 3.0, 2.0], atol=1e-3) and (deviation < 1e-2).all()
    far_mean, far_deviation = gp.predict(np.array([[0.3], [0.7]]))
    assert (far_deviation > deviation.max()).all()


def test_expected_improvement_favours_high_means_and_uncertainty():
    gain = bayes.expected_improvement(np.array([1.0, 2.0, 1.0]), np.array([0.1, 0.1, 1.0]), best=1.5)
    assert gain[1] > gain[0] and gain[2] > gain[0]


def test_bayesian_search_finds_the_peak_of_a_smooth_objective():
    def objective(p):
        return 10.0 - 20.0 * ((p[0] - 0.7) ** 2 + (p[1] - 0.3) ** 2)

    rng = np.random.default_rng(1)
    points = [[0.25, 0.25], [0.75, 0.75], [0.5, 0.9]]
    scores = [objective(p) for p in points]
    for _ in range(12):
        point = bayes.next_point(points, scores, lambda ps: np.zeros(len(ps)), 0.05, rng)
        points.append(list(point))
        scores.append(objective(point))
    assert max(scores) > 9.8  # within 0.1 of the peak's coordinates


def settings(**changes):
    values = dict(enabled=True, log_file=None, warmup_samples=1, steps_per_sample=3, max_samples=8, noise=0.3,
                  prior="none", pinned=frozenset())
    values.update(changes)
    return AutotuneSettings(**values)


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


START = {"fusion": 64 * MB, "cycle": 1.0, "bucket": 25 * MB, "algorithm": None}
SIZES = [("grad%d" % i, 40_000) for i in range(50)]


def step_seconds(current):
    """A made-up machine on which small buckets and a fusion threshold near 1 MiB are best."""
    return (0.05 + 0.01 * (math.log2(current["fusion"] / MB)) ** 2 / 10 + 0.02 * abs(math.log2(current["bucket"] / MB))
            / 7 + 0.001 * current["cycle"])


def drive(tuner, steps=400, algorithm_factor=None, objective=step_seconds):
    """Runs `steps` training steps of SIZES through the tuner's measurements; returns the decisions, in order."""
    clock = tuner.clock
    decisions = []
    for _ in range(steps):
        seconds = objective(tuner.current)
        if algorithm_factor:
            seconds *= algorithm_factor[tuner.current["algorithm"]]
        for name, size in SIZES:
            clock.now += seconds / len(SIZES)
            tuner.record([(name, size)], 0.0)
        decision = tuner.outgoing()
        if decision is not None:
            decisions.append(decision)
            if "probe" in decision:
                tuner.probed([(b, 2e-5 + b * 3e-10) for b in decision["probe"]])
            tuner.applied(decision)
        if tuner.done:
            break
    return decisions


def test_search_beats_the_starting_settings_and_logs_like_horovod(tmp_path, capsys):
    log = tmp_path / "tune.csv"
    tuner = autotune.Autotuner(0, settings(log_file=str(log)), START, [], clock=Clock())
    decisions = drive(tuner)
    assert tuner.done and decisions[-1]["done"]
    assert step_seconds(tuner.current) < 0.8 * step_seconds(START)
    rows = list(csv.reader(open(log)))
    assert rows[0] == list(autotune.HEADER)
    assert len(rows) == 1 + 8 + 10 + 1  # header, a row per search sample and confirmation sample, the best last
    assert float(rows[-1][3]) * MB == pytest.approx(tuner.current["fusion"], rel=1e-3)
    said = capsys.readouterr().err
    assert "autotune: done after 19 samples (1 warm-up)" in said and "--fusion-threshold-mb" in said
    # the confirmation took the search's best and the starting settings in pairs, the order alternating
    confirm = decisions[-11:-1]
    assert [d == {k: START[k] for k in d} for d in confirm] == [False, True, True, False] * 2 + [False, True]


def test_the_starting_settings_stay_when_the_search_cannot_beat_them():
    def flat(current):  # every setting as good as any other but the start, 2% better
        return 0.05 * (0.98 if all(current[k] == START[k] for k in START) else 1.0)

    tuner = autotune.Autotuner(0, settings(), START, [], clock=Clock())
    drive(tuner, objective=flat)
    assert tuner.done and all(tuner.current[k] == START[k] for k in START)


def test_pinned_settings_stay_put_and_other_ranks_only_follow():
    tuner = autotune.Autotuner(0, settings(pinned=frozenset({"fusion", "cycle"})), START, [], clock=Clock())
    decisions = drive(tuner)
    assert tuner.done and all(d["fusion"] == START["fusion"] and d["cycle"] == START["cycle"] for d in decisions)
    follower = autotune.Autotuner(1, settings(), START, [], clock=Clock())
    assert drive(follower, steps=50) == [] and not follower.done  # rank 1 never decides


def test_the_algorithm_is_chosen_across_hosts_after_the_search():
    tuner = autotune.Autotuner(0, settings(max_samples=4), dict(START, algorithm="torus"), ["torus", "ring", "mpi"],
                               clock=Clock())
    decisions = drive(tuner, algorithm_factor={"torus": 1.3, "ring": 1.0, "mpi": 1.6})
    # the best settings on each algorithm, then the winner (ring) against the start (torus), then ring
    pairs = ["ring", "torus", "torus", "ring"] * 2 + ["ring", "torus"]
    assert [d["algorithm"] for d in decisions[-14:]] == ["torus", "ring", "mpi"] + pairs + ["ring"]
    assert tuner.current["algorithm"] == "ring" and tuner.done


def test_the_cost_model_prior_predicts_fusion_and_buckets():
    timings = [(4096, 2e-5), (65536, 4e-5), (MB, 4e-4), (8 * MB, 3e-3)]
    model = StepModel(4, 4, 64 << 10, 0.0, timings, [size for _, size in SIZES], 0.06, START)
    assert model.allreduce_seconds(8 * MB) == pytest.approx(3e-3, rel=0.3)
    fused = dict(START)
    unfused = dict(START, fusion=16 << 10)  # every gradient alone: 50 latencies
    assert model.score(fused) > model.score(unfused)
    assert model.comm_seconds(dict(START, bucket=64 << 10)) > model.comm_seconds(START)  # a negotiation per round


def test_the_prior_steers_the_first_guess():
    tuner = autotune.Autotuner(0, settings(prior="model"), START, [], clock=Clock(),
                               model=lambda timings, sizes, seconds, start: StepModel(2, 2, 64 << 10, 0.0, timings,
                                                                                      sizes, seconds, start))
    decisions = drive(tuner)
    assert "probe" in decisions[0] and tuner.model is not None and tuner.done


JOB = rank_program("""
    import json, sys
    import numpy as np
    import shmcomm
    from shmcomm import engine
    shmcomm.init(engine=True)
    rank, size = shmcomm.rank(), shmcomm.size()
    grads = [np.full(1000 + 37 * i, float(rank + i), dtype=np.float32) for i in range(40)]
    for step in range(int(sys.argv[1])):
        handles = [shmcomm.allreduce_async(g, name="g%d" % i, op=shmcomm.Sum) for i, g in enumerate(grads)]
        for i, h in enumerate(handles):
            out = shmcomm.synchronize(h)
            assert np.all(out == sum(r + i for r in range(size))), (step, i)
    eng = engine.current()
    print(json.dumps({"applied": eng.tuning_applied, "final": [eng.fusion_threshold, eng.cycle_s, eng.bucket_bytes],
                      "done": eng.tuner.done}))
    shmcomm.shutdown()
""")


@pytest.mark.slow
def test_a_job_tunes_and_every_rank_applies_each_choice_in_the_same_cycle(tmp_path):
    log = tmp_path / "tune.csv"
    result = launch("-np", 2, "--autotune", "--autotune-log-file", log, "--autotune-warmup-samples", 1,
                    "--autotune-steps-per-sample", 3, "--autotune-bayes-opt-max-samples", 5, *JOB, 200,
                    timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    reports = [json.loads(lines[-1]) for _, lines in sorted(rank_lines(result.stdout).items())]
    assert len(reports) == 2 and reports[0] == reports[1]  # same decisions, same cycles, same final settings
    applied = reports[0]["applied"]
    assert reports[0]["done"] and applied[-1][1]["done"] and "probe" in applied[0][1]
    assert len(applied) == 1 + 5 + 10  # the probe, a decision after each search and confirmation sample
    final = applied[-1][1]
    assert reports[0]["final"] == [final["fusion"], pytest.approx(final["cycle"] / 1000), final["bucket"]]
    rows = list(csv.reader(open(log)))
    assert len(rows) == 1 + 5 + 10 + 1
    assert "autotune: done after 16 samples (1 warm-up); chosen: --fusion-threshold-mb" in result.stderr


@pytest.mark.slow
def test_across_simulated_hosts_the_algorithms_are_tried_and_results_stay_exact(tmp_path):
    import subprocess
    import sys

    from test_simhosts import REPO, job_env, open_hosts

    sim = open_hosts(2)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "shmcomm.runner", *sim.shmcommrun_args(2), "--autotune",
             "--autotune-warmup-samples", "1", "--autotune-steps-per-sample", "2",
             "--autotune-bayes-opt-max-samples", "3", *JOB, "120"], cwd=REPO, env=job_env(),
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
    finally:
        sim.close()
    assert result.returncode == 0, result.stdout + result.stderr
    reports = [json.loads(lines[-1]) for _, lines in sorted(rank_lines(result.stdout).items())]
    assert len(reports) == 4 and all(report == reports[0] for report in reports)
    tried = {decision.get("algorithm") for _, decision in reports[0]["applied"]}
    assert {"torus", "ring", "mpi"} <= tried and reports[0]["done"]
