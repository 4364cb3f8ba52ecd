# SPDX-License-Identifier: Apache-2.0
"""Nothing outside the job gets in through its sockets: every TCP connection opens with the handshake of
csrc/net/handshake.c (each end proves it holds the job's secret over fresh nonces), and a server admits no one who
does not. Here, on one host: the handshake itself (the standard's HMAC, refusals, a replay), the launcher's
membership and notice servers, the elastic mesh, and the box servers of a job of two pretend hosts, each probed by
an outsider who gets nothing back that names the job and changes nothing; and the secret's way to the ranks, which
no command line, output, timeline or error shows. Across simulated hosts: tests/test_security_hosts.py."""
import hashlib
import hmac
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from shmcomm.runner.elastic_server import MembershipServer, reaching
from shmcomm.runner.notice_server import NoticeServer
from shmcomm.smb import wire
from shmcomm.transport import handshake
from shmcomm.transport.tcp_connect import connect_mesh
from shmcomm.vocabulary.exceptions import AuthenticationError, TimeoutError
from shmcomm._native import ffi, lib

from test_runner import REPO, launch, launcher_args, launcher_env, rank_program
from test_simhosts import MPIEXEC, job_env

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))  # another job's


def _hmac(key, message):
    out = ffi.new("uint8_t[32]")
    lib.smc_handshake_hmac(key, len(key), message, len(message), out)
    return bytes(out)


def test_the_hmac_is_the_standards():
    # RFC 4231, test case 2; then keys and messages of every length class against Python's own.
    assert _hmac(b"Jefe", b"what do ya want for nothing?").hex() == \
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    for key_len, message_len in [(16, 0), (32, 55), (64, 56), (65, 64), (131, 1000)]:
        key, message = os.urandom(key_len), os.urandom(message_len)
        assert _hmac(key, message) == hmac.new(key, message, hashlib.sha256).digest()


def _admit_in_thread(sock, secret, timeout_s=5.0):
    result = {}
    thread = threading.Thread(target=lambda: result.update(admitted=handshake.admit(sock, secret, "a test server",
                                                                                   timeout_s)))
    thread.start()
    return thread, result


