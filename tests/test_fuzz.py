# SPDX-License-Identifier: Apache-2.0
"""Fuzzing: every C entry point with random and boundary arguments, in a subprocess (tests/fuzz_core.py: never a
crash, always a result code, an error code where the arguments are certainly wrong); every SHMCOMM_* setting with
bad values (refused at init, the message naming the setting); handles used after they were closed. (The launcher's
own command-line flags are checked by its tests.)"""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import multiproc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_core_survives_random_and_boundary_arguments(tmp_path, seed):
    log = tmp_path / "calls.log"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fuzz_core.py"), str(log), str(seed), "300"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    last = log.read_text().splitlines()[-1:] if log.exists() else []
    assert run.returncode == 0, "the fuzzer died (%d) at %s\n%s" % (run.returncode, last, run.stderr[-3000:])
    assert run.stdout.startswith("fuzz ok"), run.stdout


@pytest.mark.long
def test_the_core_survives_many_seeds(tmp_path):
    for seed in range(10, 40):
        test_the_core_survives_random_and_boundary_arguments(tmp_path, seed)


# (setting, bad values): every SHMCOMM_* setting a rank reads (shmcomm/env/). Launch variables are the launcher's.
BAD_SETTINGS = [
    ("TIMEOUT", ["abc", "0", "-1", "nan", "inf", "1e12", ""]),
    ("START_TIMEOUT", ["x", "0", "-5", "nan"]),
    ("LIVENESS_INTERVAL", ["0", "-0.1", "inf"]),
    ("SPIN_US", ["1.5", "-1", "99999999999"]),
    ("YIELD_US", ["1.5", "-1", "99999999999", "soon"]),
    ("SLOT_BYTES", ["0", "100", "-4096", "4k", str(1 << 60)]),
    ("SMALL_BYTES", ["-1", "x", str(1 << 60)]),
    ("SMB_BYTES", ["-1", "1e6", str(1 << 60)]),
    ("SINGLE_COPY_BYTES", ["-1", "lots", str(1 << 60)]),
    ("CACHE_BYTES", ["0", "lots", str(1 << 60)]),
    ("PIECE_BYTES", ["-1", "1.5", str(1 << 60)]),
    ("PULL_BYTES", ["-1", "128K", str(1 << 60)]),
    ("SHARED_BUFFERS", ["2", "shared"]),
    ("HUGE_PAGES", ["2", "huge"]),
    ("CYCLE_TIME", ["0", "-1", "nan", "fast"]),
    ("FUSION_THRESHOLD", ["-1", "64MB"]),
    ("BUCKET_BYTES", ["-1", "1.5"]),
    ("CACHE_CAPACITY", ["-1", "lots"]),
    ("STALL_CHECK_TIME_SECONDS", ["-1", "nan"]),
    ("STALL_SHUTDOWN_TIME_SECONDS", ["-1", "soon"]),
    ("STALL_CHECK_DISABLE", ["2", "maybe"]),
    ("TIMELINE_MARK_CYCLES", ["2", "maybe"]),
    ("ENGINE", ["2", "banana"]),
    ("ELASTIC", ["yes please"]),
    ("LOG_LEVEL", ["loud", "7"]),
    ("RANKS_PER_HOST", ["-2", "two"]),
    ("JAX_HEAP_BYTES", ["-1", "1G", str(1 << 31)]),
    ("TEST_RACE_PAUSE_US", ["-1", "1ms", str(1 << 31)]),
    ("MPI_CROSSING", ["2", "maybe"]),
]


def _case_ids():
    return ["%s=%s" % (name, value) for name, values in BAD_SETTINGS for value in values if value]


@pytest.mark.parametrize("case", _case_ids())
def test_a_bad_setting_is_refused_at_init_naming_it(monkeypatch, case):
    from shmcomm import env

    name, value = case.split("=", 1)
    for variable in [v for v in os.environ if v.startswith(("SHMCOMM_", "HOROVOD_"))]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("SHMCOMM_" + name, value)
    with pytest.raises(ValueError, match="SHMCOMM_" + name):
        env.validate()


def test_good_settings_pass_and_horovod_spellings_are_checked_too(monkeypatch):
    from shmcomm import env

    for variable in [v for v in os.environ if v.startswith(("SHMCOMM_", "HOROVOD_"))]:
        monkeypatch.delenv(variable)
    for name, value in [("TIMEOUT", "0.5"), ("SLOT_BYTES", "65536"), ("CYCLE_TIME", "5"), ("ENGINE", "true"),
                        ("STALL_CHECK_DISABLE", "1"), ("LOG_LEVEL", "debug"), ("SPIN_US", "0")]:
        monkeypatch.setenv("SHMCOMM_" + name, value)
    env.validate()
    assert env.tuning(1).timeout_s == 0.5 and env.engine_requested() and not env.engine().stall_check
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "nan")
    monkeypatch.delenv("SHMCOMM_CYCLE_TIME")
    with pytest.raises(ValueError, match="CYCLE_TIME"):
        env.validate()


