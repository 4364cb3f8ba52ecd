# SPDX-License-Identifier: Apache-2.0
"""horovodrun parity: shmcommrun takes every flag of horovodrun 0.28 (and its config file), each with its effect on
the ranks or a one-line note; bad values are usage errors naming the flag."""
import json
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

from test_runner import launch, launcher_env, launcher_args, rank_lines, rank_program, REPO

# A rank reports what the library made of its environment, and where its engine thread may run.
REPORT = rank_program("""
    import json, os, threading
    import shmcomm
    from shmcomm import env
    shmcomm.init(engine=True)
    from shmcomm import engine
    found = [t.native_id for t in threading.enumerate() if t.name == "shmcomm-engine"]
    assert found, "no engine thread: %r" % (engine.current()._fatal,)
    tid = found[0]
    with open("/proc/self/task/%d/status" % tid) as status:
        cores = next(line.split()[1] for line in status if line.startswith("Cpus_allowed_list"))
    # A rank's shutdown ends the others' engine threads too: none goes before every rank has read its thread.
    shmcomm.barrier()
    e, a, t = env.engine(), env.autotune(), env.tuning(1)
    print(json.dumps({"env": dict(os.environ), "engine_cores": cores, "timeout": t.timeout_s,
                      "start_timeout": t.start_timeout_s, "cycle_ms": e.cycle_s * 1000,
                      "fusion": e.fusion_threshold, "cache": e.cache_capacity, "stall_check": e.stall_check,
                      "stall_s": e.stall_check_s, "shutdown_s": e.stall_shutdown_s,
                      "timeline": env.timeline(), "algorithm": env.paths(2).algorithm,
                      "autotune": [a.enabled, a.log_file, a.warmup_samples, a.steps_per_sample, a.max_samples,
                                   a.noise], "log_with_time": env.log_with_time(),
                      "log_level": env.log_level(), "mpi_threads_disabled": env.mpi_threads_disabled()}))
    shmcomm.shutdown()
""")


def reports(result, stdout=None):
    assert result.returncode == 0, result.stdout + result.stderr
    lines = rank_lines(result.stdout if stdout is None else stdout)
    assert sorted(lines) == [0, 1], result.stdout + result.stderr
    return [json.loads(next(line for line in lines[rank] if line.startswith("{"))) for rank in (0, 1)]


def notes(result):
    return [line for line in result.stderr.splitlines() if line.startswith("shmcommrun: note: ")]