def _tcp_pair():
    """(client, server): the two ends of one TCP connection on loopback."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


def test_one_secret_proves_both_ends():
    client, server = _tcp_pair()
    thread, result = _admit_in_thread(server, SECRET)
    handshake.prove(client, SECRET, "a test server")
    thread.join(10)
    assert result["admitted"]
    client.sendall(b"after")  # the connection is the callers' from here on
    assert server.recv(5) == b"after"
    client.close()
    server.close()


def test_another_secret_is_refused_by_both_ends_and_logged_naming_the_client(caplog):
    client, server = _tcp_pair()
    thread, result = _admit_in_thread(server, SECRET)
    with caplog.at_level(logging.WARNING, logger="shmcomm.security"):
        with pytest.raises(AuthenticationError, match="does not hold the job's secret"):
            handshake.prove(client, OTHER, "a test server")
        thread.join(10)
    assert result["admitted"] is False
    refusals = [r.getMessage() for r in caplog.records if r.name == "shmcomm.security"]
    assert len(refusals) == 1 and "a test server refused a connection from 127.0.0.1:" in refusals[0], refusals
    assert "wrong" in refusals[0]


def test_a_server_without_the_secret_is_not_trusted():
    client, server = _tcp_pair()
    thread, _ = _admit_in_thread(server, OTHER)
    with pytest.raises(AuthenticationError):
        handshake.prove(client, SECRET, "a test server")
    thread.join(10)


def _relay(listener_port, record, host="127.0.0.1"):
    """A man in the middle on a port of its own: passes bytes both ways to host:listener_port and keeps what the
    client sent."""
    relay = socket.create_server(("127.0.0.1", 0))

    def run():
        inner, _ = relay.accept()
        outer = socket.create_connection((host, listener_port))

        def pump(a, b, keep):
            while True:
                try:
                    data = a.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    try:
                        b.shutdown(socket.SHUT_RDWR)  # wakes the other direction's pump too
                    except OSError:
                        pass
                    return
                if keep:
                    record.append(data)
                b.sendall(data)
        threading.Thread(target=pump, args=(outer, inner, False), daemon=True).start()
        pump(inner, outer, True)
    threading.Thread(target=run, daemon=True).start()
    return relay.getsockname()[1]


def _until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.01)
    return predicate()


def _everything_back(sock, timeout_s=3.0):
    """What a server sends an outsider until it closes the connection (or timeout_s passes)."""
    sock.settimeout(timeout_s)
    got = b""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return got
            got += data
    except (socket.timeout, ConnectionResetError):
        return got


def _outsiders(address, what_they_send):
    """Connects to `address` ("ip:port") as outsiders that send each of `what_they_send` (bytes) or try the
    handshake with another secret: what each got back."""
    host, port = address.rsplit(":", 1)
    answers = []
    for payload in what_they_send:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(payload)
            answers.append(_everything_back(sock))
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        with pytest.raises(AuthenticationError):
            handshake.prove(sock, OTHER, "the server")
    return answers


def _assert_nothing_names_the_job(answers, *secrets_of_the_job):
    for answer in answers:
        # At most the server's random nonce, after a hello in the handshake's own form; never the job's words.
        assert len(answer) <= 40, answer
        for word in secrets_of_the_job:
            assert word not in answer


def test_the_membership_server_tells_and_registers_only_proven_workers(caplog):
    server = MembershipServer(SECRET, local_only=True)
    try:
        assert [a.rsplit(":", 1)[0] for a in server.addresses] == ["127.0.0.1"]
        assert all(s.getsockname()[0] == "127.0.0.1" for s in server.listeners)
        record = {"generation": 1, "token": "job-token-g1", "members": [0], "hosts": ["h"],
                  "addresses": ["192.0.2.2:57605"], "retired": [], "abort": None}
        server.publish(record)
        hello = (json.dumps({"worker": 1, "address": "127.0.0.1:9", "host": "x", "pid": 1}) + "\n").encode()
        with caplog.at_level(logging.WARNING, logger="shmcomm.security"):
            answers = _outsiders(server.addresses[0], [hello, b"SMCAUTH1" + bytes(32) + hello])
            # A worker's handshake and hello, recorded on the way and replayed.
            recorded = []
            port = _relay(int(server.addresses[0].rsplit(":", 1)[1]), recorded)
            worker = socket.create_connection(("127.0.0.1", port))
            handshake.prove(worker, SECRET, "the launcher")
            worker.sendall(hello)
            assert b"job-token-g1" in worker.makefile("rb").readline()  # the worker hears the record
            worker.close()
            assert _until(lambda: not server.ready(1))
            server.workers.clear()
            replayed = socket.create_connection(("127.0.0.1", int(server.addresses[0].rsplit(":", 1)[1])))
            replayed.sendall(b"".join(recorded))
            answers.append(_everything_back(replayed))
            replayed.close()
        _assert_nothing_names_the_job(answers, b"job-token", b"192.0.2.2", b"generation")
        assert server.workers == {}  # no outsider, nor the replay, was registered
        assert _until(lambda: len([r for r in caplog.records if "membership server refused" in r.getMessage()])
                      == 4)
    finally:
        server.close()


def test_the_launcher_listens_where_the_hosts_reach_it():
    assert reaching(["127.0.0.1", "localhost"]) == ["127.0.0.1"]
    assert reaching(["no-such-host.invalid"]) is None  # listens on every interface then
    server = NoticeServer(SECRET, hosts=["127.0.0.1"])
    try:
        assert [s.getsockname()[0] for s in server.listeners] == ["127.0.0.1"]
        assert [a.rsplit(":", 1)[0] for a in server.addresses] == ["127.0.0.1"]
    finally:
        server.close()
    server = NoticeServer(SECRET, hosts=["no-such-host.invalid"])
    try:
        assert [s.getsockname()[0] for s in server.listeners] == ["0.0.0.0"]
    finally:
        server.close()


def test_the_notice_server_tells_only_proven_ranks():
    server = NoticeServer(SECRET)
    try:
        server.publish(3, "host-b", "was killed by signal 9")
        answers = _outsiders(server.addresses[0], [b"GET / HTTP/1.1\r\n\r\n".ljust(40), b"SMCAUTH1" + bytes(64)])
        _assert_nothing_names_the_job(answers, b"host-b", b"rank")
        host, port = server.addresses[0].rsplit(":", 1)
        rank = socket.create_connection((host, int(port)))
        handshake.prove(rank, SECRET, "the launcher")
        assert b"host-b" in rank.makefile("rb").readline()
        rank.close()
    finally:
        server.close()


def _mesh_listeners(n):
    listeners = [socket.create_server(("127.0.0.1", 0), backlog=64) for _ in range(n)]
    return listeners, ["127.0.0.1:%d" % s.getsockname()[1] for s in listeners]


def test_an_outsider_with_the_token_cannot_join_a_forming_mesh():
    listeners, addresses = _mesh_listeners(2)
    result = {}
    thread = threading.Thread(target=lambda: result.update(r0=connect_mesh(listeners[0], addresses, 0, "tok",
                                                                           SECRET, 20)))
    thread.start()
    # What the mesh checked before its handshake: the world's token and a rank number.
    answers = _outsiders(addresses[0], [b"tok".ljust(64, b"\0") + (1).to_bytes(8, "little")])
    fresh = connect_mesh(listeners[1], addresses, 1, "tok", SECRET, 20)
    thread.join(30)
    _assert_nothing_names_the_job(answers, b"tok")
    mine, theirs = fresh[0], result["r0"][1]
    mine.setblocking(True)
    theirs.setblocking(True)
    mine.sendall(b"hi")
    assert theirs.recv(2) == b"hi"  # the world's own connection
    for sock in [mine, theirs] + listeners:
        sock.close()


def test_a_rank_with_another_secret_is_refused_and_named(caplog):
    listeners, addresses = _mesh_listeners(2)
    errors = {}

    def rank(r, secret):
        try:
            connect_mesh(listeners[r], addresses, r, "tok", secret, 3)
        except Exception as error:  # noqa: B902 (checked below)
            errors[r] = error
    with caplog.at_level(logging.WARNING, logger="shmcomm.security"):
        threads = [threading.Thread(target=rank, args=(r, s)) for r, s in ((0, SECRET), (1, OTHER))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert isinstance(errors[1], AuthenticationError) and "rank 0 (for rank 1)" in str(errors[1])
    assert isinstance(errors[0], TimeoutError) and "ranks [1] did not connect" in str(errors[0])
    assert any("rank 0's listener for its peers refused a connection from 127.0.0.1" in r.getMessage()
               for r in caplog.records)
    for sock in listeners:
        sock.close()


# Two pretend hosts of one rank each under a bare mpiexec (the secret made by rank 0): rank 0 says where its box
# server listens, waits while the test probes it, then both check the box is as they left it.
BOXES = """
import json, os, pathlib, sys, time
import numpy as np
import shmcomm as hvd
hvd.init()
folder = pathlib.Path(sys.argv[1])
box = hvd.SoftMemoryBox("weights", 4, np.float64, home=0)
if hvd.rank() == 0:
    box.write(np.arange(4.0))
