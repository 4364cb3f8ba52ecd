# SPDX-License-Identifier: Apache-2.0
"""The cost model of shmcomm.sim against the numbers of the design notes, hand-computed cases and its CLI."""
import json
import subprocess
import sys

import numpy as np
import pytest

from shmcomm.sim import (LinkModel, Machine, best_grid, calibrate, cost_terms, hierarchical_time, inter_host_bytes,
                         predict, ring_time, star_time, steps, torus_time)
from shmcomm.sim.__main__ import main, parse_bandwidth, parse_size, parse_time, parse_time_per_byte

MiB = 2**20

# SEEDS.md 2.4, "Step counts": N, grid X x Y, ring steps 2(N-1), 2D steps 2(X-1)+2(Y-1), ratio as printed there.
SONY_STEP_TABLE = [
    (16, (4, 4), 30, 12, "2.5"),
    (64, (8, 8), 126, 28, "4.5"),
    (1088, (4, 272), 2174, 548, "4.0"),
    (1088, (32, 34), 2174, 128, "17"),
    (2176, (4, 544), 4350, 1092, "4.0"),
]


def _machine(ranks, local, intra=(1e-6, 1e-10), inter=(1e-5, 1e-9), gamma=0.0):
    return Machine(ranks, local, LinkModel(*intra), LinkModel(*inter), gamma)


@pytest.mark.parametrize("ranks, grid, ring_steps, torus_steps, printed_ratio", SONY_STEP_TABLE)
def test_step_counts_and_ratios_of_the_sony_table(ranks, grid, ring_steps, torus_steps, printed_ratio):
    machine = _machine(ranks, local=4)
    assert steps("ring", machine) == ring_steps
    assert steps("torus", machine, grid) == torus_steps
    decimals = len(printed_ratio.partition(".")[2])
    assert "%.*f" % (decimals, ring_steps / torus_steps) == printed_ratio


@pytest.mark.parametrize("ranks, grid, ring_steps, torus_steps, printed_ratio", SONY_STEP_TABLE)
def test_latency_bound_time_ratio_is_the_step_ratio(ranks, grid, ring_steps, torus_steps, printed_ratio):
    # SEEDS.md 2.4: "T_ring/T_2D -> (N-1)/(X+Y-2) when alpha dominates". With free bytes and one latency for
    # both links this holds exactly, for rows inside hosts (local = X) and for rows spanning hosts (local = 4).
    for local in sorted({grid[0], 4}):
        machine = _machine(ranks, local, intra=(1e-6, 0.0), inter=(1e-6, 0.0))
        ratio = ring_time(machine, 1024) / torus_time(machine, 1024, grid)
        assert ratio == pytest.approx((ranks - 1) / (grid[0] + grid[1] - 2), rel=1e-12)


@pytest.mark.parametrize("ranks, grid", [(16, (4, 4)), (64, (8, 8)), (1088, (4, 272)), (1088, (32, 34))])
def test_torus_sends_the_same_bytes_per_rank_as_the_ring(ranks, grid):
    # SEEDS.md 2.4: 2(X-1)/X M + 2(Y-1)/(XY) M = 2(N-1)/N M. With one rank per host every byte crosses hosts.
    machine, nbytes = _machine(ranks, local=1), 100 * MiB
    columns, rows = grid
    expected = 2 * (columns - 1) / columns * nbytes + 2 * (rows - 1) / (columns * rows) * nbytes
    assert expected == pytest.approx(2 * (ranks - 1) / ranks * nbytes, rel=1e-12)
    assert inter_host_bytes("torus", machine, nbytes, grid) == pytest.approx(expected, rel=1e-12)
    assert inter_host_bytes("ring", machine, nbytes) == pytest.approx(expected, rel=1e-12)


def test_hierarchical_root_sends_local_times_the_torus_bytes_across_hosts():
    # SEEDS.md 6, oracle 2: torus 2(Y-1)/(XY) M across hosts per rank; hierarchical root 2(Y-1)/Y M, X times more.
    machine, nbytes = _machine(1088, local=4), 100 * MiB
    torus_bytes = inter_host_bytes("torus", machine, nbytes)
    assert torus_bytes == pytest.approx(2 * 271 / 1088 * nbytes, rel=1e-12)
    assert inter_host_bytes("hierarchical", machine, nbytes) == pytest.approx(4 * torus_bytes, rel=1e-12)
    assert steps("hierarchical", machine) == steps("torus", machine) == 548


# N = 4 ranks on 2 hosts (local 2), M = 1e6 bytes; intra 1 us + 0.1 ns/B, inter 10 us + 1 ns/B, gamma 0.01 ns/B.
HAND = dict(ranks=4, local=2, intra=(1e-6, 1e-10), inter=(1e-5, 1e-9), gamma=1e-11)


def test_ring_on_two_hosts_by_hand():
    # 6 steps of M/4 = 250 kB, every step waits for the hop across hosts (one pair per boundary, whole NIC):
    # 6 * (10 us + 250 us) = 1560 us; reduce 3/4 M * 0.01 ns = 7.5 us.
    assert ring_time(_machine(**HAND), 1e6) == pytest.approx(1567.5e-6, rel=1e-12)


