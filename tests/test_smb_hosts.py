# SPDX-License-Identifier: Apache-2.0
"""Soft Memory Boxes across simulated hosts: exact concurrent accumulates from every rank (with the home host's
ranks busy in numpy), atomic exchanges, the lock across hosts, striped boxes (created by every rank at once),
versions waking ranks on other hosts, bad inputs, and the failures: the home host killed, a lock holder on another
host killed."""
import functools
import json
import os
import sys

import pytest

from test_multihost import _shmcommrun
from test_simhosts import open_hosts

from shmcomm.testing import outcomes

CHECKS = """
import json, os, sys, time, numpy as np, shmcomm
from shmcomm import basics
shmcomm.init()
out = sys.argv[1]
r, n = shmcomm.rank(), shmcomm.size()
net = basics.communicator().box_network
hosts, host = net.hosts, net.host
report = {"host": host}
K = 12

def expected_sum(count):
    per_rank = np.full(count, 1.0)
    per_rank[::7] = -1.0
    return sum(K * 1.5 * (q + 1) for q in range(n)) * per_rank

def delta(count, scale):
    d = np.full(count, scale, np.float32)
    d[::7] = -scale
    return d

# Every rank accumulates into a box homed on each host in turn: alpha 1 and alpha 0.5 (integer-valued, exact).
report["sum"] = {}
for home in range(hosts):
    box = shmcomm.SoftMemoryBox("sum%d" % home, shape=(70_000,), dtype=np.float32, home=home)
    shmcomm.barrier()
    for i in range(K):
        box.accumulate(delta(box.count, r + 1), alpha=1.0)
        box.accumulate(delta(box.count, r + 1), alpha=0.5, beta=1.0)
    shmcomm.barrier()
    report["sum"][home] = bool((box.read() == expected_sum(box.count)).all()) and box.version == 2 * K * n
    box.close()

# The home host's ranks compute (numpy, no shmcomm call) while the others accumulate: the box servers progress.
busy = shmcomm.SoftMemoryBox("busy", shape=(1 << 16,), dtype=np.float32, home=0)
done = shmcomm.SoftMemoryBox("done", shape=(1,), dtype=np.float32, home=0, local=False)
remote_ranks = n - len(net.host_ranks[0])
shmcomm.barrier()
computing = shmcomm.SoftMemoryBox("computing", shape=(1,), dtype=np.float32, home=0)
shmcomm.barrier()
if host == 0:
    a = np.random.default_rng(r).standard_normal((256, 256))
    products, deadline = 0, time.monotonic() + 120
    computing.accumulate(np.ones(1, np.float32))  # the other hosts start once every rank here is in the loop below
    while done.version < remote_ranks and time.monotonic() < deadline:
        a = np.tanh(a @ a.T)
        products += 1
    report["busy_products"] = products
    report["busy_finished"] = done.version >= remote_ranks
else:
    computing.wait_version(len(net.host_ranks[0]), timeout=60)
    for i in range(K):
        busy.accumulate(np.ones(busy.count, np.float32))
    done.accumulate(np.ones(1, np.float32))
shmcomm.barrier()
report["busy_sum"] = bool((busy.read() == K * remote_ranks).all())

# The home host's ranks hold the interpreter lock without a break (one C call through ctypes.PyDLL, which keeps it)
# while the others exchange and read: the box servers serve without the interpreter. The remote ranks start once
# every home rank has said it goes in, and check afterwards that none has come out yet.
import ctypes
held = shmcomm.SoftMemoryBox("held", shape=(1 << 12,), dtype=np.float64, home=0)
holding = shmcomm.SoftMemoryBox("holding", shape=(1,), dtype=np.float32, home=0)
home_ranks = len(net.host_ranks[0])
shmcomm.barrier()
if host == 0:
    holding.accumulate(np.ones(1, np.float32))
    ctypes.PyDLL(None).poll(None, 0, 4000)  # 4 s inside C with the interpreter lock held
    holding.accumulate(np.ones(1, np.float32))
else:
    holding.wait_version(home_ranks, timeout=60)
    x = np.full(held.count, r + 1.0)
    for i in range(K):
        d = x.copy()
        held.exchange(d, 0.5)
        x -= d
        held.read()
    report["served_while_held"] = holding.version == home_ranks
shmcomm.barrier()

# Read-modify-write under the lock from every rank: nothing lost, on a box of one home and on a striped one.
counter = shmcomm.SoftMemoryBox("counter", shape=(1,), dtype=np.int64, home=hosts - 1)
striped = shmcomm.SoftMemoryBox("scounter", shape=(3 * hosts + 1,), dtype=np.int64, stripes=hosts)
shmcomm.barrier()
for i in range(10):
    with counter.locked():
        counter.write(counter.read() + 1)
    with striped.locked():
        striped.write(striped.read() + 1)
shmcomm.barrier()
report["lock"] = int(counter.read()[0])
report["striped_lock"] = striped.read().tolist()
report["striped_hosts"] = list(striped.hosts)
shmcomm.barrier()  # read before anyone accumulates below

# Every rank creates the same striped boxes at once: one description write between them, so each box is at
# version 0 (a second write would pass for the first write to the box, and wake its readers too early).
fresh = []
for i in range(12):
    shmcomm.barrier()
    fresh.append(shmcomm.SoftMemoryBox("race%d" % i, shape=(64,), dtype=np.float64, stripes=hosts))
shmcomm.barrier()
report["fresh_versions"] = [box.version for box in fresh]
shmcomm.barrier()
for box in fresh:
    box.close()

# A striped box found by name, without shape or stripes, and its exact sum.
attached = shmcomm.SoftMemoryBox("scounter", timeout=30)
attached.accumulate(np.arange(attached.count, dtype=np.int64))
shmcomm.barrier()
report["striped_attach"] = [list(attached.shape), str(attached.dtype), list(attached.hosts)]
report["striped_sum"] = bool((attached.read() == 10 * n + n * np.arange(attached.count)).all())

# Exchanges (elastic averaging's one-step read and accumulate) from every rank at once, into a box homed on one
# host and into a striped one. alpha 1 swaps x and the centre: atomic swaps only permute the values, where a read
# and an accumulate apart would make new ones. alpha 0.5 keeps the sum of the workers and the centre (exact: few
# halvings of integers in float64). Each exchange bumps the version once. 1000 elements go as one request and one
# reply; 100000 (800 KB) stream, their d coming back in parts while x still goes.
report["exchange"] = {}
for stripes, length in ((1, 1000), (hosts, 1000), (1, 100000), (hosts, 100000)):
    centre = shmcomm.SoftMemoryBox("elastic%d_%d" % (stripes, length), shape=(length,), dtype=np.float64,
                                   home=hosts - 1, stripes=stripes)
    start = centre.version
    shmcomm.barrier()
    x = r * float(length) + np.arange(length) + 1
    for i in range(5):
        d = x.copy()
        centre.exchange(d, 1.0)
        x -= d
    shmcomm.barrier()
    values = np.sort(np.concatenate([shmcomm.allgather(x.reshape(1, -1)), centre.read().reshape(1, -1)]), axis=0)
    permuted = bool((values == np.sort(np.vstack([np.zeros(length)] + [q * float(length) + np.arange(length) + 1
                                                                        for q in range(n)]), axis=0)).all())
    before = shmcomm.allreduce(x, op=shmcomm.Sum) + centre.read()
    shmcomm.barrier()
    for i in range(3):
        d = x.copy()
        centre.exchange(d, 0.5)
        x -= d
    shmcomm.barrier()
    kept = bool((shmcomm.allreduce(x, op=shmcomm.Sum) + centre.read() == before).all())
    report["exchange"]["%d/%d" % (stripes, length)] = [permuted, kept, centre.version - start == 8 * n]
    shmcomm.barrier()
    centre.close()

# wait_version wakes the ranks of the last host when rank 0 writes.
bell = shmcomm.SoftMemoryBox("bell", shape=(4,), dtype=np.float64, home=0)
ready = shmcomm.SoftMemoryBox("ready", shape=(1,), dtype=np.float64, home=0)
waiters = net.host_ranks[hosts - 1]
v = bell.version
shmcomm.barrier()
if r in waiters:
    ready.accumulate(np.ones(1))
    seen = bell.wait_version(v + 1, timeout=60)
    report["woken"] = [seen >= v + 1, bell.read().tolist()]
elif r == 0:
    ready.wait_version(len(waiters), timeout=60)
    bell.write(np.arange(4.0))
shmcomm.barrier()

# Bad inputs, each a typed error naming the box; the box stays as it was.
def raised(call):
    try:
        call()
    except shmcomm.ShmCommError as error:
        return [type(error).__name__, str(error)]
    return None

far = shmcomm.SoftMemoryBox("far", shape=(8,), dtype=np.int32, home=(host + 1) % hosts)
report["bad"] = {
    "read past the end": raised(lambda: far.read(offset=6, count=4)),
    "write past the end": raised(lambda: far.write(np.ones(3, np.int32), offset=6)),
    "float into int": raised(lambda: far.accumulate(np.ones(2, np.float64))),
    "negative offset": raised(lambda: far.read(offset=-1)),
    "exchange past the end": raised(lambda: far.exchange(np.ones(3, np.int32), 0.5, offset=6)),
    "exchange of floats": raised(lambda: far.exchange(np.ones(2), 0.5)),
    "other shape": raised(lambda: shmcomm.SoftMemoryBox("far", shape=(9,), dtype=np.int32, home=(host + 1) % hosts)),
    "create twice": raised(lambda: shmcomm.SoftMemoryBox("far", shape=(8,), dtype=np.int32, create=True,
                                                         home=(host + 1) % hosts)),
    "missing": raised(lambda: shmcomm.SoftMemoryBox("absent", timeout=0.2)),
    "too many stripes": raised(lambda: shmcomm.SoftMemoryBox("x", shape=(4,), stripes=hosts + 1)),
    "no stripes": raised(lambda: shmcomm.SoftMemoryBox("x", shape=(4,), stripes=0)),
    "home out of range": raised(lambda: shmcomm.SoftMemoryBox("x", shape=(4,), home=hosts)),
    "view of a remote box": raised(far.view),
    "view of a striped box": raised(striped.view),
    "unlock without the lock": raised(far.unlock),
    "wait past the timeout": raised(lambda: far.wait_version(far.version + 100, timeout=0.3)),
}
report["far_untouched"] = far.read().tolist()
mine = shmcomm.SoftMemoryBox("mine", shape=(1,), dtype=np.float32, local=True)
shmcomm.barrier()
mine.accumulate(np.ones(1, np.float32))
shmcomm.barrier()
report["local_box"] = [float(mine.read()[0]), list(mine.hosts)]
shmcomm.barrier()
with open(os.path.join(out, "report.%d" % r), "w") as f:
    json.dump(report, f)
"""


