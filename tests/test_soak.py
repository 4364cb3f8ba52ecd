# SPDX-License-Identifier: Apache-2.0
"""The soak run (tests/soak.py): 100,000 mixed operations per rank at np=4; memory, descriptors, threads and
/dev/shm stay flat after warm-up. Minutes long: -m long."""
import pytest

import soak


@pytest.mark.long
@pytest.mark.timeout(2400)  # minutes on 2 quiet cores, several times longer beside CPU-bound processes
def test_a_hundred_thousand_mixed_operations_leave_everything_flat(tmp_path):
    table, grew = soak.soak(str(tmp_path), 100_000)
    print(table)
    assert not grew, "\n".join(grew) + "\n" + table


def _series(ops, floor_kib, leak_bytes_per_op=0, step_kib_at=(0, 0)):
    """Rows as the soak samples them on one rank: a floor, a 16 MiB buffer alive in every third sample, a leak of
    leak_bytes_per_op, and a step of step_kib_at[0] KiB from operation step_kib_at[1] on (a buffer kept for reuse
    that grew late)."""
    step_kib, step_at = step_kib_at
    return [(0, i, floor_kib + (16 << 10) * (k % 3 == 0) + leak_bytes_per_op * i // 1024 + step_kib * (i >= step_at),
             18, 2, 1000, 0) for k, i in enumerate(range(1, ops + 1, ops // 50))]


def test_the_judge_sees_a_leak_and_not_the_peaks_of_live_buffers_nor_a_late_step():
    fields = ("rss_anon_kib", "fds", "threads", "rss_shmem_kib", "shm_files")
    _, grew = soak.judge(_series(100_000, 380_000), 100_000, fields, "flat")
    assert grew == []
    _, grew = soak.judge(_series(100_000, 380_000, leak_bytes_per_op=512), 100_000, fields, "leaking")
    assert [g.split(" grew")[0] for g in grew] == ["rank 0: rss_anon_kib"]
    for step_at in (40_000, 80_000):  # a buffer kept for reuse that reached 20 MiB late, in either span
        _, grew = soak.judge(_series(100_000, 380_000, step_kib_at=(20 << 10, step_at)), 100_000, fields, "a step")
        assert grew == []
    rows = _series(100_000, 380_000)
    rows[-1] = rows[-1][:3] + (19,) + rows[-1][4:]  # one descriptor more at the end
    _, grew = soak.judge(rows, 100_000, fields, "a descriptor left open")
    assert [g.split(" grew")[0] for g in grew] == ["rank 0: fds"]
