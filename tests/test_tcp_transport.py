# SPDX-License-Identifier: Apache-2.0
"""The TCP transport of elastic worlds across hosts (shmcomm/transport/tcp.py, tcp_connect.py), on this host's
loopback: a mesh of ranks in threads, every collective against numpy with the same bits on every rank, a closed peer
named at once, a late one after the deadline, a straggler of an older world turned away, and process sets that
connect their members through the world's listeners."""
import socket
import threading

import numpy as np
import pytest

from shmcomm.vocabulary import dtypes
from shmcomm._native import ffi, lib
from shmcomm.vocabulary.exceptions import AuthenticationError, BrokenCommunicatorError, RankFailure, TimeoutError
from shmcomm.transport import handshake
from shmcomm.transport.tcp import Tcp
from shmcomm.transport.tcp_connect import SetDoor, connect_mesh

SECRET = bytes(range(32))  # the job's secret, as shmcommrun would hand it to the ranks


def _listeners(n):
    out = []
    for _ in range(n):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        out.append(sock)
    return out, ["127.0.0.1:%d" % s.getsockname()[1] for s in out]


def _on_every_rank(n, job, timeout_s=20.0, token="t1"):
    """job(transport) in a thread per rank; returns their results in rank order (raises the first error)."""
    listeners, addresses = _listeners(n)
    results, errors = [None] * n, []

    def rank_main(r):
        try:
            transport = Tcp(connect_mesh(listeners[r], addresses, r, token, SECRET, timeout_s), r, range(n),
                            ["host%d" % i for i in range(n)], timeout_s,
                            door=SetDoor(listeners[r], addresses, token, SECRET))
            try:
                results[r] = job(transport)
            finally:
                transport.close()
                transport.door.close()
        except BaseException as error:  # noqa: B902 (reported below)
            errors.append(error)
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for sock in listeners:
        sock.close()
    if errors:
        raise errors[0]
    return results


def _ptr(a):
    return ffi.from_buffer(a)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.float16])