@functools.lru_cache(maxsize=None)
def _reports(hosts, per_host, directory):
    sim = open_hosts(hosts)
    try:
        script = os.path.join(directory, "checks.py")
        with open(script, "w") as f:
            f.write(CHECKS)
        # Every box update pauses between its read and its write under the lock, on the home host's server too:
        # a lock that does not exclude loses remote and local updates every run.
        run = _shmcommrun(sim, per_host, [sys.executable, script, directory], SHMCOMM_TEST_RACE_PAUSE_US="2000")
        assert run.returncode == 0, run.stdout + run.stderr
    finally:
        sim.close()
    found = {}
    for r in range(hosts * per_host):
        with open(os.path.join(directory, "report.%d" % r)) as f:
            found[r] = json.load(f)
    return found


@pytest.fixture(scope="module", params=[(2, 2), pytest.param((3, 2), marks=pytest.mark.long)], ids=["2x2", "3x2"])
def reports(request, tmp_path_factory):
    hosts, per_host = request.param
    return hosts, _reports(hosts, per_host, str(tmp_path_factory.mktemp("smb%dx%d" % request.param)))


def test_concurrent_accumulates_from_every_rank_are_exact(reports):
    hosts, found = reports
    for r, report in found.items():
        assert report["sum"] == {str(h): True for h in range(hosts)}, (r, report["sum"])


