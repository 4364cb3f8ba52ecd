# SPDX-License-Identifier: Apache-2.0
"""The cross-host agreement's arithmetic: every rank's schedule pairs up with its partners', and combining headers
gives one verdict whatever the order (which is what makes every rank reach the same one)."""
import itertools
import random

import numpy as np
import pytest

pytest.importorskip("mpi4py")
from shmcomm.algorithms.agreement import FAILED, MISMATCH, OK, _schedule  # noqa: E402
from shmcomm.transport.kernels import combine_headers  # noqa: E402


@pytest.mark.parametrize("size", range(1, 18))
def test_schedules_pair_up_and_reach_everyone(size):
    plans = [_schedule(r, size) for r in range(size)]
    folded = [r for r, (into, _, _) in enumerate(plans) if into is not None]
    for r in folded:
        assert plans[r][1] is None and plans[r][2] == [] and plans[plans[r][0]][1] == r
    active = [r for r in range(size) if r not in folded]
    rounds = {len(plans[r][2]) for r in active}
    assert len(rounds) == 1 and 2 ** rounds.pop() == len(active)
    for k in range(len(plans[active[0]][2])):
        for r in active:
            partner = plans[r][2][k]
            assert plans[partner][2][k] == r  # both sides of every round expect each other
    # Everyone hears from everyone: simulate the rounds on sets of ranks.
    heard = {r: {r} for r in range(size)}
    for r in folded:
        heard[plans[r][0]] |= heard[r]
    for k in range(len(plans[active[0]][2]) if active else 0):
        heard = {r: heard[r] | heard[plans[r][2][k]] if r in active else heard[r] for r in range(size)}
    for r in folded:
        heard[r] = heard[plans[r][0]]
    assert all(heard[r] == set(range(size)) for r in range(size))


def _fold(headers):
    """(status, culprit) of the (signature, status, culprit) headers combined in order, as the rounds combine them."""
    rows = np.zeros((len(headers), 4), dtype=np.uint64)
    rows[:, :3] = headers
    combine_headers(rows)
    return int(rows[0, 1]), int(rows[0, 2])


def test_combining_gives_one_verdict_in_any_order():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 6)
        headers = [(rng.choice([11, 11, 11, 12]), rng.choice([OK, OK, OK, MISMATCH, FAILED]),
                    rng.choice([0, 0, 1 + rng.randint(0, 5)])) for _ in range(n)]
        verdicts = {_fold(list(order)) for order in itertools.permutations(headers)}
        assert len(verdicts) == 1, headers
        status, culprit = verdicts.pop()
        statuses = {h[1] for h in headers}
        if statuses == {OK}:
            assert status == (OK if len({h[0] for h in headers}) == 1 else MISMATCH)
        else:
            assert status == max(statuses)
        failed = [h[2] for h in headers if h[2]]
        assert culprit == (min(failed) if failed else 0)