def test_allreduce_and_reducescatter_match_numpy_with_the_same_bits_everywhere(n, dtype):
    count = 1001
    inputs = [(np.random.default_rng(r).standard_normal(count) * 10).astype(dtype) for r in range(n)]
    code = dtypes.numpy_code(np.dtype(dtype))
    half = 1.0 if dtype == np.int32 else 0.5

    def job(t):
        out = inputs[t.rank].copy()
        t.allreduce(_ptr(out), _ptr(out), count, code, lib.SMC_SUM, 1.0, half, 1, 0, "allreduce")
        biggest = np.empty_like(out)
        t.allreduce(_ptr(inputs[t.rank]), _ptr(biggest), count, code, lib.SMC_MAX, 1.0, 1.0, 1, 0, "max")
        counts = [count // n + (r < count % n) for r in range(n)]
        mine = np.empty(counts[t.rank], dtype)
        t.reducescatter(_ptr(inputs[t.rank]), _ptr(mine), counts, code, lib.SMC_SUM, 1.0, 1.0, 1, 0, "rs")
        return out, biggest, mine, counts
    results = _on_every_rank(n, job)
    wide = np.float64 if dtype != np.int32 else np.int64
    expected = sum(i.astype(wide) for i in inputs) * (0.5 if dtype != np.int32 else 1)
    tolerance = 2e-2 if dtype == np.float16 else 1e-5
    for out, biggest, mine, counts in results:
        assert out.tobytes() == results[0][0].tobytes()  # the same bits on every rank
        if dtype == np.int32:
            assert np.array_equal(out, expected.astype(np.int32))
        else:
            np.testing.assert_allclose(out.astype(np.float64), expected, rtol=tolerance, atol=tolerance)
        assert np.array_equal(biggest, np.max(inputs, axis=0))
    whole = np.concatenate([r[2] for r in results])
    np.testing.assert_allclose(whole.astype(np.float64), sum(i.astype(wide) for i in inputs), rtol=tolerance,
                               atol=tolerance * 10)


def test_broadcast_allgather_alltoall_barrier_and_bytes():
    n = 3

    def job(t):
        r = t.rank
        data = np.full(8, r + 1, np.uint8)
        t.broadcast(_ptr(data), _ptr(data), 8, 1, 0, "broadcast")
        sizes = [2, 0, 5]
        every = np.empty(sum(sizes), np.uint8)
        t.allgatherv(_ptr(np.full(sizes[r], r, np.uint8)), sizes[r], _ptr(every), sizes, 0, "allgather")
        send = np.array([10 * r + j for j in range(n) for _ in range(j + 1)], np.uint8)
        got = np.empty((r + 1) * n, np.uint8)
        t.alltoallv(_ptr(send), [1, 2, 3], _ptr(got), [r + 1] * n, 0, "alltoall")
        t.barrier()
        return data, every, got, t.allgather_bytes(b"x" * (r * 3000))
    for r, (data, every, got, payloads) in enumerate(_on_every_rank(n, job)):
        assert list(data) == [2] * 8
        assert list(every) == [0, 0, 2, 2, 2, 2, 2]
        assert list(got) == [10 * s + r for s in range(n) for _ in range(r + 1)]
        assert payloads == [b"x" * (s * 3000) for s in range(n)]


def test_a_closed_peer_is_named_at_once_and_the_transport_refuses_afterwards():
    def job(t):
        if t.rank == 1:
            return None
        buf = np.zeros(4, np.uint8)
        with pytest.raises(RankFailure, match="rank 1 on host1 closed its connection") as failure:
            t.broadcast(_ptr(buf), _ptr(buf), 4, 1, 0, "broadcast")
        assert failure.value.rank == 1
        with pytest.raises(BrokenCommunicatorError):
            t.barrier()
        return True
    assert _on_every_rank(2, job)[0] is True


def test_a_late_peer_times_out_and_the_transport_refuses_afterwards():
    release = threading.Event()

    def job(t):
        if t.rank == 1:
            release.wait(10)
            return None
        t.timeout_s = 0.5
        with pytest.raises(TimeoutError, match="rank 1 on host1"):
            t.barrier()
        release.set()
        with pytest.raises(BrokenCommunicatorError):
            t.barrier()
        return True
    assert _on_every_rank(2, job)[0] is True


def test_a_connection_of_an_older_world_is_turned_away():
    listeners, addresses = _listeners(2)
    result = {}
    thread = threading.Thread(target=lambda: result.update(r0=connect_mesh(listeners[0], addresses, 0, "new", SECRET,
                                                                           10)))
    thread.start()
    stale = socket.create_connection(("127.0.0.1", listeners[0].getsockname()[1]))
    handshake.prove(stale, SECRET, "rank 0")  # a rank of this job, still in its older world
    stale.sendall(b"old-token".ljust(64, b"\0") + (1).to_bytes(8, "little"))
    fresh = connect_mesh(listeners[1], addresses, 1, "new", SECRET, 10)
    thread.join(20)
    mine, theirs = fresh[0], result["r0"][1]
    mine.setblocking(True)
    mine.sendall(b"hi")
    theirs.setblocking(True)
    assert theirs.recv(2) == b"hi"  # the world's own connection, not the straggler's
    for sock in [stale, mine, theirs] + listeners:
        sock.close()


def test_sets_connect_their_members_in_any_order_and_from_several_threads():
    """Each rank makes its sets in its own order, rank 2 two of them at once on two threads (as torch's send/recv
    channels do): every set's members reach each other, and the set's collectives run on its own connections."""
    sets = {11: [0, 1, 2], 12: [0, 2], 13: [1, 2]}

    def job(t):
        me, made = t.rank, {}

        def make(key):
            made[key] = t.subset(sets[key], key, "set %d" % key)
        if me == 2:
            threads = [threading.Thread(target=make, args=(key,)) for key in (12, 13)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
        for key in {0: (11, 12), 1: (13, 11), 2: (11,)}[me]:
            make(key)
        got = {}
        for key in sorted(made):
            data = np.array([me + 1.0])
            code = dtypes.numpy_code(data.dtype)
            made[key].allreduce(_ptr(data), _ptr(data), 1, code, lib.SMC_SUM, 1.0, 1.0, 1, 0, "allreduce")
            got[key] = (made[key].rank, made[key].ranks, data[0], made[key].allgather_bytes(b"%d" % me))
            made[key].close()
        return got
    for me, got in enumerate(_on_every_rank(3, job)):
        assert sorted(got) == [key for key in sorted(sets) if me in sets[key]]
        for key, (index, ranks, total, payloads) in got.items():
            assert (index, ranks) == (sets[key].index(me), sets[key])
            assert total == sum(r + 1.0 for r in sets[key])
            assert payloads == [b"%d" % r for r in sets[key]]


def test_a_set_member_that_never_comes_is_named_in_time():
    def job(t):
        t.timeout_s = 1.0
        if t.rank == 2:
            return None
        with pytest.raises(TimeoutError, match=r"set 5: rank %d: ranks \[2\] did not connect" % t.rank):
            t.subset([0, 1, 2], 5, "set 5")
        return True
    assert _on_every_rank(3, job)[:2] == [True, True]


def test_a_set_connection_of_an_older_world_or_another_secret_is_not_taken():
    listeners, addresses = _listeners(2)
    errors = {}

    def member(r, token, secret):
        try:
            SetDoor(listeners[r], addresses, token, secret).connect_set([0, 1], r, 5, 1.0, "set 5")
        except Exception as error:  # noqa: B902 (checked below)
            errors[r] = error
    for other in (("old", SECRET), ("new", bytes(32))):
        threads = [threading.Thread(target=member, args=args) for args in ((0, "new", SECRET), (1,) + other)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert isinstance(errors[0], TimeoutError) and "ranks [1] did not connect" in str(errors[0])
        if other[0] == "old":
            assert isinstance(errors[1], TimeoutError) and "could not connect to rank 0" in str(errors[1])
        else:
            assert isinstance(errors[1], AuthenticationError) and "rank 0 (for rank 1, set 5)" in str(errors[1])
    for sock in listeners:
        sock.close()