hvd.barrier()
if hvd.rank() == 0:
    from shmcomm.startup import session
    addresses, port = session.communicator().box_network.server.address
    (folder / "server.part").write_text(json.dumps([addresses, port]))
    (folder / "server.part").rename(folder / "server")  # whole when the test sees it
    deadline = time.monotonic() + 60
    while not (folder / "probed").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
hvd.barrier()
os.write(1, ("rank %d box %s version %d\\n" % (hvd.rank(), box.read().tolist(), box.version)).encode())
hvd.barrier()
hvd.shutdown()
"""


def test_an_outsider_gets_nothing_from_a_box_server_and_changes_nothing(tmp_path):
    job = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-c", BOXES, str(tmp_path)], cwd=REPO,
                           env=job_env(SHMCOMM_RANKS_PER_HOST="1"), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        assert _until(lambda: (tmp_path / "server").exists() or job.poll() is not None, 120)
        assert (tmp_path / "server").exists(), job.communicate(timeout=60)
        addresses, port = json.loads((tmp_path / "server").read_text())
        assert addresses == ["127.0.0.1"]  # both "hosts" on this machine: loopback only
        name = b"weights"
        attach = wire.REQUEST.pack(wire.ATTACH, 0, len(name), 0, 0, 0, 0.0, 0.0, 0.0) + name
        write = wire.REQUEST.pack(wire.WRITE, 0, 0, 0, 0, 4, 0.0, 0.0, 0.0) + bytes(32)
        ping = wire.REQUEST.pack(wire.PING, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0)
        answers = _outsiders("127.0.0.1:%d" % port, [attach + write, ping, b"SMCAUTH1" + bytes(32) + bytes(32)])
        _assert_nothing_names_the_job(answers, name)
    finally:
        (tmp_path / "probed").write_text("")
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, out + err
    for rank in range(2):
        assert "rank %d box [0.0, 1.0, 2.0, 3.0] version 1" % rank in out, out + err
    assert err.count("rank 0's box server refused a connection from 127.0.0.1:") == 4, err


# The issue's own example: an elastic job of 2 workers on one host (-np 2 --min-np 1 --max-np 3). Each says where
# the launcher and its own listener are, waits while the test probes them, then allreduces.
ELASTIC = """
import os, pathlib, sys, time
import numpy as np
import shmcomm as hvd
from shmcomm.startup import membership
folder = pathlib.Path(sys.argv[1])
driver = os.environ["SHMCOMM_ELASTIC_DRIVER"]
hvd.init()
mine = "none" if membership.listener() is None else "%s:%d" % membership.listener().getsockname()
(folder / "part").with_suffix(".%d" % hvd.rank()).write_text(driver + " " + mine)
os.replace(folder / ("part.%d" % hvd.rank()), folder / ("worker%d" % hvd.rank()))  # seen whole or not at all
deadline = time.monotonic() + 60
while not (folder / "probed").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
total = hvd.allreduce(np.full(3, hvd.rank() + 1.0), op=hvd.Sum, name="x")
os.write(1, ("size %d sum %s generation %d\\n" % (hvd.size(), total.tolist(), membership.current_generation())).encode())
"""


def test_an_outsider_changes_nothing_in_an_elastic_job(tmp_path):
    job = subprocess.Popen(launcher_args("-np", "2", "--min-np", "1", "--max-np", "3", sys.executable, "-c", ELASTIC,
                                         tmp_path), cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        ready = lambda: all((tmp_path / ("worker%d" % r)).exists() for r in range(2))  # noqa: E731
        assert _until(lambda: ready() or job.poll() is not None, 120)
        assert ready(), job.communicate(timeout=60)
        answers = []
        for r in range(2):
            driver, mine = (tmp_path / ("worker%d" % r)).read_text().split()
            assert all(a.startswith("127.0.0.1:") for a in driver.split(","))  # loopback only
            assert mine == "none"  # all on one host: no worker listens for peers
            hello = (json.dumps({"worker": 7, "address": "127.0.0.1:9", "host": "x", "pid": 1}) + "\n").encode()
            answers += _outsiders(driver.split(",")[0], [hello])
        _assert_nothing_names_the_job(answers, b"token", b"generation", b"members")
    finally:
        (tmp_path / "probed").write_text("")
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, out + err
    # The same world of 2, its first generation, and the sum of its two workers only.
    assert out.count("size 2 sum [3.0, 3.0, 3.0] generation 1") == 2, out + err
    assert err.count("the launcher's membership server refused a connection from 127.0.0.1") == 4, err


def test_mpiexec_gets_the_secret_by_name_only():
    from shmcomm.runner import mpi_launch

    command = mpi_launch.mpiexec_command("mpiexec", 2, [("a", 1), ("b", 1)], {"X": "1"}, ["prog"])
    assert command.count("-genvlist") == 1 and command[command.index("-genvlist") + 1] == "SHMCOMM_SECRET"
    mine = mpi_launch.mpiexec_command("mpiexec", 2, [("a", 1), ("b", 1)], {}, ["prog"], mpi_args=["-genvlist", "FOO"])
    assert mine.count("-genvlist") == 1 and mine[mine.index("-genvlist") + 1] == "FOO,SHMCOMM_SECRET"
    hydra = mpi_launch.launcher_environment({}, secret="ab" * 32)
    assert hydra["SHMCOMM_SECRET"] == "ab" * 32  # in mpiexec's environment, which -genvlist passes on


SECRET_PROGRAM = """
import os, pathlib, sys
secret = os.environ["SHMCOMM_SECRET"]
import shmcomm as hvd
hvd.init()
assert "SHMCOMM_SECRET" not in os.environ  # gone from the environment once read: children do not inherit it
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        if secret.encode() in pathlib.Path("/proc", pid, "cmdline").read_bytes():
            print("the secret is on the command line of", pid)
    except OSError:
        pass
pathlib.Path(sys.argv[1], "secret%d" % hvd.rank()).write_text(secret)
hvd.allreduce(__import__("numpy").ones(3), name="x")
if hvd.rank() == 1:
    hvd.allreduce(__import__("numpy").ones(3), name="y", op="no such op")
"""


def test_the_secret_is_in_no_command_line_output_timeline_or_error(tmp_path):
    timeline = tmp_path / "timeline.json"
    run = launch("-np", "2", "--verbose", "--timeline-filename", timeline, *rank_program(SECRET_PROGRAM), tmp_path)
    secrets_seen = {(tmp_path / ("secret%d" % r)).read_text() for r in range(2)}
    assert len(secrets_seen) == 1, "every rank has the one secret"
    secret = secrets_seen.pop()
    assert len(bytes.fromhex(secret)) >= 16
    assert run.returncode != 0 and "no such op" in run.stdout + run.stderr  # the error is reported
    assert "command line" not in run.stdout
    for text in (run.stdout, run.stderr, timeline.read_text() if timeline.exists() else ""):
        assert secret not in text
