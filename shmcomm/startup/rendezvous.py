# SPDX-License-Identifier: Apache-2.0
"""A job started through a key-value store rather than by shmcommrun or MPI (torchrun, or any env:// start of
torch.distributed): shmcomm's place in it, agreed through the store.

Rank 0 draws the job token; every rank names its host and addresses. On one host that is all. Across hosts each rank
also opens a listener for its peers (the TCP mesh of startup/bootstrap.py) and says where; the mesh's secret is the
ranks' SHMCOMM_SECRET, or else one rank 0 draws and hands out through the store (as private as the store itself)."""
import json
import secrets
import socket

from shmcomm import env
from shmcomm.startup.addresses import interface_addresses, listen_address


class _Joined:
    record = None  # {"hosts": [...], "addresses": ["ip:port", ...], "token": ...} of a job that spans hosts
    listener = None  # this rank's socket for its peers in that job


def spans_hosts():
    """Whether this process joined, through a store, a job whose ranks are on more than one host."""
    return _Joined.record is not None


def joined():
    """The record of the job that spans hosts (its hosts and addresses by rank), as startup/bootstrap.py reads it."""
    return _Joined.record


def listener():
    """The socket this rank's peers connect to (transport/tcp_connect.py)."""
    return _Joined.listener


def take_place(store, rank, size):
    """Agrees this process's place in a job of `size` ranks as `rank` through `store` (anything with torch's Store's
    set(key, str) and get(key) -> bytes, whose get waits for the key), then sets the launch variables init reads.

    Raises:
        ValueError: the ranks of a host are not consecutive, or some ranks have SHMCOMM_SECRET and others not.
    """
    has_secret = env.job_secret() is not None
    mine = {"host": socket.gethostname(), "secret": has_secret,
            "addresses": [a for a in interface_addresses() if not a.startswith("127.")]}
    store.set("shmcomm/host/%d" % rank, json.dumps(mine))
    if rank == 0:
        store.set("shmcomm/token", secrets.token_hex(16))
    every = [json.loads(store.get("shmcomm/host/%d" % r)) for r in range(size)]
    token = store.get("shmcomm/token").decode()
    hosts = [e["host"] for e in every]
    order = list(dict.fromkeys(hosts))
    local = [r for r in range(size) if hosts[r] == hosts[rank]]
    if hosts != [h for h in order for _ in range(hosts.count(h))]:
        raise ValueError("the ranks of each host must be consecutive (torchrun numbers them so); the hosts by rank "
                         "are %s" % hosts)
    if len(order) > 1:
        _join_mesh(store, rank, every, has_secret, token)
    else:
        _forget()
    env.adopt_identity({"RANK": rank, "SIZE": size, "LOCAL_RANK": local.index(rank), "LOCAL_SIZE": len(local),
                        "CROSS_RANK": order.index(hosts[rank]), "CROSS_SIZE": len(order), "JOB_TOKEN": token})


def _join_mesh(store, rank, every, has_secret, token):
    holding = [r for r, e in enumerate(every) if e["secret"]]
    if holding and len(holding) < len(every):
        missing = [r for r in range(len(every)) if r not in holding]
        raise ValueError("%s is set on rank(s) %s but not on rank(s) %s: every rank of a job needs the same one, or "
                         "none" % (env.SECRET, holding, missing))
    if not holding:
        if rank == 0:
            store.set("shmcomm/secret", env.new_secret())
        env.adopt_secret(store.get("shmcomm/secret").decode())
    others = [e["addresses"] for e in every if e["host"] != every[rank]["host"]]
    where = listen_address(others)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((where, 0))
        listener.listen(256)
        reached_on = every[rank]["addresses"][0] if where == "0.0.0.0" else where
        store.set("shmcomm/address/%d" % rank, "%s:%d" % (reached_on, listener.getsockname()[1]))
        addresses = [store.get("shmcomm/address/%d" % r).decode() for r in range(len(every))]
    except BaseException:
        listener.close()
        raise
    _forget()
    _Joined.listener = listener
    _Joined.record = {"hosts": [e["host"] for e in every], "addresses": addresses, "token": token}


def _forget():
    """Drops what a job this process was in before left here."""
    if _Joined.listener is not None:
        _Joined.listener.close()
    _Joined.listener = _Joined.record = None