def test_every_horovodrun_flag_is_accepted_and_takes_effect(tmp_path):
    # --min-np, --max-np and --host-discovery-script make the job elastic: tests/test_elastic.py runs them.
    timeline = tmp_path / "timeline.json"
    flags = ["--gloo", "--disable-cache", "--start-timeout", "45", "--network-interfaces", "lo",
             "--network-interface", "lo", "--output-filename", tmp_path / "out", "--verbose",
             "-p", "2222", "-i", tmp_path / "key", "--fusion-threshold-mb", "2", "--cycle-time-ms", "2.5",
             "--cache-capacity", "77", "--hierarchical-allreduce", "--no-hierarchical-allgather",
             "--torus-allreduce", "--autotune", "--autotune-log-file", tmp_path / "tune.csv",
             "--autotune-warmup-samples", "1", "--autotune-steps-per-sample", "4",
             "--autotune-bayes-opt-max-samples", "6", "--autotune-gaussian-process-noise", "0.5",
             "--slots-per-host", "2", "--elastic-timeout", "30",
             "--reset-limit", "3", "--blacklist-cooldown-range", "10", "100",
             "--timeline-filename", timeline, "--timeline-mark-cycles",
             "--no-stall-check", "--stall-check-warning-time-seconds", "20",
             "--stall-check-shutdown-time-seconds", "40", "--mpi-threads-disable", "--mpi-args=-v",
             "--tcp", "--binding-args=-bind-to none", "--num-nccl-streams", "2", "--thread-affinity", "0",
             "--gloo-timeout-seconds", "33", "--log-level", "info", "--log-with-timestamp",
             "--prefix-output-with-timestamp"]
    result = launch("-np", 2, *flags, *REPORT)
    assert result.returncode == 0, result.stderr
    # -prefix-timestamp: every forwarded line starts with the time of day
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    stamped = [line for line in result.stdout.splitlines() if re.match(stamp + r"\[\d\]<stdout>: ", line)]
    assert len(stamped) == len(result.stdout.splitlines()) >= 2
    plain = "\n".join(re.sub("^" + stamp, "", line) for line in result.stdout.splitlines())
    for report in reports(result, plain):
        env = report["env"]
        assert env["HOROVOD_START_TIMEOUT"] == "45" and report["start_timeout"] == 45
        assert report["fusion"] == 2 << 20 and report["cycle_ms"] == 2.5 and report["cache"] == 77
        assert env["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "1" and env["HOROVOD_TORUS_ALLREDUCE"] == "1"
        assert report["algorithm"] == "torus"
        assert env["HOROVOD_HIERARCHICAL_ALLGATHER"] == "0"
        assert report["autotune"] == [True, str(tmp_path / "tune.csv"), 1, 4, 6, 0.5]
        assert report["timeline"] == [str(timeline), True]
        assert report["stall_check"] is False and report["stall_s"] == 20 and report["shutdown_s"] == 40
        assert report["mpi_threads_disabled"] is True and env["NCCL_IB_DISABLE"] == "1"
        assert env["HOROVOD_NUM_NCCL_STREAMS"] == "2" and env["HOROVOD_ELASTIC_TIMEOUT"] == "30"
        assert report["engine_cores"] == "0"  # --thread-affinity pinned the engine thread
        assert report["timeout"] == 33  # --gloo-timeout-seconds bounds the collectives
        assert report["log_with_time"] is True and report["log_level"] == 20
    # the log records carry the time; --output-filename kept the raw output; --verbose printed the plan
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \[0\] shmcomm INFO", result.stdout + result.stderr)
    assert (tmp_path / "out" / "rank.0" / "stdout").read_text().startswith("{")
    assert "launching 2 rank(s)" in result.stderr
    said = "\n".join(notes(result))
    for flag in ("--gloo", "--disable-cache", "--num-nccl-streams", "hierarchical-allgather", "--slots-per-host",
                 "--tcp", "--binding-args", "-i/--ssh-identity-file", "--mpi-args",
                 "--[no-]hierarchical-allreduce"):
        assert flag in said, said
    assert all(len(line) < 400 for line in notes(result))


@pytest.mark.parametrize("flags, meant", [
    (["--no-hierarchical-allreduce"], "mpi"), (["--no-torus-allreduce"], "mpi"), ([], "auto"),
    (["--allreduce-algo", "ring", "--hierarchical-allreduce"], "ring")])
def test_hierarchical_switches_choose_the_algorithm(flags, meant):
    program = rank_program("from shmcomm import env; print(env.paths(2).algorithm)")
    result = launch("-np", 2, *flags, *program)
    assert result.returncode == 0, result.stderr
    assert {lines[0] for lines in rank_lines(result.stdout).values()} == {meant}


def test_horovod_variables_work_without_the_launcher_flags():
    result = launch("-np", 2, *REPORT, env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "12", "HOROVOD_THREAD_AFFINITY": "0,0",
                                           "HOROVOD_LOG_HIDE_TIME": "0", "HOROVOD_AUTOTUNE": "1",
                                           "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "7",
                                           "HOROVOD_HIERARCHICAL_ALLREDUCE": "0", "HOROVOD_MPI_THREADS_DISABLE": "1"})
    for report in reports(result):
        assert report["timeout"] == 12 and report["engine_cores"] == "0" and report["log_with_time"] is True
        assert report["autotune"][0] is True and report["autotune"][3] == 7
        assert report["algorithm"] == "mpi" and report["mpi_threads_disabled"] is True