def test_the_home_hosts_ranks_compute_while_others_accumulate(reports):
    hosts, found = reports
    assert all(report["busy_sum"] for report in found.values())
    home = [report for report in found.values() if report["host"] == 0]
    # How many products ran meanwhile depends on the scheduler (6 ranks on 2 cores): it is reported, not asserted.
    # busy_finished: the others' accumulates all completed while this host's ranks were inside their compute loop.
    assert home and all(report["busy_finished"] for report in home), home


def test_boxes_are_served_while_the_home_ranks_hold_the_interpreter_lock(reports):
    hosts, found = reports
    remote = [report for report in found.values() if report["host"] != 0]
    assert remote and all(report["served_while_held"] for report in remote), found


def test_the_lock_excludes_every_rank_of_every_host(reports):
    hosts, found = reports
    n = len(found)
    for report in found.values():
        assert report["lock"] == 10 * n
        assert report["striped_lock"] == [10 * n] * (3 * hosts + 1)
        assert sorted(report["striped_hosts"]) == list(range(hosts))


def test_striped_boxes_attach_by_name_and_sum_exactly(reports):
    hosts, found = reports
    for report in found.values():
        assert report["striped_attach"][:2] == [[3 * hosts + 1], "int64"]
        assert sorted(report["striped_attach"][2]) == list(range(hosts))
        assert report["striped_sum"]


