# SPDX-License-Identifier: Apache-2.0
"""Chaos runs (tests/chaos.py): a random rank of a 4-rank job killed (SIGKILL) or stopped (SIGSTOP) at a random
moment of init, collectives of every kind, the engine's negotiation, a held box lock or shutdown; the survivors name
it, the launcher fails naming it, nothing is left in /dev/shm and no process is left. A few runs by default; 50 of
each kind on one host, and 50 SIGKILL runs across two simulated hosts, with -m long."""
import signal

import pytest

import chaos


def _campaign(runs, signum, hosts=1, seed=None):
    failures, lines = chaos.campaign(runs, signum, hosts, seed)
    assert not failures, "\n".join(failures)
    return lines


def test_a_killed_rank_is_named_and_the_job_is_cleaned_up():
    _campaign(3, signal.SIGKILL, seed=3)


def test_a_stopped_rank_is_named_and_the_job_is_cleaned_up():
    _campaign(2, signal.SIGSTOP, seed=4)


@pytest.mark.long
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["KILL", "STOP"])
def test_fifty_chaos_runs_on_one_host(signum):
    _campaign(50, signum)


@pytest.mark.long
def test_fifty_chaos_runs_across_two_simulated_hosts():
    # SIGKILL only: a run with a rank stopped (SIGSTOP) across simulated hosts did not end within minutes, which
    # is still to be understood (hydra and a stopped rank); `python tests/chaos.py --hosts 2 --signal STOP` shows it.
    from test_simhosts import open_hosts

    open_hosts(1).close()  # skips, with the reason, where simulated hosts cannot be made
    _campaign(50, signal.SIGKILL, hosts=2)
