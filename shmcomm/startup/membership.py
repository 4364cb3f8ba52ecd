# SPDX-License-Identifier: Apache-2.0
"""Who is in an elastic job now: the membership the elastic launcher (runner/elastic.py) sends, and how a worker
takes its place in it.

Every worker holds one TCP connection to the launcher (SHMCOMM_ELASTIC_DRIVER: the launcher's addresses, tried in
turn; the first that answers is the one routable from this host). Over it the worker says who it is, where it listens
for its peers (transport/tcp.py) and that it is ready; the launcher sends a record (see _Link) whenever the job changes.
A worker that hears an abort, or loses the launcher, stops (SIGTERM to itself): no worker outlives its job, even on a
host the launcher reaches only through ssh. Nothing else in shmcomm knows the job is elastic."""
import atexit
import json
import logging
import os
import signal
import socket
import threading
import time

from shmcomm import env
from shmcomm.transport import handshake
from shmcomm.transport.shm import AbandonWord
from shmcomm.vocabulary.exceptions import AuthenticationError, ShmCommError

log = logging.getLogger("shmcomm.elastic")
_CONNECT_TIMEOUT_S = 5.0


class MembershipError(ShmCommError):
    """The elastic job cannot go on: the launcher stopped it, or no membership came in time."""


class _Link:
    """This process's connection to the launcher, its listening socket for its peers, and what it has heard: the
    launcher's records, one JSON line each, such as

        {"generation": 3, "token": "<job token>g3", "members": [0, 2, 3, 4], "hosts": [...], "addresses": [...],
         "retired": [5], "abort": null}

    `members` are worker ids in rank order, with each one's host and listening address (the ranks of a host are
    consecutive, and rank 0 is the oldest worker: the one whose state the others receive). Each generation has a job
    token of its own, so a re-formed world meets in new segments. `retired` workers were stopped by the launcher
    (their host left the discovery script's output): they exit at their next join. `abort` holds the reason when the
    job cannot go on."""
    sock = None
    listener = None
    address = None  # "ip:port" of the listener, as the peers reach it
    record = None  # the newest record
    joined = None  # the record of the world this process joined last
    lost = None  # why the connection is gone
    leaving = False  # this process is exiting: a closed connection is expected
    changed = threading.Condition()
    # Set while superseded() would say why (a newer record came, or the launcher is gone): init's waits read it.
    abandon = AbandonWord()


def _update_abandon():
    """Called with _Link.changed held, after the record, the joined record or `lost` changed."""
    _Link.abandon.set(superseded() is not None)


def joined_generation():
    return -1 if _Link.joined is None else _Link.joined["generation"]


def current_generation():
    """The newest generation the launcher has sent (no I/O: cheap enough for every commit)."""
    return -1 if _Link.record is None else _Link.record["generation"]


def joined():
    """The record of the world this process is in (for bootstrap: hosts and addresses)."""
    return _Link.joined


def listener():
    """The socket this process's peers connect to (transport/tcp_connect.py); None on a one-host job."""
    return _Link.listener


def superseded():
    """Why the world being formed will not be (a newer membership came, or the launcher is gone), or None."""
    if _Link.lost:
        return "elastic worker %d: %s" % (env.elastic_worker(), _Link.lost)
    if current_generation() > joined_generation():
        return "a newer membership (generation %d) replaced generation %d while it formed" % (
            current_generation(), joined_generation())
    return None


def abandon_word():
    """The word init's shared-memory waits watch (transport/shm.py's `abandon`), or None outside an elastic job."""
    return None if _Link.joined is None else _Link.abandon


def spans_hosts():
    return _Link.joined is not None and len(set(_Link.joined["hosts"])) > 1


