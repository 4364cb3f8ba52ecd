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


def _series(ops, floor_kib, leak_bytes_per_op=0):
    """Rows as the soak samples them on one rank: a floor, a 16 MiB buffer alive in every third sample, and a
    leak of leak_bytes_per_op."""
    return [(0, i, floor_kib + (16 << 10) * (k % 3 == 0) + leak_bytes_per_op * i // 1024, 18, 2, 1000, 0)
            for k, i in enumerate(range(1, ops + 1, ops // 50))]


def test_the_judge_sees_a_leak_and_not_the_peaks_of_live_buffers():
    fields = ("rss_anon_kib", "fds", "threads", "rss_shmem_kib", "shm_files")
    _, grew = soak.judge(_series(100_000, 380_000), 100_000, fields, "flat")
    assert grew == []
    _, grew = soak.judge(_series(100_000, 380_000, leak_bytes_per_op=512), 100_000, fields, "leaking")
    assert [g.split(" grew")[0] for g in grew] == ["rank 0: rss_anon_kib"]
    rows = _series(100_000, 380_000)
    rows[-1] = rows[-1][:3] + (19,) + rows[-1][4:]  # one descriptor more at the end
    _, grew = soak.judge(rows, 100_000, fields, "a descriptor left open")
    assert [g.split(" grew")[0] for g in grew] == ["rank 0: fds"]
