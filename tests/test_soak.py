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