def test_torus_on_two_hosts_by_hand():
    # Rows inside hosts: 2 steps of M/2 on shared memory, 2 * (1 us + 50 us) = 102 us. Columns: 2 steps of M/4,
    # both ranks of a host through one NIC, so 500 kB of NIC time a step: 2 * (10 us + 500 us) = 1020 us.
    # Reduce (1/2 + 1/4) M * 0.01 ns = 7.5 us.
    assert torus_time(_machine(**HAND), 1e6) == pytest.approx(1129.5e-6, rel=1e-12)


def test_hierarchical_on_two_hosts_by_hand():
    # Reduce and broadcast chains: 2 * 1 us + 2 M * 0.1 ns = 202 us, reduce M * 0.01 ns = 10 us. Roots' ring:
    # 2 * (10 us + M/2 * 1 ns) = 1020 us, reduce M/2 * 0.01 ns = 5 us.
    assert hierarchical_time(_machine(**HAND), 1e6) == pytest.approx(1237e-6, rel=1e-12)


def test_torus_small_path_on_two_hosts_by_hand():
    # Row allreduce and broadcast on shared memory: 2 * (1 us + M * 0.1 ns) = 202 us; one exchange of M across
    # hosts: 10 us + 1000 us; reduce (L - 1 + 1) M * 0.01 ns = 20 us.
    assert float(cost_terms("torus-small", _machine(**HAND), 1e6)[0] @ _machine(**HAND).parameters) == \
        pytest.approx(1232e-6, rel=1e-12)


@pytest.mark.parametrize("hosts, exchanges", [(1, 0), (2, 1), (3, 3), (4, 2), (6, 4), (8, 3)])
def test_torus_small_path_steps_follow_recursive_doubling(hosts, exchanges):
    assert steps("torus-small", _machine(2 * hosts, local=2)) == 2 + exchanges
    assert steps("torus-small", _machine(hosts, local=1)) == exchanges


def test_star_on_two_hosts_by_hand():
    # Push then pull through one server: 2 * 10 us + 2 * 4 M * 1 ns = 8020 us; the server sums 4 M: 40 us.
    # With 4 servers the worker host's NIC binds: 2 * 2 M * 1 ns = 4000 us, 20 us latency, server sums M: 10 us.
    assert star_time(_machine(**HAND), 1e6) == pytest.approx(8060e-6, rel=1e-12)
    assert star_time(_machine(**HAND), 1e6, servers=4) == pytest.approx(4030e-6, rel=1e-12)


def test_rows_spanning_hosts_use_the_inter_link():
    # 8 ranks, 2 per host, grid 4x2: a row covers 2 hosts, so each of its 6 steps of M/4 crosses a host boundary
    # with one pair per NIC: 6 * (10 us + 250 us). Columns: 2 steps of M/8 with both ranks of a host on its NIC:
    # 2 * (10 us + 250 us). Reduce (3/4 + 1/8) M * 0.01 ns = 8.75 us.
    machine = _machine(8, 2, gamma=1e-11)
    assert torus_time(machine, 1e6, (4, 2)) == pytest.approx(2088.75e-6, rel=1e-12)


def test_smb_memory_server_bound():
    # SEEDS.md 1.6: ResNet-50 (fp32 ~102 MB), P = 16 through one SMB1 server at 6.7 GB/s: 2 P M / B ~ 0.49 s;
    # SMB2 divides by the number of memory servers k.
    machine = Machine(16, 1, LinkModel(0.0, 0.0), LinkModel.from_bandwidth(0.0, 6.7e9))
    one_server = star_time(machine, 102e6)
    assert round(one_server, 2) == 0.49
    assert star_time(machine, 102e6, servers=8) == pytest.approx(one_server / 8, rel=1e-12)


def test_best_grid():
    abci = Machine(1088, 4, LinkModel.from_bandwidth(0.5e-6, 1000e9), LinkModel.from_bandwidth(2e-6, 12.5e9))
    # A shared-memory link far faster than the NIC: the heavy row phases are nearly free, keep rows in hosts.
    assert best_grid(abci, 1 << 30) == (4, 272)
    # Latency-bound messages: the fewest steps, X + Y least, which is the 32x34 grid of the step table.
    assert best_grid(abci, 1024) == (32, 34)


def test_predict_lists_every_algorithm():
    machine = _machine(1088, 4, gamma=1e-10)
    predictions = predict(machine, 100 * MiB, grid=(32, 34), servers=2)
    labels = [p.algorithm for p in predictions]
    assert labels[0] == "ring" and "torus 4x272" in labels and "torus 32x34" in labels
    assert labels[-2:] == ["hierarchical", "star 2"]
    assert "torus %dx%d" % best_grid(machine, 100 * MiB) in labels
    for algorithm, seconds, step_count, inter_bytes in predictions:
        coefficients, _ = cost_terms(algorithm, machine, 100 * MiB)
        assert seconds == pytest.approx(coefficients @ machine.parameters) and seconds > 0
        assert step_count == steps(algorithm, machine) and inter_bytes > 0