def test_ranks_creating_a_striped_box_at_once_leave_it_at_version_0(reports):
    hosts, found = reports
    for r, report in found.items():
        assert report["fresh_versions"] == [0] * 12, (r, report["fresh_versions"])


def test_exchanges_from_every_rank_are_atomic(reports):
    hosts, found = reports
    for r, report in found.items():
        assert report["exchange"] == {"%d/%d" % (stripes, length): [True, True, True] for stripes in (1, hosts)
                                      for length in (1000, 100000)}, (r, report)


def test_wait_version_wakes_ranks_on_another_host(reports):
    hosts, found = reports
    woken = [report["woken"] for report in found.values() if "woken" in report]
    assert woken and all(w == [True, [0.0, 1.0, 2.0, 3.0]] for w in woken)


def test_bad_inputs_raise_typed_errors_naming_the_box(reports):
    hosts, found = reports
    for report in found.values():
        bad = report["bad"]
        assert all(bad[k] is not None for k in bad), bad
        types = {k: v[0] for k, v in bad.items()}
        assert types == {
            "read past the end": "InvalidArgumentError", "write past the end": "InvalidArgumentError",
            "float into int": "InvalidArgumentError", "negative offset": "InvalidArgumentError",
            "exchange past the end": "InvalidArgumentError", "exchange of floats": "InvalidArgumentError",
            "other shape": "BoxExistsError", "create twice": "BoxExistsError", "missing": "BoxNotFoundError",
            "too many stripes": "InvalidArgumentError", "no stripes": "InvalidArgumentError",
            "home out of range": "InvalidArgumentError", "view of a remote box": "InvalidArgumentError",
            "view of a striped box": "InvalidArgumentError", "unlock without the lock": "InvalidArgumentError",
            "wait past the timeout": "TimeoutError"}, bad
        assert "lives on host" in bad["view of a remote box"][1] and "simhost" in bad["view of a remote box"][1]
        assert all("'far'" in bad[k][1] for k in ("read past the end", "other shape", "unlock without the lock"))
        assert report["far_untouched"] == [0] * 8


def test_host_local_boxes_stay_on_their_host(reports):
    hosts, found = reports
    for report in found.values():
        ranks_here = sum(1 for other in found.values() if other["host"] == report["host"])
        assert report["local_box"] == [float(ranks_here), [report["host"]]]


HOME_KILLED = """
import os, signal, sys, time, numpy as np, shmcomm
from shmcomm import basics
from shmcomm.testing import outcomes
shmcomm.init()
r = shmcomm.rank()
box = shmcomm.SoftMemoryBox("w", shape=(1 << 12,), dtype=np.float32, home=0)
shmcomm.barrier()
if basics.communicator().box_network.host == 0:
    os.kill(os.getppid(), signal.SIGSTOP)  # the launcher's guard would stop the job at once
    os.kill(os.getpid(), signal.SIGKILL)
started = time.monotonic()
try:
    while time.monotonic() - started < 60:
        box.accumulate(np.ones(box.count, np.float32))
except shmcomm.ShmCommError as error:
    outcomes.record(sys.argv[1], r, error, started)
try:
    box.read()
except shmcomm.ShmCommError as error:
    outcomes.record(sys.argv[1], 100 + r, error)
outcomes.wait_for(sys.argv[1], [2, 3, 102, 103], timeout=60)
os._exit(1)
"""