@pytest.mark.long
def test_version_and_check_build_need_no_np():
    from shmcomm import __version__

    result = subprocess.run(launcher_args("-v"), cwd=REPO, env=launcher_env(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == __version__
    result = subprocess.run(launcher_args("-cb"), cwd=REPO, env=launcher_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "shmcomm" in result.stdout, result.stderr


def test_jsrun_is_refused():
    result = launch("-np", 2, "--jsrun", "true")
    assert result.returncode == 2 and "--jsrun" in result.stderr and "jsrun" in result.stderr.split("error:")[1]


@pytest.mark.parametrize("flag, value", [
    ("--start-timeout", "soon"), ("--fusion-threshold-mb", "-1"), ("--cycle-time-ms", "nan"),
    ("--cache-capacity", "1.5"), ("--autotune-warmup-samples", "-2"), ("--autotune-steps-per-sample", "0"),
    ("--autotune-bayes-opt-max-samples", "0"), ("--autotune-gaussian-process-noise", "1.5"),
    ("--stall-check-warning-time-seconds", "x"), ("--stall-check-shutdown-time-seconds", "-3"),
    ("--thread-affinity", "first"), ("--num-nccl-streams", "-1"), ("--gloo-timeout-seconds", "never"),
    ("--log-level", "loud"), ("--min-np", "0"), ("--max-np", "1"), ("--min-np", "3"), ("--elastic-timeout", "-1"),
    ("--reset-limit", "0"), ("--slots-per-host", "x"), ("-p", "70000"), ("--blacklist-cooldown-range", "9 3"),
    ("--ssh-port", "ssh"), ("-np", "two")])
def test_bad_values_are_usage_errors_naming_the_flag(flag, value):
    result = launch("-np", 2, flag, *value.split(" "), "true") if flag != "-np" else launch(flag, value, "true")
    assert result.returncode == 2, result.stderr
    assert "usage:" in result.stderr and flag in result.stderr.split("error:")[1], result.stderr


@pytest.mark.parametrize("name, value", [("SHMCOMM_TIMEOUT", "abc"), ("HOROVOD_CYCLE_TIME", "-1"),
                                         ("SHMCOMM_LOG_LEVEL", "loud"), ("HOROVOD_TIMELINE_MARK_CYCLES", "maybe"),
                                         ("SHMCOMM_TORUS_GRID", "3x3")])
def test_a_bad_setting_is_refused_before_any_rank_starts(tmp_path, name, value):
    started = tmp_path / "started"
    result = launch("-np", 2, sys.executable, "-c", "open(%r, 'a').close()" % str(started), env={name: value})
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and name in result.stderr and value in result.stderr, result.stderr
    assert result.stdout == "" and not started.exists()


def test_a_misspelt_flag_gets_the_closest_one():
    result = launch("-np", 2, "--fusion-treshold-mb", "4", "true")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].endswith("--fusion-treshold-mb (did you mean --fusion-threshold-mb?)")


def test_host_lists_exclude_each_other():
    result = launch("-np", 2, "-H", "localhost:2", "-hostfile", "/dev/null", "true")
    assert result.returncode == 2 and "not allowed with" in result.stderr


def test_a_failing_discovery_script_is_a_usage_error(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho no hosts for you >&2\nexit 3\n")
    script.chmod(0o755)
    result = launch("-np", 2, "--host-discovery-script", script, "true")
    assert result.returncode == 2 and "exited with code 3" in result.stderr and "no hosts for you" in result.stderr


CONFIG = """
controller: gloo
params:
  fusion_threshold_mb: 8
  cycle_time_ms: 4
  cache_capacity: 99
  hierarchical_allreduce: false
autotune:
  enabled: true
  warmup_samples: 2
  steps_per_sample: 5
  bayes_opt_max_samples: 9
  gaussian_process_noise: 0.25
timeline:
  filename: {timeline}
  mark_cycles: true
stall_check:
  enabled: false
  warning_time_seconds: 15
library_options:
  mpi_threads_disable: true
  ccl_bgt_affinity: 0
  gloo_timeout_seconds: 21
logging:
  level: debug
  with_timestamp: true
"""


def test_config_file_in_horovods_layout_with_the_command_line_on_top(tmp_path):
    config = tmp_path / "hvd.yaml"
    config.write_text(CONFIG.format(timeline=tmp_path / "t.json"))
    result = launch("-np", 2, "--config-file", config, "--cycle-time-ms", "6", "--stall-check",
                    "--autotune-steps-per-sample", "11", *REPORT)
    for report in reports(result):
        assert report["fusion"] == 8 << 20 and report["cache"] == 99
        assert report["cycle_ms"] == 6  # the command line overrides the file
        assert report["stall_check"] is True and report["stall_s"] == 15
        assert report["autotune"] == [True, None, 2, 11, 9, 0.25]
        assert report["timeline"] == [str(tmp_path / "t.json"), True]
        assert report["algorithm"] == "mpi" and report["mpi_threads_disabled"] is True
        assert report["engine_cores"] == "0" and report["timeout"] == 21
        assert report["log_level"] == 10 and report["log_with_time"] is True
    assert any("--gloo" in line for line in notes(result))


@pytest.mark.parametrize("text, named", [
    ("params:\n  fusion_threshold_mb: lots\n", "params.fusion_threshold_mb"),
    ("params:\n  fusion_treshold_mb: 4\n", "params.fusion_treshold_mb"),
    ("autotune:\n  gaussian_process_noise: 2\n", "autotune.gaussian_process_noise"),
    ("stall_check:\n  enabled: maybe\n", "stall_check.enabled"),
    ("tuning:\n  x: 1\n", "'tuning'"), ("controller: jsrun\n", "controller"),
    ("params: [1, 2\n", "not valid YAML"), ("- a list\n", "mapping")])
def test_bad_config_files_are_usage_errors_naming_the_entry(tmp_path, text, named):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    result = launch("-np", 2, "--config-file", config, "true")
    assert result.returncode == 2 and "--config-file" in result.stderr and named in result.stderr, result.stderr


def test_multi_host_flags_reach_mpiexec_and_ssh(tmp_path):
    from shmcomm.runner import mpi_launch

    env = mpi_launch.job_environment("t" * 32, {}, {}, 2, 4, tcp_only=True)
    assert env["UCX_TLS"] == "tcp,self,sm" and env["FI_PROVIDER"] == "tcp" and env["NCCL_IB_DISABLE"] == "1"
    assert "UCX_TLS" not in mpi_launch.job_environment("t" * 32, {}, {"UCX_TLS": "rc"}, 2, 4, tcp_only=True)
    # Each host's cores (taken to be this one's) shared out among its ranks, unless the caller set it
    assert env["OMP_NUM_THREADS"] == "2"
    assert mpi_launch.job_environment("t" * 32, {}, {}, 3, 4)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in mpi_launch.job_environment("t" * 32, {}, {"OMP_NUM_THREADS": "3"}, 2, 4)
    hydra = mpi_launch.launcher_environment({}, 2222, str(tmp_path / "id key"))
    assert shlex.split(hydra["HYDRA_LAUNCHER_EXTRA_ARGS"]) == ["-p", "2222", "-i", str(tmp_path / "id key")]


SIM_REPORT = textwrap.dedent("""
    import json, os
    import shmcomm
    from shmcomm import basics
    shmcomm.init()
    from mpi4py import MPI  # after init: imported first, it would have initialised MPI itself
    print(json.dumps({"thread_level": MPI.Query_thread() == MPI.THREAD_SERIALIZED,
                      "algorithm": basics.communicator().algorithm, "ucx": os.environ.get("UCX_TLS")}), flush=True)
    shmcomm.shutdown()
""")


def test_multi_host_flags_across_simulated_hosts(tmp_path):
    from test_simhosts import job_env, open_hosts

    sim = open_hosts(2)
    try:
        # An ssh stand-in that notes its options, then runs the simulated hosts' own.
        agent = tmp_path / "agent"
        agent.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\nexec {sim.agent} \"$@\"\n")
        agent.chmod(0o755)
        args = sim.shmcommrun_args(1)
        args[args.index("--launcher-agent") + 1] = str(agent)
        result = subprocess.run(
            [sys.executable, "-m", "shmcomm.runner", *args, "-p", "2200", "-i", str(tmp_path / "key"), "--tcp",
             "--binding-args=-bind-to none", "--mpi-threads-disable", "--hierarchical-allreduce", "--verbose",
             "--output-filename", str(tmp_path / "out"), "--prefix-output-with-timestamp",
             sys.executable, "-c", SIM_REPORT], cwd=REPO, env=job_env(), stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=240)
    finally:
        sim.close()
    assert result.returncode == 0, result.stdout + result.stderr
    # -prefix-timestamp: every forwarded line starts with the time of day; --output-filename kept the raw output
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    assert all(re.match(stamp + r"\[\d\]<stdout>: ", line) for line in result.stdout.splitlines()), result.stdout
    lines = rank_lines("\n".join(re.sub("^" + stamp, "", line) for line in result.stdout.splitlines()))
    for rank in (0, 1):
        report = json.loads(lines[rank][-1])
        assert report == {"thread_level": True, "algorithm": "torus", "ucx": "tcp,self"}, report  # the sim's UCX_TLS
        assert (tmp_path / "out" / f"rank.{rank}" / "stdout").read_text() == lines[rank][-1] + "\n"
    assert "-bind-to none" in result.stderr  # in the mpiexec command --verbose prints
    calls = (tmp_path / "calls").read_text()
    assert "-p 2200" in calls and f"-i {tmp_path / 'key'}" in calls


ENV = rank_program("import json, os; print(json.dumps(dict(os.environ)))")


@pytest.mark.parametrize("flags, name, value", [
    (["--no-autotune"], "HOROVOD_AUTOTUNE", "0"), (["--no-timeline-mark-cycles"], "HOROVOD_TIMELINE_MARK_CYCLES", "0"),
    (["--no-mpi-threads-disable"], "HOROVOD_MPI_THREADS_DISABLE", "0"),
    (["--log-without-timestamp"], "HOROVOD_LOG_HIDE_TIME", "1"),
    (["--log-hide-timestamp"], "HOROVOD_LOG_HIDE_TIME", "1"),
    (["--no-log-hide-timestamp"], "HOROVOD_LOG_HIDE_TIME", "0"),
    (["--stall-check"], "HOROVOD_STALL_CHECK_DISABLE", "0"),
    (["-H", "localhost:2"], "SHMCOMM_SIZE", "2"),
    (["--mpi"], "SHMCOMM_SIZE", "2")])
def test_other_spellings(tmp_path, flags, name, value):
    result = launch("-np", 2, *flags, *ENV)
    assert result.returncode == 0, result.stderr
    assert {json.loads(lines[0])[name] for lines in rank_lines(result.stdout).values()} == {value}
    if flags[0] == "--mpi":
        assert len(notes(result)) == 1


def test_hostfile_with_a_single_dash(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    result = launch("-np", 2, "-hostfile", hostfile, *ENV)
    assert result.returncode == 0 and len(rank_lines(result.stdout)) == 2, result.stderr
    assert launch("-np", 3, "-hostfile", hostfile, "true").returncode == 2  # more ranks than slots


def test_help_is_short_and_the_tuning_flags_are_listed_on_their_own():
    from shmcomm.runner import flags

    short = subprocess.run([sys.executable, "-m", "shmcomm.runner", "--help"], capture_output=True, text=True,
                           cwd=REPO)
    assert short.returncode == 0 and short.stderr == "", short.stderr
    lines = short.stdout.splitlines()
    assert len(lines) <= 100, len(lines)
    for heading in ("hosts:", "multi-host jobs", "elastic jobs", "examples:"):
        assert any(line.startswith(heading) for line in lines), heading
    assert len([line for line in lines if line.startswith("  shmcommrun -np")]) == 3
    assert "%d tuning flags" % (len(flags.SWITCHES) + len(flags.ENV_FLAGS)) in short.stdout
    tuning = subprocess.run([sys.executable, "-m", "shmcomm.runner", "--help-tuning"], capture_output=True,
                            text=True, cwd=REPO)
    assert tuning.returncode == 0 and tuning.stdout.startswith("tuning ("), tuning.stdout + tuning.stderr
    for flag in [on[0] for _, on, _, _, _ in flags.SWITCHES] + [flag for flag, *_ in flags.ENV_FLAGS]:
        assert re.search(r"^  %s\b" % re.escape(flag), tuning.stdout, re.MULTILINE), flag
        assert not re.search(r"^  %s\b" % re.escape(flag), short.stdout, re.MULTILINE), flag
    # Every flag says what it does.
    for action in flags.build_parser("shmcommrun")._actions:
        assert action.help, action.option_strings
