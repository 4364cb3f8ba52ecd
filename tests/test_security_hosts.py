# SPDX-License-Identifier: Apache-2.0
"""The job's sockets across two simulated hosts (shmcommrun -H, one rank per host): an outsider on the network who
probes every port the job's own code listens on (each rank's box server, the launcher's notice server) gets nothing
back that names the job and changes nothing, a replayed handshake fails, the secret is on no command line of either
host (hydra's included) nor in any output, and a rank started with another secret is refused and named."""
import json
import socket
import subprocess
import sys

from test_multihost import ROOT, _shmcommrun, two_hosts  # noqa: F401 (a fixture)
from test_security import _assert_nothing_names_the_job, _everything_back, _outsiders, _relay, _until
from test_simhosts import job_env

from shmcomm.smb import wire
from shmcomm.transport import handshake


PROGRAM = """
import json, os, pathlib, sys, time
import numpy as np
folder = pathlib.Path(sys.argv[1])
secret = os.environ["SHMCOMM_SECRET"]
notices = os.environ.get("SHMCOMM_LAUNCHER_NOTICES", "")
if sys.argv[2] == "other" and os.environ.get("PMI_RANK") == "1":
    os.environ["SHMCOMM_SECRET"] = "ab" * 32  # a rank of another job, or one started by hand with a stale secret
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        if secret.encode() in pathlib.Path("/proc", pid, "cmdline").read_bytes():
            print("the secret is on the command line of", pathlib.Path("/proc", pid, "cmdline").read_bytes())
    except OSError:
        pass
import shmcomm as hvd
from shmcomm.startup import session
hvd.init()
box = hvd.SoftMemoryBox("weights", 4, np.float64, home=0)
if hvd.rank() == 0:
    box.write(np.arange(4.0))
hvd.barrier()
address = session.communicator().box_network.server.address
(folder / ("ports%d" % hvd.rank())).write_text(json.dumps({"box": address, "notices": notices, "secret": secret}))
deadline = time.monotonic() + 90
while not (folder / "probed").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
hvd.barrier()
os.write(1, ("box %s version %d\\n" % (box.read().tolist(), box.version)).encode())
hvd.barrier()
"""


def test_an_outsider_on_the_network_gets_nothing_and_changes_nothing(two_hosts, tmp_path):
    job = subprocess.Popen([sys.executable, "-m", "shmcomm.runner", *two_hosts.shmcommrun_args(1), sys.executable,
                            "-c", PROGRAM, str(tmp_path), "same"], cwd=ROOT, env=job_env(), stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = lambda: all((tmp_path / ("ports%d" % r)).exists() for r in range(2))  # noqa: E731
        assert _until(lambda: ready() or job.poll() is not None, 180)
        assert ready(), job.communicate(timeout=60)
        ports = [json.loads((tmp_path / ("ports%d" % r)).read_text()) for r in range(2)]
        secret = bytes.fromhex(ports[0]["secret"])
        name = b"weights"
        attach = wire.REQUEST.pack(wire.ATTACH, 0, len(name), 0, 0, 0, 0.0, 0.0, 0.0) + name
        write = wire.REQUEST.pack(wire.WRITE, 0, 0, 0, 0, 4, 0.0, 0.0, 0.0) + bytes(32)
        answers = []
        for rank, report in enumerate(ports):
            (addresses, port) = report["box"]
            assert len(addresses) == 1 and addresses[0].startswith("10."), addresses  # the host's link only
            answers += _outsiders("%s:%d" % (addresses[0], port), [attach + write, b"SMCAUTH1" + bytes(64)])
        notice_address = ports[0]["notices"].split(",")[0]
        answers += _outsiders(notice_address, [b"x" * 40])
        # A rank's handshake with rank 0's box server, recorded on the way and replayed.
        (addresses, port) = ports[0]["box"]
        recorded = []
        relay = _relay(port, recorded, addresses[0])
        with socket.create_connection(("127.0.0.1", relay)) as client:
            handshake.prove(client, secret, "rank 0's box server")
        assert _until(lambda: len(b"".join(recorded)) == 72)
        with socket.create_connection((addresses[0], port)) as replayed:
            replayed.sendall(b"".join(recorded))
            answers.append(_everything_back(replayed))
        _assert_nothing_names_the_job(answers, name, secret.hex().encode())
    finally:
        (tmp_path / "probed").write_text("")
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, out + err
    assert out.count("box [0.0, 1.0, 2.0, 3.0] version 1") == 2, out + err  # the box as rank 0 left it
    assert "command line" not in out, out
    assert secret.hex() not in out + err
    # 3 refusals each (2 outsiders, another secret) and the replay at rank 0's; the launcher's 2.
    assert err.count("rank 0's box server refused a connection from 10.") == 4, err
    assert err.count("rank 1's box server refused a connection from 10.") == 3, err
    assert err.count("the launcher's notice server refused a connection from") == 2, err


def test_a_rank_with_another_secret_is_refused_and_named(two_hosts, tmp_path):
    run = _shmcommrun(two_hosts, 1, [sys.executable, "-c", PROGRAM, str(tmp_path), "other"], timeout=180)
    assert run.returncode != 0, run.stdout + run.stderr
    text = run.stdout + run.stderr
    assert "rank 0's box server refused a connection from 10." in text, text
    assert "box 'weights': the box server of its home host 0" in text and "does not hold the job's secret" in text, \
        text