@pytest.mark.long
def test_home_host_killed_every_user_raises_naming_it(tmp_path):
    sim = open_hosts(2)
    try:
        run = _shmcommrun(sim, 2, [sys.executable, "-c", HOME_KILLED, str(tmp_path)], timeout=120,
                          SHMCOMM_TIMEOUT="3")
    finally:
        sim.close()
    assert run.returncode != 0
    raised = outcomes.read(tmp_path)
    assert sorted(raised) == [2, 3, 102, 103], run.stdout + run.stderr
    for r in (2, 3):
        assert raised[r]["type"] == "HostFailure", raised
        assert "simhost0" in raised[r]["message"] and "ranks 0, 1" in raised[r]["message"], raised
        assert raised[r]["seconds"] < 3 * 3, raised  # SHMCOMM_TIMEOUT, with room for a busy machine
        assert raised[100 + r]["type"] == "HostFailure", raised  # and every later call


HOLDER_KILLED = """
import os, signal, sys, time, numpy as np, shmcomm
from shmcomm import basics
from shmcomm.testing import outcomes
shmcomm.init()
r = shmcomm.rank()
box = shmcomm.SoftMemoryBox("w", shape=(16,), dtype=np.float32, home=0)
marker = os.path.join(sys.argv[1], "locked")

def count(prefix):
    return len([n for n in os.listdir(sys.argv[1]) if n.startswith(prefix) and "tmp" not in n])

shmcomm.barrier()
if r == 3:  # on the other host than the box
    box.lock()
    box.write(np.full(16, 7, np.float32))  # under the lock: version 1
    with open(marker + ".tmp", "w") as f:
        f.write(str(box.version))
    os.replace(marker + ".tmp", marker)
    os.kill(os.getppid(), signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGKILL)
deadline = time.monotonic() + 60
while not os.path.exists(marker) and time.monotonic() < deadline:
    time.sleep(0.01)
locked_at = int(open(marker).read())
version = box.accumulate(np.ones(16, np.float32))  # the dead holder's lock passes on
with open(os.path.join(sys.argv[1], "after.tmp%d" % r), "w") as f:
    f.write("%d %d" % (locked_at, version))
os.replace(os.path.join(sys.argv[1], "after.tmp%d" % r), os.path.join(sys.argv[1], "after.%d" % r))
while count("after.") < 3 and time.monotonic() < deadline:
    time.sleep(0.01)
final = os.path.join(sys.argv[1], "final.%d" % r)
with open(final + ".tmp", "w") as f:
    f.write("%s %d" % (box.read().tolist(), box.version))
os.replace(final + ".tmp", final)
while count("final.") < 3 and time.monotonic() < deadline:
    time.sleep(0.01)  # the first to exit has the launcher stop the rest
os._exit(1)
"""


@pytest.mark.long
def test_a_lock_holder_killed_on_another_host_leaves_the_box_usable(tmp_path):
    sim = open_hosts(2)
    try:
        _shmcommrun(sim, 2, [sys.executable, "-c", HOLDER_KILLED, str(tmp_path)], timeout=120, SHMCOMM_TIMEOUT="20")
    finally:
        sim.close()
    after = {r: [int(v) for v in (tmp_path / ("after.%d" % r)).read_text().split()] for r in (0, 1, 2)}
    assert {a[0] for a in after.values()} == {1}
    # The recovery bumped the version once (2), then each survivor's accumulate once: 3, 4, 5 in some order.
    assert sorted(a[1] for a in after.values()) == [3, 4, 5], after
    finals = [(tmp_path / ("final.%d" % r)).read_text() for r in (0, 1, 2)]
    assert all(f == "%s 5" % ([10.0] * 16) for f in finals), finals