def _connect():
    """Connects to the launcher (proving both ends hold the job's secret), and opens this worker's listener for its
    peers on the address of this host that reaches the launcher: the one the other hosts reach it on too. A launcher
    on loopback runs every worker on its own host (no discovery script): no world spans hosts, none listens."""
    secret = env.job_secret()
    if secret is None:
        raise MembershipError("elastic worker %d has no job secret (%s): elastic workers are started by shmcommrun"
                              % (env.elastic_worker(), env.SECRET))
    addresses = (env.elastic_driver() or "").split(",")
    errors = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S)
            handshake.prove(sock, secret, "elastic worker %d: the launcher" % env.elastic_worker())
        except AuthenticationError as error:
            raise MembershipError(str(error)) from None
        except (OSError, ValueError) as error:
            errors.append("%s: %s" % (address, error))
            continue
        sock.settimeout(None)
        listener = None
        if not sock.getpeername()[0].startswith("127."):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((sock.getsockname()[0], 0))
            listener.listen(256)
        _Link.sock, _Link.listener = sock, listener
        _Link.address = listener and "%s:%d" % (sock.getsockname()[0], listener.getsockname()[1])
        hello = {"worker": env.elastic_worker(), "address": _Link.address, "host": socket.gethostname(),
                 "pid": os.getpid()}
        sock.sendall((json.dumps(hello) + "\n").encode())
        threading.Thread(target=_listen, args=(sock,), name="shmcomm-membership", daemon=True).start()
        return
    raise MembershipError("elastic worker %d cannot reach the launcher at any of its addresses (%s)"
                          % (env.elastic_worker(), "; ".join(errors)))


def _listen(sock):
    """Takes the launcher's records as they come; stops this worker when the launcher aborts or goes away."""
    reader = sock.makefile("rb")
    reason = "the launcher closed the connection"
    try:
        for line in reader:
            record = json.loads(line)
            with _Link.changed:
                _Link.record = record
                _update_abandon()
                _Link.changed.notify_all()
            if record["abort"]:
                reason = "the launcher stopped the job: %s" % record["abort"]
                break
    except (OSError, ValueError) as error:
        reason = "the connection to the launcher failed: %s" % error
    with _Link.changed:
        _Link.lost = reason
        _update_abandon()
        _Link.changed.notify_all()
    if not _Link.leaving:
        log.warning("elastic worker %d stops: %s", env.elastic_worker(), reason)
        os.kill(os.getpid(), signal.SIGTERM)


@atexit.register
def _leave():
    _Link.leaving = True


def join(timeout_s=None):
    """Waits for a generation newer than the last one joined that includes this worker, then sets the launcher's
    variables of that world (rank, size, local and cross ranks, token) for init to read. Raises MembershipError
    when the launcher gave up or is gone, or after `timeout_s` (SHMCOMM_ELASTIC_TIMEOUT) without one: never waits
    forever. A worker the launcher retired exits here (SystemExit 0)."""
    me = env.elastic_worker()
    timeout_s = env.elastic_timeout() if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    if _Link.sock is None:
        _connect()  # says this worker is ready: the launcher adds it to the next membership
    with _Link.changed:
        while True:
            record = _Link.record
            if record is not None and record["abort"]:
                raise MembershipError("elastic job stopped: %s" % record["abort"])
            if record is not None and me in record.get("retired", ()):
                _Link.leaving = True
                log.info("elastic worker %d leaves the job: the launcher retired it", me)
                raise SystemExit(0)
            if record is not None and record["generation"] > joined_generation() and me in record["members"]:
                _Link.joined = record
                _update_abandon()
                break
            if _Link.lost:
                raise MembershipError("elastic worker %d: %s" % (me, _Link.lost))
            if time.monotonic() > deadline:
                raise MembershipError("elastic worker %d: no new membership that includes it within %.0f s "
                                      "(SHMCOMM_ELASTIC_TIMEOUT)" % (me, timeout_s))
            _Link.changed.wait(min(1.0, max(0.01, deadline - time.monotonic())))
    rank, size = record["members"].index(me), len(record["members"])
    hosts = record["hosts"]
    order = list(dict.fromkeys(hosts))  # hosts in rank order
    local = [r for r in range(size) if hosts[r] == hosts[rank]]
    identity = {"RANK": rank, "SIZE": size, "LOCAL_RANK": local.index(rank), "LOCAL_SIZE": len(local),
                "CROSS_RANK": order.index(hosts[rank]), "CROSS_SIZE": len(order), "JOB_TOKEN": record["token"]}
    env.adopt_identity(identity)
    return record