def test_waiters_yield_a_slice_per_rank_sharing_a_core(monkeypatch):
    """SHMCOMM_YIELD_US's default: 1000 us while every rank has a core (another process may share it), then 1000 us
    per rank sharing one."""
    from shmcomm import env

    for variable in [v for v in os.environ if v.startswith(("SHMCOMM_", "HOROVOD_"))]:
        monkeypatch.delenv(variable)
    cores = len(os.sched_getaffinity(0))
    assert env.tuning(1).yield_us == 1000 and env.tuning(cores).yield_us == 1000
    assert env.tuning(cores + 1).yield_us == 2000
    assert env.tuning(4 * cores).yield_us == 4000 and env.tuning(4 * cores + 1).yield_us == 5000
    monkeypatch.setenv("SHMCOMM_YIELD_US", "7")
    assert env.tuning(4 * cores).yield_us == 7


def test_allreduce_pieces_follow_the_l2_only_while_every_rank_has_a_core(monkeypatch):
    """SHMCOMM_PIECE_BYTES's default: an eighth of the L2 the machine reports, at least 128 KiB, for pulled steps
    only (piece_probed: staged ones take a half's share); 0 (a staging half's share) with more ranks than cores, where
    each step costs context switches; set, it sizes both. Single copy from 16 KiB, or from the L2's size with more
    ranks than cores for broadcast; the L2 sizes its chunks either way, and the last-level cache (8 L2s where the
    machine does not say) where reductions' outputs start to stream past it."""
    from shmcomm import env
    from shmcomm.env import machine

    for variable in [v for v in os.environ if v.startswith(("SHMCOMM_", "HOROVOD_"))]:
        monkeypatch.delenv(variable)
    cores = len(os.sched_getaffinity(0))
    l2 = machine.cache_bytes(2) or (1 << 20)
    assert env.tuning(cores).piece_bytes == max(l2 // 8, 128 << 10) and env.tuning(cores).single_copy_bytes == 16 << 10
    assert env.tuning(cores).piece_probed
    assert env.tuning(cores).broadcast_single_copy_bytes == 16 << 10
    assert env.tuning(cores + 1).piece_bytes == 0 and env.tuning(cores + 1).single_copy_bytes == 32 << 10
    assert env.tuning(cores + 1).broadcast_single_copy_bytes == max(32 << 10, l2)
    assert env.tuning(cores).cache_bytes == env.tuning(cores + 1).cache_bytes == l2
    assert env.tuning(cores).shared_cache_bytes == (machine.cache_bytes(3) or 8 * l2)
    monkeypatch.setenv("SHMCOMM_PIECE_BYTES", "4096")
    assert env.tuning(cores + 1).piece_bytes == 4096 and not env.tuning(cores).piece_probed
    # Allreduces and reduce-scatters pull from 128 KiB at two ranks with a core each, never otherwise unless set.
    assert env.tuning(2).pull_bytes == (128 << 10 if cores >= 2 else 0)
    assert env.tuning(1).pull_bytes == env.tuning(3).pull_bytes == env.tuning(cores + 1).pull_bytes == 0
    monkeypatch.setenv("SHMCOMM_PULL_BYTES", "1")
    assert env.tuning(cores + 1).pull_bytes == 1
    monkeypatch.setenv("SHMCOMM_SINGLE_COPY_BYTES", "1")  # set: every collective's, broadcast's too
    assert env.tuning(cores + 1).single_copy_bytes == env.tuning(cores + 1).broadcast_single_copy_bytes == 1


def _init_with_bad_setting():
    import shmcomm

    with pytest.raises(ValueError, match="SHMCOMM_TIMEOUT='nan'"):
        shmcomm.init()
    assert not shmcomm.is_initialized()
    return True


def test_init_refuses_a_bad_setting_before_joining():
    assert multiproc.run(2, _init_with_bad_setting, env={"SHMCOMM_TIMEOUT": "nan"}) == [True, True]


def _closed_handles():
    import shmcomm
    from shmcomm import basics

    shmcomm.init()
    box = shmcomm.SoftMemoryBox("fuzzbox", shape=(4,), create=True)
    box.close()
    box.close()  # twice is harmless
    for call in (lambda: box.read(), lambda: box.write(np.ones(4, np.float32)), lambda: box.lock(),
                 lambda: box.wait_version(1, timeout=0.01)):
        with pytest.raises(shmcomm.ShmCommError):
            call()
    shm = basics.communicator().shm
    shmcomm.shutdown()
    x = np.ones(4, np.float32)
    with pytest.raises(shmcomm.InvalidArgumentError, match="communicator is NULL"):  # a closed transport
        from shmcomm._native import ffi, lib

        shm.allreduce(ffi.from_buffer(x), ffi.from_buffer(x), 4, lib.SMC_FLOAT32, lib.SMC_SUM, 1.0, 1.0, 1, 0, "x")
    for call in (lambda: shmcomm.allreduce(x), lambda: shmcomm.barrier(), lambda: shmcomm.allreduce_async(x)):
        with pytest.raises(shmcomm.NotInitializedError):
            call()
    return True


def test_handles_used_after_they_were_closed_raise():
    assert multiproc.run(1, _closed_handles) == [True]


def test_nan_and_endless_timeouts_are_refused_by_the_box():
    def body():
        import shmcomm

        shmcomm.init()
        box = shmcomm.SoftMemoryBox("timeouts", shape=(2,), create=True)
        for timeout in (math.nan, -1.0, math.inf):
            with pytest.raises(shmcomm.InvalidArgumentError):
                box.lock(timeout)
            with pytest.raises(shmcomm.InvalidArgumentError):
                box.wait_version(5, timeout=timeout)
        box.close()
        return True

    assert multiproc.run(1, body) == [True]
