# SPDX-License-Identifier: Apache-2.0
"""The microbenchmarks run end to end on small sizes, every backend computes the exact results, and the size
parsing and bus-bandwidth formulas hold. Timings are never asserted on."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks import backends, collectives, engine_settings, interleaved, report  # noqa: E402
HEADER = ("#       size         count      type   redop    root"
          "     time   algbw   busbw #wrong     time   algbw   busbw #wrong")


def run_module(module, args, timeout):
    env = backends.job_environment()
    return subprocess.run([sys.executable, "-m", module] + list(args), cwd=str(REPO), env=env, capture_output=True,
                          text=True, timeout=timeout)


def halves(result):
    for row in result["rows"]:
        for half in report.HALVES:
            yield row, row[half]


def test_interleaved_runs_both_libraries_in_one_job():
    """benchmarks.interleaved under MPICH's mpiexec: every op and size gets a row, after both libraries' results were
    found equal (the benchmark raises otherwise)."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("no mpiexec beside this interpreter")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "benchmarks.interleaved", "--bytes", "4K,1M",
                           "--rounds", "2", "--iters", "3"], cwd=str(REPO), env=backends.job_environment(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert sorted((row[0], int(row[1])) for row in rows) == sorted(
        (op, size) for op in interleaved.OPS for size in (4096, 1 << 20))
    assert "broadcast" in interleaved.OPS
    # op bytes shmcomm (p90) MPI (p90) ratio, verdicts on the medians and p90s, a ratio per round; each median no
    # later than its p90
    assert all(len(row) == 11 and 0 < float(row[2]) <= float(row[3]) and 0 < float(row[4]) <= float(row[5])
               for row in rows), proc.stdout
    assert all(row[7] in ("met", "spread", "BEHIND") and row[8] in ("met", "spread", "BEHIND") for row in rows)
    listed = [line for line in proc.stdout.splitlines() if line.startswith("# behind MPI in every round: ")]
    behind = sum(row[i] == "BEHIND" for row in rows for i in (7, 8))
    assert len(listed) == 1 and (listed[0].endswith(": none") if behind == 0 else listed[0].count(",") == behind - 1)


def test_interleaved_verdicts_follow_the_rounds():
    """A cell is met where the median of the rounds' ratios (MPI's time over shmcomm's) reaches 1, level within the
    spread where only some round's does, behind where none does."""
    assert interleaved.verdict([1.0, 0.5, 1.2]) == "met"
    assert interleaved.verdict([0.8, 0.9, 1.01]) == "spread"
    assert interleaved.verdict([0.99, 0.5, 0.98]) == "BEHIND"
    assert interleaved.verdict([2.0]) == "met" and interleaved.verdict([0.7]) == "BEHIND"


def test_interleaved_compares_settings_in_one_job():
    """--setting: shmcomm re-initialised with each value every round, every value's results checked against MPI's,
    a time and a ratio per value on each row."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("no mpiexec beside this interpreter")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "benchmarks.interleaved", "--bytes", "4K,1M",
                           "--ops", "allreduce,broadcast", "--rounds", "2", "--iters", "3",
                           "--setting", "SHMCOMM_PULL_BYTES=unset,0"], cwd=str(REPO), env=backends.job_environment(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert sorted((row[0], int(row[1])) for row in rows) == sorted(
        (op, size) for op in ("allreduce", "broadcast") for size in (4096, 1 << 20)), proc.stdout
    for row in rows:  # op bytes unset: us ratio 0: us ratio MPI us
        assert row[2] == "unset:" and row[5] == "0:" and row[8] == "MPI", proc.stdout
        assert all(float(row[i]) > 0 for i in (3, 6, 9)) and row[4].endswith("x") and row[7].endswith("x")


def test_interleaved_loop_times_calls_back_to_back():
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("no mpiexec beside this interpreter")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "benchmarks.interleaved", "--bytes", "8,4K",
                           "--ops", "broadcast,allreduce", "--rounds", "2", "--iters", "20", "--loop",
                           "--cpu-load", "1"], cwd=str(REPO),
                          env=backends.job_environment(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mean of --iters calls back to back" in proc.stdout, proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert sorted((row[0], int(row[1])) for row in rows) == sorted(
        (op, size) for op in ("broadcast", "allreduce") for size in (8, 4096)), proc.stdout
    assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in rows), proc.stdout


def test_interleaved_broadcast_from_another_root():
    """--root: broadcast from the last rank (both libraries' results are checked against each other, so a root that one
    of them ignored fails the job); a root outside the job is refused."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("no mpiexec beside this interpreter")
    command = [mpiexec, "-n", "2", sys.executable, "-m", "benchmarks.interleaved", "--bytes", "8,4K", "--ops",
               "broadcast", "--rounds", "1", "--iters", "3", "--root"]
    proc = subprocess.run(command + ["-1"], cwd=str(REPO), env=backends.job_environment(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert sorted((row[0], int(row[1])) for row in rows) == [("broadcast", 8), ("broadcast", 4096)], proc.stdout
    proc = subprocess.run(command + ["2"], cwd=str(REPO), env=backends.job_environment(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode != 0 and "--root 2: the job has 2 ranks" in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.long
def test_interleaved_on_torch_memory():
    """--torch-memory: every buffer of both libraries from torch's allocator, both libraries' results checked against
    each other (the benchmark raises otherwise), at a size whose buffers hold whole huge pages."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("no mpiexec beside this interpreter")
    pytest.importorskip("torch")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "benchmarks.interleaved", "--bytes", "4K,5M",
                           "--rounds", "1", "--iters", "3", "--torch-memory"], cwd=str(REPO),
                          env=backends.job_environment(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert sorted((row[0], int(row[1])) for row in rows) == sorted(
        (op, size) for op in interleaved.OPS for size in (4096, 5 << 20)), proc.stdout
    import torch

    assert interleaved.torch_empty(8).base is not None  # a view of a tensor's memory, not numpy's own
    assert isinstance(interleaved.torch_empty(8).base, torch.Tensor)


def test_kernel_copy_reports_both_kinds_of_pages():
    proc = run_module("benchmarks.kernel_copy", ["--bytes", "64K,5M", "--tries", "2"], 120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert [int(row[0]) for row in rows] == [64 << 10, 5 << 20], proc.stdout
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows), proc.stdout
    assert "no whole huge page inside" in proc.stdout.splitlines()[2], proc.stdout  # 64 KiB holds none


def test_reduction_reports_every_dtype_size_and_source_count():
    proc = run_module("benchmarks.reduction", ["--elements", "1K,3000", "--dtypes", "float32,bfloat16,int32",
                                               "--sources", "2,3", "--tries", "1"], 120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert [(row[0], int(row[1]), int(row[2])) for row in rows] == [
        (dtype, elements, sources) for dtype in ("float32", "bfloat16", "int32") for elements in (1024, 3000)
        for sources in (2, 3)], proc.stdout
    assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in rows), proc.stdout


def test_torch_distributed_against_gloo_and_the_numpy_api():
    pytest.importorskip("torch")
    proc = run_module("shmcomm.runner", ["-np", "2", sys.executable, "-m", "benchmarks.torch_distributed", "--bytes",
                                         "4K,64K", "--rounds", "2", "--iters", "2", "--ops",
                                         "all_reduce,all_to_all_single"], 180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("[0]<stdout>: | all")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("all_reduce", "4 KiB"), ("all_reduce", "64 KiB"),
                                                            ("all_to_all_single", "4 KiB"),
                                                            ("all_to_all_single", "64 KiB")], proc.stdout
    for row in rows:
        for cell in row[2:5]:  # median (p90), both positive, the median no later than the p90
            median, p90 = (float(x) for x in cell.strip().rstrip(")").split(" ("))
            assert 0 < median <= p90, row
        # the ratios to gloo, to the numpy API, and of torch's layer alone (a do-nothing group) to the numpy API
        assert float(row[5].strip().rstrip("x")) > 0 and float(row[6]) > 0 and float(row[7]) > 0, row


@pytest.mark.long  # DeepSpeed is a peer, never a dependency: this runs where it is installed
def test_deepspeed_allreduce_against_shmcomm():
    pytest.importorskip("deepspeed")
    proc = run_module("shmcomm.runner", ["-np", "2", sys.executable, "-m", "benchmarks.deepspeed", "--bytes", "8,64K",
                                         "--rounds", "1", "--iters", "3"], 600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("[0]<stdout>: | float")]
    assert [(r[0].strip(), r[1].strip()) for r in rows][:2] == [("float32", "8 B"), ("float32", "64 KiB")], proc.stdout
    assert all(float(r[4]) > 0 for r in rows), proc.stdout


def test_oneccl_without_oneccl_says_how_to_install_it(tmp_path):
    """oneCCL is never installed at run time: a prefix without it stops the driver before any job, with the commands
    that install it there."""
    proc = run_module("benchmarks.oneccl", ["-np", "2", "--prefix", str(tmp_path)], 60)
    assert proc.returncode != 0
    assert "no oneCCL with its Intel MPI in %s" % tmp_path in proc.stderr, proc.stderr
    assert "%s/bin/pip install --no-deps oneccl==2022.2.0" % tmp_path in proc.stderr, proc.stderr


@pytest.mark.long  # oneCCL is a peer, never a dependency: this runs where it is installed (benchmarks/README.md)
def test_oneccl_collectives_against_shmcomm():
    from benchmarks import oneccl
    if not os.path.exists(os.path.join(oneccl.PREFIX, "lib", "libccl.so.2")):
        pytest.skip("oneCCL is not installed in %s" % oneccl.PREFIX)
    proc = run_module("benchmarks.oneccl", ["-np", "2", "--ops", "allreduce,allgather,alltoall,reducescatter,broadcast",
                                            "--dtypes", "float32,float16", "--bytes", "8,64K", "--rounds", "1",
                                            "--iters", "3"], 600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "us" not in line]
    cases = [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows]
    assert cases == [(op, dtype, size) for op in oneccl.OPS for dtype in ("float32", "float16")
                     for size in ("8 B", "64 KiB")], proc.stdout
    assert all(float(r[5]) > 0 for r in rows), proc.stdout


def test_tcp_mesh_reports_set_up_and_every_size():
    proc = run_module("benchmarks.tcp_mesh", ["-np", "3", "-b", "4K", "-e", "16K", "-f", "4", "-n", "2",
                                              "--rounds", "1"], 120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.strip("|").split("|") for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0][0].strip() == "mesh set-up ms" and float(rows[0][1]) > 0, proc.stdout
    assert [int(row[0]) for row in rows[2:]] == [4096, 16384], proc.stdout
    assert all(0 < float(row[1]) <= float(row[2]) for row in rows[2:]), proc.stdout


# The default run compares with MPICH; the second tier with every backend (Open MPI, torch's gloo, and oneCCL and
# DeepSpeed's op where they are installed).
@pytest.mark.parametrize("names", [("shmcomm", "mpi", "memcpy"), pytest.param(backends.NAMES, marks=pytest.mark.long)],
                         ids=["mpich", "every-backend"])
def test_collectives_every_backend_and_op(tmp_path, names):
    if "openmpi" in names:
        from benchmarks import openmpi

        print(openmpi.install() or "Open MPI installed")  # the benchmark itself only says how
    out = tmp_path / "collectives.json"
    proc = run_module("benchmarks.collectives", ["-np", "2", "-b", "8", "-e", "64K", "-f", "32", "-n", "3", "-w", "1",
                                                 "--ops", ",".join(collectives.OPS), "--cpu-load", "1",
                                                 "--backends", ",".join(names), "--json", str(out)], 240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every job ran beside 1 CPU-bound processes" in proc.stdout
    assert HEADER in proc.stdout
    assert "# Summary" in proc.stdout
    document = json.loads(out.read_text())
    results = document["results"]
    expected = ["shmcomm"]
    for name in [name for name in ("mpi", "openmpi", "gloo", "torch_shmcomm", "oneccl", "deepspeed") if name in names]:
        why = backends.unavailable(name)
        if why:  # said on the console, and the rest must still run
            assert "%s skipped" % name in proc.stdout
            print("%s not compared: %s" % (name, why))
        else:
            expected.append(name)
    for name in expected:
        assert [row for row in results[name]["rows"] if row["op"] == "allreduce"], name
        assert {row["op"] for row in results[name]["rows"]} == set(collectives.OPS), name
    assert results["memcpy"]["rows"]
    if "mpi" in expected and "openmpi" in expected:  # both MPI wheels, each its own library, and the faster one
        assert results["mpi"]["library"].startswith("MPICH"), results["mpi"]["library"]
        assert results["openmpi"]["library"].startswith("Open MPI"), results["openmpi"]["library"]
        assert "shmcomm/faster MPI" in proc.stdout
        for entry in document["summary"]:
            faster = max(entry["busbw"]["mpi"] or 0, entry["busbw"]["openmpi"] or 0)
            assert faster > 0, entry  # the summary's halves are those both MPIs have
            assert entry["ratio"]["faster MPI"] == pytest.approx(entry["busbw"]["shmcomm"] / faster), entry
    measured = 0
    for name, result in results.items():
        for row, cell in halves(result):
            if "na" not in cell:
                measured += 1
                assert cell["wrong"] == 0, (name, row)
                assert cell["iters"] >= 1
    assert measured > 0
    assert document["machine"]["cores"] >= 1 and "line" in document["machine"]
    # the memory limit: a line per op at the largest size measured (64 KiB here), its fraction from the row's time
    limit = proc.stdout[proc.stdout.index("# Memory limit"):].splitlines()[2:2 + len(collectives.OPS)]
    assert [line.split()[0] for line in limit] == list(collectives.OPS)
    for line in limit:
        op, size, copied, limit_us, measured_us, fraction = line.split()
        assert float(fraction) == pytest.approx(float(limit_us) / float(measured_us), rel=0.02, abs=0.01)
        assert float(copied) * 1e6 == pytest.approx(report.ideal_copies(op, int(size), 2), abs=600)


def test_ideal_copies_count_what_must_move():
    size = 1 << 20
    assert report.ideal_copies("broadcast", size, 4) == 3 * size  # three ranks receive the root's buffer
    assert report.ideal_copies("allgather", size, 4) == 3 * size  # each of 4 lacks 3/4 of the output
    assert report.ideal_copies("alltoall", size, 2) == size
    assert report.ideal_copies("reducescatter", size, 2) == 3 * size // 2
    assert report.ideal_copies("allreduce", size, 2) == 3 * size // 2 + size
    with pytest.raises(ValueError):
        report.ideal_copies("gather", size, 2)


def test_inplace_only_still_measures_the_copy(tmp_path):
    out = tmp_path / "inplace.json"
    proc = run_module("benchmarks.collectives", ["-np", "2", "-b", "8", "-e", "64", "-f", "8", "-n", "2", "-w", "1",
                                                 "--ops", "allreduce", "--backends", "shmcomm,memcpy", "--inplace-only",
                                                 "--json", str(out)], 120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    assert all(row["out_of_place"] == {"na": "--inplace-only"} for row in results["shmcomm"]["rows"])
    assert all("na" not in row["out_of_place"] for row in results["memcpy"]["rows"])


@pytest.mark.long
def test_engine_settings_against_the_defaults():
    proc = run_module("benchmarks.engine_settings", ["-np", "2", "--rounds", "1", "--steps", "3", "--warmup", "1"],
                      300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row[0].lstrip("| ") for row in rows[1:]] == [label for label, _ in engine_settings.CONFIGURATIONS]
    assert rows[1][3].strip(" |") == "1.00" and all(float(row[1]) > 0 for row in rows[1:])


def test_smb_bandwidth_and_pingpong(tmp_path):
    out = tmp_path / "smb.json"
    proc = run_module("benchmarks.smb", ["-np", "2", "-b", "8", "-e", "4K", "-f", "16", "-n", "3", "-w", "1",
                                         "--json", str(out)], 120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    document = json.loads(out.read_text())
    rows = document["smb"]["rows"]
    assert [row["size"] for row in rows] == [8, 128, 2048]
    for row in rows:
        assert row["wrong"] == 0, row
        assert row["write"] > 0 and row["read"] > 0 and row["accumulate"] > 0 and row["pingpong_us"] > 0
    if backends.unavailable("mpi"):
        assert document["mpi"] is None
    else:
        assert [row["size"] for row in document["mpi"]["rows"]] == [8, 128, 2048]


def test_streamed_and_plain_exchanges_across_simulated_hosts():
    """benchmarks/exchange_stream.py through benchmarks.simhosts_bench --script and --script-args: a size below
    box_client.STREAM_BYTES and one of several streamed parts, both ways, every rank exchanging at once."""
    from shmcomm.testing import simhosts
    missing = simhosts.missing_prerequisite()
    if missing is not None and os.environ.get("SHMCOMM_REQUIRE_SIMHOSTS") != "1":
        pytest.skip(missing)
    proc = run_module("benchmarks.simhosts_bench", ["--hosts", "2", "--ranks-per-host", "1", "--script",
                                                    "benchmarks/exchange_stream.py", "--bytes", "4K,1M", "--iters",
                                                    "3", "--warmup", "1", "--script-args", "--rounds 1 --both"], 180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every rank at once, box striped, 2 hosts x 1 ranks" in proc.stdout, proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if "plain/streamed" in line and "bytes" in line]
    assert [int(row[0]) for row in rows] == [4096, 1 << 20], proc.stdout
    assert all(float(row[3]) > 0 and float(row[6]) > 0 for row in rows), proc.stdout


def test_multihost_fused_goes_through_the_engine():
    """benchmarks.multihost --fused: every algorithm's row, the tensors fused by the engine across hosts."""
    from shmcomm.testing import simhosts
    missing = simhosts.missing_prerequisite()
    if missing is not None and os.environ.get("SHMCOMM_REQUIRE_SIMHOSTS") != "1":
        pytest.skip(missing)
    proc = run_module("benchmarks.multihost", ["--hosts", "2", "--ranks-per-host", "2", "--bytes", "1M", "--iters",
                                               "1", "--warmup", "1", "--fused"], 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] == ["1048576"]]
    assert len(rows) == 1 and all(float(v) > 0 for v in rows[0][1:5]), proc.stdout
    assert "cost model not calibrated" in proc.stdout, proc.stdout


def test_multihost_breakdown_times_every_phase_on_every_rank():
    """benchmarks.multihost --breakdown --shared: each rank's row of the torus's small path, the first rank of each host
    (the leader) with its cross-host phase and a bare MPI_Sendrecv beside it, the others with the row broadcast they
    wait in, and every rank the same call in one C call. Only that the phases were seen is checked, never how long
    they took."""
    from shmcomm.testing import simhosts
    missing = simhosts.missing_prerequisite()
    if missing is not None and os.environ.get("SHMCOMM_REQUIRE_SIMHOSTS") != "1":
        pytest.skip(missing)
    proc = run_module("benchmarks.multihost", ["--hosts", "2", "--ranks-per-host", "2", "--bytes", "4K,1M", "--iters",
                                               "1", "--warmup", "1", "--breakdown", "--shared"], 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.split()[:1] == ["1048576"] for line in lines), proc.stdout  # the three-phase path, shared
    at = next(i for i, line in enumerate(lines) if line.startswith("where the torus's small path"))
    rows = [line.split() for line in lines[at + 2:at + 6]]
    assert [(int(r[0]), int(r[1]), r[2]) for r in rows] == [(4096, 0, "yes"), (4096, 1, "no"), (4096, 2, "yes"),
                                                             (4096, 3, "no")], proc.stdout
    for r in rows:
        call, row_step, across, exchange, broadcast = (float(v) for v in r[3:8])
        assert call > 0 and row_step > 0 and float(r[10]) > 0, proc.stdout
        if r[2] == "yes":
            assert across >= exchange > 0 and float(r[9]) > 0, proc.stdout
        else:
            assert across == exchange == 0 and broadcast > 0 and r[9] == "-", proc.stdout


@pytest.mark.parametrize("text, value", [("8", 8), ("64K", 64 << 10), ("256M", 256 << 20), ("1G", 1 << 30),
                                         ("4k", 4096), ("2MB", 2 << 20)])
def test_parse_size(text, value):
    assert collectives.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "K", "1.5M", "-8", "8T"])
def test_parse_size_rejects(text):
    with pytest.raises(Exception):
        collectives.parse_size(text)


def test_sweep():
    assert collectives.sweep(8, 256 << 20, 4)[:3] == [8, 32, 128]
    assert collectives.sweep(8, 256 << 20, 4)[-1] == 128 << 20
    assert collectives.sweep(8, 8, 2) == [8]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_busbw_factors(n):
    c = collectives.COLLECTIVES
    assert c["allreduce"].busbw_factor(n) == pytest.approx(2 * (n - 1) / n)
    for name in ("allgather", "reducescatter", "alltoall"):
        assert c[name].busbw_factor(n) == pytest.approx((n - 1) / n)
    assert c["broadcast"].busbw_factor(n) == 1.0


def test_layouts_follow_nccl_tests():
    c = collectives.COLLECTIVES
    # allgather: size and count describe the whole output; reducescatter: the whole input.
    gather = c["allgather"].layout(1000, 4)
    assert (gather.count, gather.send, gather.recv) == (1000, 250, 1000)
    scatter = c["reducescatter"].layout(1000, 4)
    assert (scatter.count, scatter.send, scatter.recv) == (1000, 1000, 250)
    alltoall = c["alltoall"].layout(1001, 4)
    assert (alltoall.count, alltoall.block) == (1000, 250)
    assert c["allgather"].layout(2, 4).count == 4  # never fewer elements than ranks


@pytest.mark.parametrize("name", collectives.OPS)
@pytest.mark.parametrize("dtype", ["float16", "int8", "uint8", "float32"])
def test_expected_results_are_exact(name, dtype):
    """The expected outputs equal a plain numpy simulation of the collective, in every dtype."""
    coll, n = collectives.COLLECTIVES[name], 3
    lay = coll.layout(30, n)
    inputs = [coll.data(r, n, lay, np.dtype(dtype)).astype(np.int64) for r in range(n)]
    for r in range(n):
        if name == "allreduce":
            want = sum(inputs)
        elif name == "broadcast":
            want = inputs[0]
        elif name == "allgather":
            want = np.concatenate(inputs)
        elif name == "reducescatter":
            want = sum(inputs)[r * lay.block:(r + 1) * lay.block]
        else:
            want = np.concatenate([x[r * lay.block:(r + 1) * lay.block] for x in inputs])
        assert np.array_equal(coll.expected(r, n, lay, np.dtype(dtype)).astype(np.int64), want)


def test_table_format():
    cell = {"time_us": 12.5, "p50_us": 12.5, "p99_us": 20.0, "algbw": 1.0, "busbw": 1.0, "wrong": 0, "iters": 3}
    result = {"backend": "shmcomm", "nranks": 2, "dtype": "float32", "library": "shmcomm",
              "rows": [{"op": "allgather", "nominal": 8, "size": 8, "count": 2, "type": "float", "redop": "none",
                        "root": -1, "out_of_place": cell, "in_place": {"na": "no in-place form"}}]}
    lines = report.table_lines(result, "allgather")
    assert HEADER in lines
    row = [line for line in lines if line.strip().startswith("8")][0]
    assert row.split()[:9] == ["8", "2", "float", "none", "-1", "12.50", "1.00", "1.00", "0"]
    assert row.split()[9:] == ["N/A"] * 4
    assert "# Wrong elements: 0 OK" in lines


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path):
    hidden = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv[0] = 'collectives'; "
              "runpy.run_module('benchmarks.collectives', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", hidden, "--plot", str(tmp_path / "p.png")], cwd=str(REPO),
                          env=backends.job_environment(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "pip install matplotlib" in proc.stderr
    assert not os.path.exists(tmp_path / "p.png")


@pytest.mark.long
def test_jax_benchmark_against_mpi4jax_and_the_training_step():
    """Runs with or without mpi4jax (its columns are nan without it); needs jax. With -m long: two JAX jobs, a
    quarter of a minute, for a benchmark that is run by hand."""
    pytest.importorskip("jax", reason="benchmarks.jax needs jax: pip install -e '.[jax]'")
    proc = run_module("benchmarks.jax", ["-np", "2", "-b", "4K", "-e", "64K", "-f", "16", "--rounds", "1", "--budget",
                                         "0.01", "--train"], 240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any("jit allreduce, float32 Sum, 2 ranks" in line for line in lines), proc.stdout
    rows = [line.split(None, 1) for line in lines if line.strip().startswith(("4K", "64K"))]
    assert [row[0] for row in rows] == ["4K", "64K"], proc.stdout
    for _, cells in rows:  # "median (p90)" of jit, sealed, mpi4jax (nan without it) and the numpy API
        medians = re.findall(r"(\S+) \(\s*\S+\)", cells)
        assert len(medians) == 4 and float(medians[0]) > 0 and float(medians[1]) > 0, cells
    steps = [line for line in lines if "distributed / (local + allreduce)" in line]
    assert len(steps) == 3 and "per jax.jit call" in steps[0] and "shmcomm.jax.jit" in steps[1] and \
        "fori_loop" in steps[2], proc.stdout


def test_rounds_report_each_rows_median_round_and_every_wrong_element():
    def round_(times, wrong=0):
        return {"backend": "x", "rows": [{"op": "allreduce", "out_of_place": {"time_us": t, "busbw": 1 / t,
                                                                                "wrong": wrong},
                                          "in_place": {"na": "no in-place form"}} for t in times]}
    merged = collectives.median_round([round_([5.0, 1.0]), round_([3.0, 9.0], wrong=2), round_([4.0, 2.0])])
    assert [row["out_of_place"]["time_us"] for row in merged["rows"]] == [4.0, 2.0]
    assert merged["rows"][0]["out_of_place"]["busbw"] == 1 / 4.0  # the median round's row, whole
    assert [row["out_of_place"]["wrong"] for row in merged["rows"]] == [2, 2]
    assert merged["rows"][1]["in_place"] == {"na": "no in-place form"}
    assert collectives.median_round([round_([3.0]), round_([1.0])])["rows"][0]["out_of_place"]["time_us"] == 1.0


def test_interleaved_shared_and_fused():
    """--shared (shmcomm's allreduce in place on a shared_empty array) and the op `fused` (8 tensors through the
    engine, a fused allreduce of its fusion buffer), each with and without shared buffers, checked against MPI's in
    place."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("no mpiexec beside this interpreter")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "benchmarks.interleaved", "--bytes", "4K,1M",
                           "--ops", "allreduce,fused", "--shared", "--rounds", "2", "--iters", "3",
                           "--setting", "SHMCOMM_SHARED_BUFFERS=unset,0"], cwd=str(REPO),
                          env=backends.job_environment(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert sorted((row[0], int(row[1])) for row in rows) == sorted(
        (op, size) for op in ("allreduce", "fused") for size in (4096, 1 << 20)), proc.stdout
    assert all(float(row[i]) > 0 for row in rows for i in (3, 6, 9)), proc.stdout


def test_a_missing_open_mpi_is_said_with_how_to_install_it_and_never_installed(tmp_path, monkeypatch):
    from benchmarks import openmpi

    monkeypatch.delenv(openmpi.SETTING, raising=False)
    monkeypatch.setattr(openmpi, "DEFAULT_PREFIX", str(tmp_path / "none"))
    assert "python -m benchmarks.openmpi" in backends.unavailable("openmpi")
    assert not (tmp_path / "none").exists()


def test_the_summary_marks_a_figure_whose_iterations_spread_widely():
    from benchmarks import report

    def result(p90_us):
        cell = {"time_us": 10.0, "p50_us": 10.0, "p90_us": p90_us, "p99_us": p90_us, "busbw": 1.0}
        return {"rows": [{"op": "allreduce", "nominal": 8, "size": 8, "out_of_place": cell, "in_place": cell}]}

    entries = report.summary({"shmcomm": result(12.0), "mpi": result(939.0)}, ["allreduce"])
    machine = {"memcpy_bytes": 1 << 20, "memcpy_one_process_GBps": 1.0, "memcpy_two_processes_GBps": 2.0, "line": "m"}
    lines = report.summary_lines(entries, ["shmcomm", "mpi"], machine, "command", "date")
    row = next(line for line in lines if line.startswith("   allreduce"))
    assert row.endswith("noisy: mpi") and any(line.startswith("# noisy: ") for line in lines)
    entries = report.summary({"shmcomm": result(12.0), "mpi": result(15.0)}, ["allreduce"])
    assert not any("noisy" in line for line in report.summary_lines(entries, ["shmcomm", "mpi"], machine, "c", "d"))


def test_the_summary_puts_each_collective_of_every_run_in_one_table_and_one_plot(tmp_path):
    """benchmarks.summary on two runs: a row per size with shmcomm's median and p90, the fastest peer's, and the
    peer's median over shmcomm's; a plot per collective; each run's command and machine under the tables."""
    from benchmarks import summary

    quiet = {"command": "python -m benchmarks.collectives -np 2", "date": "2026-12-06 03:00 UTC", "notes": [],
             "machine": {"line": "machine: 2 cores"}, "options": {"ops": ["allreduce", "alltoall"]}, "results": {}}
    times = {"shmcomm": (10.0, 12.0), "mpi": (25.0, 40.0), "openmpi": (20.0, 30.0), "gloo": (80.0, 90.0)}
    for name, (p50, p90) in times.items():
        rows = []
        for op in ("allreduce", "alltoall"):
            for nominal in (1024, 1 << 20):
                cell = {"time_us": p50 * nominal / 1024, "p50_us": p50 * nominal / 1024,
                        "p90_us": p90 * nominal / 1024, "busbw": nominal / p50, "wrong": 0}
                rows.append({"op": op, "nominal": nominal, "size": nominal, "in_place": cell,
                             "out_of_place": dict(cell)})
        quiet["results"][name] = {"nranks": 2, "rows": rows}
    busy = json.loads(json.dumps(quiet))
    busy["notes"] = ["every job ran beside 2 CPU-bound processes"]
    for row in busy["results"]["openmpi"]["rows"]:  # under load Open MPI falls behind MPICH
        for half in report.HALVES:
            row[half].update(time_us=row[half]["time_us"] * 4, p50_us=row[half]["p50_us"] * 4)
    paths = [tmp_path / "quiet.json", tmp_path / "busy.json"]
    for path, document in zip(paths, (quiet, busy)):
        path.write_text(json.dumps(document))
    if importlib.util.find_spec("matplotlib") is None:
        pytest.fail("the benchmarks' plots need matplotlib: pip install -e '.[test]' installs it")
    proc = run_module("benchmarks.summary", [str(p) for p in paths] + ["--labels", "idle,busy", "--plots",
                                                                          str(tmp_path)], 60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[lines.index("### allreduce") + 4] == ("| 1 KiB | 10.00 (12.00) | Open MPI 20.00 (30.00) | **2.00** "
                                                       "| 10.00 (12.00) | MPICH 25.00 (40.00) | **2.50** |")
    assert lines[lines.index("### alltoall") + 5].startswith("| 1 MiB | 10240 (12288) | Open MPI 20480 (30720) |")
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["allreduce_np2.png", "alltoall_np2.png"]
    assert "- busy: `python -m benchmarks.collectives -np 2`, 2026-12-06 03:00 UTC, machine: 2 cores; every job " \
           "ran beside 2 CPU-bound processes" in lines
    assert run_module("benchmarks.summary", [str(paths[0]), "--labels", "a,b"], 60).returncode == 2


def test_spells_sorts_rounds_by_the_probe():
    """benchmarks.spells: each value of --setting checked against MPI, then rounds until --seconds; every size gets a
    row per kind of round that occurred, with a time and p90 for each value and for MPI."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("no mpiexec beside this interpreter")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "benchmarks.spells", "--seconds", "1", "--bytes",
                           "4K,1M", "--iters", "2", "--setting", "SHMCOMM_PIECE_BYTES=unset,131072"], cwd=str(REPO),
                          env=backends.job_environment(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    rounds, in_spells = map(int, re.search(r"(\d+) rounds, (\d+) in spells", proc.stdout).groups())
    kinds = [line for line in lines if line.startswith("  ") and "probe" in line]
    assert len(kinds) == 1 + (0 < in_spells < rounds) and rounds >= 1, proc.stdout
    rows = [line.split() for line in lines if line.startswith("    ")]
    assert [(row[0], int(row[1])) for row in rows] == [("allreduce", 4096), ("allreduce", 1 << 20)] * len(kinds), \
        proc.stdout
    for row in rows:  # op, bytes, then VAR value us (p90) for each value, MPI us (p90)
        assert row[2:4] + row[6:8] + row[10:11] == ["SHMCOMM_PIECE_BYTES", "unset", "SHMCOMM_PIECE_BYTES", "131072",
                                                     "MPI"], proc.stdout
        assert all(float(row[i].strip("()")) > 0 for i in (4, 5, 8, 9, 11, 12)), proc.stdout


@pytest.mark.parametrize("op", ["allreduce", "allgather", "alltoall"])
def test_placement_reports_each_tenth_of_the_calls(op):
    """benchmarks.placement beside a busy process: ten rows, each with how many calls ran packed and a median for
    each placement that occurred, and a last line whose packed count is the rows' sum."""
    proc = subprocess.run([sys.executable, "-m", "shmcomm.runner", "-np", "2", sys.executable, "-m",
                           "benchmarks.placement", "--op", op, "--bytes", "64K", "--calls", "40", "--cpu-load", "1"],
                          cwd=str(REPO),
                          env=backends.job_environment(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "beside 1 CPU-bound process" in proc.stdout, proc.stdout + proc.stderr
    rows = [line.split()[1:] for line in proc.stdout.splitlines() if re.match(r"\[0\]<stdout>:\s+\d+-\d+ ", line)]
    assert [row[0] for row in rows] == ["%d-%d" % (k, k + 4) for k in range(0, 40, 4)], proc.stdout
    for _, packed, with_packed, apart in rows:
        assert (with_packed == "-") == (packed == "0") and (apart == "-") == (packed == "4"), proc.stdout
    total = re.search(r"# all: (\d+) of 40 calls packed; median ([\d.]+) us, p90 [\d.]+ us", proc.stdout)
    assert total and int(total.group(1)) == sum(int(row[1]) for row in rows) and float(total.group(2)) > 0