def _synthetic_samples(truth, algorithms, seed=0, noise=0.02):
    rng = np.random.default_rng(seed)
    samples = []
    for algorithm in algorithms:
        for nbytes in (2**k for k in range(4, 29)):
            if algorithm == "reduce":
                exact = nbytes * truth.gamma_s_per_byte
            else:
                exact = float(cost_terms(algorithm, truth, nbytes)[0] @ truth.parameters)
            samples.append((algorithm, nbytes, exact * (1 + rng.uniform(-noise, noise))))
    return samples


def test_calibrate_recovers_the_parameters_from_noisy_samples():
    truth = Machine(8, 4, LinkModel.from_bandwidth(1e-6, 10e9), LinkModel.from_bandwidth(10e-6, 5e9), 0.1e-9)
    guess = Machine(8, 4, LinkModel.from_bandwidth(2e-6, 20e9), LinkModel.from_bandwidth(5e-6, 1e9))
    samples = _synthetic_samples(truth, ["ring", "torus 4x2", "torus 2x4", "hierarchical", "star", "reduce"])
    fit = calibrate(samples, guess)
    assert fit.fitted == ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "gamma")
    assert fit.machine.parameters == pytest.approx(truth.parameters, rel=0.05)
    assert fit.intra.bandwidth == pytest.approx(10e9, rel=0.05) and fit.inter.latency == pytest.approx(10e-6, rel=0.05)
    assert len(fit.relative_errors) == len(samples) and max(map(abs, fit.relative_errors)) < 0.05


def test_calibrate_keeps_what_the_samples_cannot_separate():
    # A ring on 2 hosts uses only the inter link, and its gamma is collinear with beta: both stay as given.
    truth = Machine(8, 4, LinkModel.from_bandwidth(1e-6, 10e9), LinkModel.from_bandwidth(10e-6, 5e9))
    guess = truth.with_parameters([0.5e-6, 1e-10, 3e-6, 1e-9, 0.0])
    fit = calibrate(_synthetic_samples(truth, ["ring"]), guess)
    assert fit.fitted == ("alpha_inter", "beta_inter")
    assert fit.intra == guess.intra and fit.gamma_s_per_byte == 0.0
    assert fit.inter.alpha_s == pytest.approx(10e-6, rel=0.05) and fit.inter.bandwidth == pytest.approx(5e9, rel=0.05)
    with pytest.raises(ValueError):
        calibrate([("ring", 1024, 1e-5)], truth)  # one sample cannot give alpha and beta


def test_unit_parsing():
    assert parse_size("100M") == 100 * MiB and parse_size("4K") == 4096 and parse_size("512") == 512
    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size("2 MB") == 2 * MiB
    assert parse_bandwidth("12.5GB/s") == pytest.approx(12.5e9)
    assert parse_bandwidth("100Gbit/s") == pytest.approx(12.5e9)
    assert parse_bandwidth("100Gb/s") == pytest.approx(12.5e9) and parse_bandwidth("7e9") == 7e9
    assert parse_time("2us") == pytest.approx(2e-6) and parse_time("3ms") == pytest.approx(3e-3)
    assert parse_time("7ns") == pytest.approx(7e-9) and parse_time("1s") == 1.0 and parse_time("1e-6") == 1e-6
    assert parse_time_per_byte("0.1ns/B") == pytest.approx(1e-10)
    for parse, text in [(parse_size, "-1M"), (parse_size, "100Q"), (parse_bandwidth, "12.5GX/s"),
                        (parse_bandwidth, "0GB/s"), (parse_time, "2 parsecs"), (parse_time_per_byte, "1ns/KB")]:
        with pytest.raises(Exception, match="invalid"):
            parse(text)


ABCI = ["--ranks", "1088", "--local", "4", "--bytes", "100M", "--inter-bw", "12.5GB/s", "--inter-lat", "2us"]


def test_cli_prints_every_algorithm(capsys):
    assert main(ABCI + ["--grid", "32x34"]) == 0
    out = capsys.readouterr().out
    for name in ("ring", "torus 4x272", "torus 32x34", "hierarchical", "star", "best grid"):
        assert name in out


def test_cli_json_is_valid(capsys):
    assert main(ABCI + ["--json", "--servers", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    labels = [p["algorithm"] for p in report["predictions"]]
    assert labels[0] == "ring" and labels[-2:] == ["hierarchical", "star 4"]
    assert report["bytes"] == 100 * MiB and report["default_grid"] == [4, 272] and len(report["best_grid"]) == 2


@pytest.mark.parametrize("bad", [["--inter-bw", "12.5GX/s"], ["--bytes", "lots"], ["--inter-lat", "2 fortnights"],
                                 ["--grid", "3x4"], ["--local", "5"]])
def test_cli_rejects_bad_input_with_exit_2(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(ABCI + bad)  # the last value of a repeated option wins
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_python_dash_m_runs():
    result = subprocess.run([sys.executable, "-m", "shmcomm.sim"] + ABCI, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "torus 4x272" in result.stdout and "hierarchical" in result.stdout
